"""The custom_vjp that ties a flash-attention forward kernel to its backward kernels.

The Pallas backends (`flash_triton`, `flash_tpu`, `flash_mosaic_gpu`) expose the same two functions:

* ``forward(params, q, k, v, q_seg, kv_seg) -> (out, lse)``
* ``backward(params, q, k, v, q_seg, kv_seg, do, lse, delta) -> (dq, dk, dv)``

The backward recomputes the probabilities from the saved float32 log-sum-exp
(``p = exp(s - lse)``), so only q, k, v, out and lse are kept between the passes, never
the [Tq, Tkv] scores. ``delta = rowsum(out * do) - dlse`` is computed here in XLA (one
fused elementwise-reduce): the lse cotangent enters the backward only through delta,
because ``d lse / d s = p`` (see ``_bwd``), so callers may differentiate through the lse
(ring attention merges chunks by it).
"""

from __future__ import annotations

import dataclasses
import functools
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


def _module(backend: str):
    if backend == "triton":
        from kernels import flash_triton
        return flash_triton
    if backend == "tpu":
        from kernels import flash_tpu
        return flash_tpu
    if backend == "mosaic_gpu":
        from kernels import flash_mosaic_gpu
        return flash_mosaic_gpu
    raise ValueError(f"unknown flash backend {backend!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash_attention(params: FlashParams, q: jax.Array, k: jax.Array, v: jax.Array,
                    q_seg: jax.Array | None, kv_seg: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(out [B, Tq, Hq, d_v] in q.dtype, lse [B, Hq, Tq] float32; -inf for rows with no visible key)."""
    return _module(params.backend).forward(params, q, k, v, q_seg, kv_seg)


def _fwd(params, q, k, v, q_seg, kv_seg):
    out, lse = _module(params.backend).forward(params, q, k, v, q_seg, kv_seg)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _bwd(params, residuals, cotangents):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    do, dlse = cotangents
    # dL/ds = p * (dp - delta) with delta = rowsum(o * do); an lse cotangent adds p * dlse.
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)
    # Rows with no visible key: lse = -inf in the output; +inf here makes every
    # recomputed p = exp(s - lse) exactly 0, so those rows add nothing and stay finite.
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
    dq, dk, dv = _module(params.backend).backward(params, q, k, v, q_seg, kv_seg, do, lse, delta)
    return dq, dk, dv, None, None


flash_attention.defvjp(_fwd, _bwd)


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
