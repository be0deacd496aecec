#!/usr/bin/env bash
# This server and llama.cpp's llama-server on the same GGUF files of a random-weight 1B Llama (issue 67's
# benchmark): Q4_K_M and Q8_0, made from one F32 file by llama-quantize; one server alive at a time (an idle
# llama-server spins its threads); the same seeded workload (prompts 128-384 tokens, 48 out) at 1 and 16
# streams; the worker's / llama-server's resident memory after each run and the seconds to ready.
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin bash loadtests/llamacpp_blocks.sh [OUT_DIR] [ROUNDS]
# (building llama.cpp: loadtests/README.md, "Against llama.cpp's server")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/llamacpp-blocks}
ROUNDS=${2:-1}
LLAMA_BIN=${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-server and llama-quantize}
mkdir -p "$OUT"
[ -f "$OUT/llama-1b-F32.gguf" ] || .venv/bin/python -P -m batchserve.loadtests.bench_gguf_model \
    --shape llama-1b --out "$OUT/llama-1b-F32.gguf"
for t in Q4_K_M Q8_0; do
    [ -f "$OUT/llama-1b-$t.gguf" ] || "$LLAMA_BIN/llama-quantize" "$OUT/llama-1b-F32.gguf" "$OUT/llama-1b-$t.gguf" $t \
        >"$OUT/quantize-$t.log" 2>&1
done
BENCH=(--workload random --endpoint completions --input-len 128:384 --output-len 48 --concurrency 1,16
       --num-prompts 6,32 --warmup 2 --no-progress)

wait_ready() {  # url pid: seconds until /health answers 200
    local start=$SECONDS
    until curl -sf -o /dev/null "$1/health"; do
        kill -0 "$2" 2>/dev/null || { echo "server $2 died" >&2; exit 1; }
        sleep 0.5
    done
    echo $((SECONDS - start))
}

rss_mb() {  # the resident MB of the largest process whose command line matches $1 (0: none left)
    { ps -eo rss,args | grep -F -- "$1" | grep -v grep || echo 0; } | sort -n | tail -1 | awk '{print int($1 / 1024)}'
}

run_one() {  # name file round command...
    local name=$1 file=$2 round=$3; shift 3
    "$@" >"$OUT/$name-$round.log" 2>&1 &
    local pid=$!
    local ready; ready=$(wait_ready http://127.0.0.1:8093 $pid)
    .venv/bin/batchserve bench --base-url http://127.0.0.1:8093 --model "$file" --seed "$round" "${BENCH[@]}" \
        --output "$OUT/$name-$round.json" >"$OUT/$name-$round.txt" 2>&1
    local rss; rss=$(rss_mb "${RSS_MATCH}")
    echo "$name round $round: ready ${ready} s, resident ${rss} MB" | tee -a "$OUT/summary.txt"
    kill $pid; wait $pid 2>/dev/null || true
}

for round in $(seq 1 "$ROUNDS"); do
    for t in Q4_K_M Q8_0; do
        f="$OUT/llama-1b-$t.gguf"
        RSS_MATCH="batchserve" run_one "batchserve-$t" "$f" "$round" \
            .venv/bin/batchserve serve --model "$f" --port 8093 --max-running-requests 16
        RSS_MATCH="llama-server" run_one "llamacpp-$t" "$f" "$round" \
            "$LLAMA_BIN/llama-server" -m "$f" --port 8093 -np 16 -c 16384 -cb -t 2 --threads-http 32
    done
done
