"""Attention kernels behind one entry point, `kernels.attention` (and `attention_with_lse`).

Modules: `attention` (public entry, validation, dispatch), `masks` (visibility and block
skipping shared by every implementation), `reference` (dense jnp reference / XLA fallback),
`flash` (the custom_vjp), `flash_triton` (GPU), `flash_mosaic_gpu` (Hopper), `flash_tpu` (TPU),
`cudnn_packing` (cuDNN on packed batches), `block_sizes` (tiles, and what `auto` prefers), `facts`
(what each implementation keeps for its backward; dispatch as a function of the device, for
`attention` and for `jaxinfra plan`).
"""

from kernels.attention import (
                               IMPLEMENTATIONS,
                               attention,
                               attention_with_lse,
                               reference_attention,
                               resolve_impl,
                               validate_attention_args,
)
from kernels.block_sizes import BlockSizes

__all__ = ["IMPLEMENTATIONS", "BlockSizes", "attention", "attention_with_lse", "reference_attention",
           "resolve_impl", "validate_attention_args"]
