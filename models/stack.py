"""The layer stack: which layers a model has (its schedule) and the one runner that applies them.

The schedule is computed once from the `ModelConfig`: per layer, its kind (dense or MoE) and its
slot in its stacked parameter group (`layers` for dense blocks, `moe_layers` for MoE blocks),
plus the shape of the order they run in:

    prefix     leading dense layers (`moe_first_dense_layers`), run before the periods and
               outside a pipeline
    period     the repeating unit: (moe_every - 1) dense blocks then one MoE block; one dense
               block for a dense model
    periods    how many times it repeats (the pipeline's layers)

One runner serves every caller: training (under the config's remat policy), prefill, decode (per
layer inputs `xs`: that layer's cache slice) and the pipeline, whose per-layer function is the
same period function (`run_pipelined` -> `sharding.pipeline.apply_layers`). A layer function is
`fn(block, h, x) -> (h, y)`: x is the layer's slice of `xs` (None: nothing), or the pipeline's
per-row side inputs; the y's come back stacked per group, in that group's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.moe import PARTIAL_STATS, merge_stats
from models.remat import remat_policy
from sharding import pipeline
from sharding.plan import ParallelPlan

Kind = Literal["dense", "moe"]
STACKS: dict[str, str] = {"dense": "layers", "moe": "moe_layers"}  # kind -> its stacked param group
LayerFn = Callable[[nnx.Module, jax.Array, Any], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of the schedule. Per-layer variations of the next model families (the
    attention window / global pattern, the RoPE base) become fields here, set in
    `layer_schedule`; they reach the block as part of the period's structure (a repeating
    local/global pattern is a period) or as stacked per-layer inputs, as decode's cache slices do."""

    kind: Kind
    index: int  # its slot on the leading `layers` axis of its stacked group


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    layers: tuple[LayerSpec, ...]
    prefix: int  # leading dense layers, outside the periods
    period: int  # layers per period (its last one is the MoE block when the model has any)

    def count(self, kind: Kind) -> int:
        return sum(spec.kind == kind for spec in self.layers)

    @property
    def stacks(self) -> tuple[str, ...]:
        """The stacked parameter groups this model has, in parameter order."""
        return tuple(name for kind, name in STACKS.items() if self.count(kind))

    @property
    def is_moe(self) -> bool:
        return self.count("moe") > 0

    @property
    def periods(self) -> int:
        return (len(self.layers) - self.prefix) // self.period

    @property
    def dense_per_period(self) -> int:
        return self.period - 1 if self.is_moe else self.period


def layer_schedule(cfg: ModelConfig) -> LayerSchedule:
    """The model's layers in running order (see the module docstring)."""
    seen = {"dense": 0, "moe": 0}
    specs = []
    for sparse in cfg.moe_layer_flags():
        kind: Kind = "moe" if sparse else "dense"
        specs.append(LayerSpec(kind, seen[kind]))
        seen[kind] += 1
    if cfg.is_moe:
        return LayerSchedule(tuple(specs), cfg.moe_first_dense_layers, cfg.moe_every)
    return LayerSchedule(tuple(specs), 0, 1)


# ---------------------------------------------------------------- pieces


def _at(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


def _stack(outs: list) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs) if outs else None


def _layer_step(graphdef: nnx.GraphDef | None, fn: LayerFn | None, cfg: ModelConfig, remat: bool) -> Callable:
    """(h, (layer params, x)) -> fn(layer module, h, x), under the config's remat policy when
    `remat` (training)."""
    def step(h, xs):
        layer_state, x = xs
        return fn(nnx.merge(graphdef, layer_state), h, x)

    if remat and cfg.remat_policy != "none":
        step = jax.checkpoint(step, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
    return step


@dataclasses.dataclass(frozen=True)
class _Parts:
    """A model's stacks split for the runner: per group, its layer step and its stacked params."""

    dense_step: Callable
    dense: Any
    moe_step: Callable
    moe: Any


def _parts(model: nnx.Module, schedule: LayerSchedule, dense_fn: LayerFn, moe_fn: LayerFn | None,
           remat: bool) -> _Parts:
    cfg = model.cfg
    dense_def, dense = nnx.split(model.layers) if schedule.count("dense") else (None, None)
    moe_def, moe = nnx.split(model.moe_layers) if schedule.is_moe else (None, None)
    return _Parts(_layer_step(dense_def, dense_fn, cfg, remat), dense,
                  _layer_step(moe_def, moe_fn, cfg, remat), moe)


def _prefix(parts: _Parts, h: jax.Array, n: int, xs: Any, scan: bool,
            shared: bool) -> tuple[jax.Array, Callable[[], Any]]:
    """The first `n` dense layers -> (h, a function giving their y's stacked, or None). `shared`:
    xs is one value given to every layer (the pipeline's side inputs) rather than stacked per
    layer. Unrolled, the y's are stacked only when asked (after the periods, as always before)."""
    if not n:
        return h, lambda: None
    step = parts.dense_step
    if scan:
        params = jax.tree.map(lambda x: x[0:n], parts.dense)
        if shared:
            h, ys = jax.lax.scan(lambda h, p: step(h, (p, xs)), h, params)
        else:
            h, ys = jax.lax.scan(step, h, (params, jax.tree.map(lambda x: x[0:n], xs)))
        return h, lambda: ys
    outs = []
    for i in range(n):
        h, y = step(h, (_at(parts.dense, i), xs) if shared else _at((parts.dense, xs), i))
        outs.append(y)
    return h, lambda: _stack(outs)


def _period_fn(parts: _Parts, schedule: LayerSchedule, shared: bool) -> Callable:
    """The function of one period, (h, inputs) -> (h, y), as the scan and the pipeline run it.

    Dense model: one layer; inputs (params, x). MoE model: inputs (dense group [per, ...], group
    xs, MoE params, MoE x) -> y = (dense y's stacked or None, MoE y); `shared`: the group xs is one
    value for every dense block."""
    if not schedule.is_moe:
        return parts.dense_step
    per = schedule.dense_per_period

    def period(h, inputs):
        group, group_xs, layer_state, x = inputs
        ys = []
        for j in range(per):
            h, y = parts.dense_step(h, (_at(group, j), group_xs) if shared else _at((group, group_xs), j))
            ys.append(y)
        h, y = parts.moe_step(h, (layer_state, x))
        return h, (_stack(ys) if per else None, y)

    return period


def _groups(tree: Any, schedule: LayerSchedule, leafwise: bool = False) -> Any:
    """Dense leaves [L_dense, ...] after the prefix -> [periods, dense per period, ...] (None: none).

    `leafwise` slices and reshapes each leaf in turn (the pipeline's order), else every slice
    then every reshape: the two orders the runners had, kept so the traced programs are unchanged."""
    per, periods = schedule.dense_per_period, schedule.periods
    if not per or tree is None:
        return None
    group = lambda x: x.reshape(periods, per, *x.shape[1:])  # noqa: E731
    if leafwise:
        return jax.tree.map(lambda x: group(x[schedule.prefix:]), tree)
    return jax.tree.map(group, jax.tree.map(lambda x: x[schedule.prefix:], tree))


# ---------------------------------------------------------------- the runner


def run(model: nnx.Module, h: jax.Array, dense_fn: LayerFn, moe_fn: LayerFn | None = None, *,
        xs: dict[str, Any] | None = None, remat: bool = False) -> tuple[jax.Array, dict[str, Any]]:
    """Every layer of `model` in schedule order -> (h, y's per stacked group, in its order).

    `xs` per group name (`layers`, `moe_layers`): per-layer inputs stacked like the params.
    `remat` applies the config's remat policy (training)."""
    schedule, cfg = model.schedule, model.cfg
    xs = xs or {}
    parts = _parts(model, schedule, dense_fn, moe_fn, remat)
    dense_xs, moe_xs = xs.get("layers"), xs.get("moe_layers")
    period = _period_fn(parts, schedule, shared=False)
    if schedule.is_moe:
        inputs = (_groups(parts.dense, schedule), _groups(dense_xs, schedule), parts.moe, moe_xs)
    else:
        inputs = (parts.dense, dense_xs)
    h, prefix_ys = _prefix(parts, h, schedule.prefix, dense_xs, cfg.scan_layers, shared=False)
    if cfg.scan_layers:
        h, ys = jax.lax.scan(period, h, inputs)
        prefix = prefix_ys()
    else:
        outs = []
        for p in range(schedule.periods):
            h, out = period(h, _at(inputs, p))
            outs.append(out)
        prefix = prefix_ys()  # the prefix's y's stacked first, then the periods' (the traced order as before)
        ys = _stack(outs)
    if not schedule.is_moe:
        return h, {"layers": ys}
    return h, _by_stack(schedule, prefix, ys)


def _by_stack(schedule: LayerSchedule, prefix_ys: Any, period_ys: Any) -> dict[str, Any]:
    """A MoE model's y's per group: the dense ones back in the order of `layers` (the prefix,
    then each period's group)."""
    group_ys, moe_ys = period_ys if period_ys is not None else (None, None)
    out = {"moe_layers": moe_ys}
    if "layers" in schedule.stacks:
        parts = [prefix_ys] if schedule.prefix else []
        if schedule.dense_per_period:
            parts.append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), group_ys))
        out["layers"] = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if parts else None
    return out


def run_pipelined(model: nnx.Module, h: jax.Array, dense_fn: LayerFn, moe_fn: LayerFn | None, side: Any,
                  plan: ParallelPlan) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Training with the periods split over the plan's `stage` axis (sharding/pipeline.py).

    The dense prefix runs first, outside the pipeline (replicated over `stage`, like the
    embeddings); each period is one pipeline layer, run by the same period function as `run`.
    Per-row inputs travel as `side` (every layer's x) so the pipeline can split them into
    microbatches. MoE router statistics come out as sums over microbatches (`PARTIAL_STATS`),
    from which `merge_stats` rebuilds the whole batch's; a dense model returns no statistics."""
    schedule, cfg = model.schedule, model.cfg
    parts = _parts(model, schedule, dense_fn, moe_fn, remat=True)
    h, _ = _prefix(parts, h, schedule.prefix, side, cfg.scan_layers, shared=True)
    period = _period_fn(parts, schedule, shared=True)
    if not schedule.is_moe:
        def layer(h, params, side):
            return period(h, (params, side))[0]

        return pipeline.apply_layers(layer, h, parts.dense, side, plan=plan, scan_layers=cfg.scan_layers), {}

    def moe_period(h, params, side):
        group, layer_state = params
        h, (_, y) = period(h, (group, side, layer_state, side))
        return h, {k: y[k] for k in PARTIAL_STATS}

    stacked = (_groups(parts.dense, schedule, leafwise=True), parts.moe)
    h, partial = pipeline.apply_layers(moe_period, h, stacked, side, plan=plan, scan_layers=cfg.scan_layers,
                                       with_stats=True)
    return h, merge_stats(partial, cfg.moe_top_k)
