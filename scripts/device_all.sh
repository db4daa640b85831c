#!/usr/bin/env bash
# Every GPU check in one call (device time is scarce). Sections, in order (default: all):
#   numerics  attention kernels vs the float32 reference (scripts/device_check.py --skip-timing)
#   attention attention TFLOP/s: ours, cuDNN, XLA (scripts/device_check.py --skip-numerics)
#   sweep     block-size sweep of our Triton kernel, bf16 D128 causal (benchmarks/attention.py --sweep)
#   step      training-step MFU per attention impl, 1.1B Llama shape (benchmarks/step_device.py)
#   decode    KV-cache decode tokens/s, the same shape in bf16 (benchmarks/decode.py)
#   hf        peak host RSS of a streaming HF import onto the GPU (benchmarks/hf_import.py)
#   quant     fp8 training step vs bf16 on the 1.1B shape, int8 weight-only decode at batch 1 vs bf16
#             (benchmarks/quant.py --sections device)
#   scripts/device_all.sh [SECTION ...]
# Output also goes to $OUT/device_all.log when $OUT is set (the device tool's result folder).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log="${OUT:-/tmp}/device_all.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxinfra-jax-cache}"
PYTHON="${PYTHON:-python3}"
sections=("$@")
[[ ${#sections[@]} -eq 0 ]] && sections=(numerics attention sweep step decode hf quant)
model=(model.d_model=2048 model.num_layers=16 model.num_heads=16 model.num_kv_heads=8 model.head_dim=128
       model.mlp_dim=8192 model.vocab_size=32768 model.tie_embeddings=false model.dtype=bfloat16)
run() { echo "== $1: ${*:2}"; local t0=$SECONDS; timeout "${LIMIT:-300}" "${@:2}"; echo "== $1: exit $? in $((SECONDS - t0)) s"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  "$PYTHON" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
  for s in "${sections[@]}"; do
    case "$s" in
      numerics) run "$s" "$PYTHON" "$repo/scripts/device_check.py" --skip-timing ;;
      attention) run "$s" "$PYTHON" "$repo/scripts/device_check.py" --skip-numerics --budget-s 100 --reps 5 ;;
      sweep) run "$s" "$PYTHON" "$repo/benchmarks/attention.py" --sweep --impls pallas_triton --shapes h16d128 \
               --causal yes --reps 5 --budget-s 110 ;;
      step) run "$s" "$PYTHON" "$repo/benchmarks/step_device.py" --impls pallas_triton,xla,cudnn --budget-s 150 ;;
      decode) run "$s" "$PYTHON" "$repo/benchmarks/decode.py" --batches 1,8,64 --prompt-len 128 --new-tokens 128 \
                "${model[@]}" model.param_dtype=bfloat16 ;;
      hf) run "$s" "$PYTHON" "$repo/benchmarks/hf_import.py" --dir /tmp/hf_bench ;;
      quant) LIMIT=420 run "$s" "$PYTHON" "$repo/benchmarks/quant.py" --sections device --out "${OUT:-/tmp}/quant" ;;
      *) echo "unknown section $s (numerics attention sweep step decode hf quant)"; exit 2 ;;
    esac
  done
} 2>&1 | tee "$log"
