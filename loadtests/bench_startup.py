"""How long `batchserve serve` takes to be ready, and what each process spent to get there: a cold start
(an empty cache: the tokenizer built by transformers, as every start did before `shared/tokenizer_cache.py`)
beside warm ones (the tokenizer read from the cache), interleaved, in one run.

    python -P -m batchserve.loadtests.bench_startup [--model PATH] [--rounds 3]

Prints, per round and kind: seconds to the "serving" line (every process ready), and each process's CPU
seconds and resident memory at that moment (from /proc; Linux only).
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND, REPO, ServerProcess

SERVING = re.compile(r"batchserve: serving .*?; (worker=\d+ .*?api=\d+);")
PROCESSES = ("worker", "scheduler", "tokenizer", "detokenizer", "api")


class ServeProcess(ServerProcess):
    """`batchserve serve`, ready at its "serving" line; `pids` by process name."""

    def __init__(self, model: str, log_path: Path, cache: Path) -> None:
        env = {"BATCHSERVE_CACHE": str(cache)}
        super().__init__([*DEFAULT_SERVE_COMMAND, "--model", model], log_path, env=env, cwd=REPO)
        self.pids: dict[str, int] = {}

    def ready(self) -> bool:
        match = SERVING.search(self.log())
        if match:
            self.pids = {k: int(v) for k, v in (kv.split("=") for kv in match.group(1).split())}
        return match is not None


def _usage(pid: int) -> tuple[float, float]:
    """(CPU seconds, resident MB) of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return ticks / 100, rss_kb / 1024


def start_once(model: str, cache: Path, log_dir: Path) -> dict[str, float]:
    server = ServeProcess(model, log_dir / f"serve-{time.monotonic_ns()}.log", cache)
    started = time.monotonic()
    server.start()
    row = {"ready_s": time.monotonic() - started}
    try:
        for name in PROCESSES:
            row[f"{name}_cpu_s"], row[f"{name}_mb"] = _usage(server.pids[name])
    finally:
        server.stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        warm_cache = Path(tmp) / "warm"
        start_once(args.model, warm_cache, Path(tmp))  # fills the warm cache (and converts a GGUF once)
        for round_ in range(args.rounds):
            for kind in ("cold", "warm"):
                cache = warm_cache if kind == "warm" else Path(tmp) / f"cold{round_}"
                if kind == "cold":  # the model's conversion is not what is measured: only the tokenizers go
                    cache.mkdir()
                    for entry in warm_cache.iterdir():
                        if entry.name != "tokenizers":
                            (cache / entry.name).symlink_to(entry)
                rows[kind].append(start_once(args.model, cache, Path(tmp)))
                print(kind, round_, {k: round(v, 2) for k, v in rows[kind][-1].items()}, flush=True)
    print(f"\nmedian of {args.rounds} rounds, {args.model}:")
    for key in rows["cold"][0]:
        cold, warm = (statistics.median(r[key] for r in rows[k]) for k in ("cold", "warm"))
        print(f"  {key:18s} cold {cold:8.2f}  warm {warm:8.2f}  warm/cold {warm / cold:5.2f}x")


if __name__ == "__main__":
    main()
