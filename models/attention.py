"""Multi-head attention with grouped K/V heads: MHA (kv = heads), GQA, MQA (kv = 1)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.layers import DTYPES, apply_rope, ones_param, param, rms_norm
from sharding.context import attention as context_attention
from sharding.rules import constrain

Cache = dict[str, jax.Array]  # one layer's cache (or one step's new entries), by name


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, kv, dh, std = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim, cfg.init_std
        self.wq = param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), std, cfg.param_dtype)
        self.wk = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), std, cfg.param_dtype)
        self.wv = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), std, cfg.param_dtype)
        self.wo = param(rngs, (h, dh, d), ("heads", "head_dim", "embed"),
                        std / math.sqrt(2 * cfg.num_layers), cfg.param_dtype)
        if cfg.qk_norm:  # per-head RMSNorm of q and k before RoPE (OLMo-2, Qwen-3)
            self.q_norm = ones_param((dh,), ("head_dim",), cfg.param_dtype)
            self.k_norm = ones_param((dh,), ("head_dim",), cfg.param_dtype)
        self.qk_norm = cfg.qk_norm
        self.eps = cfg.norm_eps
        self.dtype = DTYPES[cfg.dtype]
        self.impl = cfg.attention_impl

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array) -> jax.Array:
        return self._attend(x, positions, segment_ids, rope_freqs)[0]

    def prefill(self, x: jax.Array, positions: jax.Array, rope_freqs: jax.Array) -> tuple[jax.Array, Cache]:
        """The training computation on a (right-padded) prompt, plus what the cache keeps of
        each token: {"k", "v"} [batch, length, kv_heads, head_dim] (k after RoPE)."""
        y, k, v = self._attend(x, positions, None, rope_freqs)
        return y, {"k": k, "v": v}

    def decode(self, x: jax.Array, positions: jax.Array, rope_freqs: jax.Array, cache: Cache,
               absorb: bool = True) -> tuple[jax.Array, Cache]:
        """One new token per row against this layer's cache.

        x [B, 1, d]; positions [B, 1] (also the token's cache slot: slots below it are the
        row's earlier tokens); cache {"k", "v"} [B, S, kv_heads, head_dim]. Returns the
        output [B, 1, d] and the token's own entries {"k", "v"} [B, 1, kv_heads, head_dim]
        (the caller writes them at `positions`). `absorb` only matters for MLA."""
        q, k, v = self._qkv(x, positions, rope_freqs)
        out = decode_attention(q, cache["k"], cache["v"], k, v, positions[:, 0], q.shape[-1] ** -0.5)
        return self._output(out), {"k": k, "v": v}

    def _qkv(self, x: jax.Array, positions: jax.Array,
             rope_freqs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        dt = self.dtype
        b, t, d = x.shape
        rows = x.reshape(b * t, d)  # 2-D matmuls: see models/layers.py MLP for why

        def project(w: nnx.Param, name: str) -> jax.Array:
            _, heads, dh = w.shape
            out = rows @ w[...].astype(dt).reshape(d, heads * dh)
            return checkpoint_name(out.reshape(b, t, heads, dh), name)

        q, k, v = project(self.wq, "query_proj"), project(self.wk, "key_proj"), project(self.wv, "value_proj")
        if self.qk_norm:
            q = rms_norm(q, self.q_norm[...], self.eps)
            k = rms_norm(k, self.k_norm[...], self.eps)
        q = constrain(apply_rope(q, positions, rope_freqs), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, rope_freqs), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def _output(self, out: jax.Array) -> jax.Array:
        b, t, heads, dh = out.shape
        d = self.wo.shape[-1]
        return (out.reshape(b * t, heads * dh) @ self.wo[...].astype(self.dtype).reshape(heads * dh, d)).reshape(b, t, d)

    def _attend(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                rope_freqs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = self._qkv(x, positions, rope_freqs)
        # Plain attention, or context-parallel when the mesh splits the sequence.
        out = context_attention(q, k, v, segment_ids=segment_ids, impl=self.impl)
        out = checkpoint_name(out, "attn_out")
        return self._output(out), k, v


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
                     positions: jax.Array, scale: float) -> jax.Array:
    """Softmax attention of one query per row over its cached keys plus its own new key.

    q [B, 1, Hq, d_qk]; k_cache [B, S, Hkv, d_qk], v_cache [B, S, Hkv, d_v]; k_new, v_new
    [B, 1, Hkv, ...] (the new token's, not yet in the cache); positions [B]: cache slots
    j < positions[b] are row b's earlier tokens, later slots (padding, stale entries) are
    masked. GQA/MQA: query head h reads kv head h // (Hq / Hkv). Scores and the softmax in
    float32 (as the training attention); result [B, 1, Hq, d_v] in q's dtype.

    The cached keys and the new key are merged in one softmax (shared max and normaliser),
    so the cache is only read here; the caller writes the new entries once per step.
    """
    b, _, hq, dqk = q.shape
    s_len, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    qg = q.reshape(b, hkv, hq // hkv, dqk)
    s_old = jnp.einsum("bkgd,bskd->bkgs", qg, k_cache, preferred_element_type=jnp.float32) * scale
    s_new = jnp.einsum("bkgd,bkd->bkg", qg, k_new[:, 0], preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(s_len)[None, :] < positions[:, None]  # [B, S]
    s_old = jnp.where(visible[:, None, None, :], s_old, -jnp.inf)
    m = jnp.maximum(jnp.max(s_old, axis=-1), s_new)  # finite: the new key is always visible
    p_old = jnp.exp(s_old - m[..., None])
    p_new = jnp.exp(s_new - m)
    denom = jnp.sum(p_old, axis=-1) + p_new
    o = jnp.einsum("bkgs,bskd->bkgd", p_old.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    o = o + p_new[..., None] * v_new[:, 0, :, None, :].astype(jnp.float32)
    o = o / denom[..., None]
    return o.reshape(b, 1, hq, dv).astype(q.dtype)
