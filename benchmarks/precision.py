"""bfloat16 against float32 in one process: the `small` step's tokens/s, and a `tiny` run's losses.

    python benchmarks/precision.py speed [--rounds 2] [--steps 6]   # small: bf16 / f32 tokens/s, A/B alternating
    python benchmarks/precision.py losses [--steps 300]             # tiny: bf16 vs f32 losses, logged and eval

`speed` also measures the two matmul probes at the MLP's shape (tokens x d_model x mlp_dim), bf16 x bf16
-> float32 and float32, which bound what the step can gain. The CPU's bf16 instructions (`lscpu` flags
avx512_bf16, amx_bf16) are printed: without them XLA:CPU has no fast bf16 matmul. Tables print in
RESULTS.md's markdown form.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step_cpu import time_steps
from jaxinfra.config import load_config
from jaxinfra.metrics.table import format_table


def cpu_bf16_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    return ", ".join(found) or "none"


def matmul_flops(m: int, k: int, n: int, dtype, repeats: int = 5) -> float:
    """FLOP/s of [m, k] x [k, n] with float32 accumulation and result (best of `repeats`)."""
    a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
    fn = jax.jit(lambda a, b: jnp.einsum("mk,kn->mn", a, b, preferred_element_type=jnp.float32))
    fn(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


def speed(rounds: int, steps: int) -> None:
    base = load_config("small", ["mesh.data=1"])
    tokens = base.train.batch_size * base.train.seq_len
    shape = (tokens, base.model.d_model, base.model.mlp_dim)
    rates: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    probes: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for _ in range(rounds):  # alternating, so the machine's drift hits both alike
        for dtype in rates:
            cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, dtype=dtype))
            rates[dtype].append(tokens / time_steps(cfg, steps)[1])
            probes[dtype].append(matmul_flops(*shape, getattr(jnp, dtype)))
    f32, bf16 = (float(np.median(rates[d])) for d in ("float32", "bfloat16"))
    p32, p16 = (float(np.median(probes[d])) for d in ("float32", "bfloat16"))
    print(f"device: {jax.devices()[0].device_kind}; CPU bf16 flags: {cpu_bf16_flags()}; matmul probe {shape}")
    print(format_table([("small", f"{f32:.0f}", f"{bf16:.0f}", f"{bf16 / f32:.2f}", f"{p32 / 1e9:.0f}",
                         f"{p16 / 1e9:.0f}", f"{p16 / p32:.2f}")],
                       ["config", "f32 tokens/s", "bf16 tokens/s", "bf16/f32", "f32 probe GFLOP/s",
                        "bf16 probe GFLOP/s", "probe bf16/f32"], style="markdown"))


def run_losses(dtype: str, steps: int) -> tuple[dict[int, float], dict[int, float]]:
    from jaxinfra.train import train

    cfg = load_config("tiny", [f"model.dtype={dtype}", f"train.steps={steps}", "log.progress=false"])
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, run_dir)
        lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return ({d["step"]: d["loss"] for d in lines if "loss" in d},
            {d["step"]: d["eval_loss"] for d in lines if "eval_loss" in d})


def losses(steps: int) -> None:
    (t32, e32), (t16, e16) = run_losses("float32", steps), run_losses("bfloat16", steps)
    rel = np.array([abs(t16[s] - t32[s]) / t32[s] for s in t32 if s in t16])
    rows = [(f"eval step {s}", f"{e32[s]:.4f}", f"{e16[s]:.4f}", f"{(e16[s] - e32[s]) / e32[s]:+.2%}") for s in e32]
    rows.append((f"logged train losses ({len(rel)})", "", "", f"mean |diff| {rel.mean():.2%}, max {rel.max():.2%}, "
                 f"{(rel <= 0.02).sum()} within 2%"))
    columns = [f"tiny, {steps} steps", "float32", "bfloat16", "bf16 vs f32"]
    print(format_table(rows, columns, style="markdown"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("speed", "losses"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    if args.what == "speed":
        speed(args.rounds, args.steps or 6)
    else:
        losses(args.steps or 300)


if __name__ == "__main__":
    main()
