"""Which step extensions a config asks for: the one place in the runtime that names feature packages.

jaxinfra/runtime.py `build_runtime` calls `extensions_for(cfg)` when given no extensions; each
feature is imported only when its config section is on.
"""

from __future__ import annotations

from jaxinfra.config import Config
from jaxinfra.extensions import StepExtension


def extensions_for(cfg: Config) -> list[StepExtension]:
    """The feature extensions of `cfg`, in the order their hooks run (after the core's ModelStats)."""
    out: list[StepExtension] = []
    if cfg.distill.enabled:  # the teacher's logits join the loss (jaxinfra/distill/)
        from jaxinfra.distill.extension import Distillation

        out.append(Distillation(cfg))
    return out
