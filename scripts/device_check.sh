#!/usr/bin/env bash
# Device check for the attention kernels (see scripts/device_check.py): numerics against the
# float32 reference, then TFLOP/s of ours / cuDNN / XLA. Without a GPU it dry-runs on CPU.
#   scripts/device_check.sh [--dry-run] [--budget-s 200] [--skip-numerics] [--skip-timing]
# PYTHON overrides the interpreter (default: the repo's dev venv if present, else python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x /work/venv/dev/bin/python ]]; then PYTHON=/work/venv/dev/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# Reruns skip recompiling the Triton kernels and XLA programs.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxinfra-jax-cache}"
"$PYTHON" -c 'import jax; print("jax", jax.__version__, "devices:", jax.devices())' \
  || { echo "device_check: jax does not import with $PYTHON (install jax[cuda12]==$(grep -o 'jax==[0-9.]*' "$repo/pyproject.toml" | cut -d= -f3))" >&2; exit 2; }
exec "$PYTHON" "$repo/scripts/device_check.py" "$@"
