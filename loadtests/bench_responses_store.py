"""What storing responses costs a request: 1,000 chained Responses turns (each reads the previous response's
conversation for `previous_response_id` and stores its own, which grows by a user and an assistant message
a turn) against each store in one run: `memory`, SQLite (a file in a temporary directory) and PostgreSQL
(a throwaway local server, as the tests start one; `--postgres URL` for another). Per turn: the time the
store's read and write take, which is what it adds to a response beside `memory`.

    .venv/bin/python -m batchserve.loadtests.bench_responses_store [--turns 1000] [--postgres URL]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from batchserve.procs.api.responses_store import ResponseStore, open_response_store, owner_of
from batchserve.procs.api.schemas import ChatMessageIn

TESTS = Path(__file__).resolve().parents[1] / "tests"


def chained_turns(store: ResponseStore, turns: int) -> np.ndarray:
    """Seconds each turn spent in the store: read the previous response, store this one."""
    owner, previous, seconds = owner_of("bench-key"), None, []
    for turn in range(turns):
        started = time.perf_counter()
        history = [] if previous is None else store.get(previous, owner).history
        history = [
            *history,
            ChatMessageIn(role="user", content=f"question {turn}: " + "words " * 20),
            ChatMessageIn(role="assistant", content=f"answer {turn}: " + "text " * 40),
        ]
        rid = f"resp_{turn:06d}"
        response = {
            "id": rid,
            "object": "response",
            "status": "completed",
            "store": True,
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "text " * 40}]}],
        }
        assert store.put(rid, owner, response, history)
        seconds.append(time.perf_counter() - started)
        previous = rid
    return np.asarray(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument(
        "--postgres", default="auto", help="a postgresql:// URL; auto: start a local server; none: leave PostgreSQL out"
    )
    args = parser.parse_args(argv)
    server = None
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        specs = {"memory": "memory", "sqlite": f"sqlite:{tmp}/responses.sqlite3"}
        if args.postgres == "auto":
            sys.path.insert(0, str(TESTS))
            from postgres_server import start_postgres

            server, why = start_postgres()
            if server is None:
                print(f"(PostgreSQL left out: {why})")
            else:
                specs["postgresql"] = server.url
        elif args.postgres != "none":
            specs["postgresql"] = args.postgres
        try:
            times = {
                name: chained_turns(open_response_store(spec, ttl_s=3600.0), args.turns) for name, spec in specs.items()
            }
        finally:
            if server is not None:
                server.stop()
    base = np.median(times["memory"])
    print(
        f"{args.turns} chained turns (the conversation grows 2 messages a turn, to "
        f"{2 * args.turns} at the end): ms per turn in the store"
    )
    print(f"  {'store':>10} {'p50':>8} {'p90':>8} {'p99':>8} {'last 100 p50':>13} {'p50 - memory':>13}")
    for name, t in times.items():
        ms = 1000 * t
        print(
            f"  {name:>10} {np.median(ms):>8.3f} {np.percentile(ms, 90):>8.3f} {np.percentile(ms, 99):>8.3f} "
            f"{np.median(ms[-100:]):>13.3f} {1000 * (np.median(t) - base):>13.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
