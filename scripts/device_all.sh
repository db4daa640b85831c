#!/usr/bin/env bash
# Every GPU check in one call (device time is scarce): attention numerics and TFLOP/s
# (scripts/device_check.py), then training-step MFU per attention impl (benchmarks/step_device.py).
#   scripts/device_all.sh [ATTENTION_BUDGET_S] [STEP_BUDGET_S]
# Output also goes to $OUT/device_all.log when $OUT is set (the device tool's result folder).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log="${OUT:-/tmp}/device_all.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxinfra-jax-cache}"
PYTHON="${PYTHON:-python3}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  "$PYTHON" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
  echo "== attention kernels =="
  PYTHON="$PYTHON" timeout 300 bash "$repo/scripts/device_check.sh" --budget-s "${1:-120}" --reps 5
  echo "exit $?"
  echo "== training step =="
  timeout 300 "$PYTHON" "$repo/benchmarks/step_device.py" --impls pallas_triton,xla,cudnn --budget-s "${2:-150}"
  echo "exit $?"
} 2>&1 | tee "$log"
