"""The custom_vjp that ties a flash-attention forward kernel to its backward kernels.

The Pallas backends (`flash_triton`, `flash_tpu`, `flash_mosaic_gpu`) expose the same two functions:

* ``forward(params, q, k, v, q_seg, kv_seg) -> (out, lse)``
* ``backward(params, q, k, v, q_seg, kv_seg, do, lse, delta) -> (dq, dk, dv)``

The backward recomputes the probabilities from the saved float32 log-sum-exp
(``p = exp(s - lse)``), so only q, k, v, out and lse are kept between the passes, never
the [Tq, Tkv] scores. ``delta = rowsum(out * do) - dlse`` is computed here in XLA (one
fused elementwise-reduce): the lse cotangent enters the backward only through delta,
because ``d lse / d s = p`` (see ``_bwd``), so callers may differentiate through the lse:
sharding/context.py's ring attention calls `attention_with_lse` per K/V block and merges the
blocks with the log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# FlashParams and the padding helpers live in flash_common.py so the backends import them without
# importing this module (which imports the backends): re-exported here for callers.
from kernels.flash_common import FlashParams, pad_axis, round_up

__all__ = ["FlashParams", "flash_attention", "pad_axis", "round_up"]


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
