"""A short headless Locust run of `loadtests/locustfile.py` against the in-test streaming server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from batchserve.loadtests.fake_openai_server import FakeServerScript, FakeServerThread

LOCUSTFILE = Path(__file__).resolve().parents[1] / "loadtests" / "locustfile.py"
USERS = 2


def run_locust(
    host: str, out_dir: Path, max_requests: int, model: str = "fake"
) -> tuple[int, dict[str, dict[str, Any]], str]:
    """Run headless (127.0.0.1 only; users, run time and requests bounded); stats per entry name."""
    env = {
        **os.environ,
        "BATCHSERVE_LOCUST_MAX_TOKENS": "8",
        "BATCHSERVE_LOCUST_PROMPT_WORDS": "6",
        "BATCHSERVE_LOCUST_MAX_REQUESTS": str(max_requests),
        "BATCHSERVE_LOCUST_MODEL": model,
    }
    stats_file = out_dir / "stats"
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--users",
        str(USERS),
        "--spawn-rate",
        str(USERS),
        "--run-time",
        "20s",
        "--stop-timeout",
        "5",
        "--host",
        host,
        "--only-summary",
        "--json-file",
        str(stats_file),
        "--loglevel",
        "WARNING",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=out_dir)
    stats = json.loads(stats_file.with_suffix(".json").read_text())
    return proc.returncode, {entry["name"]: entry for entry in stats}, proc.stdout + proc.stderr


def test_headless_locust_reports_ttft_and_itl_without_failures(tmp_path):
    with FakeServerThread(FakeServerScript(ttft_s=0.01, token_interval_s=0.002)) as server:
        status, stats, output = run_locust(server.base_url, tmp_path, max_requests=10)
        received = len(server.script.received)
    assert status == 0, output  # locust exits 1 when any request failed
    streams, ttft, itl = stats["chat stream"], stats["TTFT"], stats["ITL"]
    n = streams["num_requests"]
    assert 10 <= n < 10 + USERS and received == n  # stopped at the request cap, well before the 20 s limit
    assert all(entry["num_failures"] == 0 for entry in stats.values())
    assert ttft["num_requests"] == n
    assert itl["num_requests"] == 7 * n  # 8 tokens, one chunk each: 7 gaps per stream
    assert ttft["min_response_time"] >= 10.0  # the scripted first-token delay, in ms
    assert streams["min_response_time"] >= 10.0 + 7 * 2.0  # timed to the end of the stream, not the headers


def test_headless_locust_counts_failed_streams(tmp_path):
    with FakeServerThread() as server:
        dead_url = server.base_url  # nothing listens there once the server has stopped
    status, stats, _ = run_locust(dead_url, tmp_path, max_requests=3)
    assert status == 1
    assert stats["chat stream"]["num_failures"] >= 3
    assert "TTFT" not in stats and "ITL" not in stats
