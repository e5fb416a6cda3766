#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine whose python3 already has torch
# (see docs/contributing.md): the CUDA tests, then the GPU rows of the benchmarks that
# exist in this checkout. Pure-Python dependencies the machine lacks (skorch,
# curvlinops-for-pytorch, backpack-for-pytorch, einconv, unfoldNd) travel as wheels in
# .whl/ (pip download --no-deps ... -d .whl NAME==VERSION); logs go to $OUT (or ./gpu-out).
# Usage: bash scripts/gpu_check.sh [seconds for the ResNet-20 rows, default 360]
#        [seconds per method, default 45] [training rows, default 10000]
#        [extra arguments for benchmarks/resnet_gpu.py, e.g. "--mix 0.92 --noise 2.0"]
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
BUDGET="${1:-360}"
PER_METHOD="${2:-45}"
N_TRAIN="${3:-10000}"
EXTRA="${4:-}"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sklearn, skorch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'sklearn', sklearn.__version__, 'skorch', skorch.__version__)" | tee -a "$OUT/gpu.txt"
status=0
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 \
    | tee "$OUT/test_cuda.log" || status=1
# shellcheck disable=SC2086
timeout "$BUDGET" python3 benchmarks/resnet_gpu.py --device cuda --n-train "$N_TRAIN" \
    --n-test 5000 --epochs 8 --timeout "$PER_METHOD" --phases --json "$OUT/resnet20.json" $EXTRA 2>&1 \
    | tee "$OUT/resnet20.log" || true
exit $status
