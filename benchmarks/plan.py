"""`jaxinfra plan` against the compiler and the clock, on this CPU with 8 fake devices.

    python benchmarks/plan.py memory [--rows pipeline]  # analytic vs compiled memory_analysis (rows naming it)
    python benchmarks/plan.py time [--steps 5]  # predicted vs measured median step time, 4 configs
    python benchmarks/plan.py search [--top 5]  # --search's top layouts for small and mixtral-tiny, measured
    python benchmarks/plan.py presets [--presets gpt-oss-20b,...]  # full-size presets on 8/64/256 H100, TPU v5p

Every figure of one table comes from one process (the matmul probe that calibrates the CPU
predictions is measured in it, next to the steps it predicts). Tables print in RESULTS.md's
markdown form.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join([*(f for f in os.environ.get("XLA_FLAGS", "").split()
                                      if "device_count" not in f), "--xla_force_host_platform_device_count=8"])
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root; tests/ for the layout table
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax
import numpy as np

from benchmarks.step_cpu import random_batch
from jaxinfra.config import Config, ConfigError, load_config
from jaxinfra.metrics.peak import measure_matmul_flops
from jaxinfra.metrics.table import format_table
from jaxinfra.plan import probes
from jaxinfra.plan.compiled import analyse
from jaxinfra.plan.devices import device_spec, measure_memory_bandwidth, with_rates
from jaxinfra.plan.estimate import make_plan
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.links import Measured, read_measured
from jaxinfra.plan.memory import estimate
from jaxinfra.plan.report import size
from jaxinfra.plan.search import overrides, search
from jaxinfra.runtime import build_runtime

MLA = ["model.attention_type=mla", "model.head_dim=null", "model.q_lora_rank=128", "model.kv_lora_rank=64",
       "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=64"]
MOE = ["model.d_model=256", "train.seq_len=256", "data.source=synthetic"]
TIME_CONFIGS = [  # (name, preset, overrides, devices): dense MHA / GQA / MLA and MoE over the layouts
    ("small, 1 device", "small", ["mesh.data=1"], 1),
    ("small, fsdp=8", "small", ["mesh.data=1", "mesh.fsdp=8"], 8),
    ("small, data=2 x tensor=4", "small", ["mesh.data=2", "mesh.tensor=4"], 8),
    ("small, data=4 x stage=2 gpipe", "small", ["mesh.data=4", "mesh.stage=2", "parallelism.microbatches=2"], 8),
    ("small GQA kv 2, dp data=8", "small", ["model.num_kv_heads=2", "mesh.data=8", "parallelism.strategy=dp"], 8),
    ("small, zero1 data=8", "small", ["mesh.data=8", "parallelism.strategy=zero1"], 8),
    ("small MLA, fsdp=8", "small", [*MLA, "mesh.data=1", "mesh.fsdp=8"], 8),
    ("mixtral-tiny d256, expert=4 x data=2", "mixtral-tiny", [*MOE, "train.batch_size=32", "mesh.data=2",
                                                              "mesh.expert=4"], 8),
    ("qwen3-moe-tiny d256, 1 device", "qwen3-moe-tiny", [*MOE, "mesh.data=1"], 1),
]


def probe_once(kinds: list[probes.Probe] | None = None) -> tuple[float, float, dict[str, float]]:
    """One run each of the matmul and memory-bandwidth probes (FLOP/s, bytes/s) and of the per-kind
    probes at the row's shapes (jaxinfra/plan/probes.py: per-device rate by kind)."""
    return (measure_matmul_flops(repeats=1), measure_memory_bandwidth.__wrapped__(repeats=1),
            {p.kind: p.work / p.seconds() for p in kinds or ()})


def measure_step(cfg: Config, devices: int, steps: int) -> tuple[float, tuple[float, float, dict[str, float]]]:
    """(median seconds of `steps` train steps after a compile + warm-up step, the probes' medians).

    This host's speed drifts by tens of percent over seconds (the 2048^3 probe ranged 183-397
    GFLOP/s in one 40 s run, benchmarks/RESULTS.md), so the probes that calibrate the prediction
    are sampled across the steps' own window: three runs before, two after each step, three after."""
    rt = build_runtime(cfg, jax.devices()[:devices])
    state, batch = rt.init_state(), rt.to_global(random_batch(cfg, np.random.default_rng(0)))
    state, metrics = rt.train_step(state, batch)
    jax.block_until_ready((state, metrics))
    kinds = probes.build_all(Layout.of(cfg, devices, "cpu"), jax.devices()[:devices])
    samples, times = [probe_once(kinds) for _ in range(3)], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = rt.train_step(state, batch)
        jax.block_until_ready((state, metrics))  # the update too: the probes must not run beside it
        times.append(time.perf_counter() - t0)
        samples += [probe_once(kinds) for _ in range(2)]
    samples += [probe_once(kinds) for _ in range(3)]
    rates = {k: float(np.median([s[2][k] for s in samples])) for k in samples[0][2]}
    return float(np.median(times)), (float(np.median([s[0] for s in samples])),
                                     float(np.median([s[1] for s in samples])), rates)


def probe() -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) as medians of 7 runs: on a loaded machine the probes' usual
    best-of-5 catches a quiet moment the following steps do not get; the median sees what they see."""
    samples = [probe_once() for _ in range(7)]
    return float(np.median([s[0] for s in samples])), float(np.median([s[1] for s in samples]))


def cpu(devices: int, sampled: tuple, dtype: str = "float32"):
    """The CPU spec of `devices` fake devices from sampled (matmul, bandwidth[, per-kind rates])."""
    spec = device_spec("cpu", devices, matmul_flops=sampled[0], bandwidth=sampled[1])
    kinds = sampled[2] if len(sampled) > 2 else {}
    return with_rates(spec, {f"{kind}:{dtype}": rate for kind, rate in kinds.items()})


def memory_layouts() -> list[tuple[str, Config]]:
    """tests/test_plan.py's layouts, then its quantization and distillation rows (a teacher run
    dir of its TEACHER shape written to a temporary directory)."""
    import tempfile

    from test_plan import FEATURES, LAYOUTS, TEACHER, layout_config

    from jaxinfra.checkpoint import save_params_only
    from jaxinfra.state import init_params

    teacher = tempfile.mkdtemp(prefix="plan-teacher-")
    save_params_only(teacher, Config(model=TEACHER), jax.jit(lambda k: init_params(TEACHER, k))(jax.random.key(0)),
                     {"params_only": True, "step": 0})
    out = [(name, layout_config(preset, extra)) for name, preset, extra in LAYOUTS]
    for name, layout, extra in FEATURES:
        _, preset, base = next(row for row in LAYOUTS if row[0] == layout)
        out.append((f"{layout} + {name}", layout_config(preset, [*base, *(e.format(teacher=teacher) for e in extra)])))
    return out


def memory_table(only: str = "") -> None:
    rows = []
    for name, cfg in memory_layouts():
        if only not in name:
            continue
        mem = estimate(Layout.of(cfg, 8, "cpu"))
        compiled = analyse(cfg, jax.devices()[:8])["total_bytes"]
        rows.append((name, size(mem.total), size(compiled), f"{mem.total / compiled:.3f}", mem.peak_phase))
        print(format_table(rows[-1:], ["layout", "analytic", "compiled", "ratio", "peak"], style="markdown",
                           header=len(rows) == 1), flush=True)
    worst = max(abs(float(r[3]) - 1) for r in rows)
    print(f"\n{len(rows)} layouts, largest |analytic/compiled - 1| = {worst:.3f}")


def measured_links(mesh_overrides: list[str]) -> Measured | None:
    """`jaxinfra bench collectives` over this config's mesh, run now (what `jaxinfra plan --links`
    reads): fake-device collectives are memcpys on the shared cores, their speed moves with the
    machine like the steps'. None on one device."""
    import contextlib
    import io
    import tempfile

    from jaxinfra import cli

    mesh = [o for o in mesh_overrides if o.startswith("mesh.")]
    if not any(not o.endswith("=1") for o in mesh):
        return None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["bench", "collectives", *mesh, "--max-bytes", str(32 << 20)])
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(out.getvalue())
    return read_measured(f.name)


def time_table(steps: int, only: str = "") -> None:
    """Each config: measure its mesh's collectives, then its steps with the probes sampled between
    them; the prediction uses the probes' medians and the measured links."""
    rows = []
    for name, preset, extra, devices in TIME_CONFIGS:
        if only not in name:
            continue
        cfg = load_config(preset, [*extra, "data.source=synthetic"])
        links = measured_links(extra)
        measured, sampled = measure_step(cfg, devices, steps)
        plan = make_plan(cfg, devices, cpu(devices, sampled, cfg.model.dtype), links)
        kinds = " ".join(f"{k[:4]} {v:.2f}" for k, v in plan.time.compute_by_kind.items())
        rows.append((name, devices, f"{sampled[0] / 1e9:.0f}", f"{sampled[2]['matmul'] * devices / 1e9:.0f}",
                     f"{sampled[1] / 1e9:.2f}",
                     f"{plan.time.step_s:.3f}", kinds, f"{measured:.3f}", f"{measured / plan.time.step_s:.3f}",
                     plan.bottleneck, f"{os.getloadavg()[0]:.1f}"))
        print(format_table(rows[-1:], ["config", "devices", "2048^3 GFLOP/s", "step's matmul GFLOP/s (host)",
                                       "probe GB/s",
                                       "predicted s", "compute by kind s", "measured s", "measured / predicted",
                                       "bottleneck", "load"], style="markdown", header=len(rows) == 1), flush=True)
    ratios = [float(r[8]) for r in rows]
    print(f"\n{len(rows)} configs, {sum(0.8 <= r <= 1.25 for r in ratios)} with measured / predicted in "
          f"[0.8, 1.25]; range {min(ratios):.3f}-{max(ratios):.3f}")


def interleaved_steps(cfgs: list[Config], steps: int) -> list[float]:
    """Median step seconds of each config, measured round-robin (one step of each per round, after
    a compile + warm-up step each), so that the machine's load drifts over all of them alike."""
    runs = []
    for cfg in cfgs:
        rt = build_runtime(cfg, jax.devices()[:8])
        state, batch = rt.init_state(), rt.to_global(random_batch(cfg, np.random.default_rng(0)))
        state, metrics = rt.train_step(state, batch)
        jax.block_until_ready(metrics)
        runs.append([rt, state, batch, []])
    for _ in range(steps):
        for run in runs:
            rt, state, batch, times = run
            t0 = time.perf_counter()
            run[1], metrics = rt.train_step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
    return [float(np.median(run[3])) for run in runs]


def search_table(preset: str, top: int, steps: int) -> None:
    """--search's top layouts measured in one run (interleaved), with the preset's own layout and
    fsdp=8 as references."""
    sampled = probe()
    cfg = load_config(preset, ["data.source=synthetic"])
    spec = cpu(8, sampled)
    ranked = search(cfg, 8, spec)[:top]
    print(f"{preset}: probes {sampled[0] / 1e9:.1f} GFLOP/s, {sampled[1] / 1e9:.2f} GB/s, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    references = [make_plan(load_config(preset, ["data.source=synthetic", *extra]), 8, spec)
                  for extra in (["mesh.data=8"], ["mesh.data=1", "mesh.fsdp=8"])]
    plans = [*ranked, *references]
    measured = interleaved_steps([p.layout.cfg for p in plans], steps)
    rows = [(str(rank) if rank <= len(ranked) else "reference",
             " ".join(o for o in overrides(p) if not o.endswith("=1")), f"{p.time.step_s:.3f}", f"{m:.3f}")
            for rank, (p, m) in enumerate(zip(plans, measured), 1)]
    print(format_table(rows, ["rank", "layout", "predicted s", "measured s"], style="markdown"))
    best = min(measured[:len(ranked)])
    print(f"predicted best measured {measured[0]:.3f} s = {measured[0] / best:.3f} x the fastest measured of the "
          f"top {len(ranked)}; load {os.getloadavg()[0]:.1f}")


PRESETS = ("llama3-8b", "deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b", "olmo2-7b", "gemma3-27b", "gpt-oss-20b",
           "gpt-oss-120b")
# On accelerators the presets would run a flash kernel and a chunked loss: XLA attention keeps
# [rows, heads, seq, seq] float32 scores per layer, and whole-sequence logits are ~10 GiB per row.
# `auto` is what the kernels pick on each device kind (kernels/facts.py: Triton on H100, Mosaic on TPU).


def presets_table(presets: tuple[str, ...] = PRESETS, kinds: tuple[str, ...] = ("h100", "tpu-v5p"),
                  counts: tuple[int, ...] = (8, 64, 256)) -> None:
    """Full-size presets: the preset's own layout (fsdp=-1) and --search's best, per device count."""
    rows = []
    for preset in presets:
        for kind in kinds:
            extra = ["model.attention_impl=auto", "model.loss_chunk_size=512"]
            cfg = load_config(preset, extra)
            spec = device_spec(kind)
            for count in counts:
                try:
                    own = make_plan(cfg, count, spec)
                    own_memory = size(own.memory.total) + (" (fits)" if own.fits else " (no)")
                except ConfigError as e:  # e.g. gpt-oss's d_model 2880 does not split over fsdp=256
                    own_memory = f"invalid: {e}"
                t0 = time.perf_counter()
                ranked = search(cfg, count, spec)
                best = ranked[0] if ranked else None
                layout = " ".join(o for o in overrides(best) if not o.endswith("=1")) if best else "nothing fits"
                rows.append((preset, kind, count, own_memory,
                             layout, size(best.memory.total) if best else "-",
                             f"{best.time.step_s:.2f}" if best else "-",
                             f"{best.tokens_per_s / count:,.0f}" if best else "-", f"{best.mfu:.2f}" if best else "-",
                             best.bottleneck if best else "-", f"{time.perf_counter() - t0:.0f}"))
                print(format_table(rows[-1:], ["preset", "device", "n", "preset layout memory", "best layout",
                                               "memory", "step s", "tokens/s/device", "MFU", "bottleneck",
                                               "search s"], style="markdown", header=len(rows) == 1), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["memory", "time", "search", "presets"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--presets", help="search: presets to search (default small,mixtral-tiny); presets: the "
                        "full-size presets to price (default all of PRESETS)")
    parser.add_argument("--rows", default="", help="memory, time: only the rows whose name contains this")
    args = parser.parse_args()
    if args.what == "memory":
        memory_table(args.rows)
    elif args.what == "time":
        time_table(args.steps, args.rows)
    elif args.what == "search":
        for preset in (args.presets or "small,mixtral-tiny").split(","):
            search_table(preset, args.top, args.steps)
    else:
        presets_table(tuple(args.presets.split(",")) if args.presets else PRESETS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
