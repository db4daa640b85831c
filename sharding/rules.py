"""Logical axis names -> mesh axes. The only place that knows both vocabularies.

Models annotate parameters and activations with logical names (`batch`,
`embed`, `heads`, ...). A rule maps each name to a tuple of mesh axes. When a
mesh axis is already used by an earlier dimension of the same array it is
skipped, so activations [batch, length, embed] shard the batch over
(data, fsdp) while the weights [embed, mlp] shard embed over fsdp: one table
serves both (the same convention as MaxText's logical_axis_rules).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = Mapping[str, tuple[str, ...]]

# ZeRO-3 / FSDP with Megatron-style tensor parallelism on `tensor`:
# params, grads and optimizer state are sharded over fsdp (gathered per layer by XLA),
# attention heads and the MLP hidden dimension over tensor.
FSDP_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "length": (),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": (),
    "norm": (),
}

STRATEGIES: dict[str, dict[str, tuple[str, ...]]] = {"fsdp": FSDP_RULES}


def rules_for(strategy: str) -> LogicalRules:
    if strategy not in STRATEGIES:
        raise ValueError(f"parallelism.strategy={strategy!r}: choose one of {sorted(STRATEGIES)}")
    return dict(STRATEGIES[strategy])


def logical_to_mesh(names: Sequence[str | None], rules: LogicalRules, mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `names`.

    Mesh axes of size 1 are dropped (they shard nothing) so specs print cleanly.
    """
    used: set[str] = set()
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        axes = tuple(a for a in rules[name]
                     if a not in used and (mesh is None or mesh.shape[a] > 1))
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


_ACTIVE: contextvars.ContextVar[tuple[Mesh, LogicalRules] | None] = contextvars.ContextVar(
    "jaxinfra_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """While tracing inside this context, `constrain` pins activations to the mesh."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside `activation_sharding`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_mesh(names, rules, mesh)))
