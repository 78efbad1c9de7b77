#!/usr/bin/env bash
# The whole GPU check, for a machine with a CUDA device, Python 3.12, torch, CuPy and nvcc
# (no Rust, no network). Run from anywhere:
#     bash benches/gpu_check.sh                      # pagedrs already pip-installed (abi3 wheel)
#     bash benches/gpu_check.sh dist/pagedrs-*.whl   # installs the wheel with --no-deps into a temp dir
# 1. pytest -m gpu tests/test_kernels.py   (every kernel vs the float64 PyTorch reference, sliding windows too)
# 2. benches/gpu_kernels.py                (decode time and GB/s vs SDPA and copy bandwidth; split-K; window; e2e)
# 3. pytest -m gpu tests/test_tensor_parallel.py tests/test_engine.py tests/test_kernels_engine.py
#    (NCCL ranks; the engine on CUDA; a sliding-window Mistral against transformers)
# Budget: about 8 minutes in all (each step has its own timeout).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PAGEDRS_CUDA_DIR="$PWD/cuda" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1

if [[ $# -ge 1 ]]; then
    target=$(mktemp -d)
    "$PY" -m pip install -q --no-deps --target "$target" "$1" || exit 1
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - <<'PYEOF' || exit 1
import cupy, torch, pagedrs, pagedrs.kernels
print(f"pagedrs {pagedrs.__version__} from {pagedrs.__file__}; cupy {cupy.__version__}; torch {torch.__version__}; "
      f"device {torch.cuda.get_device_name(0)}")
PYEOF

status=0
# --noconftest: tests/conftest.py builds tiny transformers models this check does not need.
timeout 200 "$PY" -m pytest -q -m gpu --noconftest -p no:cacheprovider tests/test_kernels.py || status=$?
timeout 200 "$PY" benches/gpu_kernels.py || status=$?
# 3. tensor parallelism over NCCL (min(2, visible GPUs) ranks) against one rank; needs transformers
#    for the tiny test model, and skips without it.
if "$PY" -c "import transformers" 2>/dev/null; then
    timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py tests/test_engine.py \
        tests/test_kernels_engine.py || status=$?
fi
exit $status
