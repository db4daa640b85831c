"""`attention(q, k, v, ...)`: one entry point for every attention implementation.

Layout [batch, length, heads, head_dim]. GQA/MQA when heads_q is a multiple of
heads_kv. Only the `xla` implementation (jax.nn.dot_product_attention) exists
so far; `auto` resolves to it. Pallas kernels plug in behind the same signature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "auto")


def validate_attention_args(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> None:
    """Shape checks in Python, before any kernel runs: a wrong head count must not run silently."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"attention: {name} must be [batch, length, heads, head_dim], got shape {x.shape}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"attention: batch differs: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"attention: k and v must agree in batch, length and heads: k {k.shape}, v {v.shape}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q and k head_dim differ: {q.shape[3]} vs {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: q heads {q.shape[2]} not a multiple of k/v heads {k.shape[2]}")
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(f"attention: segment_ids must be [batch, length] = {q.shape[:2]}, got {segment_ids.shape}")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Softmax attention; tokens attend only within their own segment (packed rows)."""
    validate_attention_args(q, k, v, segment_ids)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention: impl={impl!r}; choose one of {IMPLEMENTATIONS}")
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, implementation="xla")


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                        segment_ids: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """Plain float32 jnp attention at HIGHEST precision: the reference for tests."""
    groups = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, groups, axis=2).astype(jnp.float32)
    v = jnp.repeat(v, groups, axis=2).astype(jnp.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k, precision="highest") * scale
    t, n = q.shape[1], k.shape[1]
    allowed = jnp.ones((1, 1, t, n), bool)
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((t, n), bool))[None, None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    s = jnp.where(allowed, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v, precision="highest").astype(q.dtype)
