"""Config sections of the feature packages: `distill` (jaxinfra/distill/) and `sft` (jaxinfra/sft/).

The run config (jaxinfra/config.py) embeds these sections, and the core never imports a feature
package (tests/test_layout.py), so their types live here, in the core, without jax;
`jaxinfra/distill/config.py` and `jaxinfra/sft/config.py` re-export them for their feature modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from sharding.ranges import range_problems, ranged

# Sections whose `enabled` turns on a step extension of the same name (jaxinfra/extensions.py
# check_sections_claimed: a section that is on with no extension to run it is refused).
FEATURE_SECTIONS: tuple[str, ...] = ("distill", "lora", "eval")  # lora: models/lora_config.py LoraConfig


def chat_data(cfg: Any) -> bool:
    """Whether the run config's data is chat conversations (a mixture is all chat or none)."""
    return any(part.source == "chat" for part in cfg.data.parts().values())


def preference_data(cfg: Any) -> bool:
    """Whether the run config's data is preference pairs (DPO; never part of a mixture)."""
    return cfg.data.source == "preference" and not cfg.data.mixture


def prompt_data(cfg: Any) -> bool:
    """Whether the run config's data is prompts for rollouts (GRPO; never part of a mixture)."""
    return cfg.data.source == "prompts" and not cfg.data.mixture


# Step extensions that another section turns on (the data, not a switch of their own), by name:
# check_sections_claimed refuses such a config without them just the same.
IMPLIED_EXTENSIONS: dict[str, Callable[[Any], bool]] = {"sft": chat_data, "dpo": preference_data,
                                                         "grpo": prompt_data}

DistillSchedule = Literal["linear", "cosine"]
TeacherDType = Literal["float32", "bfloat16"]
TrainOn = Literal["assistant", "all", "last_assistant"]
DpoLoss = Literal["sigmoid", "ipo", "hinge"]


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Logit distillation (Hinton et al. 2015): loss = alpha * T^2 * KL(softmax(t/T) || softmax(s/T))
    + (1 - alpha) * cross-entropy, with t the teacher's and s the student's logits.

    Off unless `teacher` (online: the teacher runs inside the train step) or `logits` (offline:
    top-k logits written by `jaxinfra distill save-logits`) is set; never both."""

    # A run directory, one checkpoint step directory (RUN/checkpoints/N) or an `hf import` output.
    # Its own config.yaml gives its architecture; only the vocabulary must match the student's.
    teacher: str | None = None
    # A directory written by `jaxinfra distill save-logits` for this run's data, seq_len, batch, seed.
    logits: str | None = None
    alpha: float = ranged(0.5, 0, 1)  # weight of the soft loss; 1 - alpha weighs the cross-entropy on the labels
    temperature: float = ranged(1.0, 0, lo_open=True)
    # Optional schedules: alpha and temperature move from their start values to these over
    # train.steps (linearly or by a half cosine); null keeps them constant.
    alpha_end: float | None = ranged(None, 0, 1)
    temperature_end: float | None = ranged(None, 0, lo_open=True)
    schedule: DistillSchedule = "linear"
    # 0: KL over the whole vocabulary; k > 0: over the teacher's k most likely tokens, both
    # distributions renormalised over them (offline: at most the saved k; 0 takes all saved).
    top_k: int = ranged(0, 0, note="0: the full vocabulary")  # <= model.vocab_size: problems()
    teacher_dtype: TeacherDType = "bfloat16"  # the teacher's params and compute dtype (logits in float32)

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.logits)

    @property
    def online(self) -> bool:
        return bool(self.teacher)

    def problems(self, vocab_size: int) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out = range_problems(self)
        if self.teacher is not None and self.logits is not None:
            out.append(("logits", self.logits, "null when distill.teacher is set (online and offline "
                                               "distillation exclude each other)"))
        for key in ("teacher", "logits"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                out.append((key, value, "null or a directory path"))
        if self.top_k > vocab_size:
            out.append(("top_k", self.top_k, f"in [0, model.vocab_size={vocab_size}] (0: the full vocabulary)"))
        return out


@dataclasses.dataclass(frozen=True)
class SftConfig:
    """Supervised fine-tuning on chat data (data.source=chat; docs/post-training.md).

    Not a FEATURE_SECTIONS entry: the SFT step extension is on exactly when the data is chat,
    which the data section decides, so this section has no switch of its own."""

    # Which target tokens the loss trains: every assistant turn's tokens (the template's
    # generation spans, or each assistant content plus its end-of-turn), only the last assistant
    # turn's, or every real token of the conversation (prompts and system text included).
    train_on: TrainOn = "assistant"


@dataclasses.dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimisation (Rafailov et al. 2023) on data.source=preference
    (jaxinfra/dpo/; docs/post-training.md). On exactly when the data is preference pairs.

    With z = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected)), sums of
    the completion tokens' log-probs: sigmoid = -(1 - ls) log sigmoid(beta z) - ls log sigmoid(-beta z),
    ipo = (z' - 1 / (2 beta))^2 with z' from per-token mean log-probs (as TRL), hinge = relu(1 - beta z)."""

    beta: float = ranged(0.1, 0, lo_open=True)
    loss: DpoLoss = "sigmoid"
    # Sigmoid only: the assumed share of flipped labels (cDPO).
    label_smoothing: float = ranged(0.0, 0, 0.5, hi_open=True)
    # The frozen reference policy: null = the checkpoint the run starts from (--restore, or the
    # run directory's own import; with LoRA: the base with the adapters off, no second copy); a run
    # directory, RUN/checkpoints/N or an `hf import` output; or a directory written by
    # `jaxinfra dpo save-reference` (its saved log-probs: no reference model in memory).
    reference: str | None = None

    def problems(self) -> list[tuple[str, object, str]]:
        out = range_problems(self)
        if self.loss not in ("sigmoid", "ipo", "hinge"):
            out.append(("loss", self.loss, "one of ['sigmoid', 'ipo', 'hinge']"))
        if self.label_smoothing and self.loss != "sigmoid" and 0 < self.label_smoothing < 0.5:
            out.append(("label_smoothing", self.label_smoothing, "0 unless dpo.loss=sigmoid"))
        if self.reference is not None and (not isinstance(self.reference, str) or not self.reference.strip()):
            out.append(("reference", self.reference, "null or a directory path"))
        return out


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """Group relative policy optimisation (Shao et al. 2024) with verifiable rewards on
    data.source=prompts (jaxinfra/grpo/; docs/post-training.md). On exactly when the data is prompts.

    Each rollout samples `group_size` completions per prompt with the current policy (the in-stack
    KV-cache sampler, params in place), scores them with the reward functions, and normalises the
    rewards within each group into advantages; `epochs_per_rollout` optimizer steps then train on
    that rollout with the clipped importance ratio against the sampler's log-probs and a k3 KL
    penalty against the frozen reference, per completion token."""

    # `module:function` or `path.py:function`, or a list of them; each is
    # fn(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float].
    reward: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ranged(())  # one per reward (empty: all 1); the reward is the weighted sum
    # Completions per prompt; train.batch_size rows = prompts per rollout x group_size.
    group_size: int = ranged(8, 2, note="advantages compare completions within a group")
    max_new_tokens: int = ranged(64, 1)
    # The sampler's; log-probs (sampler and trainer) are of logits / temperature.
    temperature: float = ranged(1.0, 0, note="0: greedy")
    top_p: float = ranged(1.0, 0, 1, lo_open=True)
    kl_beta: float = ranged(0.04, 0)  # weight of the k3 KL estimate to the reference (0: no reference model)
    clip_eps: float = ranged(0.2, 0, 1, lo_open=True, hi_open=True)
    epochs_per_rollout: int = ranged(1, 1)  # optimizer steps per rollout (train.steps counts optimizer steps)
    scale_rewards: bool = True  # divide the group-centred rewards by the group's std (False: Dr. GRPO)
    reference: str | None = None  # as dpo.reference (a model or run, not saved log-probs)
    samples_per_rollout: int = ranged(4, 0)  # completions written to RUN/samples.jsonl per rollout

    def problems(self) -> list[tuple[str, object, str]]:
        out = range_problems(self)
        if isinstance(self.reward, str) or not all(isinstance(r, str) and ":" in r for r in self.reward):
            out.append(("reward", self.reward, "a list of 'module:function' or 'path.py:function'"))
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            out.append(("reward_weights", self.reward_weights, f"empty or {len(self.reward)} numbers (one per reward)"))
        if self.reference is not None and (not isinstance(self.reference, str) or not self.reference.strip()):
            out.append(("reference", self.reference, "null or a directory path"))
        return out


@dataclasses.dataclass(frozen=True)
class EvalTasksConfig:
    """lm-evaluation-harness tasks run on the live params during training (jaxinfra/harness/).

    Off unless `tasks` is set. Scores go to metrics.jsonl as `eval/<task>/<metric>`, to TensorBoard
    and to the trackers. lm-eval itself is the optional extra `jaxinfra[eval]`."""

    tasks: tuple[str, ...] = ()  # lm-eval task names (or groups)
    every: int = ranged(0, 0, note="0: at train.eval_every")  # steps between task evals
    limit: int | None = ranged(None, 1)  # documents per task (None: all)
    num_fewshot: int | None = ranged(None, 0)  # None: each task's own default
    include_path: str | None = None  # a directory of local task YAMLs (offline tasks)

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)

    def problems(self) -> list[tuple[str, object, str]]:
        out = range_problems(self)
        if any(not t.strip() for t in self.tasks):
            out.append(("tasks", list(self.tasks), "a list of task names"))
        return out


WandbMode = Literal["offline", "online", "disabled"]


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (the optional extra `jaxinfra[wandb]`); off unless `project` is set."""

    project: str | None = None
    entity: str | None = None
    name: str | None = None  # default: the run directory's name
    tags: tuple[str, ...] = ()
    group: str | None = None  # default: the sweep's name for sweep runs
    mode: WandbMode = "offline"  # offline works with no network (`wandb sync` later)


@dataclasses.dataclass(frozen=True)
class MlflowConfig:
    """MLflow (the optional extra `jaxinfra[mlflow]`); off unless `experiment` or `tracking_uri` is set."""

    tracking_uri: str | None = None  # default: a local store in the run dir (sqlite:///RUN/mlflow.db)
    experiment: str | None = None  # default: the config's name
    group: str | None = None  # a `group` tag (default: the sweep's name for sweep runs)

    @property
    def enabled(self) -> bool:
        return self.tracking_uri is not None or self.experiment is not None
