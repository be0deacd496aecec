"""Tensor parallelism end to end: `batchserve serve --tp 2` (two CPU worker ranks over gloo beside the
other four processes) called through the `openai` package, against a TP=1 server of the same tiny
model (a byte-level tokenizer, so that structured output works): greedy streams, n, logprobs, the
prefix cache, preemption, structured output and disconnects answer as with one rank. Then failures:
a follower rank killed (or stopped) mid-stream ends every stream and the server; two "machines" on loopback
(`--nnodes 2`, each with its own runtime dir) serve as one; a rank whose peer never comes exits
naming the join; the api's watch covers the follower ranks (hand-made heartbeats).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import openai
import pytest
import zmq
from e2e_server import REPO, Server, free_port, metric, pid_alive, start_server, stream_completion, wait_until
from fault_injection import Stack, StreamRecord, segments_of, streams_through_fault
from pydantic import BaseModel, Field

from batchserve.procs.api.engine_client_zmq import BACKEND_PROCESSES, ZmqEngineClient, backend_processes
from batchserve.shared.commands import cli_command
from batchserve.shared.config import ServerConfig
from batchserve.shared.ipc import Endpoints, Sender
from batchserve.shared.messages import GenerateRequest, RequestRejected
from batchserve.shared.process_messages import Heartbeat

FLAGS = ("--kv-capacity-tokens", "1024", "--max-running-requests", "16")
TP2 = ("--tp", "2")
PROMPTS = ["the quick brown fox", '{"name": "Ada", "age"', "jumps over the lazy dog", "<tool_call>\n"]
SYSTEM = " ".join(f"item {i}" for i in range(40))  # ~300 tokens: whole pages for the prefix cache
MAX_TOKENS = 24
TERMINAL_WITHIN_S = 2.0  # as tests/test_fault_injection.py: after /health turns 503


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """(TP=2, TP=1) on the same model and flags, for the module."""
    logs = tmp_path_factory.mktemp("tensor-parallel")
    with ThreadPoolExecutor(2) as pool:  # much of a start is waiting: start both at once
        starts = [
            pool.submit(start_server, model, logs / "tp2.log", *TP2, *FLAGS),
            pool.submit(start_server, model, logs / "tp1.log", *FLAGS),
        ]
    if any(f.exception() for f in starts):
        for f in starts:
            if not f.exception():
                f.result().stop()
        raise next(f.exception() for f in starts if f.exception())
    tp2, tp1 = (f.result() for f in starts)
    yield tp2, tp1
    with ThreadPoolExecutor(2) as pool:
        statuses = list(pool.map(Server.stop, (tp2, tp1)))
    assert statuses == [0, 0]  # drained and stopped: rank 0's stop ended its follower


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(server: Server, model: Path, prompt: str, **kw):
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return client(server).completions.create(model=str(model), prompt=prompt, extra_body={"ignore_eos": True}, **kw)


def chat(server: Server, model: Path, messages: list[dict], **kw):
    return client(server).chat.completions.create(
        model=str(model), messages=messages, temperature=0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw
    )


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text if hasattr(choice, "text") else choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_greedy_streams_equal_one_rank(servers, model):
    tp2, tp1 = servers
    assert {"worker", "worker-1"} <= set(tp2.pids) and "worker-1" not in tp1.pids  # the ready line names each rank
    for prompt in PROMPTS:
        expected = complete(tp1, model, prompt).choices[0].text
        assert streamed_text(complete(tp2, model, prompt, stream=True)) == (expected, "length"), prompt
        messages = [{"role": "user", "content": prompt}]
        expected = chat(tp1, model, messages, extra_body={"ignore_eos": True}).choices[0].message.content
        streamed = streamed_text(chat(tp2, model, messages, stream=True, extra_body={"ignore_eos": True}))
        assert streamed == (expected, "length"), prompt


def test_n_choices_equal_one_rank(servers, model):
    tp2, tp1 = servers
    sampled = [complete(s, model, PROMPTS[0], n=2, temperature=0.9, seed=11) for s in servers]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert [c.index for c in sampled[0].choices] == [0, 1]
    greedy = complete(tp2, model, PROMPTS[1], n=2).choices
    assert greedy[0].text == greedy[1].text == complete(tp1, model, PROMPTS[1]).choices[0].text


def test_logprobs_equal_one_rank_within_1e_4(servers, model):
    tp2, tp1 = servers
    got, want = (complete(s, model, PROMPTS[2], max_tokens=12, logprobs=5).choices[0].logprobs for s in servers)
    assert got.tokens == want.tokens
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
    for top_got, top_want in zip(got.top_logprobs, want.top_logprobs, strict=True):
        assert top_got.keys() == top_want.keys()  # up to 5: byte tokens that print alike share a key
        assert [top_got[k] for k in top_want] == pytest.approx(list(top_want.values()), abs=1e-4)
    messages = [{"role": "user", "content": PROMPTS[3]}]
    got, want = (
        chat(s, model, messages, max_tokens=12, logprobs=True, top_logprobs=3).choices[0].logprobs.content
        for s in servers
    )
    assert [t.token for t in got] == [t.token for t in want]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([t.logprob for t in w.top_logprobs], abs=1e-4)


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache(servers, model):
    tp2, tp1 = servers
    system = {"role": "system", "content": SYSTEM}
    first = chat(tp2, model, [system, {"role": "user", "content": "the quick"}])
    assert first.usage.prompt_tokens > 250 and first.usage.prompt_tokens_details.cached_tokens == 0
    hits_before = metric(tp2.url, "batchserve_prefix_cache_hit_tokens_total")
    second = chat(tp2, model, [system, {"role": "user", "content": "brown fox"}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.9 * (first.usage.prompt_tokens - 16)  # all but the question's page
    assert metric(tp2.url, "batchserve_prefix_cache_hit_tokens_total") - hits_before >= cached
    expected = chat(tp1, model, [system, {"role": "user", "content": "brown fox"}]).choices[0].message.content
    assert second.choices[0].message.content == expected


def test_concurrent_long_streams_are_preempted_and_all_complete(servers, model):
    """16 streams of 150 tokens in a 1,024-token pool: admitted on their estimates, preempted and
    recomputed, each still exactly what one rank gives it alone."""
    tp2, tp1 = servers
    solo = [complete(tp1, model, p, max_tokens=150) for p in PROMPTS]
    preempted_before = metric(tp2.url, "batchserve_preemptions_total")

    async def together():
        async with async_client(tp2) as c:
            return await asyncio.gather(
                *(stream_completion(c, str(model), PROMPTS[i % len(PROMPTS)], 150) for i in range(16))
            )

    results = asyncio.run(together())
    assert metric(tp2.url, "batchserve_preemptions_total") > preempted_before
    for i, (text, finish, usage) in enumerate(results):
        expected = solo[i % len(PROMPTS)]
        assert (text, finish) == (expected.choices[0].text, "length"), i
        assert usage.completion_tokens == 150 and usage.prompt_tokens == expected.usage.prompt_tokens
    assert wait_until(
        lambda: (
            metric(tp2.url, "batchserve_num_requests_running") == 0
            and metric(tp2.url, "batchserve_kv_cache_used_tokens") == 0
        ),
        timeout=30,
    )


class Reply(BaseModel):
    ok: bool
    colour: Literal["red", "green"]
    word: str = Field(max_length=8)


def test_json_schema_output_parses_and_validates(servers, model):
    tp2, tp1 = servers
    messages = [{"role": "user", "content": '{"name": "Ada", "age": 36, "ok": true}'}]
    done = [
        client(s).chat.completions.parse(
            model=str(model), messages=messages, response_format=Reply, temperature=0, max_tokens=80
        )
        for s in servers
    ]
    for out in done:
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(out.choices[0].message.parsed, Reply)  # pydantic validated it against the schema
    assert done[0].choices[0].message.content == done[1].choices[0].message.content


def test_clients_disconnecting_mid_stream_free_their_requests(servers, model):
    tp2, _ = servers

    async def one(c: openai.AsyncOpenAI, i: int) -> None:
        stream = await c.completions.create(
            model=str(model),
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=300,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n = 0
        async for _ in stream:
            n += 1
            if n > i % 5:
                break
        await stream.close()  # hang up mid-stream

    async def storm():
        async with async_client(tp2) as c:
            await asyncio.gather(*(one(c, i) for i in range(20)))

    asyncio.run(storm())
    assert wait_until(
        lambda: (
            metric(tp2.url, "batchserve_num_requests_running") == 0
            and metric(tp2.url, "batchserve_kv_cache_used_tokens") == 0
        ),
        timeout=30,
    ), (metric(tp2.url, "batchserve_num_requests_running"), metric(tp2.url, "batchserve_kv_cache_used_tokens"))
    assert complete(tp2, model, PROMPTS[0]).choices[0].finish_reason == "length"  # and it still serves


# ------------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_follower_rank_killed_or_hung_mid_stream_ends_every_stream_and_serve(model, tmp_path, how):
    """SIGKILL: the api sees its pid gone; SIGSTOP: its heartbeats stop, and rank 0's collective (or the
    scheduler's wait for the step) times out after --step-timeout-s. Either way serve stops everything
    and exits 1."""
    stack = Stack(
        "serve",
        model,
        tmp_path,
        *TP2,
        "--kv-capacity-tokens",
        "8192",
        "--step-timeout-s",
        "3",
        "--drain-timeout-s",
        "5",
    )
    stack.start()
    try:
        records = [StreamRecord() for _ in range(4)]
        body = {"model": str(model), "prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        _, down_at = asyncio.run(streams_through_fault(stack.url, body, records, lambda: stack.inject("worker-1", how)))
        assert stack.procs["serve"].wait(30) == 1
    finally:
        stack.stop()
    assert down_at is not None
    for record in records:
        assert record.terminal().startswith("finish_reason abort + error"), record.terminal()
        assert record.ended_at - down_at <= TERMINAL_WITHIN_S
    log = (tmp_path / "serve-1.log").read_text(errors="replace")
    assert "exited with status" in log and "; stopping the others" in log
    if how == "kill":
        assert f"the worker-1 process (pid {stack.pids['worker-1']}) exited" in log
    # (a stopped rank is alive: rank 0's collective or the scheduler's step timeout gives up on it first)
    pids = list(stack.pids.values())
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10), [p for p in pids if pid_alive(p)]
    assert segments_of(pids) == [] and stack.runtime_dir is not None and not stack.runtime_dir.exists()


WORKER_NODE_LINE = re.compile(r"batchserve: serving worker ranks of .*?; ((?:worker-\d+=\d+ ?)+);")


class WorkerNode(Server):
    """`batchserve serve --node-rank R > 0`: ready once it prints its worker-ranks line."""

    def ready(self) -> bool:
        match = WORKER_NODE_LINE.search(self.log())
        if match:
            self.pids = {k: int(v) for k, v in (kv.split("=") for kv in match.group(1).split())}
        return match is not None


def test_two_nodes_on_loopback_serve_as_one_rank_does(servers, model, tmp_path):
    tp1 = servers[1]
    layout = (*TP2, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}", "--dist-timeout-s", "60", *FLAGS)
    node1 = WorkerNode(
        model, tmp_path / "node1.log", *layout, "--node-rank", "1", "--runtime-dir", str(tmp_path / "node1-run")
    )
    # Node 1 is ready only once node 0's rank has joined it: start it beside node 0.
    starting = threading.Thread(target=node1.start)
    starting.start()
    try:
        node0 = start_server(model, tmp_path / "node0.log", *layout, "--node-rank", "0")
        try:
            starting.join(60)
            assert node1.pids.keys() == {"worker-1"}, node1.log_tail()
            assert set(node0.pids) == {"worker", *BACKEND_PROCESSES, "api"}  # its rank 1 runs on node 1
            for prompt in PROMPTS[:2]:
                assert complete(node0, model, prompt).choices[0].text == complete(tp1, model, prompt).choices[0].text
        finally:
            assert node0.stop() == 0
        # Rank 0's stop ends node 1's ranks, and its serve, cleanly.
        assert node1.proc is not None and node1.proc.wait(30) == 0, node1.log_tail()
        assert "stopped the worker group" in node1.log()
        assert not any(pid_alive(p) for p in [*node0.pids.values(), *node1.pids.values()])
    finally:
        starting.join(60)
        node1.stop()


def test_a_rank_whose_peer_never_comes_exits_naming_the_join(model, tmp_path):
    """Rank 0 alone (it listens, nobody joins) and rank 1 alone (nobody listens), at once."""
    timeout_s = 3
    procs = {}
    for rank in (0, 1):
        procs[rank] = subprocess.Popen(
            [
                *cli_command("proc", "worker"),
                "--model",
                str(model),
                *TP2,
                "--local-rank",
                str(rank),
                "--dist-init-addr",
                f"127.0.0.1:{free_port()}",
                "--dist-timeout-s",
                str(timeout_s),
                "--runtime-dir",
                str(tmp_path / f"rank{rank}"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    started = time.monotonic()
    for rank, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=timeout_s + 60)
        finally:
            proc.kill()
        assert proc.returncode != 0, out
        assert f"worker rank {rank} of 2 could not join the others" in out, out
    # the join's timeout, not the default 600 s (python and torch take seconds to start on a busy CPU)
    assert time.monotonic() - started < timeout_s + 30


@pytest.mark.parametrize(
    "flags, setting",
    [
        (("--nnodes", "3"), "nnodes"),
        (("--nnodes", "2", "--node-rank", "1"), "dist_init_addr"),
        (("--tp", "0"), "tensor_parallel_size"),
        (("--step-timeout-s", "2"), "step_timeout_s must be > 2"),
    ],
)
def test_a_layout_that_cannot_run_is_refused_before_anything_starts(tmp_path, flags, setting):
    proc = subprocess.run(
        [*cli_command("serve"), "--model", str(tmp_path), *TP2, *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and setting in proc.stderr, proc.stderr
    assert "serving" not in proc.stdout


# ------------------------------------------------------------------------------- the api's watch


def test_backend_processes_are_this_machines_ranks():
    assert backend_processes(ServerConfig()) == BACKEND_PROCESSES
    assert backend_processes(ServerConfig(tensor_parallel_size=4)) == (
        "worker",
        "worker-1",
        "worker-2",
        "worker-3",
        "scheduler",
        "tokenizer",
        "detokenizer",
    )
    # node 0 of two: rank 1 is on the other machine, which rank 0 watches through its collectives
    two_nodes = dict(tensor_parallel_size=2, nnodes=2, dist_init_addr="10.0.0.1:29500")
    assert backend_processes(ServerConfig(**two_nodes)) == BACKEND_PROCESSES


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_hung_follower_rank_fails_requests_in_flight_until_every_rank_is_back(tmp_path):
    """Heartbeats by hand over the api's real socket: the api is ready only once worker-1 is; worker-1
    falling silent fails the request in flight and /health; rank 0 dying after it (its collective
    failed) must be restarted too before the failure clears."""
    names = backend_processes(ServerConfig(tensor_parallel_size=2))
    endpoints = Endpoints.in_dir(tmp_path)
    ctx = zmq.Context()
    to_api: Sender = Sender(ctx, endpoints.api)
    sleepers = {name: _sleeper() for name in ("worker", "worker-1", "worker-new", "worker-1-new")}
    pids = {name: os.getpid() for name in names} | {
        "worker": sleepers["worker"].pid,
        "worker-1": sleepers["worker-1"].pid,
    }
    silent: set[str] = set()

    async def wait_for(predicate, timeout: float = 8.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    async def beat_forever() -> None:
        while True:
            for name, pid in pids.items():
                if name not in silent:
                    to_api.send(Heartbeat(process=name, pid=pid, ready=True, host=socket.gethostname()))
            await asyncio.sleep(0.2)

    async def go():
        engine = ZmqEngineClient(endpoints, "m", 64, names)
        await engine.start()
        beats = asyncio.ensure_future(beat_forever())
        try:
            silent.add("worker-1")
            await asyncio.sleep(0.5)
            assert engine.health_problem() == "the backend processes are not ready"
            silent.clear()
            await wait_for(lambda: engine.health_problem() is None)
            events = engine.generate(GenerateRequest(rid="r1", prompt="hi"))
            pending = asyncio.ensure_future(events.__anext__())
            await asyncio.sleep(0.1)
            assert not pending.done()

            silent.add("worker-1")  # hung: no heartbeat, pid still there
            event = await asyncio.wait_for(pending, 8)
            assert isinstance(event, RequestRejected) and event.status == 503
            assert f"worker-1 process (pid {pids['worker-1']}) sent no heartbeat" in event.message
            assert "worker-1" in engine.health_problem()

            sleepers["worker"].kill()  # rank 0's collective failed: it exits too
            await asyncio.sleep(0.3)
            pids["worker-1"] = sleepers["worker-1-new"].pid  # only the follower restarted: not enough
            silent.clear()
            await asyncio.sleep(0.5)
            assert engine.health_problem() is not None
            pids["worker"] = sleepers["worker-new"].pid
            await wait_for(lambda: engine.health_problem() is None)
        finally:
            beats.cancel()
            await engine.close()

    try:
        asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        for proc in sleepers.values():
            proc.kill()
            proc.wait()
        to_api.close()
        ctx.destroy(linger=0)
