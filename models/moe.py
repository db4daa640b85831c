"""Mixture-of-Experts feed-forward layer: router, routed SwiGLU experts, shared experts.

    y = sum_{i in top-k(x)} g_i(x) * FFN_i(x)  +  FFN_shared(x)

Routed experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al.
2021) are SwiGLU MLPs stored stacked on a leading `experts` axis. Shared experts
(DeepSeekMoE, Dai et al. 2024; DeepSeek-V2/V3) see every token; `moe_shared_experts` of
them are one SwiGLU of that many times the expert width, which is the same function.

Two dispatch paths, same routing:

* capacity (`moe_dispatch="capacity"`): each sequence is a group; every expert has
  C = ceil(capacity_factor * S * k / E) slots per group. Assignments claim slots in order
  of choice rank, then position (all first choices before any second choice, GShard
  Algorithm 1); those past C are dropped (the token keeps its residual) and counted.
  "Position" is the token's place in the original sequence, recovered from its
  (segment id, position) pair, so layouts that permute the sequence (ring attention's
  load balancing) drop exactly the same tokens. Dispatch and combine are one-hot einsums
  that XLA shards like any matmul.
* dropless (`moe_dispatch="dropless"`): (token, choice) pairs sorted by expert, grouped
  matmuls with `jax.lax.ragged_dot` (MegaBlocks, Gale et al. 2022). Nothing is dropped.

Expert parallelism (sharding/expert.py) moves tokens to their experts' devices in both.
Padding tokens (mask False) are never routed on the capacity path (they cannot take a
real token's slot) and are left out of every statistic.
"""

from __future__ import annotations

import math
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kernels import mixed
from models.config import ModelConfig
from models.layers import DTYPES, MLP, GatedActivation, param, zeros_bias
from models.lora_config import NO_LORA, LoraConfig
from models.project import (
    Adapted,
    Int8Weight,
    Projections,
    Weight,
    adapter_layout,
    matmul_of,
    prepare_weights,
    project,
    project_ragged,
    weight,
)
from models.quant_config import NO_QUANT, MatmulQuant, QuantConfig
from models.router import Router, router_losses
from sharding.expert import capacity_experts, dropless_experts
from sharding.plan import SINGLE_DEVICE, ParallelPlan

GATE_NAMES = ("experts", "embed", "mlp")
DOWN_NAMES = ("experts", "mlp", "embed")
BIAS_NAMES = ("experts", "mlp")  # gpt-oss's per-expert gate/up biases
SWIGLU = GatedActivation()  # silu(gate) * up


class MoE(nnx.Module):
    # weight -> (projection name, contracted dims): models/project.py prepare_weights
    PROJECTIONS: ClassVar[Projections] = {
        "w_gate": ("experts.gate", (-2,)), "w_up": ("experts.up", (-2,)), "w_down": ("experts.down", (-2,))}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA):
        e, d, f, std = cfg.moe_num_experts, cfg.d_model, cfg.expert_dim, cfg.init_std
        self.router = Router(cfg, rngs, quant)
        self.w_gate = param(rngs, (e, d, f), GATE_NAMES, std, cfg.param_dtype)
        self.w_up = param(rngs, (e, d, f), GATE_NAMES, std, cfg.param_dtype)
        # Residual-branch output scaled down with depth, as the dense MLP's w_down.
        self.w_down = param(rngs, (e, f, d), DOWN_NAMES, std / math.sqrt(2 * cfg.num_layers), cfg.param_dtype)
        if cfg.moe_expert_bias:  # gpt-oss (Bias params: no weight decay)
            self.b_gate = zeros_bias((e, f), BIAS_NAMES, cfg.param_dtype)
            self.b_up = zeros_bias((e, f), BIAS_NAMES, cfg.param_dtype)
            self.b_down = zeros_bias((e, d), ("experts", "embed"), cfg.param_dtype)
        if cfg.moe_shared_experts:
            self.shared = MLP(cfg, rngs, width=cfg.moe_shared_experts * f, quant=quant, lora=lora)
        self.act = GatedActivation.of(cfg)
        self.cfg = cfg
        prepare_weights(self, quant, self.PROJECTIONS, DTYPES[cfg.dtype], lora, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, order: jax.Array | None = None, *,
                 plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, d], mask [B, T] -> (y [B, T, d], per-layer statistics).

        order [B, T]: per row, the indices of its tokens in original sequence order (the
        capacity path's slot priority); None: the array order.

        Statistics: counts [E] (assignments per expert), dropped (assignments dropped
        for capacity), aux_loss, z_loss (see models/router.py), and the additive sums the
        losses are built from (`PARTIAL_STATS`: prob_sum [E], z_sum, tokens), so that a
        caller that split the batch can rebuild the whole batch's losses (`merge_stats`)."""
        cfg, dt = self.cfg, self.dtype
        b, t, d = x.shape
        k = cfg.moe_top_k
        routing = self.router(x.reshape(b * t, d), mask.reshape(b * t))
        experts, gates = routing.experts.reshape(b, t, k), routing.weights.reshape(b, t, k)
        # Float weights enter the expert exchange in the compute dtype (gathers move half the bytes in
        # bfloat16); int8-stored ones as they are. Flat leaves: an Int8Weight is two arrays.
        weights = [_exchanged(w, dt) for w in map(partial(weight, self), ATTRS)]
        weights += [self.b_gate[...].astype(dt), self.b_up[...].astype(dt)] if cfg.moe_expert_bias else []
        leaves, treedef = jax.tree.flatten(weights)
        matmuls = tuple(matmul_of(self, a) for a in ATTRS)
        if cfg.moe_dispatch == "capacity":
            capacity = expert_capacity(t, k, cfg.moe_num_experts, cfg.moe_capacity_factor)
            dispatch, combine, dropped = capacity_assignment(experts, gates, mask, cfg.moe_num_experts, capacity,
                                                             order)
            x_e = mixed.einsum("gsec,gsd->gecd", dispatch, x, dtype=dt)
            ffn = partial(_unflattened, partial(expert_swiglu, act=self.act), treedef, matmuls, dt)
            y_e = capacity_experts(x_e, leaves, ffn, plan=plan)
            y = mixed.einsum("gsec,gecd->gsd", combine, y_e, dtype=dt)
            kept = jnp.sum(combine, axis=-1) if cfg.moe_expert_bias else None  # [B, T, E]: kept assignments' weights
        else:
            kinds = (GATE_NAMES, GATE_NAMES, DOWN_NAMES, BIAS_NAMES, BIAS_NAMES)
            names = jax.tree.leaves([_names(w, n) for w, n in zip(weights, kinds)],
                                    is_leaf=lambda n: isinstance(n, tuple) and not isinstance(n, (Int8Weight, Adapted)))
            y = dropless_experts(x, experts, gates, leaves, names,
                                 partial(_unflattened, partial(grouped_swiglu, act=self.act), treedef, matmuls, dt,
                                         ragged=True),
                                 cfg.moe_num_experts, plan=plan)
            dropped = jnp.zeros((), jnp.float32)
            kept = jnp.einsum("btke,btk->bte", jax.nn.one_hot(experts, cfg.moe_num_experts, dtype=jnp.float32),
                              gates.astype(jnp.float32)) if cfg.moe_expert_bias else None
        if cfg.moe_expert_bias:  # the down bias, weighted like its expert's output: added here, outside the
            # expert exchange, where no tensor-parallel partial sum would count it once per shard
            y = y + mixed.einsum("bte,ed->btd", kept, self.b_down[...], dtype=dt)
        if cfg.moe_shared_experts:
            y = y + self.shared(x, plan=plan)
        stats = {"counts": routing.counts, "dropped": dropped, "aux_loss": routing.aux_loss,
                 "z_loss": routing.z_loss, "prob_sum": routing.prob_sum, "z_sum": routing.z_sum,
                 "tokens": routing.tokens}
        return y.astype(x.dtype), stats


# The per-layer statistics Transformer.forward() returns (it keeps only these of a MoE call's
# output); aux_loss and z_loss are not sums, so they cannot be added over parts of a batch.
MOE_STATS = ("counts", "dropped", "aux_loss", "z_loss")
# The statistics that do add up: the pipelined forward sums these over microbatches and
# `merge_stats` rebuilds MOE_STATS of the whole batch from them.
PARTIAL_STATS = ("counts", "dropped", "prob_sum", "z_sum", "tokens")


def merge_stats(partial: dict[str, jax.Array], top_k: int) -> dict[str, jax.Array]:
    """Per-layer statistics (counts, dropped, aux_loss, z_loss) from `PARTIAL_STATS` summed over
    the parts of a batch: the same values as one MoE call on the whole batch."""
    aux, z = router_losses(partial["counts"], partial["prob_sum"], partial["z_sum"], partial["tokens"], top_k)
    return {"counts": partial["counts"], "dropped": partial["dropped"], "aux_loss": aux, "z_loss": z}


def expert_capacity(tokens_per_group: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots per expert per group: ceil(factor * tokens * k / E), at least 1."""
    return max(1, math.ceil(factor * tokens_per_group * top_k / num_experts))


def capacity_assignment(experts: jax.Array, gates: jax.Array, mask: jax.Array, num_experts: int,
                        capacity: int, order: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard slot assignment per group.

    experts, gates [G, S, k]; mask [G, S]; order [G, S] the tokens' priority order within
    the group (None: as stored). Returns dispatch [G, S, E, C] (0/1), combine [G, S, E, C]
    (gate weight in the token's slot) and the number of real assignments dropped because
    their expert was full."""
    g, s, k = experts.shape
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32) * mask[..., None, None].astype(jnp.int32)
    ranked = chosen if order is None else jnp.take_along_axis(chosen, order[:, :, None, None], axis=1)
    # Priority: choice rank first, then token order, so a second choice never displaces a first.
    by_rank = ranked.transpose(0, 2, 1, 3).reshape(g, k * s, num_experts)
    slot = (jnp.cumsum(by_rank, axis=1) - 1).reshape(g, k, s, num_experts).transpose(0, 2, 1, 3)
    slot = jnp.sum(slot * ranked, axis=-1)  # [G, S, k]: the slot each assignment asks for, in `order`
    if order is not None:  # back to storage order
        slot = jnp.take_along_axis(slot, jnp.argsort(order, axis=1)[:, :, None], axis=1)
    kept = (jnp.sum(chosen, axis=-1) > 0) & (slot < capacity)
    in_slot = jax.nn.one_hot(jnp.where(kept, slot, capacity), capacity, dtype=jnp.float32)  # dropped: all-zero
    expert_hot = chosen.astype(jnp.float32)
    dispatch = jnp.einsum("gske,gskc->gsec", expert_hot, in_slot)
    combine = jnp.einsum("gske,gskc->gsec", expert_hot * gates[..., None].astype(jnp.float32), in_slot)
    dropped = jnp.sum(chosen) - jnp.sum(kept)
    return dispatch, combine, dropped.astype(jnp.float32)


ATTRS = ("w_gate", "w_up", "w_down")


def _exchanged(w: Weight, dtype) -> Weight:
    """A weight as it enters the expert exchange: float arrays (adapters too) in the compute dtype."""
    if isinstance(w, Adapted):
        return Adapted(_exchanged(w.base, dtype), w.a.astype(dtype), w.b.astype(dtype))
    return w if isinstance(w, Int8Weight) else w.astype(dtype)


def _names(w: Weight, names: tuple[str, ...]) -> tuple | Int8Weight | Adapted:
    """Logical names of a weight's arrays: a scale has None where it is reduced (size 1); adapters'
    as models/project.py gives them (A: batch and contracted dims + None, B: batch + None + output)."""
    if isinstance(w, Adapted):
        batch, axes, out = adapter_layout(names, names, (-2,))
        return Adapted(_names(w.base, names), tuple(names[i] for i in batch + axes) + (None,),
                       tuple(names[i] for i in batch) + (None,) + tuple(names[i] for i in out))
    if not isinstance(w, Int8Weight):
        return names
    return Int8Weight(names, tuple(n if s == v else None for n, s, v in zip(names, w.scale.shape, w.values.shape)))


def _unflattened(ffn, treedef, matmuls: tuple[MatmulQuant, ...], dtype, x: jax.Array, *leaves: jax.Array,
                 ragged: bool = False) -> jax.Array:
    """The expert FFN on leaves flattened for the exchange (sharding/expert.py): rebuilds the weights."""
    if ragged:
        group_sizes, *leaves = leaves
        return ffn(matmuls, dtype, x, group_sizes, *jax.tree.unflatten(treedef, leaves))
    return ffn(matmuls, dtype, x, *jax.tree.unflatten(treedef, leaves))


def expert_swiglu(matmuls: tuple[MatmulQuant, ...], dtype, x: jax.Array, w_gate: Weight, w_up: Weight,
                  w_down: Weight, b_gate: jax.Array | None = None, b_up: jax.Array | None = None, *,
                  act: GatedActivation = SWIGLU) -> jax.Array:
    """Per-expert SwiGLU on slots x [..., E, C, d] with weights [E, d, f], [E, d, f], [E, f, d] and optional
    gate/up biases [E, f] (the down bias is the caller's: models/moe.py MoE.__call__)."""
    x_names = ("batch",) * (x.ndim - 3) + ("experts", None, "embed")  # leading dims: groups of the batch
    h_names = x_names[:-1] + ("mlp",)
    gate = project("...ecd,edf->...ecf", x, w_gate, matmuls[0], dtype=dtype, names=(x_names, GATE_NAMES))
    up = project("...ecd,edf->...ecf", x, w_up, matmuls[1], dtype=dtype, names=(x_names, GATE_NAMES))
    if b_gate is not None:
        gate, up = gate + b_gate[:, None, :], up + b_up[:, None, :]
    hidden = checkpoint_name(act(gate, up), "mlp_hidden")
    return project("...ecf,efd->...ecd", hidden, w_down, matmuls[2], dtype=dtype, names=(h_names, DOWN_NAMES))


def grouped_swiglu(matmuls: tuple[MatmulQuant, ...], dtype, rows: jax.Array, group_sizes: jax.Array,
                   w_gate: Weight, w_up: Weight, w_down: Weight, b_gate: jax.Array | None = None,
                   b_up: jax.Array | None = None, *, act: GatedActivation = SWIGLU) -> jax.Array:
    """SwiGLU of rows sorted by expert [M, d]: rows of group e use expert e's weights (and gate/up biases [E, f]).

    Grouped matmuls (`jax.lax.ragged_dot`); rows past sum(group_sizes) give 0."""
    gate = project_ragged(rows, w_gate, group_sizes, matmuls[0], dtype=dtype, names=(("rows", "embed"), GATE_NAMES))
    up = project_ragged(rows, w_up, group_sizes, matmuls[1], dtype=dtype, names=(("rows", "embed"), GATE_NAMES))
    if b_gate is not None:  # each row's expert from the group sizes; rows past the groups: the last expert's
        # bias, harmless, since the down projection gives those rows 0
        ids = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right")
        ids = jnp.minimum(ids, group_sizes.shape[0] - 1)
        gate, up = gate + b_gate[ids], up + b_up[ids]
    hidden = checkpoint_name(act(gate, up), "mlp_hidden")
    return project_ragged(hidden, w_down, group_sizes, matmuls[2], dtype=dtype, names=(("rows", "mlp"), DOWN_NAMES))
