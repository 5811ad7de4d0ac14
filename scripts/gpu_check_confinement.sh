#!/usr/bin/env bash
# Issue 25 on a GPU machine, each part from empty compile caches (docs/gpu-results/README.md):
#   attacks  every attack of tests/test_gym_confinement.py, on the GPU (KPIPE_TEST_GYM_DEVICE=cuda),
#            through `kpipe gym eval` and `kpipe gym eval-batch`
#   bank     the 66 bank pairs at full size through the pool, confined: their expected statuses
#   cost     benchmarks/confinement_cost.py: confined against unconfined throughput, one pass each
# Usage: bash scripts/gpu_check_confinement.sh [attacks,bank,cost]   (all three by default)
set -uo pipefail
. scripts/device_env.sh
export PYTHONUNBUFFERED=1
out=${OUT:-$(mktemp -d)}
sections=${1:-attacks,bank,cost}
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git rev-parse --short HEAD 2>/dev/null || true
if [[ $sections == *attacks* ]]; then
  TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) KPIPE_TEST_GYM_DEVICE=cuda \
    python3 -m pytest -q -p no:cacheprovider -rA tests/test_gym_confinement.py 2>&1 | tee "$out/confinement_attacks.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [[ $sections == *bank* ]]; then
  python3 scripts/gpu_check_gym_paths.py --sections pool || status=1
fi
if [[ $sections == *cost* ]]; then
  python3 benchmarks/confinement_cost.py --rounds 2 || status=1
fi
exit $status
