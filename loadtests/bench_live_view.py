"""What the live view (`/dashboard`) costs a loaded server: one server (the default model), the same
closed-loop load run again and again, each round once per viewer in a rotating order, output tok/s of each:

- `closed`: nobody watches (the scheduler still builds its views: they ride in every stats message);
- `chromium`: the page open in a headless chromium on this machine, whose drawing competes with the
  server for the same cores (on a 2-core box, with the worker's two threads); its window 1400x1000 (a
  laptop's), or `--window-size` (the page redraws only the panels on screen);
- `poller`: the page's requests alone (GET /dashboard/snapshot every POLL_S, the JSON parsed), as a
  browser on another machine costs the server.

    .venv/bin/python -m batchserve.loadtests.bench_live_view --rounds 3 --concurrency 32

Prints each run with the CPU seconds the server's processes and the viewer used in it, then each viewer's
mean output tok/s against `closed`'s. Output tok/s of one run moves by several percent on a shared machine;
the CPU seconds are the steadier reading."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

from batchserve.loadtests.bench import bench_once
from batchserve.loadtests.browser import WINDOW_SIZE, chromium_driver, chromium_missing, quit_driver
from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND, ServerProcess

POLL_S = 2.0  # the page's default refresh (procs/api/webui/dashboard.js)


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


class ChromiumViewer:
    window_size = WINDOW_SIZE  # `--window-size`: a taller one shows every panel, which the page then redraws

    def __init__(self, url: str) -> None:
        self.driver = chromium_driver(self.window_size)
        self.driver.get(url + "/dashboard")
        time.sleep(2)  # loaded and polling

    def cpu(self) -> float:
        return cpu_seconds(self.driver.service.process.pid)

    def close(self) -> None:
        updated = self.driver.execute_script("return window.batchserveUpdated || 0")
        quit_driver(self.driver)
        assert updated, "the page never drew a snapshot"


class PollerViewer:
    """The page's requests without a browser, from a thread of this process."""

    def __init__(self, url: str) -> None:
        self.stop = threading.Event()
        self.snapshots = 0
        self.thread = threading.Thread(target=self._poll, args=(url + "/dashboard/snapshot",), daemon=True)
        self.thread.start()

    def _poll(self, url: str) -> None:
        while not self.stop.wait(POLL_S):
            with urllib.request.urlopen(url, timeout=30) as page:
                json.loads(page.read())
            self.snapshots += 1

    def cpu(self) -> float:
        return sum(os.times()[:2])  # this process's (the poller thread is most of it)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        assert self.snapshots, "the poller read no snapshot"


class NoViewer:
    def __init__(self, url: str) -> None:
        pass

    def cpu(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


VIEWERS: dict[str, Callable[[str], NoViewer | ChromiumViewer | PollerViewer]] = {
    "closed": NoViewer,
    "chromium": ChromiumViewer,
    "poller": PollerViewer,
}


def measure(
    server: ServerProcess, viewer_name: str, args: argparse.Namespace, index: int, work: Path
) -> tuple[dict, float, float]:
    """One run with `viewer_name` watching: its metrics, and the server's and the viewer's CPU seconds."""
    viewer = VIEWERS[viewer_name](server.base_url)
    try:
        server_cpu, viewer_cpu = cpu_seconds(server.proc.pid), viewer.cpu()
        metrics = bench_once(server.base_url, args, index, work / f"run{index}.json")
        return metrics, cpu_seconds(server.proc.pid) - server_cpu, viewer.cpu() - viewer_cpu
    finally:
        viewer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run per viewer, the order rotating")
    parser.add_argument("--viewers", default="closed,chromium,poller", help=f"comma list of {', '.join(VIEWERS)}")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="64:128")
    parser.add_argument(
        "--window-size",
        default="x".join(map(str, WINDOW_SIZE)),
        help="chromium's window, WxH (the page redraws only the panels on screen)",
    )
    args = parser.parse_args(argv)
    ChromiumViewer.window_size = tuple(int(n) for n in args.window_size.split("x"))
    viewers = args.viewers.split(",")
    if "chromium" in viewers and chromium_missing():
        parser.error(chromium_missing())
    work = Path(tempfile.mkdtemp(prefix="bench-live-view-"))
    command = [*DEFAULT_SERVE_COMMAND, "--max-running-requests", str(args.concurrency)]
    runs: dict[str, list[tuple[float, float, float]]] = {v: [] for v in viewers}  # tok/s, server CPU s, viewer CPU s
    with ServerProcess(command, work / "serve.log") as server:
        bench_once(
            server.base_url,
            argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency}),
            99,
            work / "warmup.json",
        )
        index = 0
        for round_ in range(args.rounds):
            for viewer in viewers[round_ % len(viewers) :] + viewers[: round_ % len(viewers)]:
                metrics, server_cpu, viewer_cpu = measure(server, viewer, args, index, work)
                runs[viewer].append((metrics["output_throughput"], server_cpu, viewer_cpu))
                print(
                    f"run {index}: {viewer:8s} output {metrics['output_throughput']:6.1f} tok/s  ITL p99 "
                    f"{metrics['itl_ms']['p99']:6.1f} ms  completed {metrics['completed']}  CPU s: server "
                    f"{server_cpu:6.1f} viewer {viewer_cpu:5.2f}",
                    flush=True,
                )
                index += 1
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as page:
            costs = [
                line
                for line in page.read().decode().splitlines()
                if line.startswith(
                    (
                        "batchserve_live_view_request_seconds_sum",
                        "batchserve_live_view_request_seconds_count",
                        "batchserve_scheduler_view_build_seconds_total",
                    )
                )
            ]
    report(runs)
    print("\n".join(costs))
    return 0


def report(runs: dict[str, list[tuple[float, float, float]]]) -> None:
    mean = {v: sum(r[0] for r in rs) / len(rs) for v, rs in runs.items()}
    for viewer, rs in runs.items():
        server_s, viewer_s = sum(r[1] for r in rs), sum(r[2] for r in rs)
        against = f"; / closed = {mean[viewer] / mean['closed']:.3f}" if "closed" in mean else ""
        print(
            f"{viewer:8s} mean output {mean[viewer]:6.1f} tok/s{against}; the viewer used {viewer_s:.1f} CPU s "
            f"beside the server's {server_s:.1f} ({viewer_s / (server_s + viewer_s):.2%})"
        )


if __name__ == "__main__":
    raise SystemExit(main())
