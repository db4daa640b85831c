"""Multi-head attention with grouped K/V heads: MHA (kv = heads), GQA, MQA (kv = 1)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.layers import DTYPES, apply_rope, norm_param, param, rms_norm, rms_norm_heads, zeros_bias
from models.lora_config import NO_LORA, LoraConfig
from models.project import Projections, prepare_weights, project_attr
from models.quant_config import NO_QUANT, QuantConfig
from sharding.context import attention as context_attention
from sharding.plan import SINGLE_DEVICE, ParallelPlan

Cache = dict[str, jax.Array]  # one layer's cache (or one step's new entries), by name


class Attention(nnx.Module):
    # weight -> (projection name, contracted dims): models/project.py prepare_weights
    PROJECTIONS: ClassVar[Projections] = {
        "wq": ("attention.q", (-3,)), "wk": ("attention.k", (-3,)), "wv": ("attention.v", (-3,)),
        "wo": ("attention.o", (-3, -2))}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA):
        d, h, kv, dh, std = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim, cfg.init_std
        self.wq = param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), std, cfg.param_dtype)
        self.wk = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), std, cfg.param_dtype)
        self.wv = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), std, cfg.param_dtype)
        self.wo = param(rngs, (h, dh, d), ("heads", "head_dim", "embed"),
                        std / math.sqrt(2 * cfg.num_layers), cfg.param_dtype)
        if cfg.qkv_bias:  # Qwen2's q/k/v biases (zeros at init; an imported model brings its own)
            self.bq = zeros_bias((h, dh), ("heads", "head_dim"), cfg.param_dtype)
            self.bk = zeros_bias((kv, dh), ("kv_heads", "head_dim"), cfg.param_dtype)
            self.bv = zeros_bias((kv, dh), ("kv_heads", "head_dim"), cfg.param_dtype)
        if cfg.attn_out_bias:  # gpt-oss's o_proj bias (its q/k/v ones are qkv_bias)
            self.bo = zeros_bias((d,), ("embed",), cfg.param_dtype)
        if cfg.qk_norm and cfg.qk_norm_scope == "full":  # over the whole q / k projection before RoPE (OLMo 2)
            # Flat like HF's and like the block norms (1-D: a norm scale to the optimizer, no decay).
            self.q_norm = norm_param((h * dh,), ("norm",), cfg)
            self.k_norm = norm_param((kv * dh,), ("norm",), cfg)
        elif cfg.qk_norm:  # per-head RMSNorm of q and k before RoPE (Qwen3)
            self.q_norm = norm_param((dh,), ("head_dim",), cfg)
            self.k_norm = norm_param((dh,), ("head_dim",), cfg)
        if cfg.attention_sinks:  # gpt-oss: one logit per head in the softmax denominator (a Bias: no decay)
            self.sinks = zeros_bias((h,), ("heads",), cfg.param_dtype)
        self.qk_norm = cfg.qk_norm
        self.qk_norm_full = cfg.qk_norm and cfg.qk_norm_scope == "full"
        self.eps, self.norm_offset = cfg.norm_eps, cfg.norm_weight_offset
        self.softcap = cfg.attn_logit_softcap
        self.q_prescale = cfg.query_prescale
        self.impl = cfg.attention_impl
        prepare_weights(self, quant, self.PROJECTIONS, DTYPES[cfg.dtype], lora, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array, *, window: int | None = None,
                 plan: ParallelPlan = SINGLE_DEVICE) -> jax.Array:
        """`window`: a sliding layer's window (a query sees itself and the window - 1 tokens before it)."""
        return self._attend(x, positions, segment_ids, rope_freqs, plan, window)[0]

    def prefill(self, x: jax.Array, positions: jax.Array, rope_freqs: jax.Array, *, window: int | None = None,
                plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        """The training computation on a (right-padded) prompt, plus what the cache keeps of
        each token: {"k", "v"} [batch, kv_heads, length, head_dim] (k after RoPE; the cache layout)."""
        y, k, v = self._attend(x, positions, None, rope_freqs, plan, window)
        return y, cache_entries(k, v, plan)

    def decode(self, x: jax.Array, positions: jax.Array, rope_freqs: jax.Array, cache: Cache,
               absorb: bool = True, *, window: int | None = None,
               plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        """One new token per row against this layer's cache.

        x [B, 1, d]; positions [B, 1] (also the token's cache slot: slots below it are the
        row's earlier tokens); cache {"k", "v"} [B, kv_heads, S, head_dim]. Returns the
        output [B, 1, d] and the token's own entries {"k", "v"} [B, kv_heads, 1, head_dim]
        (the caller writes them at `positions`). `absorb` only matters for MLA. `window`: a sliding
        layer's, whose cache is a ring buffer of S slots (slot positions % S; `visible_slots`)."""
        q, k, v = self._qkv(x, positions, rope_freqs, plan)
        new = cache_entries(k, v, plan)
        out = decode_attention([q], [cache["k"]], [new["k"]], cache["v"], new["v"], positions[:, 0],
                               q.shape[-1] ** -0.5, k_scales=[cache.get("k_scale")], v_scale=cache.get("v_scale"),
                               softcap=self.softcap, sinks=self._sinks(), window=window)
        return self._output(out), new

    def _qkv(self, x: jax.Array, positions: jax.Array, rope_freqs: jax.Array,
             plan: ParallelPlan) -> tuple[jax.Array, jax.Array, jax.Array]:
        dt = self.dtype
        b, t, d = x.shape
        rows = x.reshape(b * t, d)  # 2-D matmuls: see models/layers.py MLP for why

        def project(attr: str, name: str) -> jax.Array:
            out = project_attr(self, "nd,dhk->nhk", rows, attr)
            return checkpoint_name(out.reshape(b, t, *out.shape[1:]), name)

        q, k, v = project("wq", "query_proj"), project("wk", "key_proj"), project("wv", "value_proj")
        if hasattr(self, "bq"):
            q, k, v = (x + b[...].astype(dt) for x, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if self.qk_norm:
            norm = rms_norm_heads if self.qk_norm_full else rms_norm
            q = norm(q, self.q_norm[...], self.eps, self.norm_offset)
            k = norm(k, self.k_norm[...], self.eps, self.norm_offset)
        q = apply_rope(q, positions, rope_freqs)
        if self.q_prescale != 1.0:  # a softmax scale other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar)
            q = q * jnp.asarray(self.q_prescale, q.dtype)
        q = plan.constrain(q, ("batch", "length", "heads", "head_dim"))
        k = plan.constrain(apply_rope(k, positions, rope_freqs), ("batch", "length", "kv_heads", "head_dim"))
        v = plan.constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def _sinks(self) -> jax.Array | None:
        return self.sinks[...] if hasattr(self, "sinks") else None

    def _output(self, out: jax.Array) -> jax.Array:
        b, t, heads, dh = out.shape
        y = project_attr(self, "nhk,hkd->nd", out.reshape(b * t, heads, dh), "wo")
        if hasattr(self, "bo"):
            y = y + self.bo[...].astype(y.dtype)
        return y.reshape(b, t, -1)

    def _attend(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, rope_freqs: jax.Array,
                plan: ParallelPlan, window: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = self._qkv(x, positions, rope_freqs, plan)
        # Plain attention, or context-parallel when the plan's mesh splits the sequence.
        out = context_attention(q, k, v, segment_ids=segment_ids, impl=self.impl, plan=plan, softcap=self.softcap,
                                sinks=self._sinks(), window=window)
        out = checkpoint_name(out, "attn_out")
        return self._output(out), k, v


def cache_entries(k: jax.Array, v: jax.Array, plan: ParallelPlan = SINGLE_DEVICE) -> Cache:
    """Projected k, v [B, T, kv_heads, head_dim] -> the cache layout [B, kv_heads, T, head_dim]."""
    names = ("batch", "kv_heads", "kv_length", "head_dim")
    return {"k": plan.constrain(jnp.swapaxes(k, 1, 2), names), "v": plan.constrain(jnp.swapaxes(v, 1, 2), names)}


def visible_slots(s_len: int, positions: jax.Array, window: int | None = None) -> jax.Array:
    """[B, S] which cache slots row b's new token (at positions[b]) attends besides itself. Global
    cache: slot j holds position j, visible when j < positions[b]. Sliding layer (`window`): the cache
    is a ring of S slots, slot j holding the row's newest position q < positions[b] with q = j (mod S);
    visible when written (q >= 0) and inside the window (q > positions[b] - window), which masks the
    slot the new token is about to overwrite (models/cache.py)."""
    slots = jnp.arange(s_len)[None, :]
    if window is None:
        return slots < positions[:, None]
    last = positions[:, None] - 1
    held = last - jnp.mod(last - slots, s_len)
    return (held >= 0) & (held > positions[:, None] - window)


def decode_attention(qs: Sequence[jax.Array], ks: Sequence[jax.Array], k_news: Sequence[jax.Array],
                     v_cache: jax.Array, v_new: jax.Array, positions: jax.Array, scale: float,
                     k_scales: Sequence[jax.Array | None] | None = None,
                     v_scale: jax.Array | None = None, softcap: float | None = None,
                     sinks: jax.Array | None = None, window: int | None = None) -> jax.Array:
    """Softmax attention of one query per row over its cached keys plus its own new key.

    Scores are sums over parts, q . k = sum_i q_i . k_i, so a key kept in pieces (MLA: latent
    and rope key) is read where it lies, never concatenated. Part i: query qs[i] [B, 1, Hq, d_i]
    (as projected), cached keys ks[i] [B, Hk_i, S, d_i] and the new token's key k_news[i]
    [B, Hk_i, 1, d_i] (not yet in the cache), in the heads-major cache layout. Values:
    v_cache [B, Hv, S, d_v], v_new [B, Hv, 1, d_v]. Query head h reads key/value head
    h // (Hq / H) (GQA/MQA; MLA's shared latent has H = 1). positions [B]: cache slots
    j < positions[b] are row b's earlier tokens, later slots (padding, stale entries) are
    masked. Scores and softmax in float32 as in training; result [B, 1, Hq, d_v] in q's dtype.

    Heads-major caches make both products batched over (batch, heads) with no transpose: with
    a [B, S, heads, d] cache XLA:CPU copied the whole cache into that order every step.

    An int8 cache (models/cache.py) passes its per-token-per-head scales: k_scales[i] [B, Hk_i, S, 1]
    multiply part i's scores, v_scale [B, Hv, S, 1] the probabilities; the int8 values enter the
    products converted, never dequantized as a whole. softcap: scores -> softcap * tanh(scores / softcap)
    after scaling (Gemma 2), as in training.

    sinks [Hq] (gpt-oss attention sinks): each head's logit joins the denominator, with no value.
    window (a sliding layer's): the cache is that layer's ring buffer (`visible_slots`).
    """
    b, _, hq, _ = qs[0].shape
    dt = qs[0].dtype
    s_len, hv, dv = v_cache.shape[2], v_cache.shape[1], v_cache.shape[-1]
    s_old = s_new = jnp.zeros((), jnp.float32)
    for q, k, k_new, k_scale in zip(qs, ks, k_news, k_scales or [None] * len(qs)):
        hk = k.shape[1]
        qg = q.reshape(b, hk, hq // hk, q.shape[-1])
        part = jnp.einsum("bkgd,bksd->bkgs", qg, k.astype(dt), preferred_element_type=jnp.float32)
        if k_scale is not None:
            part = part * k_scale[:, :, None, :, 0]
        s_old = s_old + part.reshape(b, hq, s_len)
        s_new = s_new + jnp.einsum("bkgd,bkd->bkg", qg, k_new[:, :, 0],
                                   preferred_element_type=jnp.float32).reshape(b, hq)
    s_old, s_new = s_old * scale, s_new * scale
    if softcap is not None:
        s_old, s_new = (softcap * jnp.tanh(s / softcap) for s in (s_old, s_new))
    visible = visible_slots(s_len, positions, window)  # [B, S]
    s_old = jnp.where(visible[:, None, :], s_old, -jnp.inf)
    m = jnp.maximum(jnp.max(s_old, axis=-1), s_new)  # finite: the new key is always visible
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32))
    p_old = jnp.exp(s_old - m[..., None])
    p_new = jnp.exp(s_new - m)
    denom = jnp.sum(p_old, axis=-1) + p_new  # [B, Hq]
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32) - m)
    pg = p_old.reshape(b, hv, hq // hv, s_len)
    if v_scale is not None:
        pg = pg * v_scale[:, :, None, :, 0]
    o = jnp.einsum("bkgs,bksd->bkgd", pg.astype(dt), v_cache.astype(dt), preferred_element_type=jnp.float32)
    o = o + p_new.reshape(b, hv, hq // hv, 1) * v_new[:, :, None, 0, :].astype(jnp.float32)
    o = o.reshape(b, hq, dv) / denom[..., None]
    return o.reshape(b, 1, hq, dv).astype(qs[0].dtype)
