"""No client left hanging: kill (SIGKILL) each of the five processes, or stop (SIGSTOP) the worker,
with streams in flight, under `batchserve serve` and as five `batchserve proc` processes with no
supervisor (as systemd runs them). Every client gets its terminal event within 2 s of /health
turning 503 (a chunk with finish_reason "abort", an error event, [DONE]; the api's own death is a
closed connection), nothing is left behind once the stack is stopped, and a restarted stack serves.

Set BATCHSERVE_FAULT_TABLE=path to get the reliability table as JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
from e2e_server import http, pid_alive
from fault_injection import PROCESSES, Stack, StreamRecord, segments_of, stream_until_end, streams_through_fault

FAULTS = [(name, "kill") for name in PROCESSES] + [("worker", "stop")]
FLAGS = (
    "--kv-capacity-tokens",
    "8192",
    "--max-running-requests",
    "8",
    "--step-timeout-s",
    "2",
    "--drain-timeout-s",
    "5",
)
STREAMS = 4
TERMINAL_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def slow_model(tiny_model_dir):
    """Big enough that 400 tokens take seconds on a CPU, so the streams are mid-way at the fault."""
    return tiny_model_dir("llama", with_tokenizer=True, hidden_size=512, intermediate_size=2048, num_hidden_layers=8)


def _fault_run(stack: Stack, process: str, how: str) -> dict:
    records = [StreamRecord() for _ in range(STREAMS)]
    body = {"model": str(stack.model), "prompt": "w5 w6 w7", "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    fault_at, down_at = asyncio.run(streams_through_fault(stack.url, body, records, lambda: stack.inject(process, how)))
    pids = list(stack.pids.values())
    status = stack.stop()
    row = {
        "mode": stack.mode,
        "fault": f"{how} {process}",
        "clients": sorted({r.terminal() for r in records}),
        "health_503_after_s": None if down_at is None else round(down_at - fault_at, 2),
        "terminal_after_503_s": None if down_at is None else round(max(r.ended_at for r in records) - down_at, 2),
        "serve_exit": status,
        "processes_left": [p for p in pids if pid_alive(p)],
        "segments_left": segments_of(pids) if stack.mode == "serve" else None,
        "runtime_dir_left": bool(stack.runtime_dir and stack.runtime_dir.exists()) if stack.mode == "serve" else None,
    }
    if path := os.environ.get("BATCHSERVE_FAULT_TABLE"):
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
    return row, records, down_at, pids


@pytest.mark.parametrize("mode", ["serve", "proc"])
def test_every_client_gets_a_terminal_event_and_nothing_is_left(slow_model, tmp_path, mode):
    stack = Stack(mode, slow_model, tmp_path, *FLAGS)
    all_pids: list[int] = []
    for process, how in FAULTS:
        stack.start()  # from the second fault on: the restarted stack serves again
        row, records, down_at, pids = _fault_run(stack, process, how)
        all_pids += pids
        assert down_at is not None, row
        for record in records:
            assert record.ended_at - down_at <= TERMINAL_WITHIN_S, row
            if process == "api":
                assert record.error, row  # the process that writes the events is the one gone
            else:
                assert record.terminal().startswith("finish_reason abort + error"), row
        assert row["processes_left"] == [], row
        if mode == "serve":
            assert row["serve_exit"] == 1 and row["segments_left"] == [] and not row["runtime_dir_left"], row
    stack.start()
    status, body = http(f"{stack.url}/v1/completions", {"model": str(slow_model), "prompt": "w5", "max_tokens": 4})
    all_pids += list(stack.pids.values())
    stack.stop()
    assert status == 200, body
    # What a killed process could not remove, the next start did.
    assert segments_of(all_pids) == []
    assert not any(pid_alive(p) for p in all_pids)


def test_streams_cut_by_the_drain_timeout_end_with_abort_and_an_error(slow_model, tmp_path):
    stack = Stack("serve", slow_model, tmp_path, "--kv-capacity-tokens", "8192", "--drain-timeout-s", "1")
    stack.start()
    records = [StreamRecord() for _ in range(STREAMS)]
    body = {"model": str(slow_model), "prompt": "w5 w6 w7", "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def main() -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
            tasks = [asyncio.create_task(stream_until_end(session, stack.url, body, r)) for r in records]
            while any(r.chunks < 2 for r in records):
                assert not any(t.done() for t in tasks)
                await asyncio.sleep(0.01)
            signalled_at = time.monotonic()
            stack.procs["serve"].terminate()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return signalled_at

    signalled_at = asyncio.run(main())
    pids = list(stack.pids.values())
    assert stack.procs["serve"].wait(30) == 0
    row = {
        "mode": "serve",
        "fault": "SIGTERM, drain timeout 1 s",
        "clients": sorted({r.terminal() for r in records}),
        "terminal_after_signal_s": round(max(r.ended_at for r in records) - signalled_at, 2),
        "processes_left": [p for p in pids if pid_alive(p)],
        "segments_left": segments_of(pids),
    }
    if path := os.environ.get("BATCHSERVE_FAULT_TABLE"):
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
    for record in records:
        assert record.terminal().startswith("finish_reason abort + error"), row
        assert "drain timeout" in json.loads(record.events[-2][1])["error"]["message"]
    assert row["terminal_after_signal_s"] <= 1 + TERMINAL_WITHIN_S, row
    assert row["processes_left"] == [] and row["segments_left"] == [], row
