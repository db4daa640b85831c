"""Rooflines from the plan's tables (jaxinfra/plan/roofline.py): ridge points, a matmul, FSDP and tensor.

    python scripts/guide/roofline.py ridges [--cpu]           HBM and link ridge points per device kind
    python scripts/guide/roofline.py matmul --device-kind h100 --d 4096 --f 14336 [--measure]
    python scripts/guide/roofline.py fsdp CONFIG --device-kind h100 --devices 8 [KEY=VALUE ...]
    python scripts/guide/roofline.py tensor CONFIG --device-kind h100 --devices 8 [KEY=VALUE ...]
    python scripts/guide/roofline.py compiled CONFIG --devices 8 [KEY=VALUE ...]   plan vs compiled collectives

`matmul --measure` times the matmul on this machine's CPU instead (float32, best of 5 runs) and
prints the FLOP/s and bytes/s it reached: noisy, on a shared host; read the trend, not the values.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxinfra.config import load_config
from jaxinfra.metrics.flops import flops_per_token
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan import roofline
from jaxinfra.plan.devices import DEVICES, DeviceSpec, device_spec
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.links import LINKS

GB = 1e9


def ridges(cpu: bool) -> None:
    rows = []
    specs = list(DEVICES.values()) + ([device_spec("cpu", 1)] if cpu else [])
    for spec in specs:
        dtype = "float32" if spec.kind == "cpu" else "bfloat16"
        fast, slow = LINKS[spec.fast_link], LINKS[spec.slow_link]
        rows.append((spec.kind, dtype, spec.peak(dtype) / 1e12, spec.efficiency, spec.memory_bandwidth / GB,
                     roofline.device_ridge(spec, dtype), f"{spec.fast_link} {fast.bandwidth / GB:g}",
                     roofline.ridge_point(spec.throughput(dtype), fast.bandwidth),
                     f"{spec.slow_link} {slow.bandwidth / GB:g}",
                     roofline.ridge_point(spec.throughput(dtype), slow.bandwidth)))
    print(format_table(rows, [Column("kind"), Column("dtype"), Column("peak TFLOP/s", ".4g", ">"),
                              Column("efficiency", "g", ">"), Column("HBM GB/s", ",.0f", ">"),
                              Column("HBM ridge", ",.0f", ">"),
                              Column("fast link GB/s"), Column("its ridge", ",.0f", ">"),
                              Column("slow link GB/s"), Column("its ridge", ",.0f", ">")]))
    print("ridge = FLOPs per byte; HBM ridge = peak / HBM bandwidth; a link's ridge = peak x efficiency / "
          "link bandwidth")


def _measure(b: int, d: int, f: int) -> float:
    """Best of 5 timed runs of a jitted float32 [b, d] x [d, f] on this CPU (after a warm-up)."""
    import jax
    import jax.numpy as jnp

    x, w = jnp.ones((b, d), jnp.float32), jnp.ones((d, f), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(x, w).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dot(x, w).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def matmul(spec: DeviceSpec, d: int, f: int, batches: list[int]) -> None:
    """The roofline of [B, d] x [d, f] per B on a device kind."""
    dtype = "float32" if spec.kind == "cpu" else "bfloat16"
    item = 4 if dtype == "float32" else 2
    peak, bw = spec.peak(dtype), spec.memory_bandwidth
    ridge = roofline.device_ridge(spec, dtype)
    rows = []
    for b in batches:
        flops, nbytes = 2 * b * d * f, item * (b * d + d * f + b * f)
        rows.append((b, roofline.matmul_intensity(b, d, f, item), flops / peak * 1e6, nbytes / bw * 1e6,
                     "compute" if flops / peak > nbytes / bw else "memory"))
    print(f"{spec.kind} {dtype}: [B, {d}] x [{d}, {f}], peak {peak / 1e12:.4g} TFLOP/s, memory {bw / GB:,.0f} GB/s, "
          f"ridge {ridge:,.1f} FLOPs/byte")
    print(format_table(rows, [Column("B", ",", ">"), Column("FLOPs/byte", ",.1f", ">"),
                              Column("compute us", ",.1f", ">"), Column("memory us", ",.1f", ">"), Column("bound")]))
    print(f"compute-bound from B = {roofline.matmul_critical_batch(d, f, ridge, item):,.1f} rows (tokens)")


def matmul_measured(d: int, f: int, batches: list[int]) -> None:
    """The same matmul timed on this CPU in float32: the FLOP/s and bytes/s it reached per B."""
    rows = []
    for b in batches:
        s = _measure(b, d, f)
        rows.append((b, roofline.matmul_intensity(b, d, f, 4), s * 1e6, 2 * b * d * f / s / 1e9,
                     4 * (b * d + d * f + b * f) / s / GB))
    print(f"this CPU, float32: [B, {d}] x [{d}, {f}], weights {4 * d * f / 2**20:,.0f} MiB")
    print(format_table(rows, [Column("B", ",", ">"), Column("FLOPs/byte", ",.1f", ">"),
                              Column("measured us", ",.0f", ">"), Column("GFLOP/s", ",.1f", ">"),
                              Column("GB/s", ",.1f", ">")]))


def _layout(args: argparse.Namespace) -> tuple[Layout, DeviceSpec]:
    spec = device_spec(args.device_kind, args.devices)
    cfg = load_config(args.config, args.overrides)
    return Layout.of(cfg, args.devices, spec.platform, target=spec.kernel_target), spec


def _describe(r: roofline.LinkRoofline, lay: Layout) -> None:
    t = lay.cfg.train
    model = flops_per_token(lay.model, t.seq_len, causal=lay.attention_keeps.skips_masked_blocks)
    tokens = roofline.tokens_per_device(lay)
    print(f"{r.what} on {r.link.name} ({r.link.bandwidth / GB:g} GB/s), {tokens:,.0f} tokens per device:")
    share = f", 1/{lay.tp} of the matmuls" if lay.tp > 1 else ""
    print(f"  FLOPs per token: model {model / 1e9:.1f} G (6N + attention), executed here "
          f"{r.flops / tokens / 1e9:.1f} G (remat {lay.model.remat_policy}{share})")
    print(f"  compute {r.compute_s * 1e3:,.1f} ms at {r.throughput / 1e12:.4g} TFLOP/s; link "
          f"{r.link_bytes / GB:,.2f} GB in {r.calls:g} collectives: {r.comm_s * 1e3:,.1f} ms")
    print(f"  intensity {r.intensity:,.0f} FLOPs per link byte vs ridge {r.ridge:,.0f}: {r.bound}-bound")


def fsdp(args: argparse.Namespace) -> None:
    lay, spec = _layout(args)
    _describe(roofline.fsdp_roofline(lay, spec), lay)
    tokens = roofline.fsdp_crossover_tokens(lay, spec)
    seq = lay.cfg.train.seq_len
    print(f"  compute-bound from {tokens:,.0f} tokens per device ({tokens / seq:.2f} sequences of {seq:,})")


def tensor(args: argparse.Namespace) -> None:
    lay, spec = _layout(args)
    r = roofline.tensor_roofline(lay, spec)
    _describe(r, lay)
    print(f"  all-reduces per layer {roofline.tensor_all_reduces_per_layer(lay)}; compute / communication "
          f"{r.compute_s / r.comm_s:.2f}")
    width = roofline.tensor_crossover_mlp_dim(lay, spec)
    start = (f"from model.mlp_dim = {width:,.0f}" if width > 0
             else "at any model.mlp_dim, attention alone outweighs them")
    m = lay.model
    print(f"  compute-bound {start} (this model: {m.mlp_dim:,}; {m.mlp_dim // lay.tp:,} per device)")


def compiled(args: argparse.Namespace) -> None:
    """The plan's collective bytes per step beside those of the compiled train step (fake CPU devices)."""
    from jaxinfra.plan.compiled import compiled_figures
    from jaxinfra.plan.estimate import make_plan

    cfg = load_config(args.config, args.overrides)
    spec = device_spec("cpu", args.devices, matmul_flops=1.0, bandwidth=1.0)  # bytes only: skip the probes
    plan = make_plan(cfg, args.devices, spec)
    found = compiled_figures(cfg, args.devices)["collectives"]
    # XLA:CPU lowers a reduce-scatter as an all-reduce followed by a slice (page 2).
    names = {"all_gather": ("all-gather",), "reduce_scatter": ("reduce-scatter", "all-reduce"),
             "all_reduce": ("all-reduce",)}
    rows = []
    for c in plan.time.collectives:
        n = math.prod(plan.layout.sizes[a] for a in c.axes)
        key = next((f"{op} x{n}" for op in names[c.op] if f"{op} x{n}" in found), None)
        calls, total = found[key] if key else (0, 0)
        rows.append((c.label, c.calls, c.calls * c.size, key or "-", calls, total, total / (c.calls * c.size)))
    print(f"{args.config} on {args.devices} fake CPU devices, mesh "
          + " x ".join(f"{a}={s}" for a, s in plan.layout.sizes.items() if s > 1) + "; bytes per step per device")
    print(format_table(rows, [Column("plan: collective"), Column("calls", "g", ">"), Column("bytes", ",.0f", ">"),
                              Column("compiled: op x group"), Column("calls", "g", ">"), Column("bytes", ",.0f", ">"),
                              Column("compiled / plan", ".2f", ">")]))


def _parsers() -> dict[str, argparse.ArgumentParser]:
    names = ("ridges", "matmul", "fsdp", "tensor", "compiled")
    parsers = {name: argparse.ArgumentParser(prog=f"roofline.py {name}") for name in names}
    parsers["ridges"].add_argument("--cpu", action="store_true", help="add this machine (matmul and bandwidth probes)")
    p = parsers["matmul"]
    p.add_argument("--device-kind", default="h100")
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--f", type=int, default=14336)
    p.add_argument("--batches", default="1,16,64,256,1024,4096")
    p.add_argument("--measure", action="store_true")
    for name in ("fsdp", "tensor", "compiled"):
        p = parsers[name]
        p.add_argument("config")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
        if name != "compiled":  # compiled: the fake CPU devices
            p.add_argument("--device-kind", default="h100")
        p.add_argument("--devices", type=int, required=True)
    return parsers


def main(argv: list[str]) -> None:
    parsers = _parsers()
    if not argv or argv[0] not in parsers:
        raise SystemExit(__doc__)
    what, args = argv[0], parsers[argv[0]].parse_intermixed_args(argv[1:])  # KEY=VALUE may follow options
    if what == "ridges":
        ridges(args.cpu)
    elif what == "matmul":
        batches = [int(b) for b in args.batches.split(",")]
        if args.measure:
            matmul_measured(args.d, args.f, batches)
        else:
            matmul(device_spec(args.device_kind, 1), args.d, args.f, batches)
    else:
        {"fsdp": fsdp, "tensor": tensor, "compiled": compiled}[what](args)


if __name__ == "__main__":
    main(sys.argv[1:])
