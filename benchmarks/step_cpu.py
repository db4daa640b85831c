"""Training-step throughput on CPU for the `small` preset, and compile time vs depth.

    python benchmarks/step_cpu.py [--steps 10] [--policies none,save_dots,full] [KEY=VALUE ...]

Prints, for each remat policy: tokens/s, achieved TFLOP/s (model FLOPs, PaLM convention)
and its ratio to a float32 jnp.dot 4096^2 measured in the same process; then the
compile time of a 2-layer vs a 32-layer scanned model. Ratios, not absolute times,
are the figures to compare across machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfra.config import Config, load_config
from jaxinfra.metrics import flops_per_token, measure_matmul_flops
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.runtime import build_runtime


def random_batch(cfg: Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    b, t = cfg.train.batch_size, cfg.train.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()}


def build_step(cfg: Config):
    """1-device runtime and its initial state."""
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=1))
    rt = build_runtime(cfg, jax.devices()[:1])
    return rt, rt.init_state()


def time_steps(cfg: Config, steps: int) -> tuple[float, float]:
    """(compile+first step seconds, median steady-state step seconds)."""
    rt, state = build_step(cfg)
    return step_seconds(rt, state, rt.to_global(random_batch(cfg, np.random.default_rng(0))), steps)


def step_seconds(rt, state, batch, steps: int) -> tuple[float, float]:
    """(first step seconds, compile included; median of the next `steps`) of a runtime's train step."""
    t0 = time.perf_counter()
    state, metrics = rt.train_step(state, batch)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = rt.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


def compile_seconds(cfg: Config) -> float:
    """Lower + compile of the train step (no execution).

    The state's initialisation is dispatched asynchronously; it must finish before the clock
    starts, or the random init of the parameters (which grows with depth) runs on the same
    cores during the compile and is counted as compile time."""
    rt, state = build_step(cfg)
    batch = rt.to_global(random_batch(cfg, np.random.default_rng(0)))
    jax.block_until_ready((state, batch))
    t0 = time.perf_counter()
    rt.lower_train_step(state, batch).compile()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--policies", default="none,save_dots_no_batch,save_qkv_attn_mlp,full")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--compile-reps", type=int, default=3, help="compiles per depth, alternating; min is kept")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    jax.config.update("jax_compilation_cache_dir", None)  # compile times must be real
    base = load_config(args.config, args.overrides)
    matmul = measure_matmul_flops(4096, jnp.float32)
    fpt = flops_per_token(base.model, base.train.seq_len)
    tokens = base.train.batch_size * base.train.seq_len
    print(f"device: {jax.devices()[0].device_kind}; jnp.dot 4096^2 float32: {matmul / 1e12:.3f} TFLOP/s")
    print(f"config {args.config}: {fpt / 1e6:.1f} MFLOP/token (train, PaLM form), {tokens} tokens/step")
    columns = (Column("remat", width=20), Column("first step s", ".2f", ">", 12), Column("step s", ".3f", ">", 8),
               Column("tokens/s", ".0f", ">", 9), Column("TFLOP/s", ".3f", ">", 8), Column("/matmul", ".2f", ">", 8))
    print(format_table([], columns, sep=" "))
    for policy in args.policies.split(","):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, remat_policy=policy))
        first, step_s = time_steps(cfg, args.steps)
        tps = tokens / step_s
        achieved = tps * fpt
        print(format_table([(policy, first, step_s, tps, achieved / 1e12, achieved / matmul)], columns, sep=" ",
                           header=False))
    if args.skip_compile:
        return
    times: dict[tuple[int, bool], float] = {}
    for _ in range(args.compile_reps):  # alternating, so load on a shared machine hits both depths alike
        for layers, scan in ((2, True), (32, True), (32, False)):
            cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, num_layers=layers, scan_layers=scan))
            seconds = compile_seconds(cfg)
            times[layers, scan] = min(times.get((layers, scan), seconds), seconds)
    print(f"compile (scan): 2 layers {times[2, True]:.2f}s, 32 layers {times[32, True]:.2f}s, "
          f"ratio {times[32, True] / times[2, True]:.2f}; 32 layers unrolled {times[32, False]:.2f}s")


if __name__ == "__main__":
    main()
