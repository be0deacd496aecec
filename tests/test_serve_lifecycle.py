"""`batchserve serve` as a supervisor: a dead process stops everything (exit non-zero, named, no
orphans, no shared memory left), SIGTERM drains (running requests finish, new ones get 503), and
SIGINT while starting stops it all (exit 0, said as a stop)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest
from e2e_server import REPO, http, pid_alive, start_server, wait_until

from batchserve.shared.commands import cli_command


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
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10), [p for p in pids if pid_alive(p)]
        assert shm_segments_of(pids) == []
        assert server.runtime_dir is not None and not server.runtime_dir.exists()
    finally:
        server.stop()


def test_sigterm_drains_running_requests_and_refuses_new_ones(model, tmp_path):
    server = start_server(model, tmp_path / "serve.log", "--kv-capacity-tokens", "4096", "--drain-timeout-s", "60")
    pids = set(server.pids.values())
    body = {
        "model": str(model),
        "prompt": [5, 6, 7],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict] = []
    first_chunk = threading.Event()

    def long_stream():
        req = urllib.request.Request(
            f"{server.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
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


def _children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _runs_a_process(pid: int) -> bool:
    """The child has exec'd `batchserve proc NAME` (before that it is a copy of serve, its signals serve's)."""
    try:
        return b"\0proc\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _exited(pid: int) -> bool:
    """Exited and not reaped yet (a zombie: its parent is stopped), or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("reaches", ["serve", "every process"])
def test_sigint_while_starting_says_stopped_and_exits_0(model, tmp_path, reaches):
    """Ctrl-C while the processes start: serve says it was stopped, not that a process died. With
    "every process" (Ctrl-C reaching the whole tree, `kill` of them all) the children have exited on the
    signal before serve looks (serve is held with SIGSTOP meanwhile), the order that read as a crash."""
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*cli_command("serve"), "--model", str(model), "--port", "0", "--kv-capacity-tokens", "2048"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert wait_until(lambda: sum(map(_runs_a_process, _children_of(proc.pid))) == 5, timeout=60), (
            log_path.read_text()
        )
        children = _children_of(proc.pid)
        if reaches == "every process":
            os.kill(proc.pid, signal.SIGSTOP)
            for pid in children:
                os.kill(pid, signal.SIGINT)
            assert wait_until(lambda: all(map(_exited, children)), timeout=60), log_path.read_text()
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=60) == 0
        text = log_path.read_text()
        assert "batchserve serve: SIGINT: stopping before every process was ready" in text, text
        assert re.search(r"^batchserve serve: stopped[;,]", text, re.M), text
        assert "exited with status" not in text and "stopping the others" not in text, text
        assert "batchserve: serving" not in text, text
        assert wait_until(lambda: not any(pid_alive(p) for p in children), timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
