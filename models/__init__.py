"""Flax NNX model definitions, annotated with logical axis names only.

`Transformer` loads on first use (PEP 562): `models.config` and `models.quant_config` are jax-free,
and the run config imports them without loading jax or Flax.
"""

from typing import Any

from models.config import REMAT_POLICIES, ModelConfig

__all__ = ["REMAT_POLICIES", "ModelConfig", "Transformer"]


def __getattr__(name: str) -> Any:
    if name == "Transformer":
        from models.transformer import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
