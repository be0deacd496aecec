#!/usr/bin/env bash
# The step-time bound on this machine's CPU, as issue 43 asks it measured (one bench run each, default
# model, servers started side by side and measured one after the other on the same seeded workload):
#   staggered  16 streams of 400-token prompts starting 0.7 s apart, 64 output tokens, --max-step-ms 250
#              against the unbounded scheduler; three runs (seeds 1, 2, 3);
#   closed     random 32-512 / 32-256 tokens, closed loop, 16 and 32 streams: the default target against
#              the unbounded scheduler and against b86cbff's default (a server the caller started from a
#              worktree of that commit, at BASE_URL, default http://127.0.0.1:8100; left out when none answers);
#   hog        24 streams of the closed workload beside a busy loop pinned to core 1: default and unbounded,
#              two rounds in the order A B B A (a busy loop's toll drifts over a run; stop 63's single rounds
#              gave 0.67x and 1.04x with the order swapped).
# Goodput objectives: TTFT 5 s, TPOT 250 ms (bench's cpu preset).
#
# Usage, from the checkout on a quiet machine:
#   bash loadtests/step_time_bound_cpu.sh [staggered|closed|hog ...]   # default: all three
#   -> loadtests/results/step_time_bound_${TAG:-stop57}_<part>.{txt,json}
set -euo pipefail
cd "$(dirname "$0")/.."
out=loadtests/results/step_time_bound_${TAG:-stop57}
base_url=${BASE_URL:-http://127.0.0.1:8100}
common=(.venv/bin/batchserve bench --compare --policies mixed --no-transformers --no-progress --workload random
        --endpoint completions --goodput ttft:5000 tpot:250)

run() {  # name, then the bench flags of this part
    local name=$1
    shift
    {
        echo "# $name: $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(git rev-parse --short HEAD)"
        echo "    $(printf '%q ' "${common[@]}" "$@")"
        "${common[@]}" "$@"
        echo
    } | tee -a "$out_file"
}

for part in "${@:-staggered closed hog}"; do
    for p in $part; do
        out_file="${out}_$p.txt"
        : > "$out_file"
        case $p in
            staggered)
                for seed in 1 2 3; do
                    run "staggered, seed $seed" --input-len 400 --output-len 64 --concurrency 16 --stagger 0.7 \
                        --num-prompts 32 --warmup 0 --seed "$seed" --output "${out}_staggered_$seed.json" \
                        --variant 'bound250=--max-step-ms 250' --variant 'unbounded=--max-step-ms -1'
                done ;;
            closed)
                extra=()
                if curl -sf "$base_url/health" > /dev/null; then extra=(--compare-url "b86cbff=$base_url"); fi
                run "closed loop" --input-len 32:512 --output-len 32:256 --concurrency 16,32 --num-prompts 40,64 \
                    --warmup 2 --output "${out}_closed.json" \
                    --variant 'default=' --variant 'unbounded=--max-step-ms -1' "${extra[@]}" ;;
            hog)
                taskset -c 1 python3 -c 'while True: pass' &
                hog=$!
                trap 'kill $hog' EXIT
                run "beside a busy loop on core 1" --input-len 32:512 --output-len 32:256 --concurrency 24 \
                    --num-prompts 48 --warmup 2 --request-timeout 1200 --rounds 2 --output "${out}_hog.json" \
                    --variant 'default=' --variant 'unbounded=--max-step-ms -1'
                kill $hog
                trap - EXIT ;;
            *) echo "unknown part $p (staggered, closed, hog)" >&2; exit 2 ;;
        esac
    done
done
