"""Output tokens/s of N concurrent streaming requests under each scheduling policy, in one run.

For each policy a fresh `batchserve serve --policy P` is started (same model, same limits), N
streaming completions of exactly M tokens each (`ignore_eos`) are sent at once, and the output
tokens/s (all tokens / wall time from the first send to the last token) plus mean TTFT are printed
side by side.

    .venv/bin/python -m loadtests.policy_throughput                     # default model, 32 x 128
    .venv/bin/python -m loadtests.policy_throughput --model DIR -n 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtests.server_process import ServerProcess
from shared.config import DEFAULT_MODEL

POLICIES = ("mixed", "prefill-first", "fixed")
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Chapter"


async def _one(session: aiohttp.ClientSession, url: str, body: dict, t0: float) -> tuple[int, float]:
    """One streaming request: (completion tokens from usage, time to first text)."""
    ttft = float("nan")
    tokens = 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft != ttft:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, ttft


async def _burst(base_url: str, n: int, max_tokens: int) -> dict[str, float]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[_one(session, f"{base_url}/v1/completions", body, t0) for _ in range(n)])
        wall = time.perf_counter() - t0
    tokens = sum(t for t, _ in results)
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
            "mean_ttft_s": sum(f for _, f in results) / n}


def run_policy(policy: str, args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "procs.cli", "serve", "--model", args.model, "--policy", policy,
               "--max-running-requests", str(args.max_running_requests),
               "--kv-capacity-tokens", str(args.kv_capacity_tokens)]
    with ServerProcess(command, log_dir / f"serve-{policy}.log", health_timeout_s=900) as server:
        asyncio.run(_burst(server.base_url, min(2, args.n), 4))  # warm-up: first-call costs out of the numbers
        return asyncio.run(_burst(server.base_url, args.n, args.max_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("-n", type=int, default=32, help="concurrent streaming requests")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument("--kv-capacity-tokens", type=int, default=16384)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="policy-throughput-"))
    rows = {}
    for policy in args.policies:
        rows[policy] = run_policy(policy, args, log_dir)
        print(f"{policy:>14}: {rows[policy]['tok_per_s']:8.1f} output tok/s", file=sys.stderr, flush=True)
    print(f"\n{args.n} concurrent streams x {args.max_tokens} tokens, model {args.model} (server logs in {log_dir})")
    print(f"{'policy':>14} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'mean TTFT s':>12}")
    for policy, r in rows.items():
        print(f"{policy:>14} {r['tokens']:7.0f} {r['wall_s']:8.2f} {r['tok_per_s']:8.1f} {r['mean_ttft_s']:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
