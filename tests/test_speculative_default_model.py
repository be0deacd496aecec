"""Speculative decoding on the default model (SmolLM2-135M-Instruct): greedy output is token for token
plain decoding's with prompt lookup and with a draft model (the model itself at int8: it agrees on
most tokens), alone and in a batch; and the drafts were really accepted."""

from __future__ import annotations

import pytest

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import DEFAULT_MODEL, ServerConfig

pytestmark = pytest.mark.slow

CHATS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "What is the capital of France?",
    "Fix the spelling: Teh cat sat on teh mat and lookd at teh dog.",
]
NEW_TOKENS = 40
METHODS = {
    "ngram": {"speculative": "ngram"},
    "draft": {
        "speculative": "draft",
        "draft_model": DEFAULT_MODEL,
        "draft_quantization": "int8",
        "num_speculative_tokens": 4,
    },
}


def engine(**overrides) -> OfflineEngine:
    return OfflineEngine(
        ServerConfig(model=DEFAULT_MODEL, device="cpu", kv_capacity_tokens=4096, max_running_requests=4, **overrides)
    )


def chats():
    return [
        request(
            f"c{i}",
            messages=[{"role": "user", "content": c}],
            sampling={"temperature": 0},
            stop={"max_tokens": NEW_TOKENS},
        )
        for i, c in enumerate(CHATS)
    ]


@pytest.fixture(scope="module")
def plain():
    return [c.token_ids for c in engine().generate(chats())]


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_output_is_plain_decodings(plain, method):
    spec = engine(**METHODS[method])
    assert [c.token_ids for c in spec.generate(chats())] == plain  # a batch of three
    assert [c.token_ids for c in spec.generate(chats()[:1])] == plain[:1]  # one alone
    assert spec.accepted_tokens > 0
    if method == "draft":
        assert spec.accepted_tokens > 0.5 * spec.draft_tokens
