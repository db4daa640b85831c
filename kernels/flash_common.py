"""What the flash-attention backends share: the static parameters of one call and the padding
helpers. Kept apart from `flash.py` (the custom_vjp), which imports the backends, so that the
backends import this module rather than their importer and the module graph has no cycle."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kernels.block_sizes import BlockSizes
from kernels.masks import Band


@dataclasses.dataclass(frozen=True)
class FlashParams:
    """Everything static about one call (hashable: it is a nondiff custom_vjp argument)."""

    backend: str  # "triton" | "tpu" | "mosaic_gpu"
    band: Band
    scale: float
    softcap: float | None
    blocks: BlockSizes
    interpret: Any  # False, True (HLO / GPU interpreter) or pltpu.InterpretParams()


def pad_axis(x: jax.Array, axis: int, size: int, value: float | int = 0) -> jax.Array:
    """Pad `axis` at the end up to `size` with a constant."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
