"""One row of `benchmarks/step_device.py`: build, compile, time, profile and size one step config.

A row is an attention implementation, a remat policy and a chain of variants applied in order
(each on top of the previous one, so a row differs from the one before it by one change):

    base                 nothing changed
    chunked_loss[=N]     model.loss_chunk_size=N (default: seq_len / 8): logits + cross-entropy per chunk
    remat=POLICY         model.remat_policy=POLICY
    batch=N              train.batch_size=N (`batch=fit` is resolved by step_device.py to the
                         previous row's largest fitting batch)
    host_batches         a fresh host batch per step through `Runtime.to_global`, as `Trainer` feeds it
    sync_each_step       block on every step's outputs (what the old timing loop did): the host gap
    KEY=VALUE            any config override, e.g. model.scan_layers=false
    fused_norm, fused_optimizer
                         named candidates not built (see benchmarks/RESULTS.md): reported as pending

Steps are dispatched back to back and waited for once (the Trainer's loop syncs only at log
points), so the time per step includes no host round trip unless a variant asks for one.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step_cpu import build_step, random_batch
from jaxinfra.config import Config, ConfigError, load_config
from jaxinfra.metrics import flops_per_token, measure_matmul_flops
from jaxinfra.metrics.flops import param_counts
from jaxinfra.metrics.hlo import parse_hlo
from jaxinfra.metrics.memory import compiled_bytes, device_memory, largest_batch
from jaxinfra.metrics.peak import peak_flops_per_device
from jaxinfra.metrics.trace import capture, load_events, op_events, summarize
from models.config import REMAT_POLICIES

GPU_OVERRIDES = ["model.d_model=2048", "model.num_layers=16", "model.num_heads=16", "model.num_kv_heads=8",
                 "model.head_dim=128", "model.mlp_dim=8192", "model.vocab_size=32768", "model.tie_embeddings=false",
                 "model.dtype=bfloat16", "model.param_dtype=float32", "model.rope_theta=500000",
                 "train.seq_len=4096", "train.batch_size=8", "data.source=synthetic"]
DRY_OVERRIDES = ["model.num_layers=2", "train.seq_len=64", "train.batch_size=2", "data.source=synthetic"]
LOOP_VARIANTS = ("host_batches", "sync_each_step")
DRY_CAPACITY = 32 * 2**20  # the CPU dry run's fake device memory, so that the batch search runs
PENDING_VARIANTS = {  # what the CPU HLO of `small` shows, and why nothing was built (benchmarks/RESULTS.md)
    "fused_norm": "not built: a jnp rewrite is the same HLO (XLA:CPU emits residual add, sum of squares, "
                  "rsqrt and scale as 4 fusions per norm either way); needs a kernel: measure the norms' "
                  "share on a GPU first",
    "fused_optimizer": "not built: the update is already in place (every state buffer donated and aliased), "
                       "as ~12 fusions per parameter; measure its share on a GPU first",
}


def slug(label: str) -> str:
    """A row label as a file name (letters, digits, '.', '_', '-')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-") or "row"


class BadVariant(ValueError):
    """A --variants entry that names nothing this script knows."""


@dataclasses.dataclass(frozen=True)
class RowSpec:
    label: str
    impl: str
    policy: str
    variants: tuple[str, ...] = ()  # applied in order after the impl and policy


@dataclasses.dataclass(frozen=True)
class RowOptions:
    preset: str = "small"  # on an accelerator, under GPU_OVERRIDES
    cpu_preset: str = ""  # on CPU: this preset as it is ("": the dry run, `tiny` under DRY_OVERRIDES)
    overrides: tuple[str, ...] = ()  # the user's KEY=VALUE, after the defaults
    steps: int = 5
    profile_steps: int = 0  # 0: no profile
    work_dir: str = ""  # traces and HLO text go here (a temporary folder when empty)
    fit: bool = False
    fit_multiple: int = 1  # batches searched are multiples of this (e.g. data-parallel devices)
    capacity: int | None = None  # bytes; None: the device's bytes_limit
    fit_deadline: float | None = None  # time.monotonic() after which the batch search stops
    measure_matmul: bool = False
    docs_per_row: int = 1


def check_variant(token: str) -> None:
    """Raise BadVariant unless `token` is a variant this script knows (module docstring); a config
    override is checked against the config schema."""
    name, eq, value = token.partition("=")
    positive = value.isdigit() and int(value) > 0
    known = ((name in ("base", *LOOP_VARIANTS, *PENDING_VARIANTS) and not eq)
             or (name == "chunked_loss" and (not eq or positive)) or (name == "remat" and value in REMAT_POLICIES)
             or (name == "batch" and (positive or value == "fit")) or ("." in name and bool(value)))
    if not known:
        policies = ", ".join(REMAT_POLICIES)
        raise BadVariant(f"unknown variant {token!r}: choose base, chunked_loss[=N], remat=POLICY ({policies}), "
                         "batch=N|fit, host_batches, sync_each_step, fused_norm, fused_optimizer or a KEY=VALUE "
                         "config override")
    if "." in name:
        try:
            load_config("tiny", [token])
        except ConfigError as e:
            raise BadVariant(f"variant {token!r}: {e}") from None


def _variant_overrides(token: str, seq_len: int) -> list[str]:
    name, _, value = token.partition("=")
    if name == "chunked_loss":
        return [f"model.loss_chunk_size={value or max(1, seq_len // 8)}"]
    if name == "remat":
        return [f"model.remat_policy={value}"]
    if name == "batch":
        return [f"train.batch_size={value}"]
    return [token] if "." in name else []


def row_config(spec: RowSpec, opts: RowOptions, dry: bool) -> Config:
    """The row's config: preset + defaults + the user's overrides + impl/policy + each variant in order."""
    if dry:
        preset, defaults = (opts.cpu_preset, []) if opts.cpu_preset else ("tiny", DRY_OVERRIDES)
    else:
        preset, defaults = opts.preset, GPU_OVERRIDES
    overrides = [*defaults, *opts.overrides, f"model.attention_impl={'xla' if dry else spec.impl}",
                 f"model.remat_policy={spec.policy}"]
    for token in spec.variants:
        seq = load_config(preset, overrides).train.seq_len
        overrides += _variant_overrides(token, seq)
    return load_config(preset, overrides)


def packed_batch(cfg: Config, rng: np.random.Generator, docs_per_row: int) -> dict[str, np.ndarray]:
    """A random batch whose rows each pack `docs_per_row` documents (segment ids 1..n, positions
    restarting per document); 1 = the plain batch of benchmarks/step_cpu.py."""
    batch = random_batch(cfg, rng)
    if docs_per_row <= 1:
        return batch
    b, t = batch["inputs"].shape
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), docs_per_row - 1, replace=False))
        starts = np.concatenate([[0], cuts])
        seg = np.searchsorted(cuts, np.arange(t), side="right")
        batch["segment_ids"][r] = seg + 1
        batch["positions"][r] = np.arange(t) - starts[seg]
    return batch


def _abstract_batch(rt, cfg: Config, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (batch_size, cfg.train.seq_len)
    keys = ("inputs", "targets", "segment_ids", "positions")
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rt.batch_sharding) for k in keys}


def _timed_steps(rt, compiled, state, batch, cfg: Config, steps: int, flags: set[str], docs: int):
    """(state, device losses, seconds per step): `steps` steps dispatched back to back."""
    host = [packed_batch(cfg, np.random.default_rng(1 + i), docs) for i in range(2)] if "host_batches" in flags \
        else None
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = compiled(state, rt.to_global(host[i % 2]) if host else batch, rt.step_inputs())
        losses.append(metrics["loss"])
        if "sync_each_step" in flags:
            jax.block_until_ready(metrics)
    jax.block_until_ready((state, losses))
    return state, losses, (time.perf_counter() - t0) / steps


def _header_facts(cfg: Config, device: jax.Device, measure_matmul: bool, dry: bool) -> dict[str, Any]:
    peak, source = peak_flops_per_device(device, cfg.model.dtype)
    facts = {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
             "peak_flops": peak, "peak_source": source, "params": param_counts(cfg.model)["total"],
             "fpt": flops_per_token(cfg.model, cfg.train.seq_len),
             "fpt_causal": flops_per_token(cfg.model, cfg.train.seq_len, causal=True)}
    if measure_matmul:  # on CPU the peak itself is a measured float32 jnp.dot (jaxinfra/metrics/peak.py)
        facts["matmul_flops"] = peak if dry else measure_matmul_flops(8192, jnp.bfloat16)
    return facts


def _profile(compiled, run_steps, work: Path, label: str, steps: int, device: bool) -> dict[str, Any]:
    """Trace `steps` steps; the step's category shares, top ops, and where the trace and HLO are."""
    hlo_text = compiled.as_text()
    module = parse_hlo(hlo_text)
    name = slug(label)
    trace = capture(run_steps, work / f"trace-{name}")
    prof = summarize(op_events(load_events(trace), module.name, device=device), module, steps)
    hlo_path = work / f"{name}.hlo.txt.gz"
    with gzip.open(hlo_path, "wt") as f:
        f.write(hlo_text)
    return {"categories": prof.categories, "ops": prof.ops[:15], "steps": prof.steps, "step_us": prof.step_us,
            "busy": prof.busy_fraction, "unnamed": prof.unnamed_fraction, "between_steps_us": prof.between_steps_us,
            "trace": str(trace), "hlo": str(hlo_path)}


def _fit(rt, state, cfg: Config, opts: RowOptions, own_bytes: int, capacity: int | None,
         options: dict | None) -> dict[str, Any]:
    """The largest batch whose compiled estimate fits `capacity`; probes compile like the row (same
    compiler options), so a later `batch=N` row reuses the probe's compile from the cache."""
    if capacity is None:
        return {"describe": "no capacity", "note": "the device reports no bytes_limit: pass --capacity-gib"}

    def bytes_at(b: int) -> int:
        lowered = rt.lower_train_step(state, _abstract_batch(rt, cfg, b))
        return compiled_bytes(lowered.compile(compiler_options=options))["peak_estimate"]

    fit = largest_batch(bytes_at, capacity, cfg.train.batch_size, multiple=opts.fit_multiple,
                        deadline=opts.fit_deadline, known={cfg.train.batch_size: own_bytes})
    return {"largest": fit.largest, "smallest_failing": fit.smallest_failing, "complete": fit.complete,
            "describe": fit.describe(), "probes": fit.probes, "capacity": capacity}


def plan_prediction(cfg: Config, device: jax.Device, matmul_flops: float | None) -> dict[str, Any]:
    """What `jaxinfra plan` predicts for this row on this device (one device): analytic memory and
    step time, printed beside the measured row (targets, docs/plan.md: memory within 10% of
    peak_bytes_in_use, step time within 25%). On CPU the peak is the row's own matmul probe."""
    from jaxinfra.plan.devices import device_spec, kind_of
    from jaxinfra.plan.estimate import make_plan

    kind = kind_of(device)
    plan = make_plan(cfg, 1, device_spec(kind, 1, matmul_flops=matmul_flops if kind == "cpu" else None))
    return {"kind": kind, "memory_bytes": plan.memory.total, "step_s": plan.time.step_s,
            "bottleneck": plan.bottleneck}


def measure(spec: RowSpec, opts: RowOptions) -> dict[str, Any]:
    """Everything step_device.py prints for one row, as plain data (JSON-ready)."""
    device = jax.devices()[0]
    dry = device.platform == "cpu"
    pending = [v for v in spec.variants if v in PENDING_VARIANTS]
    cfg = row_config(spec, opts, dry)
    out: dict[str, Any] = {"label": spec.label, "impl": cfg.model.attention_impl, "remat": cfg.model.remat_policy,
                           "chunk": cfg.model.loss_chunk_size, "batch": cfg.train.batch_size,
                           "tokens": cfg.train.batch_size * cfg.train.seq_len,
                           **_header_facts(cfg, device, opts.measure_matmul, dry)}
    if pending:
        return {**out, "note": PENDING_VARIANTS[pending[-1]]}
    out["plan"] = plan_prediction(cfg, device, out["peak_flops"] if dry else None)
    flags = {v for v in spec.variants if v in LOOP_VARIANTS}
    work = Path(opts.work_dir or tempfile.mkdtemp(prefix="step_device-"))
    rt, state = build_step(cfg)
    batch = rt.to_global(packed_batch(cfg, np.random.default_rng(0), opts.docs_per_row))
    jax.block_until_ready((state, batch))
    t0 = time.perf_counter()
    # XLA:CPU emits per-op trace events only when compiled to (STACK-NOTES: xprof traceme).
    options = {"xla_cpu_enable_xprof_traceme": True} if dry and opts.profile_steps else None
    compiled = rt.lower_train_step(state, batch).compile(compiler_options=options)
    out["compile_s"] = time.perf_counter() - t0
    out["memory"] = compiled_bytes(compiled)
    capacity = opts.capacity or device_memory(device)[1] or (DRY_CAPACITY if dry and not opts.cpu_preset else None)
    if capacity and out["memory"]["peak_estimate"] > capacity:
        out["note"] = (f"not run: compiled estimate {out['memory']['peak_estimate'] / 2**30:.2f} GiB > "
                       f"{capacity / 2**30:.2f} GiB of device memory")
    else:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        try:
            _run_row(out, rt, compiled, state, batch, cfg, spec, opts, work, flags)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at run time: keep the compile's figures
            out["note"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        state = abstract  # donated: the batch search lowers against shapes only
    # The largest batch depends on the model and remat, not on the batch or the loop: those rows reuse the last.
    last = spec.variants[-1] if spec.variants else ""
    if opts.fit and not flags and not last.startswith("batch="):
        out["fit"] = _fit(rt, state, cfg, opts, out["memory"]["peak_estimate"], capacity, options)
    return out


def _run_row(out: dict[str, Any], rt, compiled, state, batch, cfg: Config, spec: RowSpec, opts: RowOptions,
             work: Path, flags: set[str]) -> None:
    """Warm-up, timed steps, the allocator's peak and (opts.profile_steps) the profile, into `out`."""
    state, first = compiled(state, batch, rt.step_inputs())  # + the step extensions' frozen inputs
    state, losses, out["step_s"] = _timed_steps(rt, compiled, state, batch, cfg, opts.steps, flags,
                                                opts.docs_per_row)
    out["losses"] = [float(x) for x in jax.device_get([first["loss"], *losses])]
    out["peak_bytes_in_use"], _ = device_memory(jax.devices()[0])
    if opts.profile_steps:
        def run_steps() -> None:
            nonlocal state
            state, _, _ = _timed_steps(rt, compiled, state, batch, cfg, opts.profile_steps, flags,
                                       opts.docs_per_row)

        try:  # a failed trace keeps the row's timing and memory
            out["profile"] = _profile(compiled, run_steps, work, spec.label, opts.profile_steps,
                                      device=jax.devices()[0].platform != "cpu")
        except Exception as e:  # noqa: BLE001
            out["note"] = f"profile failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
