"""The teacher: where it is, its own architecture, and its params on the student's mesh.

A teacher is a run directory (its newest readable checkpoint), one checkpoint step directory
(RUN/checkpoints/N) or an `hf import` output (a run directory holding params only). Its own
config.yaml gives its model section, which may differ from the student's in everything but the
vocabulary (an MLA or MoE teacher for a GQA student is fine). Its params are restored straight
into the shardings the student's sharding rules give the teacher's logical axes on the same
mesh, then cast to `distill.teacher_dtype`; they are an input of the train step, never part of
the TrainState, so the optimizer and the checkpoints never see them.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxinfra.checkpoint import CheckpointError, restore_params
from jaxinfra.config import Config, ConfigError, from_dict, load_yaml, validate
from jaxinfra.distill.config import DistillConfig
from jaxinfra.infer.loading import resolve_checkpoint
from jaxinfra.state import abstract_params, model_graphdef, tree_shardings
from models import ModelConfig
from sharding.rules import ShardingRules


@dataclasses.dataclass(frozen=True)
class TeacherSource:
    """A resolved teacher path: its run dir, checkpoints dir, pinned step (None: newest) and model."""

    path: str  # as given (distill.teacher or the save-logits argument)
    run_dir: pathlib.Path
    checkpoints: pathlib.Path
    step: int | None
    saved_model: ModelConfig  # as it was trained (the params' saved dtypes and shapes)

    def compute_model(self, dtype: str) -> ModelConfig:
        """The teacher's model as the distillation runs it: params and compute in `dtype`; its
        forward is never differentiated, so no remat."""
        return dataclasses.replace(self.saved_model, param_dtype=dtype, dtype=dtype, remat_policy="none")


def resolve_teacher(path: str, vocab_size: int | None = None, what: str = "distill.teacher") -> TeacherSource:
    """The teacher at `path`; CheckpointError (missing or unreadable) or ConfigError (another vocabulary)."""
    try:
        run_dir, checkpoints, step = resolve_checkpoint(path)
        tree = load_yaml(str(run_dir / "config.yaml"))
        model = from_dict(ModelConfig, tree.get("model", {}), "model")
    except (CheckpointError, ConfigError, OSError) as e:
        raise CheckpointError(f"{what}={path}: cannot use it as a teacher: {e}") from None
    for key, value, allowed in model.problems():
        raise CheckpointError(f"{what}={path}: its config.yaml has model.{key}={value!r}, which must be {allowed}")
    if not checkpoints.is_dir():
        raise CheckpointError(f"{what}={path}: no checkpoints directory at {checkpoints}")
    if vocab_size is not None and model.vocab_size != vocab_size:
        raise ConfigError(f"{what}={path} has model.vocab_size={model.vocab_size} but the student has "
                          f"model.vocab_size={vocab_size}: distillation needs one vocabulary")
    return TeacherSource(path, run_dir, checkpoints, step, model)


def check_teacher_fits(cfg: Config, model: ModelConfig, device_count: int) -> None:
    """The teacher's model against the student's mesh (heads, experts, widths that shard): one line."""
    probe = dataclasses.replace(cfg, model=dataclasses.replace(model, loss_chunk_size=0), distill=DistillConfig())
    try:
        validate(probe, device_count)
    except ConfigError as e:
        raise ConfigError(f"distill.teacher={cfg.distill.teacher} does not fit this run's mesh: {e}") from None


def teacher_shardings(model: ModelConfig, mesh: Mesh, rules: ShardingRules) -> Any:
    """NamedShardings of the teacher's params by the student's rules (the same logical names)."""
    return tree_shardings(abstract_params(model), mesh, rules.params)


def load_teacher_params(source: TeacherSource, dtype: str, mesh: Mesh, rules: ShardingRules,
                        step: int | None = None) -> tuple[int, nnx.State]:
    """(step, params) of the teacher restored onto `mesh` and cast to `dtype`; `step` pins one checkpoint."""
    target = abstract_params(source.saved_model, mesh, rules)
    pinned = source.step if step is None else step
    found, params = restore_params(source.checkpoints, target, step=pinned,
                                   config={"model": dataclasses.asdict(source.saved_model)})
    if all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(params)):
        return found, params
    shardings = jax.tree.map(lambda x: x.sharding, params)
    with jax.set_mesh(mesh):
        cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), p), out_shardings=shardings)
        return found, cast(params)


def teacher_graphdef(source: TeacherSource, dtype: str) -> nnx.GraphDef:
    return model_graphdef(source.compute_model(dtype))
