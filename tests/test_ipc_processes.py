"""Process plumbing without starting a server: typed sockets, sd_notify, config precedence, and the
per-process logic (prompt checks, token deltas, stop strings in the detokenizer)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid

import msgspec
import numpy as np
import pytest
import zmq

from batchserve.procs import launch
from batchserve.procs.detokenizer.process import Detokenizers
from batchserve.procs.scheduler import Scheduler, SchedulerConfig, ScriptedExecutor, StepOutput
from batchserve.procs.tokenizer.prompts import PromptTokenizer
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import Refusal
from batchserve.shared.ipc import Endpoints, Receiver, SchedulerInbox, Sender
from batchserve.shared.messages import (
    PROMPT_TAIL_TOKENS,
    AbortRequest,
    ChatMessage,
    ForwardBatch,
    GenerateRequest,
    RequestParams,
    SamplingParams,
    StopParams,
    TokenDelta,
    TokenizedRequest,
)
from batchserve.shared.process_messages import WorkerInfo
from batchserve.shared.readiness import notify, notify_ready
from batchserve.shared.shm import SharedRing


def test_typed_sockets_carry_a_union_in_order_with_prompt_ids_in_shared_memory(tmp_path):
    ep = Endpoints.in_dir(tmp_path)
    ctx = zmq.Context()
    ring = SharedRing("test-ipc")
    try:
        sender = Sender(ctx, ep.scheduler, writer=ring)  # connects before the receiver binds: queued
        prompt = np.arange(1000, dtype=np.int32)
        sender.send(TokenizedRequest(rid="a", prompt_ids=prompt, params=RequestParams()))
        sender.send(AbortRequest(rid="a"))
        sender.send(WorkerInfo(kv_capacity_tokens=64, eos_token_ids=[2], max_context=32, page_size=16))
        receiver: Receiver[SchedulerInbox] = Receiver(ctx, ep.scheduler, SchedulerInbox)
        got = [receiver.recv(5) for _ in range(3)]
        assert isinstance(got[0], TokenizedRequest) and (got[0].prompt_ids == prompt).all()
        assert got[1] == AbortRequest(rid="a") and isinstance(got[2], WorkerInfo)
        assert ring.read_pos == ring.write_pos  # the receiver released the prompt's space
        assert receiver.recv(0.01) is None and receiver.recv_ready() == []
    finally:
        ctx.destroy(linger=0)
        ring.close()


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_ready_speaks_sd_notify(tmp_path, monkeypatch, abstract):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"batchserve-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    else:
        sock.bind(str(tmp_path / "notify"))
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    with sock:
        assert notify_ready()
        assert sock.recv(100).decode() == f"READY=1\nMAINPID={os.getpid()}"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify("READY=1") is False  # outside systemd / serve: nothing to tell


def test_proc_config_precedence_file_then_env_then_flags(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(ServerConfig(model="from-file", port=1111, page_size=32, policy="fixed").to_json())
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(["worker", "--config", str(path), "--port", "3333"])
    config = launch.load_config(args, env={"BATCHSERVE_PORT": "2222", "BATCHSERVE_POLICY": "mixed"})
    assert (config.model, config.page_size) == ("from-file", 32)  # file
    assert config.policy == "mixed"  # env over file
    assert config.port == 3333  # flag over env
    with pytest.raises(FileNotFoundError):
        launch.load_config(parser.parse_args(["api", "--config", str(tmp_path / "missing.json")]), env={})


class WordTokenizer:
    """Stands in for a Hugging Face tokenizer: words "w<i>" <-> ids."""

    def __len__(self):
        return 100

    def encode(self, text, add_special_tokens=True):
        return [int(w[1:]) for w in text.split()]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        if any(m["role"] not in ("user", "assistant", "system") for m in messages):
            raise ValueError("unknown role")
        return " ".join(m["content"] for m in messages) + " w99"


def request(max_tokens: int | None = None, stop: StopParams | None = None, **kw) -> GenerateRequest:
    stop = msgspec.structs.replace(stop or StopParams(), max_tokens=max_tokens)
    return GenerateRequest(rid="r", **kw, params=RequestParams(stop=stop))


def test_prompt_checks_name_the_field():
    tok = PromptTokenizer(WordTokenizer(), max_context=10)
    ok = tok.tokenize(request(prompt="w1 w2", max_tokens=8))
    assert ok.prompt_ids.tolist() == [1, 2] and ok.prompt_ids.dtype == np.int32 and ok.params.stop.max_tokens == 8
    chat = tok.tokenize(request(messages=[ChatMessage(role="user", content="w3")], max_tokens=2))
    assert chat.prompt_ids.tolist() == [3, 99]
    # not given: a prompt gets 16 lowered to the room left, a chat all the room left
    assert tok.tokenize(request(prompt="w1 w2 w3")).params.stop.max_tokens == 7
    assert tok.tokenize(request(messages=[ChatMessage(role="user", content="w3")])).params.stop.max_tokens == 8
    cases = [
        (request(prompt=""), "prompt"),
        (request(prompt_token_ids=[]), "prompt"),
        (request(prompt_token_ids=[1, 100]), "prompt"),  # outside the vocabulary
        (request(messages=[]), "messages"),
        (request(messages=[ChatMessage(role="robot", content="w1")]), "messages"),
        (request(prompt=" ".join(["w1"] * 10)), "prompt"),  # no room for one generated token
        (request(prompt="w1 w2", max_tokens=9), "max_tokens"),
        (request(prompt="w1 w2", max_tokens=0), "max_tokens"),
        # the refusal names the field the client sent
        (
            request(
                messages=[ChatMessage(role="user", content="w3")],
                max_tokens=9,
                max_tokens_param="max_completion_tokens",
            ),
            "max_completion_tokens",
        ),
        (request(prompt="w1", max_tokens=2, stop=StopParams(stop_token_ids=(5, 100))), "stop_token_ids"),
    ]
    for req, param in cases:
        with pytest.raises(Refusal) as info:
            tok.tokenize(req)
        assert info.value.param == param and info.value.status == 400, (req, info.value)


def _delta_scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_running_requests=2, prefill_budget=64, kv_capacity_tokens=128), eos_token_ids=(2,)
    )


def test_token_deltas_first_carries_stop_strings_and_last_carries_the_reason():
    sched = _delta_scheduler()
    executor = ScriptedExecutor(lambda slot: 10)  # tokens 100, 101, ...
    stop = StopParams(max_tokens=2, stop=("x",))
    sched.add_request("a", np.arange(20, dtype=np.int32), RequestParams(stop=stop))
    first = sched.token_deltas(sched.step(executor))
    assert first == [
        TokenDelta(
            rid="a",
            token_ids=[100],
            prompt_tokens=20,
            completion_tokens=1,
            stop=stop,
            prompt_tail=list(range(20 - PROMPT_TAIL_TOKENS, 20)),
        )
    ]
    last = sched.token_deltas(sched.step(executor))
    assert last == [TokenDelta(rid="a", token_ids=[101], finish_reason="length", prompt_tokens=20, completion_tokens=2)]
    assert not sched.has_unfinished()  # forgotten, its final delta built from the step's record of it
    # an abort of a request never seen still closes it downstream
    assert sched.token_deltas(StepOutput(step=2, cancelled=["zzz"])) == [
        TokenDelta(rid="zzz", token_ids=[], finish_reason="abort")
    ]


def test_an_aborted_request_closes_with_its_counts_and_its_first_delta_may_be_the_abort():
    sched = _delta_scheduler()
    executor = ScriptedExecutor(lambda slot: 10)
    sched.add_request("a", np.arange(3, 9, dtype=np.int32), RequestParams(stop=StopParams(max_tokens=8, stop=("x",))))
    sched.add_request("w", np.arange(3, 6, dtype=np.int32), RequestParams(stop=StopParams(max_tokens=8, stop=("y",))))
    sched.token_deltas(sched.step(executor))
    sched.token_deltas(sched.step(executor))  # a and w have 2 tokens each
    assert sched.abort("a")
    q_stop = StopParams(max_tokens=8, stop=("z",))
    sched.add_request("q", [3], RequestParams(stop=q_stop))
    assert sched.abort("q")  # before any token: its only delta is the first
    deltas = sched.token_deltas(sched.step(executor))
    assert deltas[-2:] == [
        TokenDelta(rid="a", token_ids=[], finish_reason="abort", prompt_tokens=6, completion_tokens=2),
        TokenDelta(rid="q", token_ids=[], finish_reason="abort", prompt_tokens=1, stop=q_stop, prompt_tail=[3]),
    ]


def test_detokenizer_stop_string_finishes_once_and_aborts_the_scheduler(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama", with_tokenizer=True))
    d = Detokenizers(tok)
    out, abort = d.handle(
        TokenDelta(
            rid="a",
            token_ids=[5],
            prompt_tokens=3,
            completion_tokens=1,
            stop=StopParams(stop=("w7",)),
            prompt_tail=[3, 4],
        )
    )
    assert out.finish_reason is None and not abort
    out, abort = d.handle(TokenDelta(rid="a", token_ids=[6, 7, 8], prompt_tokens=3, completion_tokens=4))
    assert abort and out.finish_reason == "stop" and "w7" not in out.text and "w6" in out.text
    assert out.usage is not None and out.usage.completion_tokens == 4
    # later tokens and the scheduler's final (abort) delta for it are dropped, and it is forgotten
    assert d.handle(TokenDelta(rid="a", token_ids=[9])) == (None, False)
    assert d.handle(TokenDelta(rid="a", token_ids=[], finish_reason="abort")) == (None, False)
    assert d.active == {} and d.stopped == set()
    # a request that ends by length gets its held-back text and usage
    d.handle(TokenDelta(rid="b", token_ids=[5], prompt_tokens=1, completion_tokens=1, stop=StopParams(stop=("w55",))))
    out, abort = d.handle(
        TokenDelta(rid="b", token_ids=[], finish_reason="length", prompt_tokens=1, completion_tokens=1)
    )
    assert out.finish_reason == "length" and not abort and out.usage.total_tokens == 2


def test_serve_refuses_an_unworkable_policy_before_starting_anything(capsys):
    from batchserve.procs.cli import main

    assert main(["serve", "--policy", "mixed", "--prefill-budget", "8", "--max-running-requests", "16"]) == 2
    assert "prefill_budget" in capsys.readouterr().err


def test_the_watchdog_is_fed_only_under_a_systemd_watchdog(tmp_path, monkeypatch):
    from batchserve.procs.runtime import ProcessRuntime

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(1)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    config = ServerConfig(runtime_dir=str(tmp_path / "run"))
    with sock:
        rt = ProcessRuntime("worker", config)
        rt.alive()  # no WatchdogSec=: nothing sent
        monkeypatch.setenv("WATCHDOG_USEC", "60000000")
        rt_watched = ProcessRuntime("worker", config)
        rt_watched.alive()
        rt_watched.alive()  # at most once a second
        assert sock.recv(100) == b"WATCHDOG=1"
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            sock.recv(100)
        monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
        rt_other = ProcessRuntime("worker", config)
        rt_other.alive()
        with pytest.raises(TimeoutError):
            sock.recv(100)
        for runtime in (rt, rt_watched, rt_other):
            runtime.ctx.destroy(linger=0)


def test_the_runtime_dir_is_made_private_even_if_it_exists(tmp_path):
    from batchserve.procs.runtime import resolve_runtime_dir

    loose = tmp_path / "run"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    assert resolve_runtime_dir(ServerConfig(runtime_dir=str(loose))) == loose
    assert loose.stat().st_mode & 0o777 == 0o700


def test_api_keys_from_flags_and_environment():
    from batchserve.shared.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--api-key", "a", "--api-key", "b"])
    assert config_from_args(args, env={}).api_key == ["a", "b"]
    assert config_from_args(parser.parse_args([]), env={"BATCHSERVE_API_KEY": "x, y,"}).api_key == ["x", "y"]
    assert config_from_args(parser.parse_args([]), env={}).api_key == []


def _one_token_batch(step: int) -> ForwardBatch:
    return ForwardBatch(
        step=step,
        slots=[0],
        prefix_lens=[0],
        extend_lens=[1],
        sample_lens=[1],
        sampling=[SamplingParams()],
        sample_counts=[0],
        **{
            name: np.zeros(1 if name in ("input_ids", "positions", "kv_locs") else 0, dtype=np.int32)
            for name in ("input_ids", "positions", "kv_locs", "page_table_slots", "page_table_cols", "page_table_pages")
        },
    )


def test_a_stalled_worker_ends_the_wait_within_the_step_timeout(tmp_path):
    from batchserve.procs.runtime import ProcessRuntime
    from batchserve.procs.scheduler.remote_worker import RemoteWorker, WorkerStalled
    from batchserve.shared.messages import StepResult

    rt = ProcessRuntime("scheduler", ServerConfig(runtime_dir=str(tmp_path)))
    try:
        results: Receiver = Receiver(rt.ctx, rt.endpoints.steps, StepResult)
        to_worker: Sender = Sender(rt.ctx, rt.endpoints.worker)  # nobody listens: the step never comes back
        worker = RemoteWorker(to_worker, results, rt, step_timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(WorkerStalled, match="no result for step 7"):
            worker.execute(_one_token_batch(7))
        assert 0.3 <= time.monotonic() - start < 2
    finally:
        rt.ctx.destroy(linger=0)


def test_a_step_predicted_long_is_given_a_multiple_of_its_prediction(tmp_path):
    """A big prefill chunk of a large model on a slow CPU takes longer than the step timeout and is not hung:
    the wait is SLOW_STEP_FACTOR times the cost model's prediction where that is longer (a 2048-token step of a
    1B model on two cores, ~40 s, was failed as a stall at 30 s)."""
    from batchserve.procs.runtime import ProcessRuntime
    from batchserve.procs.scheduler.remote_worker import SLOW_STEP_FACTOR, RemoteWorker
    from batchserve.shared.messages import StepResult

    class Predicts:
        seconds = 0.0

        def shape(self, prefix_lens, extend_lens):
            return None

        def predict(self, shape):
            return self.seconds

    rt = ProcessRuntime("scheduler", ServerConfig(runtime_dir=str(tmp_path)))
    try:
        worker = RemoteWorker(
            Sender(rt.ctx, rt.endpoints.worker), Receiver(rt.ctx, rt.endpoints.steps, StepResult), rt, 30
        )
        batch = _one_token_batch(3)
        assert worker.timeout_s(batch) == 30  # no cost model yet
        worker.cost = cost = Predicts()
        cost.seconds = 2.0
        assert worker.timeout_s(batch) == 30
        cost.seconds = 40.0
        assert worker.timeout_s(batch) == SLOW_STEP_FACTOR * 40.0
    finally:
        rt.ctx.destroy(linger=0)


@pytest.mark.parametrize("stopping", [False, True])
def test_a_dead_worker_ends_the_wait_at_once(tmp_path, stopping):
    """A killed worker's step never comes back: the wait ends as soon as its process is gone, not after
    the step timeout (running) or the stop's grace for the step in flight (stopping)."""
    from batchserve.procs.runtime import ProcessRuntime
    from batchserve.procs.scheduler.remote_worker import WORKER_STOP_GRACE_S, RemoteWorker, WorkerGone, WorkerStalled
    from batchserve.shared.messages import StepResult

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rt = ProcessRuntime("scheduler", ServerConfig(runtime_dir=str(tmp_path)))
    try:
        if stopping:
            rt.stopping.set()
        results: Receiver = Receiver(rt.ctx, rt.endpoints.steps, StepResult)
        to_worker: Sender = Sender(rt.ctx, rt.endpoints.worker)
        worker = RemoteWorker(to_worker, results, rt, step_timeout_s=60)
        worker.worker_pid = dead.pid
        start = time.monotonic()
        with pytest.raises(WorkerGone if stopping else WorkerStalled, match=f"pid {dead.pid}"):
            worker.execute(_one_token_batch(7))
        assert time.monotonic() - start < WORKER_STOP_GRACE_S / 2
    finally:
        rt.ctx.destroy(linger=0)
