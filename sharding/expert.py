"""Expert parallelism: routed tokens travel to the devices holding their experts.

Experts are sharded over the `expert` mesh axis (logical axis `experts`), and the batch is
sharded over it too (see sharding/rules.py), so each device starts with its own tokens and
the experts they chose live elsewhere. Two exchanges, one per MoE dispatch path:

- `capacity_experts` (capacity path, GShard, Lepikhin et al. 2020): tokens arrive already
  packed into fixed per-expert slots [groups, experts, capacity, d]. Inside a `shard_map`
  manual over the batch's axes (data/fsdp/expert; context and tensor stay automatic), one `all_to_all`
  sends each expert's slots to its owner (splitting the expert dim, gathering the group
  dim), the expert FFN runs on local experts, and a second `all_to_all` brings results
  back. Equal-sized messages, works on every backend.

- `dropless_experts` (dropless path, MegaBlocks-style, Gale et al. 2022): each device sorts
  its (token, choice) pairs by expert; group sizes are all-gathered over `expert`; each
  device sends every peer exactly the rows for that peer's experts (`ragged_all_to_all`),
  sorts what it received by local expert, runs grouped matmuls (`jax.lax.ragged_dot`) and
  sends the rows back the same way. Manual over every mesh axis: FSDP-sharded expert
  weights are all-gathered inside (ZeRO-3), the expert hidden dim stays split over
  `tensor` (Megatron TP, one psum at the end). XLA:CPU has no ragged-all-to-all, so there
  the same offsets drive an exact emulation built from a padded `all_to_all` plus a
  scatter (logged once); the receive buffer is the worst case (every row to one device).

Without a mesh in the plan (`sharding.plan.single_device()`: unit tests, one device), or for
layouts these exchanges do not cover (logged), the same math runs under GSPMD alone.

Under pipeline parallelism (mesh.stage > 1) MoE layers run inside the pipeline's
`vmap(spmd_axis_name="stage")` (sharding/pipeline.py), which adds `stage` to both
shard_maps' specs: the capacity exchange is then manual over `stage` as well, and the
dropless one runs with `check_vma=False` (see there).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels.logs import log_once
from sharding.plan import ParallelPlan
from sharding.reductions import manual_reductions
from sharding.rules import logical_to_mesh

EXPERT = "expert"
STAGE = "stage"
TENSOR = "tensor"

logger = logging.getLogger(__name__)
_logged: set[str] = set()  # messages already logged (kernels.logs.log_once)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(names: Sequence[str | None], table, mesh: Mesh, shape: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    spec = logical_to_mesh(names, table, mesh, shape)
    return tuple(_axes(e) for e in tuple(spec) + (None,) * (len(shape) - len(spec)))


def _to_pspec(axes: Sequence[tuple[str, ...]]) -> P:
    return P(*[a[0] if len(a) == 1 else (a or None) for a in axes])


# ---------------------------------------------------------------- token permutation (local math)


def permute(rows: jax.Array, experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows of each (token, choice) pair sorted by expert [N*k, d], group sizes [E], sort order).

    experts: [N, k] ids; ids >= num_experts sort last and are not counted in any group."""
    k = experts.shape[-1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=0)
    return rows[order // k], sizes, order


def unpermute(y_sorted: jax.Array, order: jax.Array, gates: jax.Array) -> jax.Array:
    """Undo `permute` and sum each token's k expert outputs weighted by gates [N, k] -> [N, d]."""
    n, k = gates.shape
    inverse = jnp.argsort(order)
    y = y_sorted[inverse].reshape(n, k, -1)
    # A weighted sum of k rows per token (k <= 8), not a matmul: in float32, as elementwise work.
    return jnp.sum(y.astype(jnp.float32) * gates[..., None].astype(jnp.float32), axis=1).astype(y.dtype)


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


# ---------------------------------------------------------------- ragged exchange


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                               send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                               axis_name: str) -> jax.Array:
    """`jax.lax.ragged_all_to_all` (one slice per peer) from a padded `all_to_all` + scatter.

    Same arguments and result. Each slice is padded to the operand's length, so it moves
    axis_size x more bytes than the real collective: a fallback for backends without it."""
    m = operand.shape[0]
    r = jnp.arange(m)
    src = input_offsets[:, None] + r[None, :]  # [peers, m]
    chunks = jnp.where((r[None, :] < send_sizes[:, None])[..., None],
                       operand[jnp.clip(src, 0, m - 1)], jnp.zeros((), operand.dtype))
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [peers, m, ...] by sender
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # sender i's slice starts here
    dest = jnp.where(r[None, :] < recv_sizes[:, None], where[:, None] + r[None, :], output.shape[0])
    return output.at[dest.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


def _ragged_exchange(platform: str) -> Callable[..., jax.Array]:
    if platform == "cpu":
        log_once(logger, _logged, "expert parallelism (dropless): XLA:CPU does not implement ragged-all-to-all; "
                 "using an exact padded all_to_all emulation")
        return emulated_ragged_all_to_all
    return jax.lax.ragged_all_to_all


# ---------------------------------------------------------------- capacity path


def capacity_experts(x_e: jax.Array, weights: Sequence[jax.Array],
                     ffn: Callable[..., jax.Array], *, plan: ParallelPlan) -> jax.Array:
    """Run `ffn(x, *weights)` on capacity slots x_e [groups, experts, capacity, d].

    `ffn` maps [..., E, C, d] with weights [E, ...] to [..., E, C, d]. With an `expert`
    mesh axis (and the batch sharded over it), slots move to their experts' devices with
    `all_to_all` and back; otherwise GSPMD partitions the einsums."""
    if plan.mesh is None or plan.expert_size == 1:
        return ffn(x_e, *weights)
    mesh, rules = plan.mesh, plan.rules
    ep = plan.expert_size
    batch_axes = _spec(("batch",), rules.activations, mesh, x_e.shape[:1])[0]
    if EXPERT not in batch_axes:
        log_once(logger, _logged, f"expert parallelism (capacity): the batch is not sharded over '{EXPERT}' "
                 f"(batch -> {batch_axes}); leaving the expert dispatch to GSPMD")
        return ffn(x_e, *weights)
    g = x_e.shape[0]
    pos = batch_axes.index(EXPERT)
    before, after = batch_axes[:pos], batch_axes[pos + 1:]
    outer = math.prod(mesh.shape[a] for a in before)
    # Split the group dim as [outer, expert, inner] so the manual `expert` split is exactly
    # the existing batch sharding: no data moves on entry or exit.
    split = x_e.reshape(outer, ep, g // (outer * ep), *x_e.shape[1:])
    split = jax.lax.with_sharding_constraint(
        split, jax.sharding.NamedSharding(mesh, P(before or None, EXPERT, after or None)))
    e_dim = 3

    def body(x, *local_weights):
        x = jax.lax.all_to_all(x, EXPERT, split_axis=e_dim, concat_axis=1, tiled=True)  # [o, ep, i, E/ep, C, d]
        # Quantization scales span all experts and every batch shard (models/qdot.py).
        with manual_reductions({"experts": (EXPERT,), "batch": (*before, *after)}):
            y = ffn(x, *local_weights)
        return jax.lax.all_to_all(y, EXPERT, split_axis=1, concat_axis=e_dim, tiled=True)  # [o, 1, i, E, C, d]

    # The batch's other axes are manual too: left to GSPMD, it all-gathers the slots over them
    # around the all_to_all (every data shard's tokens exchanged and computed on every device).
    # Inside the pipeline (sharding/pipeline.py) this runs under a vmap with spmd_axis_name
    # `stage`, which adds `stage` to the specs: it must then be manual too (each stage's slice).
    manual = {EXPERT, *before, *after} | ({STAGE} if plan.pipelined else set())
    slots = P(before or None, EXPERT, after or None)
    out = jax.shard_map(body, mesh=mesh, axis_names=manual, in_specs=(slots,) + (P(EXPERT),) * len(weights),
                        out_specs=slots)(split, *weights)
    return out.reshape(x_e.shape)


# ---------------------------------------------------------------- dropless path


def dropless_experts(x: jax.Array, experts: jax.Array, gates: jax.Array, weights: Sequence[jax.Array],
                     weight_names: Sequence[Sequence[str]], grouped_ffn: Callable[..., jax.Array],
                     num_experts: int, *, plan: ParallelPlan) -> jax.Array:
    """Every (token, choice) pair through its expert, none dropped -> [B, T, d].

    x [B, T, d]; experts, gates [B, T, k]; weights [E, ...] with logical names
    `weight_names` (experts first, the hidden dim named "mlp"); `grouped_ffn(rows sorted by
    expert, group sizes, *weights)` is the per-expert FFN (rows past the groups: ignored)."""
    if plan.mesh is None:
        return _dropless_local(x, experts, gates, weights, grouped_ffn, num_experts)
    mesh = plan.mesh
    layout = _dropless_plan(x, weights, weight_names, mesh, plan.rules)
    if isinstance(layout, str):
        log_once(logger, _logged, f"expert parallelism (dropless): {layout}; leaving the expert dispatch to GSPMD")
        return _dropless_local(x, experts, gates, weights, grouped_ffn, num_experts)
    token_spec, weight_specs, gathers, tp = layout
    ep = plan.expert_size if any(EXPERT in s[0] for s in weight_specs) else 1
    exchange = _ragged_exchange(plan.platform) if ep > 1 else None
    # Which manual axes split the body's dims, for quantization scales (sharding/reductions.py): rows
    # (all the assignments) over the token axes, the expert hidden dim over `tensor`, experts over `expert`.
    splits = {"rows": tuple(sorted({a for e in token_spec for a in _axes(e)})), "mlp": (TENSOR,) if tp else (),
              "experts": (EXPERT,) if ep > 1 else ()}

    def body(x, experts, gates, *local):
        local = [_gather(w, axes) for w, axes in zip(local, gathers)]
        b, t, d = x.shape
        rows, ids, g = x.reshape(b * t, d), experts.reshape(b * t, -1), gates.reshape(b * t, -1)
        with manual_reductions(splits):
            if ep == 1:
                y = _dropless_local_rows(rows, ids, g, local, grouped_ffn, num_experts)
            else:
                y = _dropless_exchange(rows, ids, g, local, grouped_ffn, num_experts, ep, exchange)
        if tp:  # each tensor shard holds a slice of the hidden dim: partial sums
            y = jax.lax.psum(y, TENSOR)
        return y.reshape(b, t, d)

    # Inside the pipeline (a vmap with spmd_axis_name `stage`), jax 0.10's batching of the
    # varying-axes checks re-marks values already varying over `stage` (a pvary error), so the
    # check is off there; the body's collectives name their axes explicitly either way.
    return jax.shard_map(body, mesh=mesh, in_specs=(token_spec, token_spec, token_spec, *map(_to_pspec, weight_specs)),
                         out_specs=token_spec, check_vma=not plan.pipelined)(x, experts, gates, *weights)


def _dropless_plan(x, weights, weight_names, mesh: Mesh, rules):
    """(token spec, weight specs, axes to all-gather per weight dim, tensor-parallel?) or why not."""
    token_axes = _spec(("batch", "length", None), rules.activations, mesh, x.shape)
    token_varying = {a for axes in token_axes for a in axes}
    weight_specs, gathers, tp = [], [], False
    for w, names in zip(weights, weight_names):
        axes = _spec(names, rules.params, mesh, w.shape)
        gather = []
        for name, on in zip(names, axes):
            keep = (name == "experts" and on == (EXPERT,)) or (name == "mlp" and on == (TENSOR,))
            tp |= name == "mlp" and on == (TENSOR,)
            gather.append(() if keep else on)
            if name == "experts" and on not in ((), (EXPERT,)):
                return f"experts sharded over {on}, not '{EXPERT}'"
        missing = {a for g in gather for a in g} - token_varying
        if missing:
            return f"expert weights sharded over {sorted(missing)}, which the batch is not"
        weight_specs.append(axes)
        gathers.append(tuple(gather))
    if any(EXPERT in s[0] for s in weight_specs) and EXPERT not in token_varying:
        return f"the batch is not sharded over '{EXPERT}'"
    return _to_pspec(token_axes), weight_specs, gathers, tp


def _gather(w: jax.Array, axes_per_dim: Sequence[tuple[str, ...]]) -> jax.Array:
    """All-gather the dims of a weight that are sharded over data-parallel axes (ZeRO-3)."""
    for dim, axes in enumerate(axes_per_dim):
        if axes:
            w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def _dropless_local(x, experts, gates, weights, grouped_ffn, num_experts):
    b, t, d = x.shape
    y = _dropless_local_rows(x.reshape(b * t, d), experts.reshape(b * t, -1), gates.reshape(b * t, -1),
                             weights, grouped_ffn, num_experts)
    return y.reshape(b, t, d)


def _dropless_local_rows(rows, ids, gates, weights, grouped_ffn, num_experts):
    x_sorted, sizes, order = permute(rows, ids, num_experts)
    return unpermute(grouped_ffn(x_sorted, sizes, *weights), order, gates)


def _dropless_exchange(rows, ids, gates, local_weights, grouped_ffn, num_experts: int, ep: int, exchange):
    """Dropless expert parallelism for this device's rows (inside the manual shard_map)."""
    e_local = num_experts // ep
    me = jax.lax.axis_index(EXPERT)
    x_sorted, sizes, order = permute(rows, ids, num_experts)
    m = x_sorted.shape[0]
    all_sizes = jax.lax.all_gather(sizes, EXPERT)  # [ep, E]: every sender's rows per expert
    sent = all_sizes.reshape(ep, ep, e_local).sum(-1)  # sent[i, j]: rows sender i has for device j
    lands = _exclusive_cumsum(sent, 0)  # where sender i's rows start in receiver j's buffer
    starts = _exclusive_cumsum(sent, 1)  # where sender i's rows for j start in its own sorted rows
    received = exchange(x_sorted, jnp.zeros((ep * m, rows.shape[1]), rows.dtype), starts[me], sent[me],
                        lands[me], sent[:, me], axis_name=EXPERT)
    # Received rows are grouped by sender, then by local expert: regroup by local expert.
    mine = jax.lax.dynamic_slice_in_dim(all_sizes, me * e_local, e_local, axis=1)  # [ep, E/ep]
    ends = jnp.cumsum(mine.reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(ep * m), side="right")  # (sender, expert) block of each row
    local_expert = jnp.where(segment < ep * e_local, segment % e_local, e_local)  # past the data: last
    regroup = jnp.argsort(local_expert, stable=True)
    y = grouped_ffn(received[regroup], mine.sum(0), *local_weights)
    y = y[jnp.argsort(regroup)]
    back = exchange(y, jnp.zeros((m, rows.shape[1]), y.dtype), lands[:, me], sent[:, me], starts[:, me], sent[me],
                    axis_name=EXPERT)
    return unpermute(back, order, gates)
