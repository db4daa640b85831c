"""The token sums a distillation train step differentiates, chunked over the sequence.

Both modes return the plain cross-entropy sums (jaxinfra/loss.py) plus `soft_sum` and
`teacher_ce_sum`, mixed by `jaxinfra.distill.loss.mix`. The output projections run inside
`chunked_sums` (model.loss_chunk_size), so neither the student's nor the teacher's
[batch, length, vocab] float32 logits exist whole: only the hidden states do.

- online: the teacher's forward runs in the same jitted step on its own params (an extra step
  input, never differentiated: `stop_gradient` on its hidden states and logits);
- offline: the batch carries the teacher's top-k ids and logits and its per-token
  cross-entropy (`teacher_ids`, `teacher_values`, `teacher_ce`, from jaxinfra/distill/logits.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfra.config import Config, ConfigError
from jaxinfra.distill.config import DistillConfig
from jaxinfra.distill.loss import (
    alpha_and_temperature,
    mix,
    schedule_knobs,
    teacher_soft_loss_sum,
    top_k_soft_loss_sum,
)
from jaxinfra.loss import add_moe_sums, chunked_sums, cross_entropy_sums
from models import ModelConfig
from sharding.plan import SINGLE_DEVICE, ParallelPlan
from sharding.rules import ShardingRules

Batch = dict[str, jax.Array]
LOGIT_KEYS = ("teacher_ids", "teacher_values", "teacher_ce")  # what an offline batch adds


def _finish(sums: dict[str, jax.Array], alpha: jax.Array, stats: dict, cfg: ModelConfig) -> dict[str, jax.Array]:
    return add_moe_sums(mix(sums, alpha), stats, cfg.moe_aux_loss_weight, cfg.moe_z_loss_weight)


def online_loss_sums(graphdef: nnx.GraphDef, cfg: ModelConfig, teacher_def: nnx.GraphDef, dcfg: DistillConfig,
                     total_steps: int, plan: ParallelPlan = SINGLE_DEVICE) -> Callable[..., dict[str, jax.Array]]:
    """loss_sums(params, batch, step, teacher_params, knobs) for jaxinfra/step.py's train step
    (knobs: `jaxinfra.distill.loss.schedule_knobs`)."""

    def loss_sums(params: nnx.State, batch: Batch, step: jax.Array, teacher_params: nnx.State,
                  knobs: jax.Array) -> dict:
        alpha, temperature = alpha_and_temperature(knobs, dcfg.schedule, step, total_steps)
        student, teacher = nnx.merge(graphdef, params), nnx.merge(teacher_def, teacher_params)
        args = (batch["inputs"], batch["positions"], batch["segment_ids"])
        h, stats = student.hidden(*args, plan=plan)
        h_teacher = jax.lax.stop_gradient(teacher.hidden(*args, plan=plan)[0])

        def token_sums(h: jax.Array, h_teacher: jax.Array, targets: jax.Array, mask: jax.Array) -> dict:
            s = student.logits(h, plan=plan)
            t = jax.lax.stop_gradient(teacher.logits(h_teacher, plan=plan))
            sums = cross_entropy_sums(s, targets, mask, cfg.z_loss_weight)
            return {**sums, "soft_sum": teacher_soft_loss_sum(s, t, mask, temperature, dcfg.top_k),
                    "teacher_ce_sum": cross_entropy_sums(t, targets, mask)["ce_sum"]}

        sums = chunked_sums(token_sums, cfg.loss_chunk_size, h, h_teacher, batch["targets"], batch["segment_ids"] > 0)
        return _finish(sums, alpha, stats, cfg)

    return loss_sums


def offline_loss_sums(graphdef: nnx.GraphDef, cfg: ModelConfig, dcfg: DistillConfig, total_steps: int,
                      top_k: int, plan: ParallelPlan = SINGLE_DEVICE) -> Callable[..., dict[str, jax.Array]]:
    """loss_sums(params, batch, step, knobs) over a batch that carries the teacher's saved top-k
    logits; the first `top_k` of the saved (sorted, most likely first) are used."""

    def loss_sums(params: nnx.State, batch: Batch, step: jax.Array, knobs: jax.Array) -> dict:
        alpha, temperature = alpha_and_temperature(knobs, dcfg.schedule, step, total_steps)
        student = nnx.merge(graphdef, params)
        h, stats = student.hidden(batch["inputs"], batch["positions"], batch["segment_ids"], plan=plan)

        def token_sums(h: jax.Array, ids: jax.Array, values: jax.Array, teacher_ce: jax.Array,
                       targets: jax.Array, mask: jax.Array) -> dict:
            s = student.logits(h, plan=plan)
            sums = cross_entropy_sums(s, targets, mask, cfg.z_loss_weight)
            return {**sums, "soft_sum": top_k_soft_loss_sum(s, ids, values, mask, temperature),
                    "teacher_ce_sum": jnp.sum(jnp.where(mask, teacher_ce, 0.0))}

        sums = chunked_sums(token_sums, cfg.loss_chunk_size, h, batch["teacher_ids"][..., :top_k],
                            batch["teacher_values"][..., :top_k], batch["teacher_ce"], batch["targets"],
                            batch["segment_ids"] > 0)
        return _finish(sums, alpha, stats, cfg)

    return loss_sums


@dataclasses.dataclass
class DistillParts:
    """What build_runtime needs from the distill section: the step's loss and its extra inputs
    (online: the teacher's params, then the schedule knobs; offline: the knobs), and for online
    distillation the teacher (source, graph, params' shardings)."""

    loss_sums: Callable[..., dict[str, jax.Array]]
    input_shardings: tuple[Any, ...]  # of the step's extra inputs: (teacher params, knobs) or (knobs,)
    knobs: np.ndarray
    teacher: Any = None  # TeacherSource (online)
    teacher_def: nnx.GraphDef | None = None
    logits: Any = None  # LogitsDir (offline)

    def step_inputs(self, teacher_params: nnx.State | None = None) -> tuple[Any, ...]:
        """The train step's arguments after the batch (online: none until the teacher is loaded)."""
        if self.teacher is None:
            return (self.knobs,)
        return () if teacher_params is None else (teacher_params, self.knobs)


def distill_parts(cfg: Config, mesh: Mesh, rules: ShardingRules, graphdef: nnx.GraphDef,
                  plan: ParallelPlan = SINGLE_DEVICE) -> DistillParts:
    """Resolve the teacher or the logits directory (bad input: one line, before anything compiles)."""
    d = cfg.distill
    knobs, replicated = schedule_knobs(d), NamedSharding(mesh, PartitionSpec())
    if mesh.shape["stage"] > 1:
        raise ConfigError(f"distill with mesh.stage={mesh.shape['stage']} is not supported (pipeline stages)")
    if not d.online:
        from jaxinfra.distill.logits import LogitsDir

        logits = LogitsDir.open(d.logits)
        logits.check_run(cfg)
        k = d.top_k or logits.top_k
        return DistillParts(offline_loss_sums(graphdef, cfg.model, d, cfg.train.steps, k, plan), (replicated,), knobs,
                            logits=logits)
    from jaxinfra.distill.teacher import check_teacher_fits, resolve_teacher, teacher_graphdef, teacher_shardings

    source = resolve_teacher(d.teacher, cfg.model.vocab_size)
    check_teacher_fits(cfg, source.saved_model, mesh.size)
    teacher_def = teacher_graphdef(source, d.teacher_dtype)
    shardings = teacher_shardings(source.compute_model(d.teacher_dtype), mesh, rules)
    loss = online_loss_sums(graphdef, cfg.model, teacher_def, d, cfg.train.steps, plan)
    return DistillParts(loss, (shardings, replicated), knobs, teacher=source, teacher_def=teacher_def)
