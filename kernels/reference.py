"""Dense jnp attention: the float32 HIGHEST-precision reference for tests, and (in the
input dtype, float32 accumulation) the `xla` implementation itself (kernels/attention.py).

Both materialise the [B, H, Tq, Tkv] scores: fine for references and short sequences,
not a kernel. Empty rows (no visible key) give output 0 and lse -inf, like the kernels.

Attention sinks (gpt-oss): a learned logit per query head that joins the softmax denominator
and carries no value, p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)); rows may sum to < 1.
With sinks the lse includes the sink term, and a row with no visible key gives output 0 and
lse = sink (finite: the sink is always "visible").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels import mixed
from kernels.masks import Band, dense_mask, make_band
from kernels.mixed import is_low_precision


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, band: Band, q_seg: jax.Array | None,
                    kv_seg: jax.Array | None, scale: float, softcap: float | None, *,
                    upcast: bool, precision: lax.Precision | None,
                    sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(out [B, Tq, Hq, d_v] float32, lse [B, Hq, Tq] float32). Differentiable by autodiff.
    sinks: optional [Hq] logits (any float dtype; used in the accumulation dtype) joining each row's denominator.

    GQA without repeating k/v: q heads are viewed as [kv_heads, group] (query head h reads
    kv head h // group, the convention of jax.nn.dot_product_attention).

    Layout: heads-major [B, Hkv, G * Tq, d] (a group's query rows stacked, one 4-D batched dot per
    product) and [B, Hkv, Tkv, d]; elementwise work on the [B, Hkv, G, Tq, Tkv] view of the same
    buffer. On XLA:CPU the 5-D [B, T, Hkv, G, d] einsums of the first version ran the attention's
    forward and backward ~20% slower (benchmarks/RESULTS.md, 2026-12-03)."""
    b, tq, hq, _ = q.shape
    hkv = k.shape[2]
    # float32 accumulation, or float64 for float64 inputs (finite-difference tests under x64).
    acc = jnp.promote_types(jnp.float32, q.dtype)
    if upcast:
        q, k, v = (x.astype(acc) for x in (q, k, v))
    g = hq // hkv
    qg = jnp.moveaxis(q.reshape(b, tq, hkv, g, q.shape[-1]), 1, 3).reshape(b, hkv, g * tq, q.shape[-1])
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, Hkv, Tkv, d]
    s = _dot("bktd,bksd->bkts", qg, k, precision, acc)
    s = s.reshape(b, hkv, g, tq, k.shape[2]) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = dense_mask(band, q_seg, kv_seg)  # [B|1, 1, Tq, Tkv]
    if mask is not None:
        # An additive 0 / -inf bias, equal to where(mask, s, -inf): with the where, JAX hoists its
        # -inf fill out of the layers' scan as a materialised [B, H, Tq, Tkv] buffer every layer reads.
        s = s + jnp.where(mask, 0.0, -jnp.inf).astype(s.dtype)[:, :, None]
    # Shift by the row max; a row with no visible key has max -inf: shift by 0 instead so
    # exp gives exact zeros (not NaN), then l == 0 marks the row empty.
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    if sinks is not None:
        # The sink joins the max too, so exp(sink - m) <= 1 can't overflow whatever its size.
        sink = sinks.astype(acc).reshape(1, hkv, hq // hkv, 1, 1)
        m = jnp.maximum(m, lax.stop_gradient(sink))
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        l = l + jnp.exp(sink - m)  # denominator only: the sink has no value row
    empty = l == 0
    l_safe = jnp.where(empty, 1.0, l)
    o = _dot("bkts,bksd->bktd", p.astype(v.dtype).reshape(b, hkv, g * tq, -1), v, precision, acc)
    o = o.reshape(b, hkv, g, tq, -1) / l_safe
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))[..., 0]  # [B, Hkv, G, Tq]
    return jnp.moveaxis(o, 3, 1).reshape(b, tq, hq, v.shape[-1]), lse.reshape(b, hq, tq)


def _dot(spec: str, a: jax.Array, b: jax.Array, precision: lax.Precision | None, acc) -> jax.Array:
    """A score or value dot accumulating in `acc`: bfloat16 operands stay bfloat16 in the backward
    too (kernels/mixed.py), float32 ones are the plain einsum at `precision`."""
    if is_low_precision(a.dtype) and is_low_precision(b.dtype):
        return mixed.einsum(spec, a, b, dtype=a.dtype, out_dtype=acc)
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=acc)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                        segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
                        window: tuple[int | None, int | None] | None = None, scale: float | None = None,
                        softcap: float | None = None, return_lse: bool = False,
                        out_dtype: jnp.dtype | None = None,
                        sinks: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Plain float32 jnp attention at HIGHEST precision: the reference for tests.

    Same arguments and conventions as `kernels.attention`; output in `out_dtype`
    (default q.dtype); with `return_lse`, also the float32 log-sum-exp [B, Hq, Tq]."""
    if isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = segment_ids
    else:
        q_seg = kv_seg = segment_ids
    band = make_band(causal, window, q.shape[1], k.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = dense_attention(q, k, v, band, q_seg, kv_seg, scale, softcap, upcast=True,
                               precision=lax.Precision.HIGHEST, sinks=sinks)
    out = out.astype(q.dtype if out_dtype is None else out_dtype)
    return (out, lse) if return_lse else out
