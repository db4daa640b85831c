"""Training-step throughput and MFU on an accelerator, per attention implementation.

    python benchmarks/step_device.py [--impls xla,cudnn,pallas_triton] [--policies none]
                                     [--budget-s 240] [KEY=VALUE ...]

The default model is Llama-shaped, ~1.1B parameters (d_model 2048, 16 layers, 16 heads of
128, 8 KV heads, SwiGLU 8192, vocab 32768, untied), seq 4096, global batch 8, bfloat16
compute with float32 parameters and AdamW: the same jitted step `jaxinfra train` runs.
For each (attention impl, remat policy) it prints step time, tokens/s, model TFLOP/s per
device and MFU two ways: PaLM's count (attention as non-causal, what `metrics.jsonl` logs)
and with causal attention halved (the work a causal kernel actually does); plus the ratio
to a bfloat16 8192^3 `jnp.dot` measured in the same process and the compiled program's
temporary memory. Without an accelerator it runs a tiny config on CPU (a dry run of the
same code; its figures say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step_cpu import build_step, random_batch
from jaxinfra.config import load_config
from jaxinfra.metrics import flops_per_token, measure_matmul_flops
from jaxinfra.metrics.flops import param_counts
from jaxinfra.metrics.peak import peak_flops_per_device
from jaxinfra.metrics.table import Column, format_table

COLUMNS = (Column("attention", width=14), Column("remat", width=20), Column("compile s", ".1f", ">", 9),
           Column("step s", ".3f", ">", 8), Column("tokens/s", ".0f", ">", 9), Column("TFLOP/s", ".1f", ">", 8),
           Column("MFU", ".3f", ">", 6), Column("MFU causal", ".3f", ">", 10), Column("/matmul", ".2f", ">", 8),
           Column("temp GiB", ".1f", ">", 9))


def _row(impl: str, policy: str, *values: float, note: str = "") -> str:
    """One result line under the COLUMNS header; a note (a skip or an error) follows the first two cells."""
    columns = COLUMNS[:2 + len(values)] + ((Column("note"),) if note else ())
    return format_table([(impl, policy, *values, *((note,) if note else ()))], columns, sep=" ", header=False)

GPU_OVERRIDES = ["model.d_model=2048", "model.num_layers=16", "model.num_heads=16", "model.num_kv_heads=8",
                 "model.head_dim=128", "model.mlp_dim=8192", "model.vocab_size=32768", "model.tie_embeddings=false",
                 "model.dtype=bfloat16", "model.param_dtype=float32", "model.rope_theta=500000",
                 "train.seq_len=4096", "train.batch_size=8", "data.source=synthetic"]
DRY_OVERRIDES = ["model.num_layers=2", "train.seq_len=64", "train.batch_size=2", "data.source=synthetic"]


def plan_check(cfg, device, step_s: float) -> str:
    """`jaxinfra plan`'s prediction for this row beside the measurement: analytic memory vs the
    device's peak_bytes_in_use (GPU/TPU; CPU has no allocator statistics) and predicted vs
    measured step time. Targets (docs/plan.md): memory within 10%, step time within 25%."""
    from jaxinfra.plan.devices import device_spec, kind_of
    from jaxinfra.plan.estimate import make_plan

    kind = kind_of(device)
    probe = measure_matmul_flops() if kind == "cpu" else None
    plan = make_plan(cfg, 1, device_spec(kind, 1, matmul_flops=probe))
    peak_bytes = (device.memory_stats() or {}).get("peak_bytes_in_use")
    memory = (f"peak_bytes_in_use {peak_bytes / 2**30:.2f} GiB, analytic/measured {plan.memory.total / peak_bytes:.3f}"
              if peak_bytes else "no peak_bytes_in_use on this platform")
    return (f"    plan ({kind}): analytic memory {plan.memory.total / 2**30:.2f} GiB ({memory}); step "
            f"{plan.time.step_s:.3f} s predicted vs {step_s:.3f} s measured, ratio {plan.time.step_s / step_s:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="xla,cudnn,pallas_triton")
    parser.add_argument("--policies", default="none")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new rows after this")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    start = time.monotonic()
    device = jax.devices()[0]
    dry = device.platform == "cpu"
    base = load_config("tiny" if dry else "small", (DRY_OVERRIDES if dry else GPU_OVERRIDES) + args.overrides)
    impls = ["xla"] if dry else args.impls.split(",")
    tokens = base.train.batch_size * base.train.seq_len
    fpt = flops_per_token(base.model, base.train.seq_len)
    fpt_causal = flops_per_token(base.model, base.train.seq_len, causal=True)
    peak, source = peak_flops_per_device(device, base.model.dtype)
    matmul = measure_matmul_flops(8192 if not dry else 1024, jnp.bfloat16 if not dry else jnp.float32)
    n_params = param_counts(base.model)["total"]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}{'; DRY RUN' if dry else ''}")
    print(f"model: {n_params / 1e9:.2f}B params, {fpt / 1e9:.2f} GFLOP/token (PaLM), {tokens} tokens/step; "
          f"peak {peak / 1e12:.0f} TFLOP/s ({source}); jnp.dot bf16 8192^3: {matmul / 1e12:.0f} TFLOP/s")
    print(format_table([], COLUMNS, sep=" "))
    for impl in impls:
        for policy in args.policies.split(","):
            if time.monotonic() - start > args.budget_s:
                print(_row(impl, policy, note="skipped: budget spent"))
                continue
            cfg = dataclasses.replace(base, model=dataclasses.replace(
                base.model, attention_impl=impl, remat_policy=policy))
            try:
                rt, state = build_step(cfg)
                batch = rt.to_global(random_batch(cfg, np.random.default_rng(0)))
                jax.block_until_ready((state, batch))
                t0 = time.perf_counter()
                compiled = rt.lower_train_step(state, batch).compile()
                compile_s = time.perf_counter() - t0
                temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) / 2**30
                state, metrics = rt.train_step(state, batch)
                jax.block_until_ready(metrics)
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    state, metrics = rt.train_step(state, batch)
                    jax.block_until_ready(metrics)
                    times.append(time.perf_counter() - t0)
                loss = float(jax.device_get(metrics["loss"]))
                del state, batch, rt
            except Exception as e:  # noqa: BLE001 - one row per failure, keep going
                print(_row(impl, policy, note=f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
                continue
            step_s = float(np.median(times))
            tps = tokens / step_s
            achieved = tps * fpt  # one device
            print(_row(impl, policy, compile_s, step_s, tps, achieved / 1e12, achieved / peak,
                       tps * fpt_causal / peak, achieved / matmul, temp) + f"  (loss {loss:.3f})")
            print(plan_check(cfg, device, step_s))
    print(f"total {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
