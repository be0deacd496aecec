"""The bench client, runner, transformers baseline and CLI against an in-test streaming server and a tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import shlex
import sys
from pathlib import Path

import pytest

from batchserve.loadtests.client import make_session, send_request
from batchserve.loadtests.fake_openai_server import FakeServerScript, FakeServerThread
from batchserve.loadtests.runner import LoadPoint, measure
from batchserve.loadtests.targets import Plan, measure_targets, url_target
from batchserve.loadtests.workload import WORDS, LengthRange, RequestSpec, WordPromptBuilder, random_workload
from batchserve.procs.cli import main as cli_main


@pytest.fixture(scope="module")
def fake_server():
    with FakeServerThread(FakeServerScript(ttft_s=0.02, token_interval_s=0.005)) as server:
        yield server


def run_one(server: FakeServerThread, endpoint: str, spec: RequestSpec):
    async def go():
        async with make_session(10) as session:
            return await send_request(session, server.base_url, endpoint, "fake", spec)

    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streaming_parse_timestamps_and_usage(fake_server, endpoint):
    r = run_one(fake_server, endpoint, RequestSpec("one two three", 3, 6))
    assert r.success, r.error
    assert r.text == "".join(f"tok{i} " for i in range(6))
    assert len(r.chunk_times) == 6  # the chat role chunk and the usage chunk carry no content
    assert (r.prompt_tokens, r.output_tokens, r.usage_reported) == (3, 6, True)
    assert r.chunk_times[0] - r.send_time >= 0.02  # the scripted TTFT
    assert r.end_time - r.send_time >= 0.02 + 5 * 0.005  # scripted TTFT + 5 token intervals
    assert r.chunk_times == sorted(r.chunk_times)
    assert r.send_time < r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time
    body = fake_server.script.received[-1]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 6
    assert ("messages" in body) == (endpoint == "chat")


def test_http_errors_stream_errors_and_dead_servers_are_failures(fake_server):
    r = run_one(fake_server, "chat", RequestSpec("please FAIL_HTTP", 2, 4))
    assert not r.success and r.error.startswith("HTTP 500")
    r = run_one(fake_server, "completions", RequestSpec("please FAIL_STREAM", 2, 4))
    assert not r.success and "stream error" in r.error

    async def dead():
        async with make_session(5) as session:
            return await send_request(session, "http://127.0.0.1:1", "chat", "m", RequestSpec("x", 1, 2))

    r = asyncio.run(dead())
    assert not r.success and r.error


@pytest.mark.parametrize("point", [LoadPoint(concurrency=3), LoadPoint(request_rate=200.0)])
def test_failures_are_counted_and_excluded(fake_server, point):
    specs = random_workload(9, LengthRange(3, 6), LengthRange(2, 5), seed=0, builder=WordPromptBuilder())
    specs[4] = RequestSpec("FAIL_HTTP now", 2, 50)
    specs[7] = RequestSpec("FAIL_STREAM now", 2, 50)

    async def go():
        async with make_session(10) as session:
            send = functools.partial(send_request, session, fake_server.base_url, "chat", "fake")
            return await measure(send, specs, point, seed=0, warmup=specs[:2], show_progress=False)

    m, results = asyncio.run(go())
    assert (m.completed, m.failed) == (7, 2)
    ok = [s for i, s in enumerate(specs) if i not in (4, 7)]
    assert m.total_output_tokens == sum(s.output_len for s in ok)
    assert m.total_input_tokens == sum(len(s.prompt.split()) for s in ok)
    assert m.ttft_ms.count == 7 and m.ttft_ms.p50 >= 20.0


def test_concurrency_limit_is_respected(fake_server):
    specs = [RequestSpec("a b", 2, 8)] * 8

    async def go():
        async with make_session(10) as session:
            send = functools.partial(send_request, session, fake_server.base_url, "chat", "fake")
            return await measure(send, specs, LoadPoint(concurrency=2), seed=0, show_progress=False)

    _, results = asyncio.run(go())
    events = sorted([(r.send_time, 1) for r in results] + [(r.end_time, -1) for r in results])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak == 2


def test_staggered_streams_start_one_by_one(fake_server):
    specs = [RequestSpec("a b", 2, 200)] * 3  # one each: a request (1 s) outlasts the stagger

    async def go():
        async with make_session(10) as session:
            send = functools.partial(send_request, session, fake_server.base_url, "chat", "fake")
            return await measure(send, specs, LoadPoint(concurrency=3, stagger_s=0.3), seed=0, show_progress=False)

    _, results = asyncio.run(go())
    firsts = sorted(r.send_time for r in results)
    assert firsts[1] - firsts[0] >= 0.25 and firsts[2] - firsts[1] >= 0.25  # 0.3 s apart, give or take the loop
    with pytest.raises(ValueError, match="stagger"):
        LoadPoint(request_rate=1.0, stagger_s=0.5)


def write_tiny_word_model(out: Path) -> Path:
    """A random-weight Llama whose WordLevel tokenizer knows the bench word list."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in (*WORDS, "user", "assistant"):
        vocab.setdefault(w, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_word_model(tmp_path_factory.mktemp("tiny-word-llama"))


def test_transformers_baseline_static_batches(tiny_model):
    from batchserve.loadtests.hf_baseline import TransformersStaticBatcher

    specs = random_workload(6, LengthRange(3, 8), LengthRange(2, 7), seed=1, builder=WordPromptBuilder())
    batcher = TransformersStaticBatcher(tiny_model, batch_size=3, endpoint="completions", device="cpu")
    try:
        m, results = asyncio.run(
            measure(batcher.send, specs, LoadPoint(request_rate=math.inf), seed=0, show_progress=False)
        )
    finally:
        batcher.close()
    assert (m.completed, m.failed) == (6, 0)
    for spec, r in zip(specs, results):
        assert r.output_tokens == len(r.chunk_times) == spec.output_len  # EOS ignored, lengths as asked
        assert r.prompt_tokens == spec.input_len  # one token per word, no padding counted
        assert r.end_time == r.chunk_times[-1]
    # all six arrive at once: two static batches of three; a batch shares its first-token time,
    # and the second batch starts only after the first batch's longest request is done
    firsts = sorted({r.chunk_times[0] for r in results})
    assert len(firsts) == 2
    first_batch = [r for r in results if r.chunk_times[0] == firsts[0]]
    assert len(first_batch) == 3
    assert firsts[1] > max(r.end_time for r in first_batch)


def test_transformers_baseline_times_a_chunk_per_token_as_a_server_streams_it(tmp_path):
    """Every token gives a chunk; one that ends inside a UTF-8 character has empty text, and its bytes go
    out with the token that completes the character, as batchserve streams them (ITLs are measured
    between chunks)."""
    import torch
    from conftest import write_byte_tokenizer
    from transformers import AutoTokenizer

    from batchserve.loadtests.client import RequestResult
    from batchserve.loadtests.hf_baseline import _Pending, _StepTimer

    write_byte_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode("a中b", add_special_tokens=False)
    assert len(ids) == 5  # "中" is three byte tokens

    async def stream() -> RequestResult:
        loop = asyncio.get_running_loop()
        pending = _Pending(RequestSpec("the", 1, len(ids)), RequestResult(send_time=0.0), loop.create_future(), loop)
        timer = _StepTimer([pending], tokenizer, prompts=[tokenizer.encode("the", add_special_tokens=False)])
        timer.put(torch.tensor([[3]]))  # generate hands over the prompt first
        for token in ids:
            timer.put(torch.tensor([token]))
        await pending.done
        return pending.result

    result = asyncio.run(stream())
    assert result.success and result.output_tokens == 5
    assert result.text == "a中b"
    assert len(result.chunk_times) == 5  # a chunk per token: "a", "", "", "中", "b"
    assert result.end_time == result.chunk_times[-1]


def test_cli_compare_runs_every_policy_and_writes_json_and_plot(tmp_path, tiny_model, capsys):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    with FakeServerThread() as other:
        status = cli_main(
            [
                "bench",
                "--compare",
                "--serve-command",
                f"{shlex.quote(sys.executable)} -P -m batchserve.loadtests.fake_openai_server --token-interval-ms 1",
                "--model",
                str(tiny_model),
                "--endpoint",
                "chat",
                "--num-prompts",
                "3,6",
                "--input-len",
                "3:6",
                "--output-len",
                "2:5",
                "--concurrency",
                "1,3",
                "--max-batch-size",
                "3",
                "--warmup",
                "1",
                "--compare-url",
                f"other={other.base_url}",
                "--output",
                str(out),
                "--plot",
                str(plot),
                "--no-progress",
                "--log-dir",
                str(tmp_path / "logs"),
                "--torch-threads",
                "1",
            ]
        )
    assert status == 0
    doc = json.loads(out.read_text())
    configs = ["mixed", "prefill-first", "fixed", "other", "transformers"]
    # each load point measures every configuration in turn, each server started for its measurement alone
    assert [(r["config"], r["concurrency"]) for r in doc["runs"]] == [(c, n) for n in (1, 3) for c in configs]
    # per-point request counts: 3 at concurrency 1, 6 at concurrency 3
    assert all(r["metrics"]["completed"] == {1: 3, 3: 6}[r["concurrency"]] for r in doc["runs"])
    assert all(r["metrics"]["failed"] == 0 for r in doc["runs"])
    assert doc["workload"]["num_prompts"] == [3, 6]
    assert set(doc["ratios"]) == {"fixed", "transformers"}
    assert len(doc["ratios"]["fixed"]) == 8  # 4 other configs x 2 points
    assert doc["workload"]["prompts_from"].endswith("tokenizer.json")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "ratios vs fixed" in printed and "ratios vs transformers" in printed
    assert (tmp_path / "logs" / "server-mixed.log").exists()


def test_each_target_is_open_alone_for_each_of_its_measurements():
    """A server idle beside the measured one slowed it (`measure_targets`): each target is opened for one
    measurement and closed before the next opens, every point and round, in the order rotated per round."""
    events: list[tuple[str, str]] = []

    def opener(name: str, url: str):
        @contextlib.contextmanager
        def open_target():
            events.append(("open", name))
            with url_target(url, "fake", "completions") as target:
                yield target
            events.append(("close", name))

        return open_target

    specs = [RequestSpec(prompt=f"p{i}", input_len=2, output_len=2) for i in range(4)]
    plan = Plan(
        specs,
        [],
        [LoadPoint(concurrency=1), LoadPoint(concurrency=2)],
        0,
        "completions",
        show_progress=False,
        num_prompts=[1, 1],
    )
    with FakeServerThread() as server:
        records, errors = measure_targets(
            [("a", opener("a", server.base_url)), ("b", opener("b", server.base_url))], plan, rounds=2
        )
    assert not errors
    one_point = [
        ("open", "a"),
        ("close", "a"),
        ("open", "b"),
        ("close", "b"),  # round 1
        ("open", "b"),
        ("close", "b"),
        ("open", "a"),
        ("close", "a"),
    ]  # round 2, rotated
    assert events == one_point * 2
    assert [(r.config, r.point.concurrency, r.metrics.completed) for r in records] == [
        ("a", 1, 2),
        ("b", 1, 2),
        ("a", 2, 2),
        ("b", 2, 2),
    ]  # the rounds pooled


def test_cli_user_errors_are_one_line(capsys):
    assert cli_main(["bench", "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert cli_main(["bench", "--concurrency", "1", "--request-rate", "2"]) == 2
    assert cli_main(["bench", "--concurrency", "1,2", "--num-prompts", "1,2,3"]) == 2
    assert cli_main(["bench", "--input-len", "9:3", "--tokenizer", "words"]) == 2
    assert cli_main(["bench", "--compare", "--policies", "fastest", "--no-transformers"]) == 2
    err = capsys.readouterr().err
    assert "--input-len" in err and "fastest" in err and "Traceback" not in err


def test_cli_reports_a_server_that_never_gets_healthy_and_keeps_the_rest(tmp_path, capsys):
    out = tmp_path / "bench.json"
    with FakeServerThread() as other:
        status = cli_main(
            [
                "bench",
                "--compare",
                "--no-transformers",
                "--policies",
                "mixed",
                "--tokenizer",
                "words",
                "--serve-command",
                f"{shlex.quote(sys.executable)} -c 'import sys; sys.exit(3)'",
                "--num-prompts",
                "2",
                "--input-len",
                "3",
                "--output-len",
                "2",
                "--log-dir",
                str(tmp_path),
                "--compare-url",
                other.base_url,
                "--output",
                str(out),
                "--no-progress",
                "--rounds",
                "2",
            ]
        )
    assert status == 2
    assert "mixed: server exited with status 3" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [r["config"] for r in doc["runs"]] == [other.base_url]  # the other target was still measured
    assert doc["runs"][0]["metrics"]["completed"] == 4  # two rounds of two requests, pooled
    assert len(doc["errors"]) == 1 and doc["errors"][0].startswith("mixed:")


def test_multiturn_conversations_resend_their_history_turn_after_turn(tmp_path, capsys):
    script = FakeServerScript(ttft_s=0.01, token_interval_s=0.001)
    out = tmp_path / "bench.json"
    with FakeServerThread(script) as server:
        status = cli_main(
            [
                "bench",
                "--base-url",
                server.base_url,
                "--model",
                "fake",
                "--tokenizer",
                "words",
                "--workload",
                "multiturn",
                "--num-prompts",
                "3",
                "--turns",
                "3",
                "--system-tokens",
                "40",
                "--output-len",
                "4",
                "--concurrency",
                "2",
                "--warmup",
                "1",
                "--output",
                str(out),
                "--no-progress",
            ]
        )
    assert status == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["metrics"]["completed"] == 9 and set(run["by_turn"]) == {"0", "1", "2"}
    chats = [body["messages"] for body in script.received if len(body["messages"]) > 1]  # the warm-up has none
    assert len(chats) == 9
    system = chats[0][0]
    assert system["role"] == "system" and len(system["content"].split()) == 40
    for messages in chats:
        assert messages[0] == system  # one system prompt, shared by every conversation
        roles = [m["role"] for m in messages[1:]]
        assert roles == ["user", "assistant"] * ((len(roles) - 1) // 2) + ["user"]
        for answer in messages[2::2]:
            assert answer["content"] == "tok0 tok1 tok2 tok3 "  # the answer the previous turn got
    assert sorted(len(m) for m in chats) == [2] * 3 + [4] * 3 + [6] * 3
    assert "TTFT by turn" in capsys.readouterr().out


def test_multiturn_needs_the_chat_endpoint_and_a_concurrency(capsys):
    for extra in (["--endpoint", "completions"], ["--request-rate", "2"]):
        assert cli_main(["bench", "--workload", "multiturn", "--tokenizer", "words", *extra]) == 2
        assert "multiturn" in capsys.readouterr().err
