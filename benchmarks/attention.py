"""Attention throughput per implementation, and a block-size sweep for the kernel table.

    python benchmarks/attention.py [--impls pallas_triton,cudnn,xla] [--shapes h16d128,gqa32-8]
                                   [--causal both|yes|no] [--dtype bfloat16] [--reps 10]
    python benchmarks/attention.py --sweep [--impls pallas_triton] [--shapes h16d128]
    python benchmarks/attention.py --dry-run     # tiny shapes, interpret mode on CPU
    python benchmarks/attention.py --shapes h16d128 --causal yes --lengths 1024,2048,4096,8192,16384   # by length

Prints forward and forward+backward time and TFLOP/s. FLOPs count the matmuls only, at
2 per multiply-add: forward 2·B·Hq·Tq·Tkv·(d_qk + d_v); backward 2·B·Hq·Tq·Tkv·(3·d_qk + 2·d_v)
(recomputed QKᵀ, dV, dP, dQ, dK); causal counts half (the FlashAttention convention), so
causal and full TFLOP/s compare directly. `--sweep` times forward+backward for candidate
block sizes and prints the fastest as rows to paste into `kernels/block_sizes.py` TABLE.
Without an accelerator use `--dry-run`: it exercises the same code path, not the speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

import kernels
from jaxinfra.metrics import table
from kernels import BlockSizes
from kernels.block_sizes import head_dim_bucket
from kernels.masks import make_band


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    b: int
    t: int
    hq: int
    hkv: int
    dqk: int
    dv: int


# The device check's shapes (the targets are bf16, D128, causal).
SHAPES = {
    "h16d128": Shape("H16 D128", 4, 4096, 16, 16, 128, 128),
    "h32d64": Shape("H32 D64", 4, 4096, 32, 32, 64, 64),
    "gqa32-8": Shape("GQA 32/8 D128", 4, 4096, 32, 8, 128, 128),
    "mla192-128": Shape("MLA 192/128", 4, 4096, 16, 16, 192, 128),
}
# Same names, tiny: for --dry-run on CPU (interpret mode is slow).
DRY_SHAPES = {
    "h16d128": Shape("H16 D128", 1, 64, 2, 2, 128, 128),
    "h32d64": Shape("H32 D64", 1, 64, 4, 4, 64, 64),
    "gqa32-8": Shape("GQA 32/8 D128", 1, 64, 4, 1, 128, 128),
    "mla192-128": Shape("MLA 192/128", 1, 64, 2, 2, 192, 128),
}
IMPLS = ("pallas_triton", "cudnn", "xla")


def has_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def attention_flops(shape: Shape, causal: bool, backward: bool) -> float:
    per_pair = 2 * (shape.dqk + shape.dv)
    if backward:
        per_pair += 2 * (3 * shape.dqk + 2 * shape.dv)
    pairs = shape.b * shape.hq * shape.t * shape.t * (0.5 if causal else 1.0)
    return per_pair * pairs


def make_inputs(shape: Shape, dtype: str, seed: int = 0):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    dt = jnp.dtype(dtype)
    q = jax.random.normal(k1, (shape.b, shape.t, shape.hq, shape.dqk), dt)
    k = jax.random.normal(k2, (shape.b, shape.t, shape.hkv, shape.dqk), dt)
    v = jax.random.normal(k3, (shape.b, shape.t, shape.hkv, shape.dv), dt)
    do = jax.random.normal(k4, (shape.b, shape.t, shape.hq, shape.dv), dt)
    return q, k, v, do


def unsupported(impl: str, shape: Shape, dtype: str) -> str | None:
    """Why `impl` cannot run this shape here (None: it can)."""
    if impl == "cudnn":
        if not has_gpu():
            return "no GPU"
        if shape.dqk != shape.dv:
            return "d_qk != d_v"
        if dtype not in ("bfloat16", "float16"):
            return dtype
    if impl == "pallas_mosaic_tpu" and jax.default_backend() not in ("tpu", "cpu"):
        return "TPU kernel"
    if impl == "pallas_triton" and jax.default_backend() not in ("gpu", "cuda", "rocm", "cpu"):
        return "GPU kernel"
    return None


def build(impl: str, causal: bool, backward: bool, block_sizes: BlockSizes | None = None) -> Callable:
    """A jitted forward (q, k, v) -> out or forward+backward (q, k, v, do) -> (dq, dk, dv)."""
    def attn(q, k, v):
        return kernels.attention(q, k, v, causal=causal, impl=impl, block_sizes=block_sizes)

    if not backward:
        return jax.jit(attn)

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    return jax.jit(fwd_bwd)


def time_call(fn: Callable, args, reps: int, warmup: int = 1) -> tuple[float, float]:
    """(median seconds per call, compile + first call seconds)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


@dataclasses.dataclass
class Row:
    shape: str
    causal: bool
    impl: str
    fwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_ms: float | None = None  # forward + backward
    bwd_tflops: float | None = None
    bwd_only_tflops: float | None = None  # backward alone: (f+b time - forward time)
    note: str = ""


def measure(shape: Shape, causal: bool, impl: str, dtype: str, reps: int,
            deadline: float = math.inf, block_sizes: BlockSizes | None = None) -> Row:
    row = Row(shape.name, causal, impl)
    reason = unsupported(impl, shape, dtype)
    if reason:
        row.note = f"n/a ({reason})"
        return row
    q, k, v, do = make_inputs(shape, dtype)
    for backward in (False, True):
        if time.monotonic() > deadline:
            row.note = "skipped (time budget)"
            break
        try:
            seconds, _ = time_call(build(impl, causal, backward, block_sizes), (q, k, v, do) if backward else (q, k, v),
                                   reps)
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
            break
        tflops = attention_flops(shape, causal, backward) / seconds / 1e12
        if backward:
            row.bwd_ms, row.bwd_tflops = seconds * 1e3, tflops
            bwd_only = (row.bwd_ms - row.fwd_ms) / 1e3
            if bwd_only > 0:
                bwd_flops = attention_flops(shape, causal, True) - attention_flops(shape, causal, False)
                row.bwd_only_tflops = bwd_flops / bwd_only / 1e12
        else:
            row.fwd_ms, row.fwd_tflops = seconds * 1e3, tflops
    return row


COLUMNS = (table.Column("shape", width=14), table.Column("causal", width=6), table.Column("impl", width=17),
           table.Column("fwd ms", ".3f", ">", 9), table.Column("fwd TF/s", ".3g", ">", 9),
           table.Column("f+b ms", ".3f", ">", 9), table.Column("f+b TF/s", ".3g", ">", 9),
           table.Column("bwd TF/s", ".3g", ">", 9), table.Column("note"))


def format_table(rows: list[Row]) -> str:
    return table.format_table([(r.shape, "yes" if r.causal else "no", r.impl, r.fwd_ms, r.fwd_tflops, r.bwd_ms,
                                r.bwd_tflops, r.bwd_only_tflops, r.note) for r in rows], COLUMNS, sep=" ", rule=True)


def sweep(shapes: dict[str, Shape], impl: str, dtype: str, reps: int, dry_run: bool, causal_modes,
          deadline: float = math.inf) -> None:
    """Two stages per (shape, mask): forward tiles (and warps) by forward time, then the
    backward tiles by forward+backward time with the best forward tiles."""
    device_kind = "cpu" if dry_run else jax.devices()[0].device_kind
    fwd_tiles = [(16, 16), (32, 16)] if dry_run else [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]
    bwd_tiles = [(16, 16), (16, 32)] if dry_run else [(32, 32), (64, 32), (64, 64), (128, 64), (64, 128)]
    warps = (None,) if dry_run else (4, 8)
    stages = (None,) if dry_run else (2, 3)
    for shape, causal in itertools.product(shapes.values(), causal_modes):
        def best(candidates, backward):
            timed = []
            for bs in candidates:
                row = measure(shape, causal, impl, dtype, reps, block_sizes=bs, deadline=deadline)
                ms = row.bwd_ms if backward else row.fwd_ms
                tf = row.bwd_tflops if backward else row.fwd_tflops
                print(f"#   {'f+b' if backward else 'fwd'} {bs!r}: "
                      + (f"{ms:.3f} ms, {tf:.0f} TFLOP/s" if ms is not None else row.note or "-"), flush=True)
                if ms is not None:
                    timed.append((ms, bs))
            return min(timed, key=lambda x: x[0]) if timed else None

        first = best([BlockSizes(bq, bk, num_warps=w, num_stages=st)
                      for (bq, bk), w, st in itertools.product(fwd_tiles, warps, stages)], backward=False)
        if first is None:
            print(f"# {shape.name} causal={causal}: no candidate ran")
            continue
        fwd = first[1]
        second = best([dataclasses.replace(fwd, block_q_dq=bq, block_kv_dq=bk, block_q_dkv=bq, block_kv_dkv=bk)
                       for bq, bk in bwd_tiles], backward=True)
        chosen = fwd if second is None else second[1]
        band = make_band(causal, None, shape.t, shape.t)
        bucket = head_dim_bucket(shape.dqk, shape.dv)
        print(f'    ("{device_kind}", "{dtype}", {bucket}, "{band.kind}"): {chosen!r},'
              f"  # measured {time.strftime('%Y-%m-%d')}: {shape.name} T{shape.t} fwd {first[0]:.3f} ms"
              + ("" if second is None else f", fwd+bwd {second[0]:.3f} ms"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="time block-size candidates, print table rows")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="sweep: stop timing after this")
    parser.add_argument("--lengths", help="sequence lengths, e.g. 1024,4096,16384: one row per shape and length")
    args = parser.parse_args(argv)
    dry = args.dry_run or (not has_gpu() and jax.default_backend() != "tpu")
    if dry and not args.dry_run:
        print(f"# no accelerator ({jax.default_backend()}): dry run with tiny shapes in interpret mode")
    table = DRY_SHAPES if dry else SHAPES
    shapes = {k: table[k] for k in args.shapes.split(",")}
    if args.lengths:  # the same shapes at other lengths (TFLOP/s by length)
        shapes = {f"{k}-T{t}": dataclasses.replace(s, name=f"{s.name} T{t}", t=int(t))
                  for k, s in shapes.items() for t in args.lengths.split(",")}
    causal_modes = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    reps = 1 if dry else args.reps
    if args.sweep:
        for impl in args.impls.split(","):
            if impl.startswith("pallas"):
                sweep(shapes, impl, args.dtype, reps, dry, causal_modes, time.monotonic() + args.budget_s)
        return 0
    rows = [measure(s, c, impl, args.dtype, reps) for s in shapes.values() for c in causal_modes
            for impl in args.impls.split(",")]
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
