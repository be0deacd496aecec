#!/usr/bin/env bash
# Data parallelism on this machine's CPU, as issue 33 asks it measured, in one run of `batchserve bench`:
# multi-turn chats (32 conversations x 4 turns behind one 1,000-token system prompt, 16 in flight) sent to
#   dp1              one server (all the cores),
#   dp2-cache_aware  2 replicas (half the cores each) behind smg, policy cache_aware,
#   dp2-round_robin  the same behind smg, policy round_robin,
# started side by side and measured one after the other on the same seeded workload. The report gives, per
# server, the prefix-cache hit rate (cached / input tokens, as the replicas reported them in usage), TTFT
# p50/p99 overall and per turn, ITL and output tokens/s: cache_aware vs round_robin, and 2 replicas vs 1.
#
# Needs the router extra (pip install -e '.[router]') and a quiet machine. From the checkout:
#   bash loadtests/data_parallel_cpu.sh                      # -> loadtests/results/data_parallel_cpu.{txt,json}
#   bash loadtests/data_parallel_cpu.sh OUT [bench flags]    # -> OUT.txt, OUT.json; later flags win
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-loadtests/results/data_parallel_cpu}
shift $(( $# > 0 ? 1 : 0 ))
command=(.venv/bin/batchserve bench --compare --policies mixed --no-transformers --no-progress
         --workload multiturn --endpoint chat --num-prompts 32 --turns 4 --system-tokens 1000 --output-len 64
         --concurrency 16 --warmup 2
         --variant "dp1=--data-parallel-size 1"
         --variant "dp2-cache_aware=--data-parallel-size 2 --router smg --router-policy cache_aware"
         --variant "dp2-round_robin=--data-parallel-size 2 --router smg --router-policy round_robin"
         --output "$out.json" "$@")
mkdir -p "$(dirname "$out")"
{
    echo "# Data parallelism: 1 server vs 2 replicas behind smg (cache_aware, round_robin), multi-turn chats"
    echo "# $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(uname -m)"
    echo
    echo "Command:"
    echo
    echo "    $(printf '%q ' "${command[@]}")"
    echo
    "${command[@]}"
} | tee "$out.txt"
