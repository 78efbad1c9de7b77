#!/usr/bin/env bash
# The whole GPU check, for a machine with a CUDA device, Python 3.12, torch, CuPy and nvcc
# (no Rust, no network; transformers optional: what needs it is skipped without it). Run from anywhere:
#     bash benches/gpu_check.sh [--out DIR] [WHEEL]       # WHEEL: the abi3 wheel, installed --no-deps into a temp dir
#     bash benches/gpu_check.sh --dry-run [--out DIR]      # the steps' code paths on the CPU, in about a minute
#                                                          # (tests/test_gpu_check_dry.py runs it in make test)
# Each step writes its output under DIR (default gpu_check_out/) as soon as it ends, so a run cut
# short keeps what ran; DIR/summary.txt lists each step's exit status and seconds.
#  1. kernels.txt        pytest -m gpu tests/test_kernels.py (every kernel vs the float64 reference)   40 s
#  2. gpu_kernels.txt    benches/gpu_kernels.py: the attention kernels' table (decode GB/s, split-K, ...) 40 s
#  3. e2e/decode.json    benches/gpu_e2e.py: SmolLM2 geometry, random weights, bf16, batch 1/32/256:
#                        eager vs padded-eager vs CUDA graphs (tokens/s, step ms, GPU busy share)       60 s
#  4. e2e/throughput.json bench throughput's QUICK workload (16 requests): paged vs contiguous vs
#                        transformers (when installed) at equal KV memory                               75 s
#  5. overhead.json      pagedrs bench overhead --device cuda (the host's share of a step; three
#                        output kinds since 2026-12-05: CUMULATIVE, DELTA, FINAL_ONLY)                45 s
#  6. engine_tests.txt   pytest -m gpu: CUDA graphs vs eager vs transformers, the engine on CUDA,
#                        TP over NCCL (these need transformers for their tiny models)                 50 s
# Budget: about 5 minutes in all (each step has its own timeout; a step that fails does not stop the rest).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=gpu_check_out
DRY=0
WHEEL=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --out=*) OUT="${1#--out=}"; shift ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) WHEEL="$1"; shift ;;
    esac
done
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
: > "$OUT/summary.txt"
export PAGEDRS_CUDA_DIR="$PWD/cuda" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1

if [[ -n "$WHEEL" ]]; then
    target=$(mktemp -d)
    "$PY" -m pip install -q --no-deps --target "$target" "$WHEEL" || exit 1
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ $DRY == 1 ]]; then
    # pytest steps only collect (their tests are gpu-marked: they would all skip here)
    # a shared CPU is slow and noisy: the dry run's timeouts are 4x the GPU run's
    TIME_SCALE=4; DEVICE=cpu; E2E_FLAGS=(--device cpu --quick); OVERHEAD_FLAGS=(--device cpu --quick --layers 2); PYTEST_FLAGS=(--collect-only)
else
    TIME_SCALE=1; DEVICE=cuda; E2E_FLAGS=(--device cuda); OVERHEAD_FLAGS=(--device cuda); PYTEST_FLAGS=()
fi

status=0
# step NAME TIMEOUT_S OUTPUT_FILE COMMAND...: runs it with its timeout, its output to the file and the
# terminal, and appends "NAME rc=.. seconds=.." to the summary at once.
step() {
    local name=$1 limit=$2 file=$3
    shift 3
    local start=$SECONDS rc
    timeout $((limit * TIME_SCALE)) "$@" > >(tee "$OUT/$file") 2>&1
    rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))" >> "$OUT/summary.txt"
    [[ $rc == 0 ]] || status=$rc
}

step environment 30 environment.txt "$PY" - "$DEVICE" <<'PYEOF'
import importlib.util, sys, torch, pagedrs
device = sys.argv[1]
line = f"pagedrs {pagedrs.__version__} from {pagedrs.__file__}; torch {torch.__version__}"
if device == "cuda":
    import cupy
    line += f"; cupy {cupy.__version__}; device {torch.cuda.get_device_name(0)}"
else:
    line += "; DRY RUN on the CPU: the numbers say nothing about a GPU"
print(line + f"; transformers {'yes' if importlib.util.find_spec('transformers') else 'absent'}")
PYEOF
[[ $status == 0 ]] || exit $status

# --noconftest: tests/conftest.py builds tiny transformers models this step does not need.
step kernels 40 kernels.txt "$PY" -m pytest -q -m gpu --noconftest -p no:cacheprovider "${PYTEST_FLAGS[@]}" tests/test_kernels.py
if [[ $DRY == 1 ]]; then  # its emulated run takes minutes: `python benches/gpu_kernels.py --emulate` proves it
    echo "gpu_kernels skipped in the dry run (benches/gpu_kernels.py --emulate: minutes on the CPU)" | tee -a "$OUT/summary.txt"
else
    step gpu_kernels 40 gpu_kernels.txt "$PY" benches/gpu_kernels.py
fi
step e2e_decode 80 e2e_decode.txt "$PY" benches/gpu_e2e.py --sections decode --out "$OUT/e2e" "${E2E_FLAGS[@]}"
step e2e_throughput 75 e2e_throughput.txt "$PY" benches/gpu_e2e.py --sections throughput --quick --out "$OUT/e2e" \
    "${E2E_FLAGS[@]}"
step overhead 45 overhead.txt "$PY" -m pagedrs.cli bench overhead "${OVERHEAD_FLAGS[@]}" --json "$OUT/overhead.json"
if "$PY" -c "import transformers" 2>/dev/null; then
    step engine_tests 50 engine_tests.txt "$PY" -m pytest -q -m gpu -p no:cacheprovider "${PYTEST_FLAGS[@]}" tests/test_decode_graphs_gpu.py \
        tests/test_engine.py tests/test_kernels_engine.py tests/test_tensor_parallel.py
else
    echo "engine_tests skipped: transformers is not installed" | tee -a "$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
exit $status
