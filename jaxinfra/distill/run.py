"""What the train loop (jaxinfra/train.py) asks of a distillation run.

- `start(meta)`: online, restore the teacher's params onto the run's mesh (on resume, the
  checkpoint's teacher step, so a teacher run that trained on meanwhile does not swap teachers
  silently) and evaluate it once on the held-out batches; offline, read that figure from the
  logits directory's meta.
- `host_batch(local, step)`: offline, this process's rows of the step's saved teacher logits.
- `checkpoint_meta()`: which teacher (path, step) or logits directory the student learns from.
- `eval_fields()`: `teacher_eval_loss` for each eval line (the teacher is frozen: one figure).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfra.distill.teacher import load_teacher_params
from jaxinfra.runtime import Runtime
from jaxinfra.step import make_eval_step


class DistillRun:
    def __init__(self, rt: Runtime, eval_batches: list[dict[str, np.ndarray]], first_row: int, rows: int):
        self.rt, self.parts, self.cfg = rt, rt.distill, rt.cfg.distill
        self.eval_batches, self.first_row, self.rows = eval_batches, first_row, rows
        self.teacher_step: int | None = None
        self.teacher_eval_loss: float | None = None

    def start(self, meta: dict[str, Any]) -> list[str]:
        """Load what the steps need; returns notes for the log."""
        if self.parts.logits is not None:
            self.teacher_eval_loss = self.parts.logits.meta.get("teacher_eval_loss")
            return []
        saved = meta.get("distill", {})
        pinned = saved.get("teacher_step") if saved.get("teacher") == self.cfg.teacher else None
        notes = []
        if saved.get("teacher") and pinned is None:
            notes.append(f"jaxinfra: note: this run was distilled from {saved['teacher']} (step "
                         f"{saved.get('teacher_step')}); it continues from distill.teacher={self.cfg.teacher}")
        rt = self.rt
        self.teacher_step, params = load_teacher_params(self.parts.teacher, self.cfg.teacher_dtype, rt.mesh,
                                                        rt.rules, step=pinned)
        rt.step_inputs = self.parts.step_inputs(params)
        if self.eval_batches:
            model = self.parts.teacher.compute_model(self.cfg.teacher_dtype)
            step = jax.jit(make_eval_step(self.parts.teacher_def, model, rt.plan),
                           in_shardings=(self.parts.input_shardings[0], rt.batch_sharding),
                           out_shardings=NamedSharding(rt.mesh, PartitionSpec()))
            ce, tokens = rt.eval_sums(params, self.eval_batches, step)
            self.teacher_eval_loss = ce / max(tokens, 1.0)
        notes.append(f"jaxinfra: distilling from {self.cfg.teacher} step {self.teacher_step} "
                     f"(teacher_eval_loss {self.teacher_eval_loss})")
        return notes

    def host_batch(self, local: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        logits = self.parts.logits
        if logits is None:
            return local
        return {**local, **logits.rows(step, self.first_row, self.rows, local)}

    def checkpoint_meta(self) -> dict[str, Any]:
        if self.parts.logits is not None:
            return {"logits": self.cfg.logits, "logits_teacher": self.parts.logits.meta.get("teacher")}
        return {"teacher": self.cfg.teacher, "teacher_step": self.teacher_step}

    def eval_fields(self) -> dict[str, float]:
        return {} if self.teacher_eval_loss is None else {"teacher_eval_loss": self.teacher_eval_loss}
