"""Training-step throughput on CPU for the `small` preset, and compile time vs depth.

    python benchmarks/step_cpu.py [--steps 10] [--policies none,save_dots,full] [KEY=VALUE ...]

Prints, for each remat policy: tokens/s, achieved TFLOP/s (model FLOPs, PaLM convention)
and its ratio to a float32 jnp.dot 4096^2 measured in the same process; then the
compile time of a 2-layer vs a 32-layer scanned model. Ratios, not absolute times,
are the figures to compare across machines.

With --rounds R the policies' steps and the matmul peak are timed in turn R times (each
policy compiled once): the table gives the medians and the range of the per-round ratios,
so a peak sampled at one unlucky moment cannot make or break the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfra.config import Config, load_config
from jaxinfra.metrics import flops_per_token, measure_matmul_flops
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.runtime import Runtime, build_runtime
from jaxinfra.state import TrainState


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
    return time_runtime(rt, state, rt.to_global(random_batch(cfg, np.random.default_rng(0))), steps)


def run_steps(rt: Runtime, state: TrainState, batch: dict, steps: int) -> tuple[TrainState, list[float]]:
    """Run `steps` steps, each timed to completion; the new state (the old one is donated) and the seconds."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = rt.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, times


def time_runtime(rt: Runtime, state: TrainState, batch: dict, steps: int) -> tuple[float, float]:
    """(first step seconds, compile included; median of `steps` more) for a built runtime."""
    state, (first,) = run_steps(rt, state, batch, 1)
    _, times = run_steps(rt, state, batch, steps)
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


def timed_rounds(base: Config, policies: list[str], steps: int,
                 rounds: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per policy, per round: (median step seconds, the matmul peak FLOP/s measured just before,
    minor page faults per step).

    The faults are the process's first touches of freshly mapped memory: XLA:CPU allocates the
    step's temporary buffer anew at every execution, and with glibc's malloc a buffer that large is
    a fresh mmap each time (docs/profiling.md: a caching allocator such as tcmalloc avoids it).

    Each policy's runtime is built and compiled once; the rounds alternate peak, policy 1,
    policy 2, ... so that load on a shared machine hits every figure alike."""
    built = {}
    for policy in policies:
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, remat_policy=policy))
        rt, state = build_step(cfg)
        batch = rt.to_global(random_batch(cfg, np.random.default_rng(0)))
        state, (first,) = run_steps(rt, state, batch, 1)
        print(f"{policy}: first step (compile included) {first:.2f}s")
        built[policy] = [rt, state, batch]
    samples: dict[str, list[tuple[float, float, float]]] = {policy: [] for policy in policies}
    for _ in range(rounds):
        for policy, entry in built.items():
            peak = measure_matmul_flops(4096, jnp.float32)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            entry[1], times = run_steps(*entry, steps)
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / max(steps, 1)
            samples[policy].append((float(np.median(times)), peak, faults))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="peak and steps timed in turn this many times")
    parser.add_argument("--policies", default="none,save_dots_no_batch,save_qkv_attn_mlp,full")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--compile-reps", type=int, default=3, help="compiles per depth, alternating; min is kept")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    jax.config.update("jax_compilation_cache_dir", None)  # compile times must be real
    base = load_config(args.config, args.overrides)
    fpt = flops_per_token(base.model, base.train.seq_len)
    tokens = base.train.batch_size * base.train.seq_len
    print(f"device: {jax.devices()[0].device_kind}; config {args.config}: {fpt / 1e6:.1f} MFLOP/token "
          f"(train, PaLM form), {tokens} tokens/step; peak = float32 jnp.dot 4096^2 before each policy's steps")
    samples = timed_rounds(base, args.policies.split(","), args.steps, args.rounds)
    columns = (Column("remat", width=20), Column("step s", ".3f", ">", 8), Column("tokens/s", ".0f", ">", 9),
               Column("TFLOP/s", ".3f", ">", 8), Column("peak TFLOP/s", ".3f", ">", 12),
               Column("/matmul", ".2f", ">", 8), Column("rounds' /matmul", width=16),
               Column("faults/step", ".0f", ">", 11))
    rows = []
    for policy, runs in samples.items():
        step_s, peak, faults = (float(np.median([run[i] for run in runs])) for i in (0, 1, 2))
        ratios = [tokens / s * fpt / p for s, p, _ in runs]
        rows.append((policy, step_s, tokens / step_s, tokens / step_s * fpt / 1e12, peak / 1e12,
                     tokens / step_s * fpt / peak, f"{min(ratios):.2f}-{max(ratios):.2f}", faults))
    print(format_table(rows, columns, sep=" "))
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
