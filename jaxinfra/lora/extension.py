"""The LoRA step extension: only the adapters train; the base gets no gradient and no optimizer state.

The adapters are model parameters (models/project.py LoraA, LoraB), so they are sharded, checkpointed
and restored with the model; this extension only names them as the trained subset (`trainable`), which
the step (jaxinfra/step.py) differentiates and the optimizer state (jaxinfra/state.py) covers.
"""

from __future__ import annotations

from typing import Any

from jaxinfra.config import Config
from jaxinfra.extensions import StepExtension
from models.project import ADAPTERS


class Lora(StepExtension):
    name = "lora"
    trainable: Any = ADAPTERS


def for_config(cfg: Config) -> Lora | None:
    """The `jaxinfra.extensions` entry point: on when lora.rank > 0."""
    return Lora() if cfg.lora.enabled else None
