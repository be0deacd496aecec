#!/usr/bin/env bash
# Instructions per scheduler step (valgrind's callgrind), for each bench_scheduler workload, in this
# checkout and in others given as arguments (e.g. a worktree of an earlier commit): a measure that a
# shared machine's neighbours do not move, unlike the wall clock. Each step includes the bench's refill
# of the waiting queue. Usage: loadtests/scheduler_instructions.sh [OTHER_CHECKOUT ...]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
steps=300
export PYTHONHASHSEED=0
count() {  # checkout workload steps -> instructions
    (cd "$1" && PYTHONPATH="$1" valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        "$python" loadtests/bench_scheduler.py --steps-only "$2" --steps "$3" 2>&1 | awk '/Collected/ {print $4}')
}
for workload in decode churn paged; do
    for checkout in "$@" "$here"; do
        base=$(count "$checkout" "$workload" 0)
        with=$(count "$checkout" "$workload" "$steps")
        echo "$workload $(cd "$checkout" && git rev-parse --short HEAD) $(( (with - base) / steps )) instructions/step"
    done
done
