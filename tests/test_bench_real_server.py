"""`batchserve bench` and the Locust user against the real server (`batchserve serve`, tiny random model)."""

from __future__ import annotations

import json

import pytest
from test_locust_user import run_locust

from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND, ServerProcess
from batchserve.procs.cli import main as cli_main


@pytest.fixture(scope="module")
def real_server(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama", with_tokenizer=True)
    log = tmp_path_factory.mktemp("bench-real") / "serve.log"
    command = [
        *DEFAULT_SERVE_COMMAND,
        "--model",
        str(model),
        "--kv-capacity-tokens",
        "4096",
        "--max-running-requests",
        "8",
        "--prefill-budget",
        "256",
    ]
    with ServerProcess(command, log, health_timeout_s=240) as server:
        yield server, model


def test_bench_against_the_real_server(real_server, tmp_path):
    server, model = real_server
    out = tmp_path / "bench.json"
    status = cli_main(
        [
            "bench",
            "--base-url",
            server.base_url,
            "--model",
            str(model),
            "--tokenizer",
            str(model),
            "--endpoint",
            "completions",
            "--num-prompts",
            "6",
            "--input-len",
            "4:12",
            "--output-len",
            "3:6",
            "--concurrency",
            "3",
            "--warmup",
            "1",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert status == 0, server.log_tail()
    (run,) = json.loads(out.read_text())["runs"]
    m = run["metrics"]
    assert (m["completed"], m["failed"]) == (6, 0)
    # ignore_eos: the usage counts are exactly the requested output lengths (3..6 tokens each)
    assert 6 * 3 <= m["total_output_tokens"] <= 6 * 6
    assert m["ttft_ms"]["count"] == 6 and m["itl_ms"]["count"] > 0


def test_locust_against_the_real_server(real_server, tmp_path):
    server, model = real_server
    status, stats, output = run_locust(server.base_url, tmp_path, max_requests=4, model=str(model))
    assert status == 0, output + server.log_tail()
    assert stats["chat stream"]["num_requests"] >= 4 and stats["TTFT"]["num_requests"] >= 4
    assert all(entry["num_failures"] == 0 for entry in stats.values())


def test_compare_variants_report_peak_running_and_preemptions(tiny_model_dir, tmp_path, capsys):
    """One server per --variant; the table gains the server's peak running requests, preemptions and steps.
    The questions send no max_tokens, so each may run to the end of its context (capped at 128 tokens:
    the wait is short): with the whole remaining context reserved (ratio 1) only two 128-token requests
    fit in 256 tokens; with 5 % all four questions run at once."""
    model = tiny_model_dir("llama", with_tokenizer=True)
    out = tmp_path / "bench.json"
    status = cli_main(
        [
            "bench",
            "--compare",
            "--policies",
            "mixed",
            "--no-transformers",
            "--model",
            str(model),
            "--workload",
            "questions",
            "--num-prompts",
            "4",
            "--concurrency",
            "4",
            "--warmup",
            "0",
            "--server-args",
            "--max-context 128 --kv-capacity-tokens 256 --page-size 16",
            "--variant",
            "whole=--kv-reserve-ratio 1",
            "--variant",
            "five=--kv-reserve-ratio 0.05",
            # a server that does not start, or a request that hangs, fails here with its log, not at
            # pytest's 600 s timeout (the defaults: 600 s each)
            "--health-timeout",
            "180",
            "--request-timeout",
            "120",
            "--log-dir",
            str(tmp_path),
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    logs = "".join(f"\n--- {log.name}\n" + log.read_text()[-3000:] for log in sorted(tmp_path.glob("server-*.log")))
    assert status == 0, capsys.readouterr().err[-3000:] + logs
    runs = {run["config"]: run for run in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"whole", "five"}
    assert all(run["metrics"]["completed"] == 4 for run in runs.values()), logs
    assert runs["whole"]["server"]["peak_running"] <= 2 and runs["whole"]["server"]["preemptions"] == 0
    assert runs["five"]["server"]["peak_running"] >= 3
    token_itl = runs["five"]["server"]["itl_token_ms"]  # the api's own per-token gaps over the run
    assert 0 < token_itl["p50"] <= token_itl["p90"] <= token_itl["p99"]
    # whole (two at a time): each step carries at most 2 requests; every request needs several steps
    whole = runs["whole"]["server"]
    assert whole["steps"] >= 4 and 1 <= whole["mean_rows"] <= 2
