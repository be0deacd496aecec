"""What the live view (`/dashboard`) costs a loaded server: one server (the default model), the same
closed-loop load run again and again, alternately with the page closed and open in a headless chromium
on the same machine (so the browser's own drawing counts against the server too), output tok/s of each.

    .venv/bin/python -m loadtests.bench_live_view --rounds 3 --concurrency 32

Prints each run (with the CPU seconds the server's processes and the browser's used in it) and the ratio
of the open runs' mean output tok/s to the closed runs' (1.0: free). Output tok/s of one run moves by
several percent on a shared machine, so the browser's and the server's CPU time are the steadier
reading of the page's cost: the browser's share of the CPU time used in its runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from loadtests.browser import chromium_driver, chromium_missing, quit_driver
from loadtests.server_process import DEFAULT_SERVE_COMMAND, REPO, ServerProcess
from shared.config import DEFAULT_MODEL


def run_load(url: str, args: argparse.Namespace, seed: int, output: Path) -> dict:
    """One `batchserve bench` run against `url`: its metrics."""
    command = [sys.executable, "-m", "procs.cli", "bench", "--base-url", url, "--model", DEFAULT_MODEL,
               "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
               "--input-len", args.input_len, "--output-len", args.output_len, "--seed", str(seed),
               "--output", str(output), "--no-progress"]
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(output.read_text())["runs"][0]["metrics"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (those still alive)."""
    root = psutil.Process(pid)
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs (closed, open), the order alternating")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="64:128")
    args = parser.parse_args(argv)
    if chromium_missing():
        parser.error(chromium_missing())
    work = Path(tempfile.mkdtemp(prefix="bench-live-view-"))
    command = [*DEFAULT_SERVE_COMMAND, "--max-running-requests", str(args.concurrency)]
    results: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[tuple[float, float]]] = {False: [], True: []}  # (server, browser) CPU seconds per run
    with ServerProcess(command, work / "serve.log", cwd=REPO) as server:
        run_load(server.base_url, argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency}), 99,
                 work / "warmup.json")
        for index in range(2 * args.rounds):
            page_open = (index % 2 == 1) == (index // 2 % 2 == 0)  # closed, open, open, closed, closed, open...
            driver = None
            if page_open:
                driver = chromium_driver()
                driver.get(server.base_url + "/dashboard")
                time.sleep(2)  # loaded and polling
            server_cpu = cpu_seconds(server.proc.pid)
            browser_cpu = cpu_seconds(driver.service.process.pid) if driver is not None else 0.0
            try:
                metrics = run_load(server.base_url, args, index, work / f"run{index}.json")
                server_cpu = cpu_seconds(server.proc.pid) - server_cpu
                browser_cpu = cpu_seconds(driver.service.process.pid) - browser_cpu if driver is not None else 0.0
            finally:
                if driver is not None:
                    updated = driver.execute_script("return document.body.dataset.updated || ''")
                    quit_driver(driver)
                    assert updated, "the page never drew a snapshot"
            results[page_open].append(metrics["output_throughput"])
            cpu[page_open].append((server_cpu, browser_cpu))
            print(f"run {index}: page {'open  ' if page_open else 'closed'} output {metrics['output_throughput']:7.1f} tok/s"
                  f"  ITL p99 {metrics['itl_ms']['p99']:6.1f} ms  completed {metrics['completed']}"
                  f"  CPU s: server {server_cpu:6.1f} browser {browser_cpu:5.2f}", flush=True)
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as page:
            costs = [line for line in page.read().decode().splitlines()
                     if line.startswith(("batchserve_live_view_request_seconds_sum", "batchserve_live_view_request_seconds_count",
                                         "batchserve_scheduler_view_build_seconds_total"))]
    closed, opened = (sum(v) / len(v) for v in (results[False], results[True]))
    print(f"mean output tok/s: closed {closed:.1f}, open {opened:.1f}; open / closed = {opened / closed:.3f}")
    server_s, browser_s = (sum(c[i] for c in cpu[True]) for i in (0, 1))
    print(f"open runs: the browser used {browser_s:.1f} CPU s beside the server's {server_s:.1f}: "
          f"{browser_s / (server_s + browser_s):.2%} of the CPU time used")
    print("\n".join(costs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
