"""Config sections of the feature packages: `distill` (jaxinfra/distill/) and `sft` (jaxinfra/sft/).

The run config (jaxinfra/config.py) embeds these sections, and the core never imports a feature
package (tests/test_layout.py), so their types live here, in the core, without jax;
`jaxinfra/distill/config.py` and `jaxinfra/sft/config.py` re-export them for their feature modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

# Sections whose `enabled` turns on a step extension of the same name (jaxinfra/extensions.py
# check_sections_claimed: a section that is on with no extension to run it is refused).
FEATURE_SECTIONS: tuple[str, ...] = ("distill", "lora")  # lora: models/lora_config.py LoraConfig


def chat_data(cfg: Any) -> bool:
    """Whether the run config's data is chat conversations (a mixture is all chat or none)."""
    return any(part.source == "chat" for part in cfg.data.parts().values())


# Step extensions that another section turns on (the data, not a switch of their own), by name:
# check_sections_claimed refuses such a config without them just the same.
IMPLIED_EXTENSIONS: dict[str, Callable[[Any], bool]] = {"sft": chat_data}

DistillSchedule = Literal["linear", "cosine"]
TeacherDType = Literal["float32", "bfloat16"]
TrainOn = Literal["assistant", "all", "last_assistant"]


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
    alpha: float = 0.5  # weight of the soft loss; 1 - alpha weighs the cross-entropy on the labels
    temperature: float = 1.0
    # Optional schedules: alpha and temperature move from their start values to these over
    # train.steps (linearly or by a half cosine); null keeps them constant.
    alpha_end: float | None = None
    temperature_end: float | None = None
    schedule: DistillSchedule = "linear"
    # 0: KL over the whole vocabulary; k > 0: over the teacher's k most likely tokens, both
    # distributions renormalised over them (offline: at most the saved k; 0 takes all saved).
    top_k: int = 0
    teacher_dtype: TeacherDType = "bfloat16"  # the teacher's params and compute dtype (logits in float32)

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.logits)

    @property
    def online(self) -> bool:
        return bool(self.teacher)

    def problems(self, vocab_size: int) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out: list[tuple[str, object, str]] = []
        if self.teacher is not None and self.logits is not None:
            out.append(("logits", self.logits, "null when distill.teacher is set (online and offline "
                                               "distillation exclude each other)"))
        for key in ("teacher", "logits"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                out.append((key, value, "null or a directory path"))
        for key in ("alpha", "alpha_end"):
            value = getattr(self, key)
            if value is not None and not 0 <= value <= 1:
                out.append((key, value, "in [0, 1]"))
        for key in ("temperature", "temperature_end"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                out.append((key, value, "> 0"))
        if not 0 <= self.top_k <= vocab_size:
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
