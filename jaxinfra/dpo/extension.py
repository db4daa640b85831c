"""DPO as a step extension (jaxinfra/extensions.py), on exactly when data.source=preference.

- the reference (dpo.reference): a ReferencePolicy (jaxinfra/reference.py: a given run or
  checkpoint, the checkpoint the run starts from, or with LoRA the base with the adapters off),
  whose params are the frozen step inputs; or a directory of `jaxinfra dpo save-reference`
  (recognised by its meta file, jaxinfra/dpo/saved.py): the batch then carries `ref_logps`
  [rows, seq] float32, the reference's log-prob of each target, and no reference model is in memory;
- loss mask: the completion targets (`completion > 0`, chosen and rejected), in the train step and
  the eval step (so `eval_loss` is the cross-entropy per completion token of the held-out pairs);
- loss terms (jaxinfra/dpo/loss.py): per loss chunk the per-segment sums of the policy's and the
  reference's completion log-probs; the objective pairs segments 2k - 1 / 2k into pair losses:
  `loss_sum` = the sum of the pair losses and `tokens` = the pair count, so the gradient is the mean
  over the global batch's pairs, exact under gradient accumulation (sums, divided once);
- metrics `loss` (= `dpo/loss`), `rewards/chosen`, `rewards/rejected`, `rewards/margin`,
  `rewards/accuracy` (means over the step's pairs); eval lines add the same over the held-out pairs
  as `eval_dpo/loss`, `eval_rewards/...`, and `eval_logps/accuracy`, the share of held-out pairs
  whose chosen completion the policy itself finds more likely (with a reference model; not from
  saved log-probs);
- checkpoint meta: which reference (path and step, so a resume reloads it) or saved directory.
Pipeline stages (mesh.stage > 1) are refused.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxinfra.config import Config
from jaxinfra.config_sections import preference_data
from jaxinfra.dpo.loss import PAIR_SUMS, SEGMENT_KEYS, pair_metrics, pair_sums, segment_sums
from jaxinfra.extensions import HostContext, StepContext, StepExtension
from jaxinfra.loss import target_logps
from jaxinfra.reference import ReferencePolicy, check_no_stages

METRICS = ("dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def for_config(cfg: Config) -> StepExtension | None:
    """The `jaxinfra.extensions` entry point (pyproject.toml): DPO exactly when the data is preference pairs."""
    return Dpo(cfg) if preference_data(cfg) else None


class Dpo(StepExtension):
    name = "dpo"
    metric_names = METRICS

    def __init__(self, cfg: Config):
        from jaxinfra.dpo.saved import SavedReference, is_saved_reference

        self.cfg, self.dcfg = cfg, cfg.dpo
        self.segments = cfg.train.seq_len + 1  # segment ids of a row are < seq_len + 1
        path = self.dcfg.reference
        self.saved = SavedReference(path) if path is not None and is_saved_reference(path) else None
        self.ref = None if self.saved else ReferencePolicy(cfg, path, "dpo.reference")
        self.host: HostContext | None = None
        self._eval_fn = None

    def setup(self, rt: Any) -> None:
        check_no_stages(rt.mesh, "dpo")
        self.rt = rt
        if self.saved is not None:
            self.saved.check_run(self.cfg)
        else:
            self.ref.setup(rt)

    # ---------------------------------------------------------------- host side

    def start(self, host: HostContext, meta: dict[str, Any]) -> list[str]:
        self.host = host
        if self.saved is not None:
            return [f"jaxinfra: dpo.reference: saved log-probs {self.saved.root} (of "
                    f"{self.saved.meta.get('reference', {}).get('path')}; no reference model in memory)"]
        return self.ref.start(host, meta.get(self.name, {}))

    def inputs(self) -> Any:
        return () if self.ref is None else self.ref.inputs()

    def input_shardings(self) -> Any:
        return () if self.ref is None else self.ref.input_shardings()

    def abstract_inputs(self) -> Any:
        return () if self.ref is None else self.ref.abstract_inputs()

    def batch_specs(self, shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
        specs = {k: jax.ShapeDtypeStruct(shape, np.int32) for k in ("completion", "truncated")}
        if self.saved is not None:
            specs["ref_logps"] = jax.ShapeDtypeStruct(shape, np.float32)
        return specs

    def host_batch(self, local: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        if self.saved is None:
            return {}
        return {"ref_logps": self.saved.rows(step, self.host.first_row, self.host.rows, local)}

    def checkpoint_meta(self) -> dict[str, Any]:
        if self.saved is not None:
            return {"saved_reference": str(self.saved.root)}
        return {"reference": self.ref.checkpoint_meta()}

    def eval_fields(self) -> dict[str, float]:
        """The DPO metrics of the held-out pairs (`eval_` prefixed), with the latest params."""
        if self.ref is None or self.host is None or not self.host.eval_batches:
            return {}
        state = self.host.current_state()
        if state is None:
            return {}
        from jaxinfra.state import model_state

        return preference_eval(self.rt, model_state(state), self.host.eval_batches, "eval_")

    # ---------------------------------------------------------------- traced

    def loss_mask(self, ctx: StepContext) -> jax.Array | None:
        return ctx.batch["completion"] > 0

    def per_token(self, ctx: StepContext, hidden: jax.Array) -> tuple[jax.Array, ...]:
        b = ctx.batch
        reference = b["ref_logps"] if self.saved is not None else self.ref.hidden(ctx)
        return reference, b["segment_ids"]

    def token_sums(self, ctx: StepContext, logits: jax.Array, per_token: tuple[jax.Array, ...],
                   targets: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
        reference, segment_ids = per_token
        if self.saved is None:  # the reference's logits of this chunk only (its hidden states came whole)
            reference = target_logps(self.ref.logits(ctx, reference), targets)
        return segment_sums(logits, reference, targets, segment_ids, mask, self.segments)

    def objective(self, ctx: StepContext, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        d = self.dcfg
        pairs = pair_sums(sums, ctx.batch["segment_ids"].shape[0], self.segments, d.beta, d.loss, d.label_smoothing)
        rest = {k: v for k, v in sums.items() if k not in SEGMENT_KEYS}
        return {**rest, **pairs, "loss_sum": pairs["dpo_loss_sum"], "tokens": pairs["dpo_pairs"]}

    def metrics(self, sums: dict[str, jax.Array], tokens: jax.Array) -> dict[str, jax.Array]:
        out = pair_metrics(sums)
        return {"loss": out["dpo/loss"], **out}


def preference_eval(rt: Any, variables: Any, batches: list[dict[str, np.ndarray]],
                    prefix: str = "") -> dict[str, float]:
    """The DPO metrics (pair_metrics) of host `batches` under the model `variables` (params and
    stats), through the train step's own per-segment code (jaxinfra/step.py forward_sums)."""
    ext = rt.extension("dpo")
    if ext._eval_fn is None:
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxinfra.state import model_state
        from jaxinfra.step import forward_sums

        sums_fn = forward_sums(rt.graphdef, rt.cfg.model, [ext], rt.plan)
        keep = lambda s: {k: s[k] for k in PAIR_SUMS}  # noqa: E731
        ext._eval_fn = jax.jit(lambda v, b, x: keep(sums_fn((v,), b, None, (x,))),
                               in_shardings=(model_state(rt.state_shardings), rt.batch_sharding, ext.input_shardings()),
                               out_shardings=NamedSharding(rt.mesh, PartitionSpec()))
    total: dict[str, float] = {}
    with jax.set_mesh(rt.mesh):
        for b in batches:
            out = jax.device_get(ext._eval_fn(variables, rt.to_global(b), ext.inputs()))
            total = {k: total.get(k, 0.0) + float(v) for k, v in out.items()}
    return {k: float(v) for k, v in pair_metrics(total, prefix).items()}
