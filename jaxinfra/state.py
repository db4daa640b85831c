"""TrainState created directly in its sharded layout: no device ever holds the whole model.

The model's parameters live in an `nnx.State` (a pytree of `nnx.Param`
variables that keep their logical-axis metadata); the optimizer is plain optax.
Optax's moment trees mirror the params tree variable-for-variable, so the same
logical metadata shards params, gradients and optimizer state alike.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import ModelConfig, Transformer
from sharding.rules import LogicalRules, logical_to_mesh


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def model_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """The model's static structure, from an abstract (shape-only) construction."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract, nnx.Param)
    return graphdef


def init_params(cfg: ModelConfig, rng: jax.Array) -> nnx.State:
    model = Transformer(cfg, nnx.Rngs(params=rng))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):  # the step function only carries Params
        raise ValueError(f"model has non-Param state that training would drop: {rest}")
    return params


def shardings_for(tree: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """NamedSharding for every leaf: variables by their logical axes, anything else replicated."""

    def one(x: Any) -> Any:
        if _is_variable(x):
            names = x.get_metadata().get("out_sharding") or (None,) * x.ndim
            return x.replace(NamedSharding(mesh, logical_to_mesh(names, rules, mesh)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def create_train_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array,
                       mesh: Mesh, rules: LogicalRules) -> tuple[TrainState, Any]:
    """Initialise params + optimizer state under jit, each shard created on its own device.

    Returns (state, state_shardings); the shardings are reused as the step's in/out shardings.
    """

    def init(rng: jax.Array) -> TrainState:
        params = init_params(model_cfg, rng)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    abstract = jax.eval_shape(init, rng)
    state_shardings = shardings_for(abstract, mesh, rules)
    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=state_shardings)(rng)
    return state, state_shardings


def bytes_per_device(tree: Any) -> int:
    """Bytes this process's first device holds for `tree` (from the arrays' actual shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.addressable_shards[0]
        total += shard.data.size * shard.data.dtype.itemsize
    return total
