#!/usr/bin/env bash
# Every GPU check in one call (device time is scarce). Sections, in order (default: all):
#   numerics  every attention implementation vs the float32 reference, float32 cases included, and
#             two runs compared bitwise (scripts/device_check.py --skip-timing)
#   attention attention TFLOP/s: ours (Triton, Mosaic GPU), cuDNN, XLA; D128, D64, GQA 32/8, MLA 192/128;
#             T 4096, 1024, 16384; causal and not (scripts/device_check.py --skip-numerics)
#   sweep     block sizes, warps and stages of our Triton and Mosaic GPU kernels, bf16 D128 causal
#             (benchmarks/attention.py --sweep)
#   numerics + attention + sweep: <= 7 minutes on one H200 (budgets below; rows past a budget are skipped).
#   step      training-step MFU per attention impl, 1.1B Llama shape (benchmarks/step_device.py)
#             one process per row: every attention impl's step time, MFU, peak memory and largest
#             fitting batch, then the chain of variants on the fastest (chunked loss, remat, larger
#             batch, host-fed batches), each row profiled (top-ops shares before -> after; traces and
#             HLO under $OUT/step_profile/). Budget: STEP_BUDGET_S (default 300 s: no row starts
#             later, a running one is stopped at +90 s, the section at +120 s; <= 7 minutes)
#   decode    KV-cache decode tokens/s, the same shape in bf16 (benchmarks/decode.py)
#   hf        peak host RSS of a streaming HF import onto the GPU (benchmarks/hf_import.py)
#   quant     fp8 training step vs bf16 on the 1.1B shape, int8 weight-only decode at batch 1 vs bf16
#             (benchmarks/quant.py --sections device)
#   scripts/device_all.sh [SECTION ...]
# Output also goes to $OUT/device_all.log when $OUT is set (the device tool's result folder), and
# the attention rows to $OUT/attention_numerics.json and $OUT/attention_timing.json.
# Without a GPU every section dry-runs (tiny shapes, interpret mode).
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
run_for() { echo "== $2: ${*:3}"; local t0=$SECONDS; timeout "$1" "${@:3}"; echo "== $2: exit $? in $((SECONDS - t0)) s"; }
step_budget="${STEP_BUDGET_S:-300}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  "$PYTHON" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
  for s in "${sections[@]}"; do
    case "$s" in
      numerics) run "$s" "$PYTHON" "$repo/scripts/device_check.py" --skip-timing --numerics-budget-s 140 ;;
      attention) run "$s" "$PYTHON" "$repo/scripts/device_check.py" --skip-numerics --budget-s 130 --reps 5 ;;
      sweep) run "$s" "$PYTHON" "$repo/benchmarks/attention.py" --sweep --impls pallas_triton,pallas_mosaic_gpu \
               --shapes h16d128 --causal yes --reps 5 --budget-s 75 ;;
      step) run_for $((step_budget + 120)) "$s" "$PYTHON" "$repo/benchmarks/step_device.py" --isolate --profile \
              --fit-batch --fit-budget-s 60 --budget-s "$step_budget" --impls pallas_triton,pallas_mosaic_gpu,cudnn,xla \
              --variants base,chunked_loss,remat=save_dots_no_batch,batch=fit,host_batches ;;
      decode) run "$s" "$PYTHON" "$repo/benchmarks/decode.py" --batches 1,8,64 --prompt-len 128 --new-tokens 128 \
                "${model[@]}" model.param_dtype=bfloat16 ;;
      hf) run "$s" "$PYTHON" "$repo/benchmarks/hf_import.py" --dir /tmp/hf_bench ;;
      quant) LIMIT=420 run "$s" "$PYTHON" "$repo/benchmarks/quant.py" --sections device --out "${OUT:-/tmp}/quant" ;;
      *) echo "unknown section $s (numerics attention sweep step decode hf quant)"; exit 2 ;;
    esac
  done
} 2>&1 | tee "$log"
