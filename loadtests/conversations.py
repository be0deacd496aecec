"""Conversations served through the real scheduler and worker in one process (the engine's loop), as the
KV benchmarks run them (`bench_sliding_window`, `bench_ring_kv`): `streams` prompts of random tokens arrive
together and each takes `output` tokens; a run's times, and its goodput under the cpu objectives of
`shared.slo`."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchserve.procs.scheduler import Scheduler
from batchserve.shared.messages import RequestParams, StopParams
from batchserve.shared.slo import DEFAULT_SLOS


def conversation_arguments(description: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the conversations' sizes: --streams, --prompt, --output."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--output", type=int, default=128)
    return parser


@dataclass
class ConversationRun:
    first: dict[str, float]  # each request's first token, seconds from the start
    done: dict[str, float]  # its end
    most_running: int  # the most requests running at once
    preemptions: int
    elapsed: float
    output: int

    def row(self) -> dict[str, Any]:
        """Time to first token, throughput and goodput (the requests meeting both cpu objectives, per second)."""
        slo, done, first = DEFAULT_SLOS["cpu"], self.done, self.first
        good = sum(all(slo.met(first[r], (done[r] - first[r]) / (self.output - 1), done[r]).values()) for r in done)
        return {
            "most_running": self.most_running,
            "ttft_p50_s": float(np.median(list(first.values()))),
            "elapsed_s": self.elapsed,
            "out_tok_per_s": len(done) * self.output / self.elapsed,
            "good": good,
            "goodput": good / self.elapsed,
            "preemptions": self.preemptions,
        }


def serve_conversations(
    sched: Scheduler,
    runner: Any,
    *,
    streams: int,
    prompt: int,
    output: int,
    vocab: int,
    each_step: Callable[[], None] = lambda: None,
) -> ConversationRun:
    """Run the conversations to the end; `each_step` is called after every step (to read the scheduler)."""
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for i in range(streams):
        sched.add_request(
            f"c{i}",
            rng.integers(3, vocab, prompt).tolist(),
            RequestParams(stop=StopParams(max_tokens=output, ignore_eos=True)),
        )
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    most_running = preemptions = 0
    while sched.has_unfinished():
        out = sched.step(runner)
        preemptions += len(out.preempted)
        now = time.perf_counter() - started
        for rid, _ in out.new_tokens:
            first.setdefault(rid, now)
        for rid in out.finished:
            done[rid] = now
        most_running = max(most_running, sched.num_running)
        each_step()
    return ConversationRun(first, done, most_running, preemptions, time.perf_counter() - started, output)
