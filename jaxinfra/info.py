"""`jaxinfra info`: devices, versions, and where a config's parameters and optimizer state live."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from typing import Any, get_args

import jax
import numpy as np
from flax import nnx

from jaxinfra.config import Config, pipeline_settings, validate
from jaxinfra.metrics import flops_per_token, param_counts
from jaxinfra.metrics.table import format_table
from jaxinfra.optim import make_optimizer, make_schedule
from jaxinfra.plan.memory import lora_trainable
from jaxinfra.state import abstract_state, model_state, sharding_rules, shardings_for
from sharding.mesh import make_mesh
from sharding.pipeline import Schedule, bubble_fraction

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _bytes_per_device(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.NamedSharding) -> int:
    return math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize


def _tree_bytes(abstract: Any, shardings: Any) -> tuple[int, int]:
    """(total bytes, bytes per device) of an abstract tree under its shardings."""
    total = per_device = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        per_device += _bytes_per_device(leaf.shape, leaf.dtype, sharding)
    return total, per_device


def _abstract_state(cfg: Config) -> Any:
    """The run's abstract TrainState (with LoRA: the adapters, and the optimizer state theirs only)."""
    tx = make_optimizer(cfg.optimizer, make_schedule(cfg.schedule, cfg.optimizer.lr, cfg.train.steps))
    return abstract_state(cfg.model, tx, cfg.quant, trainable=lora_trainable(cfg.lora), lora=cfg.lora)


def memory_table(cfg: Config, mesh: jax.sharding.Mesh) -> dict[str, tuple[int, int]]:
    """{params, grads, optimizer state[, stats]}: (total bytes, bytes per device), from shapes and shardings
    (stats: the model's non-trained variables, e.g. router bias, amax histories; models/stat.py). With
    LoRA, params split into `frozen params` (the base: no grads, no optimizer state) and `trained params`
    (the adapters), and grads are the adapters' only."""
    rules = sharding_rules(cfg.parallelism)
    state = _abstract_state(cfg)
    shardings = shardings_for(state, mesh, rules)
    params = _tree_bytes(state.params, shardings.params)
    stats = {"stats": _tree_bytes(state.stats, shardings.stats)} if jax.tree.leaves(state.stats) else {}
    optimizer = {"optimizer state": _tree_bytes(state.opt_state, shardings.opt_state)}
    trainable = lora_trainable(cfg.lora)
    if trainable is not None:
        trained, frozen = (_tree_bytes(*(nnx.split_state(t, trainable, ...)[i] for t in (state.params,
                                                                                        shardings.params)))
                           for i in (0, 1))
        return {"frozen params": frozen, "trained params": trained, "grads": trained, **optimizer, **stats}
    if cfg.quant.weights != "none":  # an inference checkpoint: no gradients, no optimizer
        return {"params": params, **stats}
    return {"params": params, "grads": params, **optimizer, **stats}


def quant_lines(cfg: Config) -> list[str]:
    """The quant section in words, and the KV cache's bytes per token in the cache's dtypes."""
    from models import cache as kv_cache

    q, lines = cfg.quant, []
    if q.train != "none":
        scaling = f", {q.scaling} scaling" + (f" over {q.amax_history} steps" if q.scaling == "delayed" else "")
        lines.append(f"quant: train={q.train}{scaling if q.train == 'fp8' else ''}, excluded: {', '.join(q.exclude)}")
    if q.weights != "none":
        per = f"groups of {q.group_size} inputs" if q.group_size else "output channel"
        lines.append(f"quant: weights stored {q.weights} with float32 scales per {per}")
    float_kv = kv_cache.bytes_per_token(cfg.model)
    kv = kv_cache.bytes_per_token(cfg.model, q.kv_cache == "int8")
    lines.append(f"kv cache: {kv:,} bytes/token ({q.kv_cache if q.kv_cache != 'none' else cfg.model.dtype}"
                 + (f"; {kv / float_kv:.3f} of {cfg.model.dtype})" if kv != float_kv else ")"))
    return lines


def inference_lines(cfg: Config, max_len: int) -> list[str]:
    """The decode cache of one row of `max_len` positions (`jaxinfra info --inference`): its bytes in the
    cache's dtype, per cache group (sliding-window layers keep min(window, max_len) slots; models/cache.py)."""
    from models import cache as kv_cache

    m, quantized = cfg.model, cfg.quant.kv_cache == "int8"
    dtype = "int8 + float32 scales" if quantized else m.dtype
    total = kv_cache.cache_bytes(m, 1, max_len, quantized)
    lines = [f"kv cache per row of {max_len:,} positions: {total:,} bytes ({dtype})"]
    full = kv_cache.bytes_per_token(m, quantized) * max_len
    if total != full:
        lines[0] += f"; {full:,} without sliding windows"
    for name, group in kv_cache.groups(m).items():
        slots = group.slots(max_len)
        what = "global" if group.window is None else f"window {group.window}"
        lines.append(f"  {name}: {len(group.layers)} layers ({what}) x {slots:,} slots")
    return lines


def pipeline_line(cfg: Config, stages: int) -> str:
    """The pipeline schedule and its analytic bubble (S-1)/(R M + S-1) (sharding/pipeline.py)."""
    p = cfg.parallelism
    settings = pipeline_settings(p)
    micro, repeats = settings.resolved(stages)

    def bubble(schedule: str) -> float:
        return bubble_fraction(stages, *dataclasses.replace(settings, schedule=schedule).resolved(stages))

    others = ", ".join(f"{name} {bubble(name):.3f}" for name in get_args(Schedule) if name != p.pipeline_schedule)
    return (f"pipeline: {p.pipeline_schedule}, {stages} stages x {micro} microbatches"
            f"{f' x {repeats} repeats' if repeats > 1 else ''}: bubble {bubble_fraction(stages, micro, repeats):.3f}"
            f" (same microbatches: {others})")


def lora_lines(cfg: Config) -> list[str]:
    """The lora section in words: rank, scale, targets and the trained parameter count."""
    from models.lora_config import adapter_param_count, lora_targets

    lora = cfg.lora
    if not lora.enabled:
        return []
    base = "int8 (weights + float32 scales)" if cfg.quant.weights == "int8" else cfg.model.param_dtype
    return [f"lora: rank {lora.rank}, alpha {lora.alpha:g} (scale {lora.scale:g}), dropout {lora.dropout:g} on "
            f"{', '.join(lora_targets(lora))}: {adapter_param_count(cfg.model, lora):,} trained params (float32) "
            f"over a frozen {base} base"]


def parameter_table(state: Any, shardings: Any, trainable: Any = None) -> str:
    """One row per parameter and stat: shape, dtype, logical axes, mesh sharding, bytes per device and,
    when a base is frozen (LoRA), whether the optimizer trains it (trainable, frozen, or stat: updated
    outside the optimizer). Without a frozen base the column is left out, as before LoRA existed."""
    trained = {path for path, _ in nnx.to_flat_state(state.params if trainable is None else
                                                      nnx.split_state(state.params, trainable, ...)[0])}
    rows = []
    flat_shardings = dict(nnx.to_flat_state(model_state(shardings)))
    for path, var in nnx.to_flat_state(model_state(state)):  # params and stats
        sharding = flat_shardings[path].get_raw_value()
        role = "trainable" if path in trained else "frozen" if isinstance(var, nnx.Param) else "stat"
        rows.append(("/".join(map(str, path)), str(tuple(var.shape)), str(np.dtype(var.dtype)),
                     str(tuple(var.get_metadata()["out_sharding"])), str(tuple(sharding.spec)),
                     f"{_bytes_per_device(var.shape, var.dtype, sharding):,}", role))
    columns = ["parameter", "shape", "dtype", "logical axes", "mesh sharding", "bytes/device", "training"]
    if trainable is None:
        return format_table([row[:-1] for row in rows], columns[:-1])
    return format_table(rows, columns)


def describe(cfg: Config | None = None, inference: int | None = None) -> str:
    """The report of `jaxinfra info`; `inference` (--inference): also the decode cache of one row of
    that many positions (0: train.seq_len)."""
    devices = jax.devices()
    lines = [
        "versions: " + ", ".join(f"{p} {_version(p)}" for p in PACKAGES),
        f"backend: {jax.default_backend()}, processes: {jax.process_count()} (this is {jax.process_index()})",
        f"devices: {len(devices)} x {devices[0].device_kind} ({jax.local_device_count()} local)",
    ]
    if cfg is None:
        return "\n".join(lines)
    validate(cfg, len(devices))
    mesh = make_mesh(cfg.mesh, devices)
    rules = sharding_rules(cfg.parallelism)
    counts = param_counts(cfg.model)
    lines.append(f"mesh: {dict(mesh.shape)}")
    lines.append(f"strategy: {rules.describe()}")
    if mesh.shape["stage"] > 1:
        lines.append(pipeline_line(cfg, mesh.shape["stage"]))
    active = f", {counts['active']:,} active per token" if "active" in counts else ""
    lines.append(f"params: {counts['total']:,} ({counts['non_embedding']:,} non-embedding{active}); "
                 f"train FLOPs/token at seq {cfg.train.seq_len}: {flops_per_token(cfg.model, cfg.train.seq_len):.4g}")
    state = _abstract_state(cfg)
    shardings = shardings_for(state, mesh, rules)
    lines += quant_lines(cfg) + lora_lines(cfg)
    if inference is not None:
        lines += inference_lines(cfg, inference or cfg.train.seq_len)
    lines.append(parameter_table(state, shardings, lora_trainable(cfg.lora)))
    for name, (total, per_device) in memory_table(cfg, mesh).items():
        lines.append(f"{name:>16}: {per_device / 2**20:10.2f} MiB per device of {total / 2**20:10.2f} MiB "
                     f"({per_device / total:.3f})")
    return "\n".join(lines)
