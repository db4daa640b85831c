"""Flax NNX model definitions, annotated with logical axis names only."""

from models.config import REMAT_POLICIES, ModelConfig
from models.transformer import Transformer

__all__ = ["REMAT_POLICIES", "ModelConfig", "Transformer"]
