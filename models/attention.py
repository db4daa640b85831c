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


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, kv, dh, std = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim, cfg.init_std
        self.wq = param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), std, cfg.param_dtype)
        self.wk = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), std, cfg.param_dtype)
        self.wv = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), std, cfg.param_dtype)
        self.wo = param(rngs, (h, dh, d), ("heads", "head_dim", "embed"),
                        std / math.sqrt(2 * cfg.num_layers), cfg.param_dtype)
        if cfg.qkv_bias:  # Qwen2's q/k/v biases (zeros at init; an imported model brings its own)
            self.bq = nnx.Param(jnp.zeros((h, dh), DTYPES[cfg.param_dtype]), out_sharding=("heads", "head_dim"),
                                eager_sharding=False)
            self.bk = nnx.Param(jnp.zeros((kv, dh), DTYPES[cfg.param_dtype]), out_sharding=("kv_heads", "head_dim"),
                                eager_sharding=False)
            self.bv = nnx.Param(jnp.zeros((kv, dh), DTYPES[cfg.param_dtype]), out_sharding=("kv_heads", "head_dim"),
                                eager_sharding=False)
        if cfg.qk_norm:  # per-head RMSNorm of q and k before RoPE (OLMo-2, Qwen-3)
            self.q_norm = ones_param((dh,), ("head_dim",), cfg.param_dtype)
            self.k_norm = ones_param((dh,), ("head_dim",), cfg.param_dtype)
        self.qk_norm = cfg.qk_norm
        self.eps = cfg.norm_eps
        self.dtype = DTYPES[cfg.dtype]
        self.impl = cfg.attention_impl

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array) -> jax.Array:
        dt = self.dtype
        b, t, d = x.shape
        rows = x.reshape(b * t, d)  # 2-D matmuls: see models/layers.py MLP for why

        def project(w: nnx.Param, name: str) -> jax.Array:
            _, heads, dh = w.shape
            out = rows @ w[...].astype(dt).reshape(d, heads * dh)
            return checkpoint_name(out.reshape(b, t, heads, dh), name)

        q, k, v = project(self.wq, "query_proj"), project(self.wk, "key_proj"), project(self.wv, "value_proj")
        if hasattr(self, "bq"):
            q, k, v = (x + b[...].astype(dt) for x, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if self.qk_norm:
            q = rms_norm(q, self.q_norm[...], self.eps)
            k = rms_norm(k, self.k_norm[...], self.eps)
        q = constrain(apply_rope(q, positions, rope_freqs), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, rope_freqs), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        # Plain attention, or context-parallel when the mesh splits the sequence.
        out = context_attention(q, k, v, segment_ids=segment_ids, impl=self.impl)
        out = checkpoint_name(out, "attn_out")
        heads, dh = out.shape[2:]
        return (out.reshape(b * t, heads * dh) @ self.wo[...].astype(dt).reshape(heads * dh, d)).reshape(b, t, d)
