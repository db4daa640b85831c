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
Rope = Literal["global", "local"]
KINDS: tuple[Kind, ...] = ("dense", "moe")
STACKS: dict[str, str] = {"dense": "layers", "moe": "moe_layers"}  # kind -> its stacked param group
LayerFn = Callable[[nnx.Module, jax.Array, Any, "LayerSpec"], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of the schedule: its kind and slot, and the static attributes its block runs with
    (set in `layer_schedule`; a layer function receives its spec)."""

    kind: Kind
    index: int  # its slot on the leading `layers` axis of its stacked group
    window: int | None = None  # sliding window (keys seen, itself included); None: a global layer
    rope: Rope = "global"  # which RoPE table: "global" (rope_theta, scaled) or "local" (rope_local_theta)

    @property
    def variant(self) -> tuple:
        """What the layer's computation depends on besides its parameters: layers with equal variants
        can share one traced step (a scan)."""
        return self.kind, self.window, self.rope


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    layers: tuple[LayerSpec, ...]
    prefix: int  # leading dense layers, outside the periods
    period: int  # layers per period (model.layer_period(): MoE period x window pattern)

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
    def suffix_start(self) -> int:
        """First layer of the suffix: what is left after the last whole period (run unrolled)."""
        return self.prefix + self.periods * self.period

    @property
    def period_specs(self) -> tuple[LayerSpec, ...]:
        """The layers of the first period (every period runs the same variants)."""
        return self.layers[self.prefix:self.prefix + self.period]

    def per_period(self, kind: Kind) -> int:
        return sum(spec.kind == kind for spec in self.period_specs)

    @property
    def dense_per_period(self) -> int:
        return self.per_period("dense")

    def grouped(self, kind: Kind) -> bool:
        """Whether a period takes that kind's layers as a group [per period, ...] (else as the one
        layer it has: dense models with a period of one, MoE models' one MoE block per period)."""
        if kind == "dense":
            return self.is_moe or self.period > 1
        return self.per_period("moe") > 1

    @property
    def simple(self) -> bool:
        """A dense model with one layer per period: the period function is the layer step itself."""
        return not self.is_moe and self.period == 1


def layer_schedule(cfg: ModelConfig) -> LayerSchedule:
    """The model's layers in running order (see the module docstring)."""
    seen = {"dense": 0, "moe": 0}
    specs = []
    for sparse, window, rope in zip(cfg.moe_layer_flags(), cfg.layer_windows(), cfg.layer_ropes(), strict=True):
        kind: Kind = "moe" if sparse else "dense"
        specs.append(LayerSpec(kind, seen[kind], window, rope))
        seen[kind] += 1
    prefix = cfg.moe_first_dense_layers if cfg.is_moe else 0
    return LayerSchedule(tuple(specs), prefix, cfg.layer_period())


# ---------------------------------------------------------------- pieces


def _at(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


def _stack(outs: list) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs) if outs else None


def _layer_step(graphdef: nnx.GraphDef | None, fn: LayerFn | None, spec: LayerSpec, cfg: ModelConfig,
                remat: bool) -> Callable:
    """(h, (layer params, x)) -> fn(layer module, h, x, spec), under the config's remat policy when
    `remat` (training)."""
    def step(h, xs):
        layer_state, x = xs
        return fn(nnx.merge(graphdef, layer_state), h, x, spec)

    if remat and cfg.remat_policy != "none":
        step = jax.checkpoint(step, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
    return step


@dataclasses.dataclass(frozen=True)
class _Parts:
    """A model's stacks split for the runner: per kind its graphdef, layer function and stacked params."""

    defs: dict[str, nnx.GraphDef | None]
    fns: dict[str, LayerFn | None]
    params: dict[str, Any]
    cfg: ModelConfig
    remat: bool

    def step(self, spec: LayerSpec) -> Callable:
        """The layer step of a layer like `spec` (its kind's module, its static attributes)."""
        return _layer_step(self.defs[spec.kind], self.fns[spec.kind], spec, self.cfg, self.remat)


def _parts(model: nnx.Module, schedule: LayerSchedule, dense_fn: LayerFn, moe_fn: LayerFn | None,
           remat: bool) -> _Parts:
    dense_def, dense = nnx.split(model.layers) if schedule.count("dense") else (None, None)
    moe_def, moe = nnx.split(model.moe_layers) if schedule.is_moe else (None, None)
    return _Parts({"dense": dense_def, "moe": moe_def}, {"dense": dense_fn, "moe": moe_fn},
                  {"dense": dense, "moe": moe}, model.cfg, remat)


def _prefix(parts: _Parts, schedule: LayerSchedule, h: jax.Array, xs: Any, scan: bool,
            shared: bool) -> tuple[jax.Array, Callable[[], Any]]:
    """The dense prefix -> (h, a function giving their y's stacked, or None). `shared`: xs is one
    value given to every layer (the pipeline's side inputs) rather than stacked per layer. Scanned
    when asked and its layers all run alike; unrolled, the y's are stacked only when asked (after
    the periods, as always before)."""
    n, specs = schedule.prefix, schedule.layers[:schedule.prefix]
    if not n:
        return h, lambda: None
    if scan and len({spec.variant for spec in specs}) == 1:
        step = parts.step(specs[0])
        params = jax.tree.map(lambda x: x[0:n], parts.params["dense"])
        if shared:
            h, ys = jax.lax.scan(lambda h, p: step(h, (p, xs)), h, params)
        else:
            h, ys = jax.lax.scan(step, h, (params, jax.tree.map(lambda x: x[0:n], xs)))
        return h, lambda: ys
    outs = []
    for spec in specs:
        layer = (_at(parts.params["dense"], spec.index), xs) if shared else _at((parts.params["dense"], xs), spec.index)
        h, y = parts.step(spec)(h, layer)
        outs.append(y)
    return h, lambda: _stack(outs)


def _suffix(parts: _Parts, schedule: LayerSchedule, h: jax.Array, xs: dict[str, Any],
            shared: bool) -> tuple[jax.Array, dict[str, Any]]:
    """The layers after the last whole period, unrolled -> (h, per kind their y's stacked, or None)."""
    ys: dict[str, list] = {kind: [] for kind in KINDS}
    for spec in schedule.layers[schedule.suffix_start:]:
        params, x = parts.params[spec.kind], xs[spec.kind]
        layer = (_at(params, spec.index), x) if shared else _at((params, x), spec.index)
        h, y = parts.step(spec)(h, layer)
        ys[spec.kind].append(y)
    return h, {kind: _stack(ys[kind]) if ys[kind] else None for kind in KINDS}


def _period_fn(parts: _Parts, schedule: LayerSchedule, shared: bool) -> Callable:
    """The function of one period, (h, inputs) -> (h, y), as the scan and the pipeline run it.

    A `simple` schedule: the one layer's step, inputs (params, x). Otherwise inputs (dense params,
    dense xs, MoE params, MoE xs), each kind as `_groups` gives it (None: none), and y per kind
    (dense, MoE): the y's stacked for a grouped kind, the one y otherwise, None without that kind.
    `shared`: the xs are one value for every layer."""
    specs = schedule.period_specs
    if schedule.simple:
        return parts.step(specs[0])

    def period(h, inputs):
        stacked = {"dense": inputs[:2], "moe": inputs[2:]}
        ys: dict[str, list] = {kind: [] for kind in KINDS}
        for spec in specs:
            group, group_xs = stacked[spec.kind]
            if schedule.grouped(spec.kind):
                j = len(ys[spec.kind])
                layer = (_at(group, j), group_xs) if shared else _at((group, group_xs), j)
            else:
                layer = (group, group_xs)
            h, y = parts.step(spec)(h, layer)
            ys[spec.kind].append(y)
        return h, tuple((_stack(ys[k]) if schedule.grouped(k) else ys[k][0]) if ys[k] else None for k in KINDS)

    return period


def _groups(tree: Any, schedule: LayerSchedule, kind: Kind, leafwise: bool = False) -> Any:
    """A kind's leaves [L_kind, ...] -> its periods' part: [periods, per period, ...] when grouped,
    else [periods, ...] (None: none). Dense layers start after the prefix; suffix layers are left out.

    `leafwise` slices and reshapes each leaf in turn (the pipeline's order), else every slice
    then every reshape: the two orders the runners had, kept so the traced programs are unchanged."""
    per, periods = schedule.per_period(kind), schedule.periods
    if not per or tree is None:
        return None
    start = schedule.prefix if kind == "dense" else 0
    stop = start + per * periods
    if not schedule.grouped(kind):
        return tree if (start, stop) == (0, schedule.count(kind)) else jax.tree.map(lambda x: x[start:stop], tree)
    group = lambda x: x.reshape(periods, per, *x.shape[1:])  # noqa: E731
    if leafwise:
        return jax.tree.map(lambda x: group(x[start:stop]), tree)
    return jax.tree.map(group, jax.tree.map(lambda x: x[start:stop], tree))


def _period_inputs(parts: _Parts, schedule: LayerSchedule, xs: dict[str, Any], shared: bool = False,
                   leafwise: bool = False) -> tuple:
    """The periods' inputs as `_period_fn` takes them, stacked over periods (`shared`: xs as given)."""
    if schedule.simple:
        return parts.params["dense"], xs["dense"]
    group = lambda kind, tree: _groups(tree, schedule, kind, leafwise)  # noqa: E731
    return tuple(x for kind in KINDS
                 for x in (group(kind, parts.params[kind]), xs[kind] if shared else group(kind, xs[kind])))


# ---------------------------------------------------------------- the runner


def run(model: nnx.Module, h: jax.Array, dense_fn: LayerFn, moe_fn: LayerFn | None = None, *,
        xs: dict[str, Any] | None = None, remat: bool = False) -> tuple[jax.Array, dict[str, Any]]:
    """Every layer of `model` in schedule order -> (h, y's per stacked group, in its order).

    `xs` per group name (`layers`, `moe_layers`): per-layer inputs stacked like the params.
    `remat` applies the config's remat policy (training). A layer function gets its `LayerSpec`."""
    schedule, cfg = model.schedule, model.cfg
    xs = {kind: (xs or {}).get(STACKS[kind]) for kind in KINDS}
    parts = _parts(model, schedule, dense_fn, moe_fn, remat)
    period = _period_fn(parts, schedule, shared=False)
    inputs = _period_inputs(parts, schedule, xs)
    h, prefix_ys = _prefix(parts, schedule, h, xs["dense"], cfg.scan_layers, shared=False)
    if not schedule.periods:
        ys, prefix = None, prefix_ys()
    elif cfg.scan_layers:
        h, ys = jax.lax.scan(period, h, inputs)
        prefix = prefix_ys()
    else:
        outs = []
        for p in range(schedule.periods):
            h, out = period(h, _at(inputs, p))
            outs.append(out)
        prefix = prefix_ys()  # the prefix's y's stacked first, then the periods' (the traced order as before)
        ys = _stack(outs)
    h, suffix = _suffix(parts, schedule, h, xs, shared=False)
    if schedule.simple:
        return h, {"layers": ys}
    return h, _by_stack(schedule, prefix, ys, suffix)


def _by_stack(schedule: LayerSchedule, prefix_ys: Any, period_ys: Any, suffix_ys: dict[str, Any]) -> dict[str, Any]:
    """The y's per group, back in the order of its stack: the prefix's (dense), each period's, the suffix's."""
    period_ys = period_ys if period_ys is not None else (None, None)
    out = {}
    for kind, ys in zip(KINDS, period_ys, strict=True):
        if not schedule.count(kind):
            continue
        parts = [prefix_ys] if kind == "dense" and schedule.prefix else []
        if schedule.per_period(kind) and schedule.periods:
            parts.append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), ys) if schedule.grouped(kind) else ys)
        if suffix_ys[kind] is not None:
            parts.append(suffix_ys[kind])
        if kind == "moe" and len(parts) == 1:  # (a MoE model's only part: as before, no concatenation)
            out[STACKS[kind]] = parts[0]
        else:
            out[STACKS[kind]] = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if parts else None
    return out


def run_pipelined(model: nnx.Module, h: jax.Array, dense_fn: LayerFn, moe_fn: LayerFn | None, side: Any,
                  plan: ParallelPlan) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Training with the periods split over the plan's `stage` axis (sharding/pipeline.py).

    The dense prefix runs first, outside the pipeline (replicated over `stage`, like the
    embeddings); each period is one pipeline layer, run by the same period function as `run`.
    Per-row inputs travel as `side` (every layer's x) so the pipeline can split them into
    microbatches. MoE router statistics come out as sums over microbatches (`PARTIAL_STATS`),
    from which `merge_stats` rebuilds the whole batch's; a dense model returns no statistics.
    A schedule with a suffix (layers after the last whole period) is refused (jaxinfra/config.py
    refuses the config first)."""
    schedule, cfg = model.schedule, model.cfg
    if schedule.suffix_start != len(schedule.layers):
        raise ValueError(f"pipeline: {len(schedule.layers) - schedule.suffix_start} layers after the last whole "
                         f"period of {schedule.period} layers; the pipeline runs whole periods only")
    parts = _parts(model, schedule, dense_fn, moe_fn, remat=True)
    h, _ = _prefix(parts, schedule, h, side, cfg.scan_layers, shared=True)
    period = _period_fn(parts, schedule, shared=True)
    if not schedule.is_moe:
        stacked = parts.params["dense"] if schedule.simple else _groups(parts.params["dense"], schedule, "dense",
                                                                        leafwise=True)

        def layer(h, params, side):
            return period(h, (params, side) if schedule.simple else (params, side, None, None))[0]

        return pipeline.apply_layers(layer, h, stacked, side, plan=plan, scan_layers=cfg.scan_layers), {}

    def moe_period(h, params, side):
        dense, moe = params
        h, (_, y) = period(h, (dense, side, moe, side))
        return h, {k: y[k] for k in PARTIAL_STATS}

    stacked = (_groups(parts.params["dense"], schedule, "dense", leafwise=True),
               _groups(parts.params["moe"], schedule, "moe", leafwise=True))
    h, partial = pipeline.apply_layers(moe_period, h, stacked, side, plan=plan, scan_layers=cfg.scan_layers,
                                       with_stats=True)
    if schedule.grouped("moe"):  # [periods, MoE per period, ...] -> [MoE layers, ...]
        partial = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), partial)
    return h, merge_stats(partial, cfg.moe_top_k)
