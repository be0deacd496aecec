"""Admission for real traffic, called through the `openai` client as users call it.

A tiny random model served with a 1,024-token KV pool: 16 greedy requests for 200 tokens each are all
admitted on their estimates (the default `kv_reserve_ratio`), outgrow the pool, get preempted and
recomputed, and still stream exactly what each request gives alone, with the usage of an
uninterrupted run. The default model on default settings (slow): 32 concurrent chat requests that
send no `max_tokens` (the client's default) run together instead of two at a time.
"""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
from e2e_server import metric, start_server, stream_completion, wait_until

from batchserve.shared.config import DEFAULT_MODEL

PROMPTS = ["w5 w6 w7", "w100 w3 w250 w17 w9", "w42", " ".join(f"w{i}" for i in range(3, 60)), "w300 w301 w302 w8"]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def tight_server(model, tmp_path_factory):
    srv = start_server(
        model,
        tmp_path_factory.mktemp("admission") / "serve.log",
        "--kv-capacity-tokens",
        "1024",
        "--max-running-requests",
        "16",
    )
    yield srv
    srv.stop()


def test_sixteen_preempted_streams_equal_their_solo_outputs(tight_server, model):
    url = f"{tight_server.url}/v1"
    solo = openai.OpenAI(base_url=url, api_key="unused")
    alone = [
        solo.completions.create(
            model=str(model), prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        for p in PROMPTS
    ]
    assert metric(tight_server.url, "batchserve_preemptions_total") == 0  # one at a time always fits

    async def together():
        async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
            return await asyncio.gather(
                *[stream_completion(client, str(model), PROMPTS[i % len(PROMPTS)], MAX_TOKENS) for i in range(16)]
            )

    results = asyncio.run(together())
    assert metric(tight_server.url, "batchserve_preemptions_total") > 0
    for i, (text, finish, usage) in enumerate(results):
        expected = alone[i % len(PROMPTS)]
        assert text == expected.choices[0].text, i  # no gap, no repeated text across preemptions
        assert finish == "length"
        assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == expected.usage.prompt_tokens
    assert wait_until(
        lambda: (
            metric(tight_server.url, "batchserve_num_requests_running") == 0
            and metric(tight_server.url, "batchserve_kv_cache_used_tokens") == 0
        )
    )


def test_metrics_show_the_configured_ratio(tight_server):
    from batchserve.shared.config import ServerConfig

    assert metric(tight_server.url, "batchserve_kv_reserve_ratio") == ServerConfig().kv_reserve_ratio


# ------------------------------------------------------------------ the default model, default settings

QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "What is the largest planet in the solar system?",
    "Name a primary colour.",
    "What is the opposite of hot?",
    "What colour is the sky on a clear day?",
]


class PeakGauge:
    """Samples a gauge of /metrics every 50 ms on a thread; `peak` is the largest value seen."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name, self.peak = url, name, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, metric(self.url, self.name))

    def __enter__(self) -> PeakGauge:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
def test_default_server_runs_32_chats_without_max_tokens_together(tmp_path):
    srv = start_server(DEFAULT_MODEL, tmp_path / "serve.log", startup_timeout=600)
    try:

        async def chat(client: openai.AsyncOpenAI, question: str) -> tuple[str, str | None]:
            stream = await client.chat.completions.create(
                model=DEFAULT_MODEL, messages=[{"role": "user", "content": question}], temperature=0, stream=True
            )
            text, finish = [], None
            async for chunk in stream:
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            return "".join(text), finish

        async def main():
            async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0) as client:
                return await asyncio.gather(*[chat(client, QUESTIONS[i % len(QUESTIONS)]) for i in range(32)])

        with PeakGauge(srv.url, "batchserve_num_requests_running") as running:
            answers = asyncio.run(main())  # a non-200 answer raises here
        assert running.peak >= 24, running.peak
        assert all(finish == "stop" and text for text, finish in answers), answers
    finally:
        srv.stop()


ESSAYS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how a car engine works.",
    "Describe a walk through a forest in autumn.",
]  # long answers
# 8 x (prompt of ~40 + 200) is nearly twice the 1,024-token pool: all are admitted on their estimates, and at
# least half are preempted and recomputed. 16 computed about three times the tokens (~24 preemptions, each
# recomputing its answer so far) for the same check; a request preempted again and again is the tiny
# model's test above (test_sixteen_preempted_streams_equal_their_solo_outputs).
TOGETHER = 8


@pytest.mark.slow
def test_default_model_in_a_1024_token_pool_preempts_and_equals_solo_outputs(tmp_path):
    srv = start_server(DEFAULT_MODEL, tmp_path / "serve.log", "--kv-capacity-tokens", "1024", startup_timeout=600)
    try:

        def ask(client: openai.OpenAI, question: str) -> str:
            out = client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=[{"role": "user", "content": question}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            return out.choices[0].message.content or ""

        solo = [ask(openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused"), q) for q in ESSAYS]

        async def main():
            async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0) as client:

                async def one(question: str) -> str:
                    out = await client.chat.completions.create(
                        model=DEFAULT_MODEL,
                        messages=[{"role": "user", "content": question}],
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                    )
                    return out.choices[0].message.content or ""

                return await asyncio.gather(*[one(ESSAYS[i % len(ESSAYS)]) for i in range(TOGETHER)])

        together = asyncio.run(main())
        assert metric(srv.url, "batchserve_preemptions_total") > 0
        assert together == [solo[i % len(ESSAYS)] for i in range(TOGETHER)]
    finally:
        srv.stop()
