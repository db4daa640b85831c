"""FlashAttention on this machine: blocks skipped, numerics of the Pallas kernel, memory against XLA.

    python scripts/guide/flash_blocks.py blocks [--length 4096] [--block 128] [--window 1024]
    python scripts/guide/flash_blocks.py numerics              # interpret mode on CPU (slow: small shapes)
    python scripts/guide/flash_blocks.py memory [--lengths 256,512,1024,2048] [--plot PNG]

`blocks` counts, per mask, the (query block, key block) tiles the kernels visit, from the
same function that sets their loop bounds (kernels/masks.py: kv_block_range): tiles that
need an element mask, tiles that are fully visible, tiles skipped. `numerics` runs
`kernels.attention(impl="pallas_triton")` (the GPU kernel, interpreted on CPU) forward and
backward against the float32 HIGHEST reference. `memory` compiles forward+backward of
attention for `xla` (scores materialised) and `pallas_triton` (interpreted) and prints XLA's
temporary bytes, plus the XLA path's measured TFLOP/s on this CPU (the interpreter's speed
means nothing: GPU figures are in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp

import kernels
from benchmarks.attention import Shape, attention_flops
from jaxinfra.metrics.table import Column, format_table
from kernels.masks import kv_block_range, make_band
from scripts.guide.plotting import pyplot


def block_rows(length: int, block: int, window: int) -> list[list]:
    rows = []
    for name, causal, win in (("full", False, None), ("causal", True, None),
                              (f"causal + window {window}", True, (window, 0))):
        band = make_band(causal, win, length, length)
        masked = full = 0
        for qb in range(length // block):
            lo, full_lo, full_hi, hi = kv_block_range(qb, block, block, band)
            masked += (full_lo - lo) + (hi - full_hi)
            full += full_hi - full_lo
        total = (length // block) ** 2
        rows.append([name, masked, full, total - masked - full, total, (masked + full) / total])
    return rows


def qkv(b: int, t: int, h: int, kv: int, d: int, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (b, t, h, d), dtype), jax.random.normal(keys[1], (b, t, kv, d), dtype),
            jax.random.normal(keys[2], (b, t, kv, d), dtype))


def loss_and_grads(impl: str):
    def loss(q, k, v):
        if impl == "reference":
            out = kernels.reference_attention(q, k, v, causal=True)
        else:
            out = kernels.attention(q, k, v, causal=True, impl=impl)
        return jnp.sum(out * jnp.cos(out))  # a loss whose gradient is not uniform

    return jax.jit(jax.value_and_grad(lambda q, k, v: loss(q, k, v), argnums=(0, 1, 2)))


def numerics_rows() -> list[list]:
    q, k, v = qkv(1, 256, 4, 2, 64)
    out_ref = kernels.reference_attention(q, k, v, causal=True)
    _, grads_ref = loss_and_grads("reference")(q, k, v)
    out = kernels.attention(q, k, v, causal=True, impl="pallas_triton")
    _, grads = loss_and_grads("pallas_triton")(q, k, v)
    rows = [["output", float(jnp.max(jnp.abs(out - out_ref)) / jnp.max(jnp.abs(out_ref)))]]
    for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
        rows.append([name, float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))])
    return rows


def memory_row(length: int) -> list:
    b, h, d = 1, 4, 64
    q, k, v = qkv(b, length, h, h, d)
    temps = {}
    for impl in ("xla", "pallas_triton"):
        temps[impl] = loss_and_grads(impl).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    step = loss_and_grads("xla")
    jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - t0)
    flops = attention_flops(Shape("", b, length, h, h, d, d), causal=True, backward=True)
    return [length, temps["xla"] / 2**20, temps["pallas_triton"] / 2**20, temps["xla"] / temps["pallas_triton"],
            flops / statistics.median(times) / 1e12]


def plot(path: str, rows: list[list]) -> None:
    plt = pyplot()
    lengths = [r[0] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(lengths, [r[1] for r in rows], "o-", label="xla (scores materialised)")
    a.plot(lengths, [r[2] for r in rows], "s-", label="pallas_triton (interpret mode)")
    a.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="temp MiB (fwd+bwd, B1 H4 D64)")
    a.legend()
    b.plot(lengths, [r[4] for r in rows], "o-", label="xla on this CPU")
    b.set(xscale="log", xlabel="sequence length", ylabel="TFLOP/s (fwd+bwd, causal)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["blocks", "numerics", "memory"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_args()
    if args.what == "blocks":
        print(f"T={args.length}, {args.block}x{args.block} tiles")
        columns = ["mask", "masked tiles", "full tiles", "skipped", "all tiles", Column("computed", ".3f", ">")]
        print(format_table(block_rows(args.length, args.block, args.window), columns))
    elif args.what == "numerics":
        print("causal, B1 T256 H4 (2 KV heads) D64, float32: max |ours - reference| / max |reference|")
        print(format_table(numerics_rows(), ["tensor", Column("relative error", ".1e", ">")]))
    else:
        rows = [memory_row(int(n)) for n in args.lengths.split(",")]
        columns = ["length", Column("xla temp MiB", ".2f", ">"), Column("flash temp MiB", ".2f", ">"),
                   Column("xla / flash", ".1f", ">"), Column("xla TFLOP/s (this CPU)", ".3f", ">")]
        print(format_table(rows, columns))
        if args.plot:
            plot(args.plot, rows)
            print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
