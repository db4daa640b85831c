"""GRPO as a step extension (jaxinfra/extensions.py) that feeds the step's batches itself.

Each rollout (jaxinfra/grpo/rollout.py) samples train.batch_size rows (P = batch / group_size
prompts x group_size completions) with the current policy's params in place, scores them and
normalises the rewards per group; the next grpo.epochs_per_rollout optimizer steps train on it.
The loss (jaxinfra/grpo/loss.py) counts only the completion tokens (`loss_mask` = completion), so
the core's `tokens` is the completion-token count of the global batch and the step's gradient is
that of the token-level mean.

Metrics: `loss` (the GRPO loss per completion token), `reward/mean`, `reward/std` (over the
rollout's rows), `kl` (k3 per completion token; 0 when grpo.kl_beta=0, no reference loaded),
`completion_len` (mean completion tokens per row), `clip_frac` (share of completion tokens whose
ratio is clipped). Process 0 appends grpo.samples_per_rollout samples per rollout to RUN/samples.jsonl.

Resume: rollout k is a function of (the params at its first step, k): the prompts' order and the
sampling seed depend on (train.seed, k) only. With epochs_per_rollout=1 a resumed run redraws its
next rollout exactly; with more, a resume can fall inside a rollout, whose arrays process 0 keeps
in RUN/grpo/rollout-<k>.npz (only those a kept checkpoint can need) and reloads.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfra.atomic import atomic_file, atomic_write_text
from jaxinfra.config import Config, ConfigError
from jaxinfra.config_sections import prompt_data
from jaxinfra.extensions import HostContext, StepContext, StepExtension
from jaxinfra.grpo.loss import CLIP_SUM, KL_SUM, PG_SUM, grpo_token_sums
from jaxinfra.grpo.prompts import load_prompts
from jaxinfra.grpo.rewards import Rewards
from jaxinfra.grpo.rollout import Roller, Rollout
from jaxinfra.loss import target_logps
from jaxinfra.state import model_state

FLOAT_FIELDS = ("old_logps", "advantages", "rewards")
REWARD_SUM, REWARD_SQ_SUM = "grpo_reward_sum", "grpo_reward_sq_sum"
ROWS, COMPLETION_SUM = "grpo_rows", "grpo_completion"


def for_config(cfg: Config) -> StepExtension | None:
    """The `jaxinfra.extensions` entry point: GRPO exactly when the data is prompts."""
    return Grpo(cfg) if prompt_data(cfg) else None


class Grpo(StepExtension):
    name = "grpo"
    metric_names = ("reward/mean", "reward/std", "kl", "completion_len", "clip_frac")
    feeds_batches = True

    def __init__(self, cfg: Config):
        self.cfg = cfg
        g = cfg.grpo
        self.temperature = g.temperature if g.temperature > 0 else 1.0  # greedy: log-probs of the plain logits
        self.epochs = g.epochs_per_rollout
        self.ref = None
        self.roller: Roller | None = None
        self.current: Rollout | None = None
        self.last_step = 0

    # ---------------------------------------------------------------- host side

    def setup(self, rt: Any) -> None:
        """Refuse what cannot run, then load the rewards and prompts (bad input before anything compiles)."""
        cfg = self.cfg
        if rt.mesh.shape.get("stage", 1) > 1:
            raise ConfigError(f"grpo: mesh.stage={rt.mesh.shape['stage']}: rollouts sample with the KV-cache "
                              f"sampler, which does not run pipeline stages; use mesh.stage=1")
        if jax.process_count() > 1:
            raise ConfigError(f"grpo: {jax.process_count()} processes: rollouts run in a single process for now "
                              f"(the sampler reads its results back whole); run GRPO on one host")
        rewards = Rewards(cfg.grpo.reward, cfg.grpo.reward_weights)
        prompts = load_prompts(cfg.data, cfg.train.seq_len, cfg.grpo.max_new_tokens)
        self.roller = Roller(cfg, prompts, rewards)
        if cfg.grpo.kl_beta > 0:
            from jaxinfra.reference import ReferencePolicy

            self.ref = ReferencePolicy(cfg, cfg.grpo.reference, "grpo.reference")
            self.ref.setup(rt)

    def _position(self) -> dict[str, Any]:
        return {"prompts_per_rollout": self.roller.per_rollout, "prompt_rows": len(self.roller.prompts),
                "seed": self.cfg.train.seed, "epochs_per_rollout": self.epochs}

    def start(self, host: HostContext, meta: dict[str, Any]) -> list[str]:
        saved = meta.get(self.name, {}) if isinstance(meta, dict) else {}
        step = int(meta.get("step", 0)) if isinstance(meta, dict) else 0
        if saved:
            mine = self._position()
            changed = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            if changed:
                raise ConfigError(f"grpo: the checkpoint at step {step} was written with "
                                  f"{ {k: a for k, (a, _) in changed.items()} }, this run has "
                                  f"{ {k: b for k, (_, b) in changed.items()} }: the rollout order cannot carry over")
        self.run_dir = pathlib.Path(host.run_dir) if host.run_dir is not None else None
        if self.run_dir is not None and jax.process_index() == 0:
            _trim_samples(self.run_dir / "samples.jsonl", step)
        notes = [f"grpo: {len(self.roller.prompts)} prompts, {self.roller.per_rollout} per rollout x group "
                 f"{self.roller.group}; rewards {', '.join(self.roller.rewards.entries)}"]
        if self.ref is not None:
            notes += self.ref.start(host, saved)
        return notes

    def batches(self, host: HostContext, first_step: int) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of each step: rollout (step - 1) // epochs_per_rollout, drawn when its
        first step comes (reloaded when a resume falls inside it)."""
        step = first_step
        while True:
            index = (step - 1) // self.epochs
            if self.current is None or self.current.index != index:
                self.current = self._rollout(host, index, step)
            self.last_step = step
            yield {k: v[host.first_row:host.first_row + host.rows] for k, v in self.current.rows.items()}
            step += 1

    def _rollout(self, host: HostContext, index: int, step: int) -> Rollout:
        first = index * self.epochs + 1  # the rollout's first step
        saved = self._saved_path(index)
        if step != first and saved is not None and saved.exists():
            with np.load(saved) as f:
                return Rollout(index, {k: f[k] for k in f.files}, [])
        if step != first:
            raise ConfigError(f"grpo: resuming at step {step - 1}, inside rollout {index}, but its saved rollout "
                              f"{saved} is missing (epochs_per_rollout={self.epochs}): it cannot be redrawn from "
                              f"the params of step {first - 1}")
        params = model_state(host.current_state())  # the policy's params in place (no copy)
        rollout = self.roller.draw(index, params, host.rt.mesh, step)
        if jax.process_index() == 0 and self.run_dir is not None:
            self._write(rollout)
        return rollout

    def _saved_path(self, index: int) -> pathlib.Path | None:
        if self.epochs == 1 or getattr(self, "run_dir", None) is None:
            return None
        return self.run_dir / "grpo" / f"rollout-{index}.npz"

    def _write(self, rollout: Rollout) -> None:
        with open(self.run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(s) + "\n" for s in rollout.samples)
        path = self._saved_path(rollout.index)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, "wb", replace=True) as f:  # the run's own file, rewritten on a resume
            np.savez(f, **rollout.rows)
        # Keep the rollouts a kept checkpoint can resume inside, and this one; drop the rest.
        ckpts = self.run_dir / "checkpoints"
        steps = [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()] if ckpts.is_dir() else []
        needed = {s // self.epochs for s in steps if s % self.epochs} | {rollout.index}
        for old in path.parent.glob("rollout-*.npz"):
            if int(old.stem.split("-")[1]) not in needed:
                old.unlink(missing_ok=True)

    def checkpoint_meta(self) -> dict[str, Any]:
        meta = {**self._position(), "rollout": (self.last_step - 1) // self.epochs if self.last_step else -1}
        if self.ref is not None:
            meta["reference"] = self.ref.checkpoint_meta()
        return meta

    def inputs(self) -> Any:
        return self.ref.inputs() if self.ref is not None else ()

    def input_shardings(self) -> Any:
        return self.ref.input_shardings() if self.ref is not None else ()

    def abstract_inputs(self) -> Any:
        return self.ref.abstract_inputs() if self.ref is not None else ()

    def batch_specs(self, shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
        return {"completion": jax.ShapeDtypeStruct(shape, np.int32),
                **{k: jax.ShapeDtypeStruct(shape, np.float32) for k in FLOAT_FIELDS}}

    # ---------------------------------------------------------------- traced

    def loss_mask(self, ctx: StepContext) -> jax.Array | None:
        return ctx.batch["completion"] > 0

    def per_token(self, ctx: StepContext, hidden: jax.Array) -> tuple[jax.Array, ...]:
        b = ctx.batch
        ref = (self.ref.hidden(ctx),) if self.ref is not None else ()
        return (b["old_logps"], b["advantages"], *ref)

    def token_sums(self, ctx: StepContext, logits: jax.Array, per_token: tuple[jax.Array, ...],
                   targets: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
        logp = target_logps(logits, targets, self.temperature)
        ref_logp = None
        if self.ref is not None:
            ref_logp = target_logps(self.ref.logits(ctx, per_token[2]), targets, self.temperature)
        return grpo_token_sums(logp, per_token[0], per_token[1], mask, self.cfg.grpo.clip_eps, ref_logp)

    def objective(self, ctx: StepContext, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        b = ctx.batch
        rewards = b["rewards"]  # each row's reward at column 0, zeros elsewhere: sums are per-row sums
        return {**sums, "loss_sum": sums[PG_SUM] + self.cfg.grpo.kl_beta * sums[KL_SUM],
                REWARD_SUM: jnp.sum(rewards), REWARD_SQ_SUM: jnp.sum(jnp.square(rewards)),
                ROWS: jnp.float32(rewards.shape[0]), COMPLETION_SUM: jnp.sum(b["completion"]).astype(jnp.float32)}

    def metrics(self, sums: dict[str, jax.Array], tokens: jax.Array) -> dict[str, jax.Array]:
        rows = sums[ROWS]
        mean = sums[REWARD_SUM] / rows
        return {"loss": sums["loss_sum"] / tokens, "reward/mean": mean,
                "reward/std": jnp.sqrt(jnp.maximum(sums[REWARD_SQ_SUM] / rows - jnp.square(mean), 0.0)),
                "kl": sums[KL_SUM] / tokens, "completion_len": sums[COMPLETION_SUM] / rows,
                "clip_frac": sums[CLIP_SUM] / tokens}


def _trim_samples(path: pathlib.Path, step: int) -> None:
    """Drop the samples of rollouts after the resumed step (they are drawn again)."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [x for x in lines if x.strip() and json.loads(x).get("step", 0) <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(x + "\n" for x in kept), replace=True)
