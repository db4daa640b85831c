"""Distillation as a step extension (jaxinfra/extensions.py): the teacher's logits join the loss.

- frozen step inputs: online, the teacher's params (restored onto the student's mesh by the same
  rules, in `teacher_dtype`; never differentiated, never in the TrainState), then the schedule
  knobs (jaxinfra/distill/loss.py schedule_knobs); offline, the knobs alone;
- extra batch fields (offline): the saved top-k ids, logits and teacher cross-entropy per token
  (jaxinfra/distill/logits.py), this process's rows of each step;
- loss terms: inside the loss chunks (jaxinfra/loss.py chunked_sums), `soft_sum` and
  `teacher_ce_sum` beside the cross-entropy (jaxinfra/distill/step.py), mixed into the objective
  as `loss_sum + alpha * (soft - CE)` (alpha = 0: the plain step bit for bit);
- metrics `distill_soft_loss, distill_hard_loss, teacher_loss` (and `loss` becomes the mixed loss),
  eval field `teacher_eval_loss`, checkpoint meta: which teacher (and step) or logits directory.

`start(host, meta)`: online, restore the teacher's params (on resume, the checkpoint's teacher step,
so a teacher run that trained on meanwhile does not swap teachers silently) and evaluate it once on
the held-out batches; offline, read that figure from the logits directory's meta.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfra.config import Config, ConfigError
from jaxinfra.distill.loss import alpha_and_temperature, mix, schedule_knobs
from jaxinfra.distill.step import offline_token_sums, online_token_sums
from jaxinfra.extensions import HostContext, StepContext, StepExtension
from jaxinfra.step import make_eval_step


def for_config(cfg: Config) -> StepExtension | None:
    """The `jaxinfra.extensions` entry point (pyproject.toml): distillation when `distill` is on."""
    return Distillation(cfg) if cfg.distill.enabled else None


class Distillation(StepExtension):
    name = "distill"
    metric_names = ("distill_soft_loss", "distill_hard_loss", "teacher_loss")

    def __init__(self, cfg: Config):
        self.cfg, self.dcfg = cfg, cfg.distill
        self.knobs = schedule_knobs(self.dcfg)
        self.teacher = self.teacher_def = self.logits = None  # TeacherSource, its graph (online); LogitsDir
        self.teacher_params: nnx.State | None = None
        self.teacher_step: int | None = None
        self.teacher_eval_loss: float | None = None
        self.top_k = self.dcfg.top_k
        self.host: HostContext | None = None

    def setup(self, rt: Any) -> None:
        """Resolve the teacher or the logits directory (bad input: one line, before anything compiles)."""
        d, mesh = self.dcfg, rt.mesh
        self.replicated = NamedSharding(mesh, PartitionSpec())
        if mesh.shape["stage"] > 1:
            raise ConfigError(f"distill with mesh.stage={mesh.shape['stage']} is not supported (pipeline stages)")
        if not d.online:
            from jaxinfra.distill.logits import LogitsDir

            self.logits = LogitsDir.open(d.logits)
            self.logits.check_run(self.cfg)
            self.top_k = d.top_k or self.logits.top_k
            return
        from jaxinfra.distill.teacher import check_teacher_fits, resolve_teacher, teacher_graphdef, teacher_shardings

        self.teacher = resolve_teacher(d.teacher, self.cfg.model.vocab_size)
        check_teacher_fits(self.cfg, self.teacher.saved_model, mesh.size)
        self.teacher_def = teacher_graphdef(self.teacher, d.teacher_dtype)
        self.teacher_shardings = teacher_shardings(self.teacher.compute_model(d.teacher_dtype), mesh, rt.rules)

    # ---------------------------------------------------------------- host side

    def inputs(self) -> tuple:
        """(teacher params, knobs) online (the knobs alone until `start` loads the teacher), (knobs,) offline."""
        if self.teacher is None or self.teacher_params is None:
            return (self.knobs,)
        return self.teacher_params, self.knobs

    def input_shardings(self) -> tuple:
        return (self.replicated,) if self.teacher is None else (self.teacher_shardings, self.replicated)

    def abstract_inputs(self) -> tuple:
        """The inputs as ShapeDtypeStructs with their shardings (the teacher's in teacher_dtype)."""
        from jaxinfra.state import abstract_params

        knobs = jax.ShapeDtypeStruct(self.knobs.shape, self.knobs.dtype, sharding=self.replicated)
        if self.teacher is None:
            return (knobs,)
        teacher = abstract_params(self.teacher.compute_model(self.dcfg.teacher_dtype))
        teacher = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), teacher,
                               self.teacher_shardings)
        return teacher, knobs

    def batch_specs(self, shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
        """Offline: the saved top-k ids and logits and the teacher's cross-entropy per token."""
        if self.logits is None:
            return {}
        k, ids = self.top_k, np.uint16 if self.cfg.model.vocab_size <= 2**16 else np.int32
        return {"teacher_ids": jax.ShapeDtypeStruct((*shape, k), ids),
                "teacher_values": jax.ShapeDtypeStruct((*shape, k), np.float32),
                "teacher_ce": jax.ShapeDtypeStruct(shape, np.float32)}

    def start(self, host: HostContext, meta: dict[str, Any]) -> list[str]:
        self.host = host
        if self.logits is not None:
            self.teacher_eval_loss = self.logits.meta.get("teacher_eval_loss")
            return []
        from jaxinfra.distill.teacher import load_teacher_params

        saved = meta.get("distill", {})
        pinned = saved.get("teacher_step") if saved.get("teacher") == self.dcfg.teacher else None
        notes = []
        if saved.get("teacher") and pinned is None:
            notes.append(f"jaxinfra: note: this run was distilled from {saved['teacher']} (step "
                         f"{saved.get('teacher_step')}); it continues from distill.teacher={self.dcfg.teacher}")
        rt = host.rt
        self.teacher_step, self.teacher_params = load_teacher_params(self.teacher, self.dcfg.teacher_dtype, rt.mesh,
                                                                     rt.rules, step=pinned)
        if host.eval_batches:
            step = jax.jit(make_eval_step(self.teacher_def, self.teacher.compute_model(self.dcfg.teacher_dtype),
                                          rt.plan),
                           in_shardings=(self.teacher_shardings, rt.batch_sharding), out_shardings=self.replicated)
            ce, tokens = rt.eval_sums(self.teacher_params, host.eval_batches, step)
            self.teacher_eval_loss = ce / max(tokens, 1.0)
        notes.append(f"jaxinfra: distilling from {self.dcfg.teacher} step {self.teacher_step} "
                     f"(teacher_eval_loss {self.teacher_eval_loss})")
        return notes

    def host_batch(self, local: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        if self.logits is None:
            return {}
        return self.logits.rows(step, self.host.first_row, self.host.rows, local)

    def checkpoint_meta(self) -> dict[str, Any]:
        if self.logits is not None:
            return {"logits": self.dcfg.logits, "logits_teacher": self.logits.meta.get("teacher")}
        return {"teacher": self.dcfg.teacher, "teacher_step": self.teacher_step}

    def eval_fields(self) -> dict[str, float]:
        return {} if self.teacher_eval_loss is None else {"teacher_eval_loss": self.teacher_eval_loss}

    # ---------------------------------------------------------------- traced

    def _knobs(self, ctx: StepContext) -> tuple[jax.Array, jax.Array]:
        return alpha_and_temperature(ctx.inputs[-1], self.dcfg.schedule, ctx.step, self.cfg.train.steps)

    def per_token(self, ctx: StepContext, hidden: jax.Array) -> tuple[jax.Array, ...]:
        b = ctx.batch
        if self.logits is not None:
            return b["teacher_ids"][..., :self.top_k], b["teacher_values"][..., :self.top_k], b["teacher_ce"]
        teacher = nnx.merge(self.teacher_def, ctx.inputs[0])
        return (jax.lax.stop_gradient(teacher.hidden(b["inputs"], b["positions"], b["segment_ids"], plan=ctx.plan)[0]),)

    def token_sums(self, ctx: StepContext, logits: jax.Array, per_token: tuple[jax.Array, ...],
                   targets: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
        _, temperature = self._knobs(ctx)
        if self.logits is not None:
            return offline_token_sums(logits, *per_token, mask, temperature)
        teacher = nnx.merge(self.teacher_def, ctx.inputs[0])
        teacher_logits = teacher.logits(per_token[0], plan=ctx.plan)
        return online_token_sums(logits, teacher_logits, targets, mask, temperature, self.dcfg.top_k)

    def objective(self, ctx: StepContext, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        alpha, _ = self._knobs(ctx)
        return mix(sums, alpha)

    def metrics(self, sums: dict[str, jax.Array], tokens: jax.Array) -> dict[str, jax.Array]:
        return {k: v / tokens for k, v in sums["means"].items()}
