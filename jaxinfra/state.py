"""TrainState created directly in its sharded layout: no device ever holds the whole model.

The model's variables split in two `nnx.State`s that keep their logical-axis metadata:
`params` (the `nnx.Param`s, what the optimizer trains) and `stats` (its `models.stat.Stat`s:
router bias, amax histories; updated by the step, never by the optimizer). Extensions keep
their own non-trainable state under `ext[name]` (jaxinfra/extensions.py). The optimizer is
plain optax over the params; its moment trees mirror them variable-for-variable, so the same
logical metadata shards params, gradients and optimizer state alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfra.config import ParallelismConfig
from models import ModelConfig, Transformer
from models.lora_config import NO_LORA, LoraConfig
from models.quant_config import NO_QUANT, QuantConfig
from models.stat import Stat
from sharding.rules import ShardingRules, Table, logical_to_mesh, rules_for


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    stats: nnx.State = dataclasses.field(default_factory=lambda: nnx.State({}))  # the model's Stats
    ext: dict[str, Any] = dataclasses.field(default_factory=dict)  # extensions' own state, by name


def model_state(state: TrainState) -> nnx.State:
    """The model's variables (params and stats in one State): what `nnx.merge(graphdef, ...)`,
    evaluation, inference and exports take."""
    return nnx.merge_state(state.params, state.stats)


def split_model_state(variables: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(params, stats) of a model's variables (the inverse of `model_state`)."""
    return nnx.split_state(variables, nnx.Param, Stat)


LORA_STREAM = 0x10A  # the adapters' init keys: the params key folded with this


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def model_graphdef(cfg: ModelConfig, quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA) -> nnx.GraphDef:
    """The model's static structure (with how its projections quantize and which carry LoRA adapters),
    from an abstract construction."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), quant, lora))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, Stat)
    return graphdef


def init_params(cfg: ModelConfig, rng: jax.Array, quant: QuantConfig = NO_QUANT,
                lora: LoraConfig = NO_LORA) -> nnx.State:
    """The model's variables, Params and Stats in one State (`split_model_state` separates them). LoRA
    adapters draw from their own stream, so the base weights are the same with or without them."""
    model = Transformer(cfg, nnx.Rngs(params=rng, lora=jax.random.fold_in(rng, LORA_STREAM)), quant, lora)
    _, variables, rest = nnx.split(model, (nnx.Param, Stat), ...)
    if jax.tree.leaves(rest):  # the train state only carries Params and Stats
        raise ValueError(f"model has state that is neither a Param nor a Stat, which training would drop: {rest}")
    return variables


def abstract_params(model_cfg: ModelConfig, mesh: Mesh | None = None, rules: ShardingRules | None = None,
                    quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA) -> nnx.State:
    """The model's variables' (params and stats) shapes, dtypes and logical metadata, unallocated.

    With a mesh every leaf is a ShapeDtypeStruct carrying its sharding on that mesh (by
    `rules.params`, replicated without rules): the target that Orbax restores into and that
    `jax.make_array_from_callback` builds. A 1-device mesh gives a single-device target.
    """
    abstract = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0), quant, lora))
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
    """Shardings of a (possibly abstract) TrainState: params, stats and extension state by the param
    table (logical metadata; replicated without), the optimizer state by its own."""
    return TrainState(step=NamedSharding(mesh, PartitionSpec()),
                      params=tree_shardings(state.params, mesh, rules.params),
                      opt_state=tree_shardings(state.opt_state, mesh, rules.opt_state),
                      stats=tree_shardings(state.stats, mesh, rules.params),
                      ext=tree_shardings(state.ext, mesh, rules.params))


InitExt = Callable[[nnx.State], dict[str, Any]]  # params -> extensions' state (jaxinfra/extensions.py)


def _init_fn(model_cfg: ModelConfig, tx: optax.GradientTransformation, quant: QuantConfig = NO_QUANT,
             init_ext: InitExt | None = None, trainable: Any = None, lora: LoraConfig = NO_LORA):
    def init(rng: jax.Array) -> TrainState:
        params, stats = split_model_state(init_params(model_cfg, rng, quant, lora))
        ext = init_ext(params) if init_ext is not None else {}
        # The optimizer holds moments for the trained params only (a frozen base has none).
        opt_state = tx.init(params if trainable is None else nnx.split_state(params, trainable, ...)[0])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, stats=stats, ext=ext)

    return init


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, quant: QuantConfig = NO_QUANT,
                   init_ext: InitExt | None = None, trainable: Any = None, lora: LoraConfig = NO_LORA) -> TrainState:
    """Shapes, dtypes and logical metadata of the TrainState, without allocating it (with LoRA: pass the
    adapters' filter as `trainable`, so the optimizer state holds only theirs)."""
    return jax.eval_shape(_init_fn(model_cfg, tx, quant, init_ext, trainable, lora), jax.random.key(0))


def create_train_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array,
                       mesh: Mesh, rules: ShardingRules, quant: QuantConfig = NO_QUANT,
                       init_ext: InitExt | None = None, trainable: Any = None,
                       lora: LoraConfig = NO_LORA) -> tuple[TrainState, Any]:
    """Initialise params, stats, extension state and optimizer state under jit, each shard on its own device.

    Returns (state, state_shardings). The shardings equal `shardings_for(abstract_state(...))`, which
    build_runtime computes once, before anything is allocated, for the jitted steps' in/out shardings.
    """
    init = _init_fn(model_cfg, tx, quant, init_ext, trainable, lora)
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
