#!/usr/bin/env bash
# Stage, HERE (with network), what tests/gpu/check.sh needs on a bare GPU box (Python 3.12, torch,
# transformers, aiohttp, uvloop, prometheus-client there; no msgspec, pyzmq, gguf, flashinfer; no
# package index; a run carries at most ~60 MiB). Writes only ignored folders of the checkout:
#
#   tests/gpu/stage.sh                     -> .gpu_stage/  cp312 manylinux wheels of msgspec, pyzmq, gguf, llguidance;
#                                             the default model's config + tokenizer + generation files
#                                             (no weights: check.sh builds random ones); flashinfer 0.7.4
#                                             "slim" (see below) + apache-tvm-ffi. One run: carry [".gpu_stage"].
#   tests/gpu/stage.sh --no-flashinfer     -> .gpu_stage/ without flashinfer (check.sh then runs the torch
#                                             backend only, and says so).
#   tests/gpu/stage.sh --flashinfer-part 1 -> .gpu_stage_fi1/ the first 54 MiB of the FULL flashinfer wheel
#   tests/gpu/stage.sh --flashinfer-part 2 -> .gpu_stage_fi2/ the rest of it + apache-tvm-ffi
#                                             (the two-run fallback: see the top of check.sh)
#
# flashinfer-python 0.7.4 is a pure-Python, JIT-only wheel (101 MB: 715 MB of CUDA sources for every
# kernel family, compiled with nvcc on first use). The attention backend needs only its Python package,
# data/include, the cutlass/cccl/spdlog include trees and the top-level files of data/csrc (the decode
# and prefill JIT modules' sources; every #include of them resolves inside that set, checked against
# the full wheel). "slim" keeps exactly that, xz-compressed: about 16 MiB. Importing it needs
# apache-tvm-ffi (staged) and nvidia-ml-py, einops, tabulate, numpy, torch, packaging (on the box);
# the other Requires-Dist entries (cuda-tile, nccl4py, nvidia-cudnn-frontend, nvidia-cutlass-dsl, ...)
# serve other kernel families and are not imported on the attention path.
#
# Downloads go through pip into .gpu_stage_cache/ (kept: reruns are fast). Versions: the env variables
# below. PIP_PYTHON: the interpreter whose pip downloads (default python3); PYTHON: the project's
# interpreter (default .venv/bin/python), used to find (and once convert) the default model.
set -euo pipefail
cd "$(dirname "$0")/../.."

MSGSPEC_VERSION=${MSGSPEC_VERSION:-0.23.0}
PYZMQ_VERSION=${PYZMQ_VERSION:-27.3.0}
GGUF_VERSION=${GGUF_VERSION:-0.19.0}
LLGUIDANCE_VERSION=${LLGUIDANCE_VERSION:-1.9.1}  # abi3 wheel, ~3 MB, no dependencies
FLA_VERSION=${FLA_VERSION:-0.6.0}  # fla-core: Gated DeltaNet's Triton kernels (pure Python, ~1 MB; needs einops)
EINOPS_VERSION=${EINOPS_VERSION:-0.8.2}
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.4}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-0.1.15.post2}  # flashinfer 0.7.4: apache-tvm-ffi>=0.1.11,<0.2
PART1_BYTES=$((54 * 1024 * 1024))
# Packages the box has (its image's list in the device notes); anything else a staged wheel requires is flagged.
BOX_HAS="numpy pyyaml requests tqdm typing-extensions packaging click einops ninja nvidia-ml-py tabulate torch
cuda-bindings cuda-core cuda-pathfinder safetensors rich jinja2 transformers tokenizers"

flashinfer=slim part=""
while [ $# -gt 0 ]; do
    case "$1" in
        --no-flashinfer) flashinfer=none ;;
        --flashinfer-part) part=${2:-}; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "stage.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$part" in ""|1|2) ;; *) echo "stage.sh: --flashinfer-part takes 1 or 2" >&2; exit 2 ;; esac

PIP_PYTHON=${PIP_PYTHON:-python3}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
CACHE=.gpu_stage_cache
mkdir -p "$CACHE"

# download NAME VERSION: the cp312 manylinux x86_64 (or pure-Python) wheel into $CACHE; prints its path
download() {
    local name=$1 version=$2 pattern found log
    pattern="$CACHE/$(echo "$name" | tr '-' '_')-$version-*.whl"
    # shellcheck disable=SC2086
    found=$(ls $pattern 2>/dev/null | head -1 || true)
    if [ -z "$found" ]; then
        log=$(mktemp)
        if ! "$PIP_PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
                --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                --platform manylinux1_x86_64 -d "$CACHE" "$name==$version" >"$log" 2>&1; then
            grep -v "is ignored" "$log" >&2 || true
            rm -f "$log"
            echo "stage.sh: pip download $name==$version failed" >&2
            return 1
        fi
        rm -f "$log"
        # shellcheck disable=SC2086
        found=$(ls $pattern 2>/dev/null | head -1 || true)
        [ -n "$found" ] || { echo "stage.sh: no wheel matching $pattern after download" >&2; return 1; }
    fi
    echo "$found"
}

# requires WHEEL STAGED_NAMES: print its Requires-Dist (extras left out), each marked staged / on the box / CHECK
requires() {
    local wheel=$1 staged=$2 line name mark
    echo "  $(basename "$wheel") requires:"
    while IFS= read -r line; do
        case "$line" in *extra\ ==*) continue ;; esac
        name=$(echo "${line#Requires-Dist: }" | sed -E 's/^([A-Za-z0-9_.-]+).*/\1/' | tr 'A-Z_.' 'a-z--')
        case "$line" in *implementation_name\ ==\ \"pypy\"*) mark="pypy only" ;;
            *) if echo " $staged " | grep -q " $name "; then mark=staged
               elif echo " $BOX_HAS " | tr '\n' ' ' | grep -q " $name "; then mark="on the box"
               else mark="CHECK: neither staged nor known on the box"; fi ;;
        esac
        echo "    ${line#Requires-Dist: }  [$mark]"
    done < <(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' || true)
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
tree_bytes() {  # what travels besides carried paths: tracked files and untracked, not ignored ones
    { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
        | awk '{ s += $1 } END { print s + 0 }'
}

# slim WHEEL OUT: the attention subset of the flashinfer wheel as .tar.xz (see the header)
slim() {
    local wheel=$1 out=$2
    "$PIP_PYTHON" - "$wheel" <<'EOF' | if command -v xz >/dev/null; then xz -T0 -6; else "$PIP_PYTHON" -c \
        "import lzma, sys; sys.stdout.buffer.write(lzma.compress(sys.stdin.buffer.read(), preset=6))"; fi > "$out.tmp"
import io, sys, tarfile, zipfile
DATA_KEEP = ("include/", "cutlass/include/", "cutlass/tools/util/include/", "spdlog/include/",
             "cccl/cub/", "cccl/libcudacxx/include/", "cccl/thrust/")
SOURCE = (".py", ".pyi", ".typed", ".json", ".jinja", ".txt", ".csv")
def keep(name):
    if name.endswith("/"):
        return False
    if ".dist-info/" in name:
        return not name.endswith("/RECORD")  # the wheel's RECORD would list the files left out
    if not name.startswith("flashinfer/"):
        return False
    if name.startswith("flashinfer/data/"):
        rel = name[len("flashinfer/data/"):]
        if "/" not in rel:
            return True
        if rel.startswith("csrc/"):
            return rel.count("/") == 1  # top-level sources: batch_decode*, batch_prefill*, tvm_ffi_utils.h, ...
        return rel.startswith(DATA_KEEP)
    base = name.rsplit("/", 1)[-1]
    return base.endswith(SOURCE) or "." not in base  # Python and its data; not other kernels' CUDA sources
count = size = 0
with zipfile.ZipFile(sys.argv[1]) as wheel, tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    for info in wheel.infolist():
        if keep(info.filename):
            data = wheel.read(info)
            entry = tarfile.TarInfo(info.filename)
            entry.size, entry.mtime, entry.mode = len(data), 0, 0o644
            tar.addfile(entry, io.BytesIO(data))
            count += 1
            size += len(data)
print(f"  slim flashinfer: {count} files, {size / 2**20:.0f} MiB uncompressed", file=sys.stderr)
EOF
    mv "$out.tmp" "$out"
}

# -- the two-run fallback: one half of the full flashinfer wheel per folder ---------------------------
if [ -n "$part" ]; then
    wheel=$(download flashinfer-python "$FLASHINFER_VERSION")
    dir=.gpu_stage_fi$part
    rm -rf "$dir" && mkdir -p "$dir"
    name=$(basename "$wheel")
    sha256sum "$wheel" | awk -v n="$name" '{ print $1 "  " n }' > "$dir/$name.sha256"
    if [ "$part" = 1 ]; then
        head -c "$PART1_BYTES" "$wheel" > "$dir/$name.part1"
    else
        tail -c +$((PART1_BYTES + 1)) "$wheel" > "$dir/$name.part2"
        cp "$(download apache-tvm-ffi "$TVM_FFI_VERSION")" "$dir/"
    fi
    total=$(du -sb "$dir" | cut -f1)
    tree=$(tree_bytes)
    echo "staged $dir: $(ls "$dir" | tr '\n' ' ')"
    echo "total $dir: $(mib "$total") ($total bytes); with the working tree ($(mib "$tree")): $(mib $((total + tree)))$(
        [ "$part" = 2 ] && echo " + .gpu_stage (stage.sh --no-flashinfer)")"
    echo "sequence: run 1 carry [\".gpu_stage_fi1\"] 'bash tests/gpu/check.sh --store-part'; at once (the box keeps"
    echo "its files ~30 s) run 2 carry [\".gpu_stage\", \".gpu_stage_fi2\"] 'bash tests/gpu/check.sh' (check.sh's header)"
    exit 0
fi

# -- .gpu_stage ---------------------------------------------------------------------------------------
STAGE=.gpu_stage
rm -rf "$STAGE" && mkdir -p "$STAGE/wheels" "$STAGE/model"
staged="msgspec pyzmq gguf llguidance apache-tvm-ffi fla-core einops"
for spec in "msgspec $MSGSPEC_VERSION" "pyzmq $PYZMQ_VERSION" "gguf $GGUF_VERSION" "llguidance $LLGUIDANCE_VERSION" \
    "fla-core $FLA_VERSION" "einops $EINOPS_VERSION"; do
    # shellcheck disable=SC2086
    cp "$(download $spec)" "$STAGE/wheels/"
done

# The default model's config, tokenizer and generation files (resolve_model converts the GGUF once, cached).
model_dir=$("$PYTHON" -c "from batchserve.shared.model import resolve_model; print(resolve_model('smollm2-135m-instruct'))" \
    | tail -1)
for path in "$model_dir"/*; do
    case "$(basename "$path")" in
        *.safetensors|*.gguf|*.bin|*.pt|*.pth|*.safetensors.index.json) ;;
        *) [ -f "$path" ] && cp "$path" "$STAGE/model/" ;;
    esac
done
grep -q '"LlamaForCausalLM"' "$STAGE/model/config.json" || { echo "stage.sh: unexpected config in $model_dir" >&2; exit 1; }

if [ "$flashinfer" = slim ]; then
    mkdir -p "$STAGE/flashinfer"
    wheel=$(download flashinfer-python "$FLASHINFER_VERSION")
    cached="$CACHE/$(basename "$wheel" .whl).slim.tar.xz"
    [ -f "$cached" ] || { echo "building the slim flashinfer (xz, a minute or two, once)"; slim "$wheel" "$cached"; }
    cp "$cached" "$STAGE/flashinfer/"
    cp "$(download apache-tvm-ffi "$TVM_FFI_VERSION")" "$STAGE/flashinfer/"
fi

{
    echo "staged by tests/gpu/stage.sh on $(date -u +%FT%TZ) for cp312 manylinux x86_64; model files from $model_dir"
    (cd "$STAGE" && find . -type f ! -name MANIFEST.txt | sort | xargs stat -c '%s %n' | xargs -n2 printf '%12s  %s\n')
} > "$STAGE/MANIFEST.txt"

echo "Requires-Dist of the staged wheels (extras left out; installed with --no-deps on the box):"
for wheel in "$STAGE"/wheels/*.whl "$STAGE"/flashinfer/*.whl; do
    [ -f "$wheel" ] && requires "$wheel" "$staged"
done
if [ "$flashinfer" = slim ]; then
    echo "  flashinfer-python $FLASHINFER_VERSION requires (slim tree; import needs only apache-tvm-ffi, nvidia-ml-py,"
    echo "  einops, tabulate, numpy, torch, packaging; the rest serve other kernel families):"
    unzip -p "$(download flashinfer-python "$FLASHINFER_VERSION")" '*.dist-info/METADATA' | grep '^Requires-Dist' \
        | grep -v 'extra ==' | sed 's/^Requires-Dist: /    /'
fi

total=$(du -sb "$STAGE" | cut -f1)
tree=$(tree_bytes)
echo
echo "staged files:"
sed 1d "$STAGE/MANIFEST.txt"
echo "total $STAGE: $(mib "$total") ($total bytes); working tree $(mib "$tree"); one run carries $(mib $((total + tree)))" \
     "(device limit 64 MiB, keep under ~55)"
if [ $((total + tree)) -gt $((55 * 1024 * 1024)) ]; then
    echo "stage.sh: WARNING: over 55 MiB" >&2
fi
