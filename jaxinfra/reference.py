"""The frozen reference policy of preference and RL training (DPO, GRPO): a second, untrained copy
of the policy that the loss compares against.

Three modes, one interface (`hidden`, `logits`, the frozen step inputs):

- a path (`dpo.reference` / `grpo.reference`): a run directory (its newest checkpoint),
  RUN/checkpoints/N or an `hf import` output. Its own config.yaml must describe the policy's
  architecture (the same parameter shapes; another d_model, depth or vocabulary is refused in one
  line). Its params are restored straight into the shardings the run's rules give them on the
  run's mesh, in the run's model param dtype (jaxinfra/distill/teacher.py: the teacher's loader),
  and are a frozen step input: never differentiated, never in the TrainState, never checkpointed;
- null: the checkpoint the run starts from (`--restore PATH`, or the run directory itself when it
  is a params-only import such as `hf import`); its path and step go into the checkpoint meta, so
  a resume reloads exactly that one. A fresh random start has no such checkpoint: refused;
- null with LoRA (`lora.rank > 0`): the base model with the adapters off. No second copy: the
  reference forward is the policy's own model with every `LoraB` zeroed (x A 0 adds exactly 0 to
  the base's output), under `stop_gradient`; no step inputs at all.

The owning extension gives `hidden`/`logits` a StepContext whose `inputs` are this reference's
`inputs()` (an extension with more frozen inputs passes `dataclasses.replace(ctx, inputs=...)`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxinfra.checkpoint import CheckpointError, is_params_only
from jaxinfra.config import Config, ConfigError
from jaxinfra.extensions import HostContext, StepContext
from models import ModelConfig
from models.project import LoraB

# ModelConfig fields that do not change the params' shapes (so a reference may differ in them).
_COMPUTE_FIELDS = ("dtype", "param_dtype", "remat_policy", "loss_chunk_size", "attention_impl", "scan_layers",
                   "moe_dispatch")


def reference_model(cfg: Config) -> ModelConfig:
    """The reference's model as the run computes it: the policy's, never differentiated (no remat)."""
    return dataclasses.replace(cfg.model, remat_policy="none")


def _shape_problems(saved: ModelConfig, policy: ModelConfig) -> list[str]:
    """'key=saved (policy: value)' for the shape-setting model fields that differ."""
    a, b = dataclasses.asdict(saved), dataclasses.asdict(policy)
    return [f"model.{k}={a[k]!r} (this run: {b[k]!r})" for k in a if k not in _COMPUTE_FIELDS and a[k] != b[k]]


def _check_same_shapes(what: str, path: str, saved: ModelConfig, policy: ModelConfig) -> None:
    """ConfigError unless the saved model's params have the policy's shapes (named by the first differences)."""
    from jaxinfra.state import abstract_params

    shapes = lambda m: jax.tree.map(lambda x: x.shape, abstract_params(m))  # noqa: E731
    try:
        same = shapes(saved) == shapes(policy)
    except Exception:  # noqa: BLE001 - a saved model the policy's code cannot even build differs in shape
        same = False
    if not same:
        diffs = _shape_problems(saved, policy) or ["its parameter shapes"]
        raise ConfigError(f"{what}={path} is a model of another shape than this run's ({'; '.join(diffs[:3])}): "
                          f"the reference must be the policy's architecture")


class ReferencePolicy:
    """The frozen reference of a run (module doc); `what` names its config key in errors."""

    def __init__(self, cfg: Config, path: str | None, what: str):
        self.cfg, self.path, self.what = cfg, path, what
        self.lora = path is None and cfg.lora.enabled  # the base with the adapters off: nothing to load
        self.source = None  # jaxinfra/distill/teacher.py TeacherSource, once resolved
        self.loaded_from: str | None = None  # the path actually restored (null mode: the run's start)
        self.step: int | None = None
        self.params: nnx.State | None = None
        self.model = reference_model(cfg)
        self.graphdef = self.shardings = None

    def setup(self, rt: Any) -> None:
        """Resolve a given path and check it (one line), and fix the params' shardings on rt.mesh."""
        if self.lora:
            return
        from jaxinfra.distill.teacher import teacher_shardings
        from jaxinfra.state import model_graphdef

        if self.path is not None:
            self.source = self._resolve(self.path)
        self.graphdef = model_graphdef(self.model)
        self.shardings = teacher_shardings(self.model, rt.mesh, rt.rules)

    def _resolve(self, path: str) -> Any:
        from jaxinfra.distill.teacher import resolve_teacher

        source = resolve_teacher(path, self.cfg.model.vocab_size, self.what)
        _check_same_shapes(self.what, path, source.saved_model, self.cfg.model)
        return source

    def _start_path(self, host: HostContext, saved: dict[str, Any]) -> tuple[str, int | None]:
        """(path, pinned step) to load: the given path, the checkpoint meta's, or the run's start."""
        if self.path is not None:
            return self.path, saved.get("step") if saved.get("path") == self.path else None
        if saved.get("path"):
            return saved["path"], saved.get("step")
        if host.restore_from is not None:
            return str(host.restore_from), None
        if host.run_dir is not None and is_params_only(host.run_dir):
            return str(host.run_dir), None
        raise ConfigError(f"{self.what} is null and the run starts from random weights: start from a checkpoint "
                          f"(--restore RUN) or set {self.what}")

    def start(self, host: HostContext, meta: dict[str, Any]) -> list[str]:
        """Load the params onto the run's mesh; notes. `meta` is the owning extension's own part of the
        resumed checkpoint's meta (e.g. meta["dpo"]), which holds this one's checkpoint_meta() under
        "reference": the owner saves {"reference": ref.checkpoint_meta()}, so a resume pins that step."""
        if self.lora:
            return [f"jaxinfra: {self.what}: the base model with the LoRA adapters off (no second copy)"]
        from jaxinfra.distill.teacher import load_teacher_params

        path, pinned = self._start_path(host, meta.get("reference", {}) if isinstance(meta, dict) else {})
        if self.source is None or self.source.path != path:
            self.source = self._resolve(path)
        rt = host.rt
        try:
            self.step, self.params = load_teacher_params(self.source, self.model.param_dtype, rt.mesh, rt.rules,
                                                         step=pinned)
        except CheckpointError as e:
            raise CheckpointError(f"{self.what}={path}: {e}") from None
        self.loaded_from = path
        return [f"jaxinfra: {self.what}: {path} step {self.step} (frozen, on the run's mesh)"]

    # ---------------------------------------------------------------- frozen step inputs

    def inputs(self) -> Any:
        return () if self.lora or self.params is None else self.params

    def input_shardings(self) -> Any:
        return () if self.lora else self.shardings

    def abstract_inputs(self) -> Any:
        if self.lora:
            return ()
        from jaxinfra.state import abstract_params

        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            abstract_params(self.model), self.shardings)

    def checkpoint_meta(self) -> dict[str, Any]:
        """Which reference (path and step): a resume reloads the same one."""
        if self.lora:
            return {"mode": "lora-base"}
        return {"path": self.loaded_from, "step": self.step}

    # ---------------------------------------------------------------- traced

    def _model(self, ctx: StepContext) -> nnx.Module:
        if self.lora:  # the policy's own weights, every LoraB zeroed: exactly the base's projections
            graphdef, state = nnx.split(ctx.model)
            adapters, rest = nnx.split_state(state, LoraB, ...)
            zeroed = jax.tree.map(jax.numpy.zeros_like, adapters)
            return nnx.merge(graphdef, nnx.merge_state(zeroed, rest))
        return nnx.merge(self.graphdef, ctx.inputs)

    def hidden(self, ctx: StepContext) -> jax.Array:
        """The reference's final hidden states [B, T, D] of ctx.batch (stop_gradient)."""
        b = ctx.batch
        h, _ = self._model(ctx).hidden(b["inputs"], b["positions"], b["segment_ids"], plan=ctx.plan)
        return jax.lax.stop_gradient(h)

    def logits(self, ctx: StepContext, hidden: jax.Array) -> jax.Array:
        """The reference's logits of (a chunk of) its hidden states (stop_gradient)."""
        return jax.lax.stop_gradient(self._model(ctx).logits(hidden, plan=ctx.plan))


def check_no_stages(mesh: Mesh, what: str) -> None:
    """A reference forward runs the whole model on every device: no pipeline stages (one line)."""
    if mesh.shape["stage"] > 1:
        raise ConfigError(f"{what} with mesh.stage={mesh.shape['stage']} is not supported (pipeline stages): "
                          f"set mesh.stage=1")
