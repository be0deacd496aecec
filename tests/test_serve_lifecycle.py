"""`batchserve serve` as a supervisor: a dead process stops everything (exit non-zero, named, no
orphans, no shared memory left), and SIGTERM drains (running requests finish, new ones get 503)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from pathlib import Path

import pytest

from e2e_server import http, pid_alive, start_server, wait_until


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True)


def shm_segments_of(pids) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob("batchserve-*") if int(p.name.split("-")[1]) in pids]


def test_killing_the_worker_stops_serve_with_an_error_and_no_orphans(model, tmp_path):
    server = start_server(model, tmp_path / "serve.log", "--kv-capacity-tokens", "2048")
    try:
        pids = set(server.pids.values())
        assert shm_segments_of(pids)  # the ring and double buffers exist while serving
        os.kill(server.pids["worker"], signal.SIGKILL)
        assert server.proc.wait(timeout=30) != 0
        assert f"the worker process (pid {server.pids['worker']}) exited" in server.log()
        assert "did not stop; killing it" not in server.log()  # the others stopped by themselves
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10), \
            [p for p in pids if pid_alive(p)]
        assert shm_segments_of(pids) == []
        assert server.runtime_dir is not None and not server.runtime_dir.exists()
    finally:
        server.stop()


def test_sigterm_drains_running_requests_and_refuses_new_ones(model, tmp_path):
    server = start_server(model, tmp_path / "serve.log", "--kv-capacity-tokens", "4096", "--drain-timeout-s", "60")
    pids = set(server.pids.values())
    body = {"model": str(model), "prompt": [5, 6, 7], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[dict] = []
    first_chunk = threading.Event()

    def long_stream():
        req = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first_chunk.set()

    try:
        reader = threading.Thread(target=long_stream)
        reader.start()
        assert first_chunk.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        # while draining: the api still listens but refuses new work
        refused = wait_until(lambda: http(f"{server.url}/health")[0] == 503, timeout=10)
        status, err = http(f"{server.url}/v1/completions", {"model": str(model), "prompt": [5], "max_tokens": 4})
        reader.join(120)
        assert refused and status == 503, (status, err)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length"  # the running request ran to its end
        assert chunks[-1]["usage"]["completion_tokens"] == 300
        assert server.proc.wait(timeout=60) == 0
        assert "draining" in server.log()
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)
        assert shm_segments_of(pids) == []
    finally:
        server.stop()


def test_a_process_that_cannot_start_is_named_and_serve_exits_non_zero(tmp_path):
    with pytest.raises(RuntimeError) as info:
        start_server(tmp_path / "no-such-model", tmp_path / "serve.log", startup_timeout=120)
    assert "exited" in str(info.value) and "not found" in str(info.value)
