"""Attention kernels behind one entry point, `kernels.attention` (and `attention_with_lse`).

Modules: `attention` (public entry, validation, dispatch), `config` (the implementation names,
jax-free), `masks` (visibility and block skipping shared by every implementation), `reference`
(dense jnp reference / XLA fallback), `flash_common` (the parameters and helpers the Pallas
backends share), `flash` (the custom_vjp), `flash_triton` (GPU), `flash_mosaic_gpu` (Hopper),
`flash_tpu` (TPU), `cudnn_packing` (cuDNN on packed batches), `block_sizes` (tiles, and what
`auto` prefers), `facts` (what each implementation keeps for its backward; dispatch as a function
of the device, for `attention` and for `jaxinfra plan`).

The entry points load on first use (PEP 562), so importing `kernels.config` (the run config
does) loads neither jax nor Pallas.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from kernels.block_sizes import BlockSizes
from kernels.config import IMPLEMENTATIONS

_ENTRY = ("apply_sinks", "attention", "attention_with_lse", "reference_attention", "resolve_impl",
          "validate_attention_args")
__all__ = ["IMPLEMENTATIONS", "BlockSizes", *_ENTRY]


def __getattr__(name: str) -> Any:
    if name in _ENTRY:
        return getattr(importlib.import_module("kernels.attention"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """`kernels.attention` is the entry function, not the submodule of the same name: the import
    system sets a package attribute to each submodule it loads, so that one is rebound here."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "attention" and isinstance(value, types.ModuleType):
            value = value.attention
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
