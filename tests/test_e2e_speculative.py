"""End to end with `--speculative ngram` and `--speculative draft` (the model drafting for itself):
`batchserve serve` on a tiny random model, called through the `openai` package as users do. Greedy output is
token for token plain decoding's (`OfflineEngine` without speculation), streamed or not; usage reports the
draft tokens as OpenAI reports a predicted output's; a request that opts out gets no drafts; `/metrics`
counts them."""

from __future__ import annotations

import pytest
from e2e_server import metric, reference_greedy, start_server
from openai import OpenAI

MAX_TOKENS = 40
# Repetitive prompts: a random model soon loops, and prompt lookup finds the loop.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [100, 3, 250, 100, 3, 250, 100], [42, 43, 42, 43]]
SPECIAL = {0, 1, 2}


def words_to_ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True, seed=5)


METHOD_FLAGS = {
    "ngram": ["--speculative", "ngram", "--ngram-min", "1"],
    "draft": ["--speculative", "draft", "--draft-model"],
}  # + the model itself


@pytest.fixture(scope="module", params=list(METHOD_FLAGS))
def server(request, model, tmp_path_factory):
    flags = METHOD_FLAGS[request.param] + ([str(model)] if request.param == "draft" else [])
    # `--max-step-ms -1`: no step-cost model, so no break-even gate: whether a draft pays is the model's
    # guess from a busy machine's timings, and one guessed "never" here (CI, stop 77): these tests are
    # about what drafts give, the gate has its own (tests/test_step_cost.py,
    # tests/test_speculative_scheduler.py)
    srv = start_server(
        model,
        tmp_path_factory.mktemp("e2e-spec") / "serve.log",
        *("--kv-capacity-tokens", "4096", "--max-step-ms", "-1", *flags),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, model, prompt, **extra):
    return client.completions.create(
        model=str(model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True, **extra}
    )


def test_greedy_output_is_plain_decodings_and_usage_counts_the_drafts(server, client, model):
    expected = reference_greedy(model, PROMPTS, MAX_TOKENS, ignore_eos=True, kv_capacity_tokens=4096)
    drafts_before = metric(server.url, "batchserve_spec_decode_num_draft_tokens_total")
    accepted = 0
    for prompt, tokens in zip(PROMPTS, expected):
        done = complete(client, model, prompt)
        assert words_to_ids(done.choices[0].text) == [t for t in tokens if t not in SPECIAL]
        details = done.usage.completion_tokens_details
        assert details is not None and details.accepted_prediction_tokens is not None
        assert details.rejected_prediction_tokens is not None
        accepted += details.accepted_prediction_tokens
        streamed = client.completions.create(
            model=str(model),
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        assert words_to_ids(text) == words_to_ids(done.choices[0].text)
    assert accepted > 0
    assert metric(server.url, "batchserve_spec_decode_num_draft_tokens_total") > drafts_before
    assert metric(server.url, "batchserve_spec_decode_num_accepted_tokens_total") > 0
    assert metric(server.url, "batchserve_spec_decode_mean_acceptance_length") > 1


def test_a_request_that_opts_out_gets_the_same_text_without_drafts(client, model):
    speculated = complete(client, model, PROMPTS[0])
    plain = complete(client, model, PROMPTS[0], speculative=False)
    assert plain.choices[0].text == speculated.choices[0].text
    assert plain.usage.completion_tokens_details is None
    assert speculated.usage.completion_tokens_details.accepted_prediction_tokens > 0
    chat = client.chat.completions.create(
        model=str(model),
        messages=[{"role": "user", "content": "w5 w6 w5 w6"}],
        max_tokens=16,
        temperature=0,
        extra_body={"speculative": False},
    )
    assert chat.usage.completion_tokens_details is None
