"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, sec. 2.1; DeepSeek-V3 sec. 2.1.1).

Keys and values are up-projected from one shared low-rank latent, so an inference cache
holds kv_lora_rank + qk_rope_head_dim numbers per token instead of 2 * heads * head_dim:

    c_kv        = RMSNorm(x W_dkv)                     [kv_lora_rank]        (cached)
    k_rope      = RoPE(x W_kr)                         [qk_rope_head_dim]    (cached; one for all heads)
    k_h, v_h    = c_kv W_uk_h, c_kv W_uv_h             [qk_nope_head_dim], [v_head_dim]
    c_q         = RMSNorm(x W_dq)                      [q_lora_rank]   (or q = x W_q when q_lora_rank is None)
    q_h, qr_h   = c_q W_uq_h, RoPE(c_q W_qr_h)
    o_h         = softmax([q_h; qr_h] . [k_h; k_rope] * scale) v_h

RoPE is "decoupled": position lives only in the rope parts, because a rotation between
W_uk and W_uq would stop the up-projection from being absorbed into the query at inference.
scale = (qk_nope + qk_rope)^-1/2, times YaRN's (0.1 ln s + 1)^2 with YaRN rope scaling.

Training uses the explicit (non-absorbed) form: K and V per head go through the shared
attention entry `sharding.context.attention` with d_qk != d_v. The W_dkv and W_kr
projections are one [d, kv_lora_rank + qk_rope_head_dim] matrix (one matmul).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.layers import DTYPES, apply_rope, ones_param, param, rms_norm, yarn_softmax_scale
from sharding.context import attention as context_attention
from sharding.rules import constrain


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, std, dtype = cfg.d_model, cfg.num_heads, cfg.init_std, cfg.param_dtype
        nope, rope, dv, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.wq = param(rngs, (d, h, nope + rope), ("embed", "heads", "head_dim"), std, dtype)
        else:
            self.wq_a = param(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), std, dtype)
            self.q_norm = ones_param((cfg.q_lora_rank,), ("q_lora",), dtype)
            self.wq_b = param(rngs, (cfg.q_lora_rank, h, nope + rope), ("q_lora", "heads", "head_dim"), std, dtype)
        self.wkv_a = param(rngs, (d, rank + rope), ("embed", "kv_lora"), std, dtype)
        self.kv_norm = ones_param((rank,), ("kv_lora",), dtype)
        self.wkv_b = param(rngs, (rank, h, nope + dv), ("kv_lora", "heads", "head_dim"), std, dtype)
        self.wo = param(rngs, (h, dv, d), ("heads", "head_dim", "embed"), std / math.sqrt(2 * cfg.num_layers), dtype)
        self.nope, self.rope, self.dv = nope, rope, dv
        self.eps = cfg.norm_eps
        self.dtype = DTYPES[cfg.dtype]
        self.impl = cfg.attention_impl
        # The attention entry scales by d_qk^-1/2; a different scale is folded into q.
        self.q_scale = yarn_softmax_scale(cfg)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array) -> jax.Array:
        dt = self.dtype
        b, t, d = x.shape
        rows = x.reshape(b * t, d)  # 2-D matmuls: see models/layers.py MLP for why

        def up(inputs: jax.Array, w: nnx.Param) -> jax.Array:  # [N, r] @ [r, H, D] -> [B, T, H, D]
            r, heads, dh = w.shape
            return (inputs @ w[...].astype(dt).reshape(r, heads * dh)).reshape(b, t, heads, dh)

        if hasattr(self, "wq"):
            q = up(rows, self.wq)
        else:
            q = up(rms_norm(rows @ self.wq_a[...].astype(dt), self.q_norm[...], self.eps), self.wq_b)
        kv_a = rows @ self.wkv_a[...].astype(dt)
        latent = rms_norm(kv_a[:, :-self.rope] if self.rope else kv_a, self.kv_norm[...], self.eps)
        kv = up(latent, self.wkv_b)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        heads = q.shape[2]
        if self.rope:
            q_rope = apply_rope(q[..., self.nope:], positions, rope_freqs)
            k_rope = apply_rope(kv_a[:, -self.rope:].reshape(b, t, 1, self.rope), positions, rope_freqs)
            q = jnp.concatenate([q[..., :self.nope], q_rope], axis=-1)
            k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (b, t, heads, self.rope))], axis=-1)
        else:
            k = k_nope
        if self.q_scale != 1.0:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        q = constrain(checkpoint_name(q, "query_proj"), ("batch", "length", "heads", "head_dim"))
        k = constrain(checkpoint_name(k, "key_proj"), ("batch", "length", "heads", "head_dim"))
        v = constrain(checkpoint_name(v, "value_proj"), ("batch", "length", "heads", "head_dim"))
        out = checkpoint_name(context_attention(q, k, v, segment_ids=segment_ids, impl=self.impl), "attn_out")
        wo = self.wo[...].astype(dt).reshape(heads * self.dv, d)
        return (out.reshape(b * t, heads * self.dv) @ wo).reshape(b, t, d)
