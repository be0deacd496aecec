"""Starting and stopping `batchserve serve` as its user sees it (issue 31).

- The ready line is printed once, after every process said it is ready, and a request sent as it
  appears gets a 200.
- A stop (SIGTERM), idle or with streams in flight, ends every process by itself: serve exits 0,
  nothing is killed, and each process's exit is within `WITHIN_S` of the api's drain, read from the
  server's own log (each process's "stopped" line and the supervisor's record of the exits).
- A port that is taken is one line and exit status 2 before anything starts; one taken after that
  check fails the api, and the others still stop by themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
from datetime import datetime
from pathlib import Path

import aiohttp
import pytest
from e2e_server import REPO, free_port, http, pid_alive, start_server, stream, wait_until
from fault_injection import StreamRecord, segments_of, stream_until_end

from batchserve.shared.commands import cli_command
from batchserve.shared.config import DEFAULT_MODEL

WITHIN_S = 5.0  # the bound on each process's exit after the drain's end
PROCESSES = ("worker", "scheduler", "tokenizer", "detokenizer", "api")
LOG_RECORD = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z \w+ (\S+) (.*)$", re.M)
STOP_RECORD = re.compile(r"^batchserve serve: stopped; seconds from SIGTERM to exit: (.*)$", re.M)
SERVING_LINE = "batchserve: serving "


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def slow_model(tiny_model_dir):
    """Big enough that 400 tokens take seconds on a CPU, so streams are still running at the stop."""
    return tiny_model_dir("llama", with_tokenizer=True, hidden_size=512, intermediate_size=2048, num_hidden_layers=8)


def log_records(log: str) -> list[tuple[datetime, str, str]]:
    """(time, logger, message with its fields) of every process's log line."""
    return [(datetime.fromisoformat(at), logger, message) for at, logger, message in LOG_RECORD.findall(log)]


def stop_record(log: str) -> dict[str, tuple[float, str]]:
    """The supervisor's record of the stop: each process's seconds from its SIGTERM to its exit, and how
    it ended where that was not status 0."""
    lines = STOP_RECORD.findall(log)
    assert len(lines) == 1, log[-3000:]
    out = {}
    for entry in lines[0].split(", "):
        name, seconds, *note = entry.split(" ", 2)
        out[name] = (float(seconds), note[0] if note else "")
    return out


def stopped_lines(log: str) -> dict[str, tuple[datetime, str]]:
    return {
        message.split()[0]: (at, message)
        for at, logger, message in log_records(log)
        if logger == "batchserve.process" and re.match(r"\S+ stopped pid=", message)
    }


def assert_clean_stop(log: str) -> dict[str, float]:
    """Every process stopped by itself with status 0 within `WITHIN_S` of the drain's end; returns each
    one's seconds after it (from its "stopped" line)."""
    assert "did not stop; killing it" not in log, log[-3000:]
    drained = [
        at for at, logger, message in log_records(log) if logger == "batchserve.api" and message.startswith("drained ")
    ]
    assert len(drained) == 1, log[-3000:]
    stopped = stopped_lines(log)
    assert sorted(stopped) == sorted(PROCESSES), log[-3000:]
    after = {name: (at - drained[0]).total_seconds() for name, (at, _) in stopped.items()}
    for name, (_, message) in stopped.items():
        assert message.endswith("status=0"), message
        assert 0 <= after[name] <= WITHIN_S, (name, after)
    record = stop_record(log)
    assert sorted(record) == sorted(PROCESSES) and all(note == "" for _, note in record.values()), record
    # The backend is stopped when the api has drained: its exits, as the supervisor saw them.
    assert all(seconds <= WITHIN_S for name, (seconds, _) in record.items() if name != "api"), record
    return after


def assert_nothing_left(pids: list[int]) -> None:
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10), [p for p in pids if pid_alive(p)]
    assert segments_of(pids) == []


def test_the_ready_line_is_printed_once_when_a_request_gets_a_200(model, tmp_path):
    server = start_server(model, tmp_path / "serve.log")
    try:
        # start_server returns as soon as the line is there
        status, body = http(f"{server.url}/v1/completions", {"model": str(model), "prompt": "w5 w6", "max_tokens": 2})
        assert status == 200, body
        assert http(f"{server.url}/health")[0] == 200
        log = server.log()
        assert log.count(SERVING_LINE) == 1, log
        before = log[: log.index(SERVING_LINE)]
        ready = {
            message.split()[0] for _, logger, message in log_records(before) if re.match(r"\S+ ready pid=", message)
        }
        assert ready == set(PROCESSES), before
        assert "listening" not in log  # the api listens (answering 503) long before it is ready
    finally:
        server.stop()


def test_an_idle_server_stops_by_itself_soon_after_the_drain(model, tmp_path):
    server = start_server(model, tmp_path / "serve.log")
    pids = list(server.pids.values())
    try:
        status, body = http(f"{server.url}/v1/completions", {"model": str(model), "prompt": "w5 w6", "max_tokens": 4})
        assert status == 200, body
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
    finally:
        server.stop()
    assert_clean_stop(server.log())
    assert_nothing_left(pids)


@pytest.mark.parametrize("drain", ["finish", "cut off"])
def test_a_busy_server_ends_every_stream_and_stops_by_itself(slow_model, tmp_path, drain):
    """Streams in flight at the stop either finish within the drain timeout or are cut off by it with
    the terminal events; either way every process then stops by itself."""
    max_tokens, drain_timeout = (100, 60) if drain == "finish" else (400, 1)
    server = start_server(
        slow_model, tmp_path / "serve.log", "--kv-capacity-tokens", "8192", "--drain-timeout-s", str(drain_timeout)
    )
    pids = list(server.pids.values())
    records = [StreamRecord() for _ in range(3)]
    body = {
        "model": str(slow_model),
        "prompt": "w5 w6 w7",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def streams_through_stop() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            tasks = [asyncio.create_task(stream_until_end(session, server.url, body, r)) for r in records]
            while any(r.chunks < 2 for r in records):
                assert not any(t.done() for t in tasks), [r.terminal() for r in records]
                await asyncio.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*tasks), 90)

    try:
        asyncio.run(streams_through_stop())
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
    finally:
        server.stop()
    ends = sorted({r.terminal() for r in records})
    if drain == "finish":
        assert ends == ["completed + [DONE]"], ends
        finishes = [
            json.loads(data)["choices"][0]["finish_reason"]
            for r in records
            for _, data in r.events
            if data.startswith("{") and json.loads(data)["choices"]
        ]
        assert finishes.count("length") == len(records)
    else:
        assert len(ends) == 1 and ends[0].startswith("finish_reason abort + error"), ends
    assert_clean_stop(server.log())
    assert_nothing_left(pids)


def serve_command(model: Path, port: int) -> list[str]:
    return [*cli_command("serve"), "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]


def test_a_taken_port_is_one_line_before_anything_starts(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(serve_command(model, port), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"batchserve serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], done.stderr


def children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_a_port_taken_after_the_check_fails_the_api_and_the_others_stop_by_themselves(model, tmp_path):
    """The port is taken once `serve` has started its five children (past its own check, before the
    api, still importing, binds): the api fails, and the others, still starting, stop at once."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log, socket.socket() as taken:
        proc = subprocess.Popen(
            serve_command(model, port), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            assert wait_until(
                lambda: len(children_of(proc.pid)) == len(PROCESSES) or proc.poll() is not None,
                timeout=60,
                interval=0.002,
            )
            pids = children_of(proc.pid)
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", port))
            taken.listen()
            assert proc.wait(timeout=120) == 1
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log_path.read_text(errors="replace")
    assert f"cannot listen on 127.0.0.1:{port}" in text and "the api process" in text, text
    assert "did not stop; killing it" not in text, text
    record = stop_record(text)
    assert sorted(record) == sorted(name for name in PROCESSES if name != "api"), record
    # Each ends by itself: with status 0, or by SIGTERM's default action if its handlers were not
    # installed yet (nothing of its own to clean up then).
    assert all(seconds <= WITHIN_S and note in ("", "(by SIGTERM)") for seconds, note in record.values()), record
    assert_nothing_left(pids)


README_CURL = re.compile(r"```bash\ncurl -N (\S+/v1/chat/completions) .*?-d '(\{.*?\})'\n```", re.S)
# the structured-output example: the first non-streamed curl to the chat endpoint
README_SCHEMA_CURL = re.compile(r"```bash\ncurl (\S+/v1/chat/completions) .*?-d '(\{.*?\})'\n```", re.S)


@pytest.mark.slow
def test_the_default_model_answers_the_readme_example_and_stops_by_itself(tmp_path):
    """The README's first example and its structured-output one, as written, on the default model:
    sensible answers; then a clean stop."""
    readme = (REPO / "README.md").read_text()
    url, body = README_CURL.search(readme).groups()
    body = json.loads(body)
    server = start_server(DEFAULT_MODEL, tmp_path / "serve.log", "--kv-capacity-tokens", "8192", startup_timeout=600)
    try:
        assert server.log().count(SERVING_LINE) == 1
        text, finish, _ = stream(server.url + url[url.index("/v1/") :], body)
        assert "Paris" in text and finish == "stop", (text, finish)
        url, body = README_SCHEMA_CURL.search(readme).groups()
        status, answer = http(server.url + url[url.index("/v1/") :], json.loads(body))
        assert status == 200, answer
        assert json.loads(answer["choices"][0]["message"]["content"]) == {"city": "Paris", "country": "France"}
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
    finally:
        server.stop()
    assert_clean_stop(server.log())
