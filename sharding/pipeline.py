"""Pipeline parallelism: the stacked layers split into stages on the `stage` mesh axis.

The model calls `apply_layers(layer, h, stacked, side, plan=plan)` where it would otherwise
loop over its stacked layers; with `mesh.stage == 1` (`plan.pipelined` false) the model does
not call it at all, so the non-pipelined path is unchanged.

SPMD formulation (no per-stage programs): every device runs the same program. The
activations in flight form a stage-sharded circular buffer `[S, micro, length, embed]`;
each tick every stage applies its own layer chunk to its slot (`jax.vmap` over the
stage dimension with `spmd_axis_name="stage"`, so the per-stage work is sharded over
`stage` and the batch/embed/heads dimensions inside keep their logical shardings over
data/fsdp/tensor), then the buffer is rotated by one stage (`jnp.roll` on the
stage-sharded dimension, which XLA lowers to a collective-permute, i.e. ppermute).

Schedules (`parallelism.pipeline_schedule`), S stages, M microbatches, R repeats:

- `gpipe` (Huang et al. 2019, "GPipe"): all M microbatches forward, then all backward
  by autodiff through the tick loop. Stage s holds layers [s L/S, (s+1) L/S). Activation
  memory grows with M (every tick's stage inputs are kept for the backward).
- `circular` (the interleaved schedule of Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM"): the layers are cut into
  S R chunks and stage s holds the non-adjacent chunks s, s+S, ..., s+(R-1)S. A
  microbatch goes round the ring R times; microbatches enter in groups of S so that the
  output of the last stage arrives at stage 0 exactly when its next chunk is due (hence
  M must be a multiple of S). Backward by autodiff, as for gpipe.
- `1f1b` (PipeDream-Flush, Narayanan et al. 2019 "PipeDream" / 2021 "Memory-Efficient
  Pipeline-Parallel DNN Training"): a `jax.custom_vjp` around the pipelined stack. Its
  forward runs the pipeline and keeps no activations (only its inputs); its backward
  runs the one-forward-one-backward schedule: each tick every stage does one forward
  (re-running its chunk, stashing the chunk input) and one backward (the VJP of its
  chunk on a stashed input, recomputing the chunk's forward inside the VJP). Microbatch
  m's forward is at stage s at tick m+s, its backward at tick m+2S-2-s, so stage s
  keeps 2(S-s)-1 stashed inputs: the stash is bounded by the number of stages
  (2S-1 slots in the lockstep SPMD form), not by M. Costs one extra forward (as full
  rematerialisation does) in exchange for memory independent of M.

Bubble (idle fraction of a stage's ticks): (S-1) / (R M + S - 1) with R=1 for gpipe
and 1f1b (`bubble_fraction`).

Placement: embeddings, the final norm and the output head run outside the pipeline
like any other layer: their weights are not split over `stage` (so replicated over it),
and every stage group computes them on its data shard. Only the stacked `layers` are
split over `stage`: the `layers` logical axis maps to `stage` in the parameter and
optimizer tables (sharding/rules.py). Under `circular` with R > 1 the stored (contiguous)
layer order does not match the interleaved placement, so XLA moves the chunks into place
each step (one all-to-all of the layer weights); the checkpoint format is unchanged.

Per-layer statistics (`apply_layers(..., with_stats=True)`, used by MoE models whose
pipeline layers are MoE periods): each layer also returns a pytree of additive statistics
(router counts, loss sums); each tick emits every stage's chunk stats with bubble slots
zeroed (a slot with no microbatch still computes, on a clipped index), and after the tick
loop they are summed per (stage, round) and returned in layer order. Gradients flow
through them: by autodiff for gpipe/circular, and for 1f1b the custom VJP feeds their
cotangent (the same for every microbatch, since they are sums) to each chunk's VJP.

Microbatching: microbatch m holds rows m, m+M, m+2M, ... of the (per-accumulation-step)
batch, so a batch sharded in contiguous blocks over data/fsdp splits without moving
data. The loss is a token sum, so gradient accumulation over microbatches is exact
(gpipe/circular: autodiff sums over ticks; 1f1b: explicit sums of per-microbatch VJPs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.config import PipelineSettings, Schedule  # noqa: F401 - jax-free, re-exported
from sharding.rules import logical_to_mesh

if TYPE_CHECKING:
    from sharding.plan import ParallelPlan

STAGE = "stage"

# layer(h [micro, length, embed], one layer's params, side inputs of this microbatch) -> h
# (or -> (h, stats) with apply_layers(..., with_stats=True))
Layer = Callable[[jax.Array, Any, Any], Any]


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Analytic idle fraction (S-1)/(R M + S - 1) of a synchronous pipeline."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


# ---------------------------------------------------------------- schedule tables


def forward_tables(stages: int, micro: int, repeats: int) -> dict[str, np.ndarray]:
    """Static schedule of the forward pipeline (gpipe: repeats=1, circular: repeats>1).

    For tick t and stage s: the microbatch `mb[t, s]`, the repeat (chunk round) `rep[t, s]`
    and whether the slot holds real work `valid[t, s]`; `fresh[t]`: stage 0 takes a new
    microbatch `mb[t, 0]` (instead of the buffer); `out_tick[m]`: the tick at which the
    last stage finishes microbatch m's last chunk.
    """
    group = stages if repeats > 1 else micro
    ticks = repeats * micro + stages - 1
    t = np.arange(ticks)[:, None]
    s = np.arange(stages)[None, :]
    u = t - s
    valid = (u >= 0) & (u < repeats * micro)
    u = np.clip(u, 0, repeats * micro - 1)
    w = u % (repeats * group)
    rep, mb = w // group, (u // (repeats * group)) * group + w % group
    fresh = valid[:, 0] & (rep[:, 0] == 0)
    out_tick = np.zeros(micro, np.int32)
    for tick in range(ticks):
        if valid[tick, -1] and rep[tick, -1] == repeats - 1:
            out_tick[mb[tick, -1]] = tick
    return {"mb": mb.astype(np.int32), "rep": rep.astype(np.int32), "valid": valid, "fresh": fresh,
            "out_tick": out_tick}


def one_f_one_b_tables(stages: int, micro: int) -> dict[str, np.ndarray]:
    """Static 1F1B schedule: forward of m at stage s at tick m+s, backward at m+2S-2-s."""
    ticks = micro + 2 * stages - 2
    t = np.arange(ticks)[:, None]
    s = np.arange(stages)[None, :]
    f, b = t - s, t - (2 * stages - 2 - s)
    return {"f": np.clip(f, 0, micro - 1).astype(np.int32), "f_valid": (f >= 0) & (f < micro),
            "b": np.clip(b, 0, micro - 1).astype(np.int32), "b_valid": (b >= 0) & (b < micro),
            "in_tick": np.arange(micro, dtype=np.int32) + 2 * stages - 2}


def stash_slots(stages: int) -> int:
    """Stage inputs a 1F1B stage keeps alive at most (stage 0: 2S-1)."""
    return 2 * stages - 1


# ---------------------------------------------------------------- helpers


def _constrain(plan: ParallelPlan, x: jax.Array, names: tuple[str | None, ...],
               stage_dim: int | None = None) -> jax.Array:
    mesh = plan.mesh
    spec = list(logical_to_mesh(names, plan.rules.activations, mesh, x.shape))
    spec += [None] * (x.ndim - len(spec))
    if stage_dim is not None:
        spec[stage_dim] = STAGE
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _split_micro(x: jax.Array, micro: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...], microbatch m = rows m, m+M, ... (block batch sharding stays put)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // micro, micro, *x.shape[1:]), 0, 1)


def _merge_micro(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _stage_params(stacked: Any, stages: int, repeats: int) -> Any:
    """Leaves [L, ...] -> [S, R, L/(S R), ...]: stage s, round r holds chunk r S + s."""

    def one(x: jax.Array) -> jax.Array:
        chunk = x.shape[0] // (stages * repeats)
        x = x.reshape(repeats, stages, chunk, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(one, stacked)


def _chunk_fn(layer: Callable, scan_layers: bool) -> Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]:
    """Apply one chunk of layers (leaves [L/(S R), ...]) to one microbatch.

    `layer` returns (h, stats); the chunk returns (h, stats stacked over its layers)."""

    def run(chunk: Any, h: jax.Array, side: Any) -> tuple[jax.Array, Any]:
        if scan_layers:
            return jax.lax.scan(lambda h, p: layer(h, p, side), h, chunk)
        outs = []
        for i in range(jax.tree.leaves(chunk)[0].shape[0]):
            h, out = layer(h, jax.tree.map(lambda x, i=i: x[i], chunk), side)
            outs.append(out)
        return h, jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    return run


def _unstage(acc: Any) -> Any:
    """Inverse of `_stage_params`: leaves [S, R, chunk, ...] -> [L, ...] in layer order."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[3:]), acc)


def _pick(tree: Any, index: jax.Array | int) -> Any:
    return jax.tree.map(lambda x: x[index], tree)


# ---------------------------------------------------------------- forward pipeline


def _pipeline_forward(plan: ParallelPlan, run: Callable, staged: Any, x: jax.Array, side: Any, stages: int,
                      repeats: int) -> tuple[jax.Array, Any]:
    """gpipe / circular forward: x [M, micro, T, D] -> ([M, micro, T, D], per-layer stats summed
    over the M microbatches, leaves [L, ...]). Bubble slots (no microbatch) add nothing."""
    micro = x.shape[0]
    tab = forward_tables(stages, micro, repeats)
    act = (None, "batch", "residual_length", "embed")
    stage_ids = jnp.arange(stages)

    def stage_step(params_s: Any, rep: jax.Array, h: jax.Array, side_s: Any) -> tuple[jax.Array, Any]:
        chunk = _pick(params_s, 0 if repeats == 1 else rep)
        return run(chunk, h, side_s)

    step = jax.vmap(stage_step, spmd_axis_name=STAGE)

    def tick(buf: jax.Array, xs: tuple) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        mb, rep, fresh, valid = xs
        new = x[mb[0]]
        buf = jnp.where(((stage_ids == 0) & fresh)[:, None, None, None], new[None], buf)
        buf = _constrain(plan, buf, act, stage_dim=0)
        out, stats = step(staged, rep, buf, _pick(side, mb))
        out = _constrain(plan, out, act, stage_dim=0)
        # Bubble slots (no microbatch) computed on a clipped index: their stats are zeroed.
        stats = jax.tree.map(lambda st: jnp.where(valid.reshape(-1, *([1] * (st.ndim - 1))), st,
                                                  jnp.zeros((), st.dtype)), stats)
        last = out[stages - 1]
        return _constrain(plan, jnp.roll(out, 1, axis=0), act, stage_dim=0), (last, stats)

    buf = _constrain(plan, jnp.zeros((stages, *x.shape[1:]), x.dtype), act, stage_dim=0)
    xs = (jnp.asarray(tab["mb"]), jnp.asarray(tab["rep"]), jnp.asarray(tab["fresh"]), jnp.asarray(tab["valid"]))
    _, (lasts, stats) = jax.lax.scan(tick, buf, xs)
    # Per-tick stats [ticks, S, chunk, ...] -> sums per (stage, round) [S, R, chunk, ...] -> layer order.
    rounds = jnp.asarray(np.eye(repeats, dtype=np.float32)[tab["rep"]])  # [ticks, S, R], static

    def per_round(st: jax.Array) -> jax.Array:
        onehot = rounds.reshape(*rounds.shape, *([1] * (st.ndim - 2))).astype(st.dtype)
        return jnp.sum(st[:, :, None] * onehot, axis=0)

    return lasts[jnp.asarray(tab["out_tick"])], _unstage(jax.tree.map(per_round, stats))


# ---------------------------------------------------------------- 1F1B


def _one_f_one_b(plan: ParallelPlan, run: Callable, stages: int) -> Callable:
    """custom_vjp pipelined stack whose backward runs the 1F1B schedule (see module doc)."""
    act = (None, "batch", "residual_length", "embed")
    stage_ids = jnp.arange(stages)
    slots = stash_slots(stages)

    @jax.custom_vjp
    def stack(staged: Any, x: jax.Array, side: Any) -> tuple[jax.Array, Any]:
        return _pipeline_forward(plan, run, staged, x, side, stages, 1)

    def fwd(staged: Any, x: jax.Array, side: Any) -> tuple[tuple[jax.Array, Any], tuple]:
        return stack(staged, x, side), (staged, x, side)

    def bwd(res: tuple, cotangents: tuple) -> tuple:
        staged, x, side = res
        dy, d_stats = cotangents  # d_stats [L, ...]: the same for every microbatch (stats are sums)
        d_stats = jax.tree.map(lambda d: d[:, 0], _stage_params(d_stats, stages, 1))  # [S, chunk, ...]
        micro = x.shape[0]
        tab = one_f_one_b_tables(stages, micro)

        def stage_tick(params_s, h_in, stash_s, f, f_ok, b, b_ok, g_in, side_f, side_b, d_stats_s):
            chunk = _pick(params_s, 0)
            y, _ = run(chunk, h_in, side_f)
            stash_s = jnp.where(f_ok, stash_s.at[f % slots].set(h_in), stash_s)
            h_saved = stash_s[b % slots]
            _, vjp = jax.vjp(lambda p, h: run(p, h, side_b), chunk, h_saved)
            g = jnp.where(b_ok, g_in, jnp.zeros_like(g_in))
            g_stats = jax.tree.map(lambda d: jnp.where(b_ok, d, jnp.zeros_like(d)), d_stats_s)
            d_chunk, d_h = vjp((g, g_stats))
            d_chunk = jax.tree.map(lambda d: jnp.where(b_ok, d, jnp.zeros_like(d)), d_chunk)
            return y, stash_s, d_chunk, jnp.where(b_ok, d_h, jnp.zeros_like(d_h))

        step = jax.vmap(stage_tick, spmd_axis_name=STAGE)

        def tick(carry: tuple, xs: tuple) -> tuple[tuple, jax.Array]:
            fbuf, bbuf, stash, grads = carry
            f, f_ok, b, b_ok = xs
            h_in = jnp.where((stage_ids == 0)[:, None, None, None], x[f[0]][None], fbuf)
            g_in = jnp.where((stage_ids == stages - 1)[:, None, None, None], dy[b[stages - 1]][None], bbuf)
            h_in, g_in = _constrain(plan, h_in, act, 0), _constrain(plan, g_in, act, 0)
            y, stash, d_chunk, d_h = step(staged, h_in, stash, f, f_ok, b, b_ok, g_in,
                                          _pick(side, f), _pick(side, b), d_stats)
            grads = jax.tree.map(lambda acc, d: acc + d[:, None], grads, d_chunk)
            fbuf = _constrain(plan, jnp.roll(y, 1, axis=0), act, 0)
            bbuf = _constrain(plan, jnp.roll(d_h, -1, axis=0), act, 0)
            return (fbuf, bbuf, stash, grads), d_h[0]

        zeros = _constrain(plan, jnp.zeros((stages, *x.shape[1:]), x.dtype), act, 0)
        stash = jnp.zeros((stages, slots, *x.shape[1:]), x.dtype)
        stash = _constrain(plan, stash, (None, None, "batch", "residual_length", "embed"), 0)
        grads = jax.tree.map(jnp.zeros_like, staged)
        xs = tuple(jnp.asarray(tab[k]) for k in ("f", "f_valid", "b", "b_valid"))
        (_, _, _, grads), d_first = jax.lax.scan(tick, (zeros, zeros, stash, grads), xs)
        return grads, d_first[jnp.asarray(tab["in_tick"])], None

    stack.defvjp(fwd, bwd)
    return stack


# ---------------------------------------------------------------- entry point


def apply_layers(layer: Callable, h: jax.Array, stacked: Any, side: Any, *, plan: ParallelPlan,
                 scan_layers: bool = True, with_stats: bool = False) -> Any:
    """Run the stacked layers on h [batch, length, embed] as a pipeline over `stage`.

    `layer(h, layer_params, side)` applies one layer to one microbatch; `stacked` holds
    every layer's params on a leading axis; `side` is a pytree of per-row inputs
    ([batch, ...] arrays, e.g. positions and segment ids) split along with h.

    With `with_stats`, `layer` returns (h, stats) with `stats` a pytree of float arrays
    that add up over microbatches (e.g. MoE router counts and loss sums); the result is
    then (h, stats summed over microbatches, leaves [layers, ...]), bubble slots excluded,
    and differentiable in every schedule.

    `plan` gives the mesh (its `stage` axis: the stage count) and the schedule's settings.
    """
    stages = plan.stages
    settings = plan.pipeline or PipelineSettings()
    micro, repeats = settings.resolved(stages)
    layers = jax.tree.leaves(stacked)[0].shape[0]
    if layers % (stages * repeats) or h.shape[0] % micro:
        raise ValueError(f"pipeline: {layers} layers / (stages {stages} x repeats {repeats}) or batch "
                         f"{h.shape[0]} / microbatches {micro} does not divide")
    if not with_stats:
        plain = layer
        layer = lambda h, p, s: (plain(h, p, s), ())  # noqa: E731
    run = _chunk_fn(layer, scan_layers)
    staged = _stage_params(stacked, stages, repeats)
    staged = jax.tree.map(lambda p: _constrain_param(plan, p), staged)
    x = _constrain(plan, _split_micro(h, micro), (None, "batch", "residual_length", "embed"))
    side = jax.tree.map(lambda a: _split_micro(a, micro), side)
    if settings.schedule == "1f1b":
        y, stats = _one_f_one_b(plan, run, stages)(staged, x, side)
    else:
        y, stats = _pipeline_forward(plan, run, staged, x, side, stages, repeats)
    y = _merge_micro(y)
    return (y, stats) if with_stats else y


def _constrain_param(plan: ParallelPlan, p: jax.Array) -> jax.Array:
    """Staged layer weights [S, R, chunk, ...]: S on `stage`, the rest left to the compiler."""
    mesh = plan.mesh
    spec = P(STAGE, *([P.UNCONSTRAINED] * (p.ndim - 1)))
    return jax.lax.with_sharding_constraint(p, NamedSharding(mesh, spec))
