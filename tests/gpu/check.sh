#!/usr/bin/env bash
# Device check of the CUDA-graph decode path and the flashinfer backend, on one GPU, in under 8 minutes.
# Installs nothing. Prints token equality (graph replay vs eager vs the torch backend, bf16, greedy,
# 8 requests, default model), capture time and memory, and decode tokens/s at batch 1, 8, 32, 64 with
# and without graphs; then runs the CUDA tests in tests/gpu. Exits non-zero on a token mismatch.
#
# Usage: tests/gpu/check.sh [check_gpu.py options], e.g. --model /path/to/hf-folder (a converted copy of
# the default model where its GGUF package is not installed). PYTHON=... picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1

echo "== tests/gpu/check_gpu.py"
timeout 400 "$PYTHON" tests/gpu/check_gpu.py "$@"
status=$?
[ $status -eq 124 ] && echo "check_gpu.py: timed out after 400 s"

echo "== pytest tests/gpu"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_decode.py
    tests=$?
    [ $status -eq 0 ] && status=$tests
else
    echo "pytest is not installed here: skipped"
fi
exit $status
