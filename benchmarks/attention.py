"""Attention throughput per implementation, and a block-size sweep for the kernel table.

    python benchmarks/attention.py [--impls pallas_triton,pallas_mosaic_gpu,cudnn,xla]
                                   [--shapes h16d128,gqa32-8] [--seq-lens 1024,4096,16384]
                                   [--causal both|yes|no] [--dtype bfloat16] [--reps 10]
    python benchmarks/attention.py --sweep [--impls pallas_triton,pallas_mosaic_gpu] [--shapes h16d128]
    python benchmarks/attention.py --dry-run     # tiny shapes, interpret mode on CPU

Prints forward and forward+backward time and TFLOP/s. FLOPs count the matmuls only, at
2 per multiply-add: forward 2·B·Hq·Tq·Tkv·(d_qk + d_v); backward 2·B·Hq·Tq·Tkv·(3·d_qk + 2·d_v)
(recomputed QKᵀ, dV, dP, dQ, dK); causal counts half (the FlashAttention convention), so
causal and full TFLOP/s compare directly. Each sequence length runs at 16384 tokens per
call (B4 at T4096, B16 at T1024, B1 at T16384). `--sweep` times forward+backward for
candidate block sizes (tiles, then warps and stages per kernel) and prints the fastest as
rows to paste into `kernels/block_sizes.py` (TABLE, or MOSAIC_GPU_TABLE).
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
IMPLS = ("pallas_triton", "pallas_mosaic_gpu", "cudnn", "xla")
TOKENS_PER_CALL = 16384
XLA_MAX_T = 8192  # above this, xla's dense [B, H, T, T] scores only measure the memory system


def at_length(shape: Shape, t: int) -> Shape:
    """The same heads at sequence length t, batch chosen for TOKENS_PER_CALL tokens."""
    return dataclasses.replace(shape, name=f"{shape.name} T{t}", t=t, b=max(1, TOKENS_PER_CALL // t))


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
    if impl == "pallas_mosaic_gpu":
        from kernels import flash_mosaic_gpu

        if not has_gpu():
            return "no GPU (the GPU interpreter is for tests, not timing)"
        cc = getattr(jax.devices()[0], "compute_capability", None)
        reason = flash_mosaic_gpu.unsupported(jnp.dtype(dtype), shape.dqk, shape.dv, "gpu", cc)
        if reason:
            return f"falls back to pallas_triton: {reason}"
    if impl == "xla" and shape.t > XLA_MAX_T:
        return f"T > {XLA_MAX_T}: dense scores"
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


COLUMNS = (table.Column("shape", width=20), table.Column("causal", width=6), table.Column("impl", width=17),
           table.Column("fwd ms", ".3f", ">", 9), table.Column("fwd TF/s", ".3g", ">", 9),
           table.Column("f+b ms", ".3f", ">", 9), table.Column("f+b TF/s", ".3g", ">", 9),
           table.Column("bwd TF/s", ".3g", ">", 9), table.Column("note"))


def format_table(rows: list[Row]) -> str:
    return table.format_table([(r.shape, "yes" if r.causal else "no", r.impl, r.fwd_ms, r.fwd_tflops, r.bwd_ms,
                                r.bwd_tflops, r.bwd_only_tflops, r.note) for r in rows], COLUMNS, sep=" ", rule=True)


def _spec(bs: BlockSizes) -> str:
    """BlockSizes as Python, set fields only (a row to paste into the table)."""
    fields = (f"{f.name}={getattr(bs, f.name)}" for f in dataclasses.fields(bs) if getattr(bs, f.name) is not None)
    return f"BlockSizes({', '.join(fields)})"


def _candidates(impl: str, dry_run: bool):
    """(forward candidates, backward variations of a chosen forward) for a sweep."""
    if impl == "pallas_mosaic_gpu":  # block_q is fixed (one 64-row wgmma tile per warpgroup)
        fwd = [BlockSizes(64, bk, 64, 64, 64, 64, num_stages=st) for bk in (64, 128) for st in (2, 3)]
        bwd = [dict(block_kv_dq=a, block_kv_dkv=b) for a, b in ((64, 64), (128, 64), (64, 128), (128, 128))]
        return fwd, bwd
    tiles = [(16, 16), (32, 16)] if dry_run else [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]
    knobs = [(None, None)] if dry_run else [(4, 2), (8, 2), (8, 3), (4, 3)]
    fwd = [BlockSizes(bq, bk, num_warps=w, num_stages=st) for (bq, bk), (w, st) in itertools.product(tiles, knobs)]
    bwd_tiles = [(16, 16), (16, 32)] if dry_run else [(64, 64), (128, 64), (64, 128), (128, 128), (32, 64)]
    bwd = [dict(block_q_dq=max(a, b), block_kv_dq=min(a, b), block_q_dkv=min(a, b), block_kv_dkv=max(a, b))
           for a, b in bwd_tiles]
    if not dry_run:  # then warps / stages per backward kernel
        bwd += [dict(num_warps_dq=wq, num_stages_dq=sq, num_warps_dkv=wk, num_stages_dkv=sk)
                for wq, sq, wk, sk in ((8, 2, 8, 2), (4, 2, 4, 2), (8, 3, 8, 3), (4, 2, 8, 2), (8, 2, 4, 3))]
    return fwd, bwd


def sweep(shapes: dict[str, Shape], impl: str, dtype: str, reps: int, dry_run: bool, causal_modes,
          deadline: float = math.inf) -> None:
    """Stages per (shape, mask): forward tiles, warps and stages by forward time; then the
    backward tiles (and, for Triton, warps / stages per backward kernel) by forward+backward
    time on top of the best forward choice; each stage keeps its winner."""
    device_kind = "cpu" if dry_run else jax.devices()[0].device_kind
    fwd_candidates, bwd_changes = _candidates(impl, dry_run)
    for shape, causal in itertools.product(shapes.values(), causal_modes):
        def timed(bs, backward):
            row = measure(shape, causal, impl, dtype, reps, block_sizes=bs, deadline=deadline)
            ms = row.bwd_ms if backward else row.fwd_ms
            tf = row.bwd_tflops if backward else row.fwd_tflops
            print(f"#   {'f+b' if backward else 'fwd'} {_spec(bs)}: "
                  + (f"{ms:.3f} ms, {tf:.0f} TFLOP/s" if ms is not None else row.note or "-"), flush=True)
            return ms

        results = [(ms, bs) for bs in fwd_candidates if (ms := timed(bs, False)) is not None]
        if not results:
            print(f"# {shape.name} causal={causal}: no candidate ran")
            continue
        fwd_ms, chosen = min(results, key=lambda x: x[0])
        best_bwd = None
        for change in bwd_changes:
            bs = dataclasses.replace(chosen if best_bwd is None else best_bwd[1], **change)
            ms = timed(bs, True)
            if ms is not None and (best_bwd is None or ms < best_bwd[0]):
                best_bwd = (ms, bs)
        if best_bwd is not None:
            chosen = best_bwd[1]
        band = make_band(causal, None, shape.t, shape.t)
        bucket = head_dim_bucket(shape.dqk, shape.dv)
        table_name = "MOSAIC_GPU_TABLE" if impl == "pallas_mosaic_gpu" else "TABLE"
        print(f'    ("{device_kind}", "{dtype}", {bucket}, "{band.kind}"): {_spec(chosen)},'
              f"  # {table_name}, measured {time.strftime('%Y-%m-%d')}: {shape.name} T{shape.t} fwd {fwd_ms:.3f} ms"
              + ("" if best_bwd is None else f", fwd+bwd {best_bwd[0]:.3f} ms"))


def rows_for(shapes: dict[str, Shape], seq_lens, causal_modes, impls) -> list[tuple[Shape, bool, str]]:
    """(shape at length, causal, impl) in priority order, for a time budget: every shape at the
    first length, then the first shape at the other lengths, then the rest.
    seq_lens None: the shapes as they are (the dry run's tiny ones)."""
    if seq_lens is None:
        return [(s, c, impl) for s in shapes.values() for c in causal_modes for impl in impls]
    first = next(iter(shapes.values()))
    pairs = sorted(((s, t) for t in seq_lens for s in shapes.values()),
                   key=lambda st: (st[1] != seq_lens[0], st[0] is not first))  # stable: keeps the given order
    return [(at_length(s, t), c, impl) for s, t in pairs for c in causal_modes for impl in impls]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--seq-lens", default="4096", help="comma list; batch keeps 16384 tokens per call")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="time block-size candidates, print table rows")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="stop timing after this")
    args = parser.parse_args(argv)
    dry = args.dry_run or (not has_gpu() and jax.default_backend() != "tpu")
    if dry and not args.dry_run:
        print(f"# no accelerator ({jax.default_backend()}): dry run with tiny shapes in interpret mode")
    table = DRY_SHAPES if dry else SHAPES
    shapes = {k: table[k] for k in args.shapes.split(",")}
    causal_modes = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    reps = 1 if dry else args.reps
    deadline = time.monotonic() + args.budget_s
    if args.sweep:
        for impl in args.impls.split(","):
            if impl.startswith("pallas"):
                sweep(shapes, impl, args.dtype, reps, dry, causal_modes, deadline)
        return 0
    seq_lens = None if dry else [int(t) for t in args.seq_lens.split(",")]
    rows = [measure(s, c, impl, args.dtype, reps, deadline=deadline)
            for s, c, impl in rows_for(shapes, seq_lens, causal_modes, args.impls.split(","))]
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
