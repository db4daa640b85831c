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

from jaxinfra.config import ParallelismConfig
from models import ModelConfig, Transformer
from models.quant_config import NO_QUANT, QuantConfig
from sharding.rules import ShardingRules, Table, logical_to_mesh, rules_for


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def model_graphdef(cfg: ModelConfig, quant: QuantConfig = NO_QUANT) -> nnx.GraphDef:
    """The model's static structure (with how its projections quantize), from an abstract construction."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), quant))
    graphdef, _ = nnx.split(abstract, nnx.Param)
    return graphdef


def init_params(cfg: ModelConfig, rng: jax.Array, quant: QuantConfig = NO_QUANT) -> nnx.State:
    model = Transformer(cfg, nnx.Rngs(params=rng), quant)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):  # the step function only carries Params
        raise ValueError(f"model has non-Param state that training would drop: {rest}")
    return params


def abstract_params(model_cfg: ModelConfig, mesh: Mesh | None = None, rules: ShardingRules | None = None,
                    quant: QuantConfig = NO_QUANT) -> nnx.State:
    """The params' shapes, dtypes and logical metadata, without allocating them.

    With a mesh every leaf is a ShapeDtypeStruct carrying its sharding on that mesh (by
    `rules.params`, replicated without rules): the target that Orbax restores into and that
    `jax.make_array_from_callback` builds. A 1-device mesh gives a single-device target.
    """
    abstract = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0), quant))
    if mesh is None:
        return abstract
    if rules is None:
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract)
    else:
        shardings = tree_shardings(abstract, mesh, rules.params)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def sharding_rules(parallelism: ParallelismConfig) -> ShardingRules:
    """The config's parallelism section -> sharding tables."""
    return rules_for(parallelism.strategy, sequence_parallel=parallelism.sequence_parallel,
                     context_impl=parallelism.context_impl, load_balance=parallelism.load_balance,
                     overrides=parallelism.rules)


def tree_shardings(tree: Any, mesh: Mesh, table: Table) -> Any:
    """NamedSharding for every leaf: variables by their logical axes, anything else replicated."""

    def one(x: Any) -> Any:
        if _is_variable(x):
            names = x.get_metadata().get("out_sharding") or (None,) * x.ndim
            return x.replace(NamedSharding(mesh, logical_to_mesh(names, table, mesh, x.shape)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def shardings_for(state: TrainState, mesh: Mesh, rules: ShardingRules) -> TrainState:
    """Shardings of a (possibly abstract) TrainState: params and optimizer state by their own tables."""
    return TrainState(step=NamedSharding(mesh, PartitionSpec()),
                      params=tree_shardings(state.params, mesh, rules.params),
                      opt_state=tree_shardings(state.opt_state, mesh, rules.opt_state))


def _init_fn(model_cfg: ModelConfig, tx: optax.GradientTransformation, quant: QuantConfig = NO_QUANT):
    def init(rng: jax.Array) -> TrainState:
        params = init_params(model_cfg, rng, quant)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return init


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation,
                   quant: QuantConfig = NO_QUANT) -> TrainState:
    """Shapes, dtypes and logical metadata of the TrainState, without allocating it."""
    return jax.eval_shape(_init_fn(model_cfg, tx, quant), jax.random.key(0))


def create_train_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array,
                       mesh: Mesh, rules: ShardingRules, quant: QuantConfig = NO_QUANT) -> tuple[TrainState, Any]:
    """Initialise params + optimizer state under jit, each shard created on its own device.

    Returns (state, state_shardings); the shardings are reused as the step's in/out shardings.
    """
    init = _init_fn(model_cfg, tx, quant)
    state_shardings = shardings_for(jax.eval_shape(init, rng), mesh, rules)
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
