"""Output tokens/s of N concurrent streaming requests under each scheduling policy, in one run.

One `batchserve serve --policy P` per policy is started (same model, same limits; all of them up
at once, idle servers cost nothing), then in each round every server gets a burst of N streaming
completions of exactly M tokens each (`ignore_eos`), sent at once; the policy order rotates between
rounds so that a shared machine's background load hits every policy alike. Printed side by side:
output tokens/s (all tokens / wall time from the first send to the last token) per round and the
median, and mean TTFT.

    .venv/bin/python -m loadtests.policy_throughput                     # default model, 32 x 128
    .venv/bin/python -m loadtests.policy_throughput --model DIR -n 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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


def start_server(policy: str, args: argparse.Namespace, log_dir: Path) -> ServerProcess:
    command = [sys.executable, "-m", "procs.cli", "serve", "--model", args.model, "--policy", policy,
               "--max-running-requests", str(args.max_running_requests),
               "--kv-capacity-tokens", str(args.kv_capacity_tokens)]
    server = ServerProcess(command, log_dir / f"serve-{policy}.log", health_timeout_s=900)
    server.start()
    asyncio.run(_burst(server.base_url, min(2, args.n), 4))  # warm-up: first-call costs out of the numbers
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("-n", type=int, default=32, help="concurrent streaming requests")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument("--kv-capacity-tokens", type=int, default=16384)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--rounds", type=int, default=3, help="bursts per policy (order rotated each round)")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="policy-throughput-"))
    servers: dict[str, ServerProcess] = {}
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in args.policies}
    try:
        for policy in args.policies:
            servers[policy] = start_server(policy, args, log_dir)
        for r in range(args.rounds):
            order = args.policies[r % len(args.policies):] + args.policies[:r % len(args.policies)]
            for policy in order:
                result = asyncio.run(_burst(servers[policy].base_url, args.n, args.max_tokens))
                runs[policy].append(result)
                print(f"round {r}: {policy:>14} {result['tok_per_s']:8.1f} output tok/s", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n{args.n} concurrent streams x {args.max_tokens} tokens, model {args.model}, {args.rounds} round(s) "
          f"(server logs in {log_dir})")
    print(f"{'policy':>14} {'median tok/s':>13} {'per round tok/s':>24} {'mean TTFT s':>12}")
    for policy, results in runs.items():
        rates = [r["tok_per_s"] for r in results]
        ttft = statistics.median(r["mean_ttft_s"] for r in results)
        print(f"{policy:>14} {statistics.median(rates):13.1f} {' '.join(f'{x:.1f}' for x in rates):>24} {ttft:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
