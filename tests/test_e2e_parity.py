"""OpenAI API parity on a real `batchserve serve` (tiny random model), called through the `openai`
package as users call it: echo + prompt logprobs (lm-evaluation-harness's loglikelihood request)
against transformers' log-softmax, logprobs of greedy tokens, logit_bias bans, min_tokens, the
penalties reaching the worker, and n choices that are reproducible with a seed whatever runs beside.

The tiny tokenizer's tokens are the words `w3..w319` (`wN` is id N), so token texts give ids.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from e2e_server import start_server

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig

PROMPT = "w5 w9 w11 w7 w7 w40 w41 w42 w5 w9"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True, seed=3)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    # A small prefill budget: the echoed prompt's logprobs come from several chunks; and the step-time
    # bound on, so steps are sized by the step-cost model too (the outputs must not care).
    srv = start_server(
        model,
        tmp_path_factory.mktemp("parity") / "serve.log",
        "--prefill-budget",
        "80",
        "--max-running-requests",
        "16",
        "--page-size",
        "4",
        "--max-step-ms",
        "20",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def log_softmax(model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)

    def run(text: str) -> tuple[list[int], torch.Tensor]:
        ids = tokenizer.encode(text)
        with torch.inference_mode():
            return ids, torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def _ids(tokens: list[str]) -> list[int]:
    return [int(t[1:]) for t in tokens]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_prompt_logprobs_equal_transformers(client, model, log_softmax, max_tokens):
    # What lm-evaluation-harness's local-completions sends for a loglikelihood request.
    long_prompt = " ".join(f"w{3 + (i * 37) % 300}" for i in range(150))  # > the prefill budget: chunked
    for prompt in (PROMPT, long_prompt):
        out = client.completions.create(
            model=str(model), prompt=prompt, max_tokens=max_tokens, logprobs=1, echo=True, temperature=0, seed=1234
        )
        choice = out.choices[0]
        ids, ref = log_softmax(prompt)
        lp = choice.logprobs
        assert _ids(lp.tokens[: len(ids)]) == ids
        assert choice.text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
            assert max(lp.top_logprobs[pos].values()) == pytest.approx(ref[pos - 1].max().item(), abs=1e-4)
        assert len(lp.tokens) == len(ids) + max_tokens
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == max_tokens


def test_greedy_tokens_are_the_top_logprob_streamed_and_not(client, model, log_softmax):
    kwargs = dict(
        model=str(model),
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    entries = whole.choices[0].logprobs.content
    streamed = [
        e
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        for c in chunk.choices
        if c.logprobs is not None
        for e in c.logprobs.content
    ]
    assert len(entries) == 8 and [e.token for e in streamed] == [e.token for e in entries]
    for e, s in zip(entries, streamed):
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert len(e.top_logprobs) == 3 and e.bytes == list(e.token.encode())
        assert s.logprob == pytest.approx(e.logprob, abs=1e-5)
    # ... and they are the model's: the template renders the message then a space.
    ids, ref = log_softmax(PROMPT + " " + " ".join(e.token for e in entries))
    first = len(ids) - len(entries) - 1
    for k, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[first + k, int(e.token[1:])].item(), abs=1e-4)


def test_logit_bias_bans_and_min_tokens_holds_the_stop(client, model):
    greedy = client.completions.create(
        model=str(model), prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    first = _ids(greedy.choices[0].logprobs.tokens)
    banned = {str(t): -100 for t in first}
    for stream in (False, True):
        kwargs = dict(
            model=str(model),
            prompt=PROMPT,
            max_tokens=24,
            temperature=1.0,
            seed=5,
            logprobs=0,
            logit_bias=banned,
            extra_body={"ignore_eos": True},
        )
        if stream:
            tokens = [
                t
                for chunk in client.completions.create(**kwargs, stream=True)
                for c in chunk.choices
                if c.logprobs
                for t in c.logprobs.tokens
            ]
        else:
            tokens = client.completions.create(**kwargs).choices[0].logprobs.tokens
        assert len(tokens) == 24 and not set(_ids(tokens)) & set(first)
    stop = {"stop_token_ids": [first[2]]}
    early = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=40, temperature=0, extra_body=stop)
    held = client.completions.create(
        model=str(model), prompt=PROMPT, max_tokens=40, temperature=0, extra_body={**stop, "min_tokens": 20}
    )
    assert early.usage.completion_tokens == 3 and early.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens >= 20


def test_penalties_through_the_api_equal_the_engine(client, model):
    penalties = dict(frequency_penalty=1.2, presence_penalty=0.6)
    extra = {"repetition_penalty": 1.3, "ignore_eos": True}
    api = client.completions.create(
        model=str(model), prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0, extra_body=extra, **penalties
    )
    engine = OfflineEngine(ServerConfig(model=str(model), page_size=4, kv_capacity_tokens=512))
    (done,) = engine.generate(
        [
            request(
                "p",
                prompt=PROMPT,
                sampling={"temperature": 0},
                stop={"max_tokens": 16, "ignore_eos": True},
                logits={**penalties, "repetition_penalty": 1.3},
            )
        ]
    )
    assert _ids(api.choices[0].logprobs.tokens) == done.token_ids
    plain = client.completions.create(
        model=str(model), prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].text != api.choices[0].text


def test_n_choices_with_a_seed_are_reproducible_across_runs_and_batch_mixes(server, model):
    kwargs = dict(
        model=str(model), prompt=PROMPT, max_tokens=16, temperature=1.0, n=3, seed=7, extra_body={"ignore_eos": True}
    )

    async def run(with_neighbours: bool):
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as aclient:
            neighbours = [
                aclient.completions.create(
                    model=str(model),
                    prompt=f"w{9 + i} w3",
                    max_tokens=24,
                    temperature=0.8,
                    extra_body={"ignore_eos": True},
                )
                for i in range(6 if with_neighbours else 0)
            ]
            results = await asyncio.gather(aclient.completions.create(**kwargs), *neighbours)
            streamed: dict[int, str] = {}
            async for chunk in await aclient.completions.create(**kwargs, stream=True):
                for c in chunk.choices:
                    streamed[c.index] = streamed.get(c.index, "") + c.text
            return results[0], streamed

    alone, streamed = asyncio.run(run(False))
    mixed, _ = asyncio.run(run(True))
    texts = [c.text for c in sorted(alone.choices, key=lambda c: c.index)]
    assert [c.index for c in alone.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [c.text for c in sorted(mixed.choices, key=lambda c: c.index)] == texts
    assert [streamed[i] for i in range(3)] == texts
    assert alone.usage.completion_tokens == 48 and alone.usage.prompt_tokens == len(PROMPT.split())
    single = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused").completions.create(**{**kwargs, "n": 1})
    assert single.choices[0].text == texts[0]  # choice 0 is the request's own seed
