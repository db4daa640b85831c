"""Pipeline schedules on fake CPU devices: analytic bubble, step time and activation memory.

    python benchmarks/pipeline.py [--devices 8] [--stages 4] [--microbatches 8] [--repeats 2] [--steps 5]
                                  [--moe-experts 8 --expert 2]

For each schedule (gpipe, circular, 1f1b; sharding/pipeline.py) on a stage x data mesh,
prints the analytic bubble (S-1)/(R M + S-1), the median steady-state step time, the
compile time and the compiled step's temporary (activation) memory per device; plus the
same model without pipelining (all devices on `data`) as a reference. On fake CPU devices
all "devices" share the host cores, so step times measure total work (the bubble's idle
slots still execute masked work in the SPMD form), not pipeline overlap: compare the
bubble and memory columns across schedules, and step times only as a cost check.

`--moe-experts E` makes every layer an MoE layer (top-2 of E, capacity dispatch, aux loss)
and `--expert N` splits the experts over N devices inside each stage (the pipeline's layers
are then the MoE periods; the reference run keeps `expert` too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import typing

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _n = 8
    for i, a in enumerate(sys.argv):
        if a == "--devices" and i + 1 < len(sys.argv):
            _n = int(sys.argv[i + 1])
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_n}"

import jax
import numpy as np

from jaxinfra.config import Config, OptimizerConfig, ParallelismConfig, ScheduleConfig, TrainConfig
from jaxinfra.data import DataConfig
from jaxinfra.metrics.table import format_table
from jaxinfra.runtime import build_runtime
from models import ModelConfig
from sharding.mesh import MeshConfig
from sharding.pipeline import Schedule, bubble_fraction


def make_cfg(args: argparse.Namespace, schedule: str | None) -> Config:
    moe = dict(moe_num_experts=args.moe_experts, moe_top_k=2, moe_mlp_dim=args.d_model, moe_dispatch="capacity",
               moe_aux_loss_weight=0.01) if args.moe_experts else {}
    model = ModelConfig(vocab_size=64, d_model=args.d_model, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                        head_dim=args.d_model // 4, mlp_dim=4 * args.d_model, tie_embeddings=False, **moe)
    data = args.devices // (args.stages * args.expert) if schedule else args.devices // args.expert
    mesh = MeshConfig(data=data, stage=args.stages if schedule else 1, expert=args.expert)
    parallelism = ParallelismConfig(pipeline_schedule=schedule or "gpipe", microbatches=args.microbatches,
                                    pipeline_repeats=args.repeats if schedule == "circular" else 1)
    return Config(model=model, optimizer=OptimizerConfig(lr=1e-3), schedule=ScheduleConfig(warmup_steps=0),
                  mesh=mesh, parallelism=parallelism, data=DataConfig(source="synthetic", synthetic_vocab=64),
                  train=TrainConfig(steps=100, batch_size=args.batch, seq_len=args.seq))


def measure(cfg: Config, steps: int) -> tuple[float, float, int]:
    """(compile seconds, median step seconds, temp bytes per device)."""
    rt = build_runtime(cfg, jax.devices())
    state = rt.init_state()
    b, t = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    batch = rt.to_global({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                          "segment_ids": np.ones((b, t), np.int32),
                          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()})
    t0 = time.perf_counter()
    compiled = rt.lower_train_step(state, batch).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    state, metrics = rt.train_step(state, batch)  # warm-up (compiles through the jit cache path)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = rt.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times), temp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--moe-experts", type=int, default=0, help="MoE layers with this many experts (0: dense)")
    p.add_argument("--expert", type=int, default=1, help="mesh.expert (expert parallelism inside a stage)")
    args = p.parse_args()
    s, m, r = args.stages, args.microbatches, args.repeats
    ep = args.expert
    print(f"{args.devices} fake CPU devices, stage={s} x data={args.devices // (s * ep)}"
          f"{f' x expert={ep}' if ep > 1 else ''}, {m} microbatches, {args.layers} layers"
          f"{f' (MoE, {args.moe_experts} experts top-2)' if args.moe_experts else ''}, d_model {args.d_model}, "
          f"batch {args.batch} x seq {args.seq}")
    columns = ("schedule", "mesh", "analytic bubble", "median step", "compile", "temp memory / device")
    print(format_table([], columns, style="markdown"))
    for schedule in (None, *typing.get_args(Schedule)):
        cfg = make_cfg(args, schedule)
        compile_s, step_s, temp = measure(cfg, args.steps)
        if schedule is None:
            name, bubble = "none (data only)", "-"
            mesh = f"data={args.devices // ep}" + (f", expert={ep}" if ep > 1 else "")
        else:
            reps = r if schedule == "circular" else 1
            name = f"{schedule}" + (f" (R={r})" if schedule == "circular" else "")
            mesh = f"stage={s}, data={args.devices // (s * ep)}" + (f", expert={ep}" if ep > 1 else "")
            bubble = f"{bubble_fraction(s, m, reps):.3f}"
        row = (name, mesh, bubble, f"{step_s * 1e3:.1f} ms", f"{compile_s:.1f} s", f"{temp / 2**20:.2f} MiB")
        print(format_table([row], columns, style="markdown", header=False), flush=True)


if __name__ == "__main__":
    main()
