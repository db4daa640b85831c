"""Logical axis names -> mesh axes. The only place that knows both vocabularies.

Models annotate parameters and activations with logical names (`batch`,
`embed`, `heads`, ...). A strategy is three tables, one each for parameters,
optimizer state and activations, mapping each name to a tuple of mesh axes:

    strategy  params                   optimizer state            (ZeRO stage)
    dp        replicated over data     replicated                 -
    zero1     replicated over data     sharded over data, fsdp    ZeRO-1
    fsdp      sharded over fsdp        sharded over fsdp          ZeRO-3 (= FSDP)

In every strategy, Megatron tensor parallelism puts attention heads, the MLP
hidden dimension and the vocabulary on `tensor`, and activations shard their
batch over (data, fsdp, expert) and their sequence over `context`. With
`sequence_parallel`, the residual stream between blocks (norms, residual adds)
is also split over `tensor` along the sequence (Korthikanti et al. 2022).

Expert parallelism: MoE expert weights (logical `experts`) are split over `expert`,
and the batch is sharded over `expert` too, as MaxText does: outside the MoE layers
the `expert` axis is one more data-parallel axis (attention, dense MLPs and the router
run on each device's own rows, their weights replicated over it), and inside them
sharding/expert.py sends each token to its experts' devices and back with all-to-all.
Without the batch split, every device of an expert group would hold the same tokens
and repeat all the non-expert work. So the batch must divide by data x fsdp x expert.
MLA's low-rank latents (`q_lora`, `kv_lora`) are replicated: they are narrow, and
sharding them would split the RMSNorm that follows each.

A mesh axis already used by an earlier dimension of the same array is skipped,
and, when the array's shape is known, a mesh axis that does not divide the
dimension is dropped (so 2 KV heads stay replicated under tensor=8, the usual
GQA practice). The config validation rejects the layouts where dropping would
hide a mistake (heads, MLP width, batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import get_args

from jax.sharding import Mesh, PartitionSpec

from sharding.config import ContextImpl, Strategy  # jax-free names: the run config embeds them

Table = Mapping[str, tuple[str, ...]]

STRATEGIES: tuple[str, ...] = get_args(Strategy)
CONTEXT_IMPLS: tuple[str, ...] = get_args(ContextImpl)

_TENSOR: dict[str, tuple[str, ...]] = {
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "head_dim": (),
    "layers": ("stage",),  # stacked layers: pipeline stages (a no-op while mesh.stage == 1)
    "experts": ("expert",),  # MoE expert weights: expert parallelism
    "q_lora": (),  # MLA query latent
    "kv_lora": (),  # MLA key/value latent
}

_ACTIVATIONS: dict[str, tuple[str, ...]] = {
    **_TENSOR,
    "batch": ("data", "fsdp", "expert"),
    "length": ("context",),  # queries (and K/V under ring attention) split along the sequence
    "kv_length": (),  # all-gather context parallelism: every device sees all keys
    "residual_length": ("context",),  # the residual stream between blocks
    "rows": ("data", "fsdp", "expert", "context"),  # batch*length flattened for 2-D matmuls
    "embed": (),
    "norm": (),
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """One strategy's three tables; `strategy` and `sequence_parallel` are for display."""

    params: Table
    opt_state: Table
    activations: Table
    strategy: str = "fsdp"
    sequence_parallel: bool = False
    context_impl: str = "allgather"  # or "ring" (see sharding/context.py)
    load_balance: bool = True  # ring only: reorder sequence chunks for causal balance

    def describe(self) -> str:
        zero = {"dp": "no ZeRO: params and optimizer state replicated over data/fsdp",
                "zero1": "ZeRO-1: optimizer state sharded over data+fsdp, params replicated",
                "fsdp": "ZeRO-3/FSDP: params, grads and optimizer state sharded over fsdp"}[self.strategy]
        sp = ", sequence-parallel norms on tensor" if self.sequence_parallel else ""
        cp = f", context parallel: {self.context_impl}"
        return f"{self.strategy} ({zero}; Megatron TP on tensor{sp}{cp})"


def rules_for(strategy: str = "fsdp", *, sequence_parallel: bool = False, context_impl: str = "allgather",
              load_balance: bool = True, overrides: Mapping[str, Sequence[str]] | None = None) -> ShardingRules:
    """The tables of a named strategy; `overrides` replaces entries in all three tables."""
    if strategy not in STRATEGIES:
        raise ValueError(f"parallelism.strategy={strategy!r}: choose one of {list(STRATEGIES)}")
    replicated = {**_TENSOR, "embed": (), "norm": ()}
    # Norm scales stay replicated even under FSDP: they are tiny, and a sharded scale
    # multiplying batch-sharded activations makes GSPMD reshard the activations instead.
    sharded = {**_TENSOR, "embed": ("fsdp",), "norm": ()}
    zero1 = {**_TENSOR, "embed": ("data", "fsdp"), "norm": ("data", "fsdp")}
    params, opt_state = {"dp": (replicated, replicated), "zero1": (replicated, zero1),
                         "fsdp": (sharded, sharded)}[strategy]
    activations = dict(_ACTIVATIONS)
    if sequence_parallel:
        activations["residual_length"] = ("context", "tensor")
    tables = [dict(params), dict(opt_state), activations]
    for name, axes in (overrides or {}).items():
        for table in tables:
            table[name] = tuple(axes)
    if context_impl not in CONTEXT_IMPLS:
        raise ValueError(f"parallelism.context_impl={context_impl!r}: choose one of {list(CONTEXT_IMPLS)}")
    return ShardingRules(*tables, strategy=strategy, sequence_parallel=sequence_parallel,
                         context_impl=context_impl, load_balance=load_balance)


def logical_to_mesh(names: Sequence[str | None], table: Table, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `names`.

    Mesh axes of size 1 are dropped (they shard nothing), as are axes already used
    by an earlier dimension and, given `shape`, axes that do not divide the dimension.
    """
    used: set[str] = set()
    out = []
    for dim, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
        axes: list[str] = []
        split = 1
        for axis in table[name]:
            size = mesh.shape[axis] if mesh is not None else 1
            if axis in used or (mesh is not None and size == 1):
                continue
            if shape is not None and shape[dim] % (split * size):
                continue
            axes.append(axis)
            split *= size
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (tuple(axes) or None))
    return PartitionSpec(*out)
