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

Training (and inference prefill) use the explicit (non-absorbed) form: K and V per head go
through the shared attention entry `sharding.context.attention` with d_qk != d_v. The W_dkv
and W_kr projections are one [d, kv_lora_rank + qk_rope_head_dim] matrix (one matmul).
Decoding (`MLA.decode`) caches only c_kv and k_rope and, by default, absorbs W_uk into the
query and W_uv into the output (DeepSeek-V2 sec. 2.1.2; see docs/inference.md).
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.attention import Cache, decode_attention
from models.config import ModelConfig
from models.layers import DTYPES, apply_rope, norm_param, param, rms_norm, yarn_softmax_scale
from models.lora_config import NO_LORA, LoraConfig
from models.project import Projections, prepare_weights, project_attr, slice_weight, weight
from models.quant import dequantize
from models.quant_config import NO_QUANT, QuantConfig
from sharding.context import attention as context_attention
from sharding.plan import SINGLE_DEVICE, ParallelPlan


class MLA(nnx.Module):
    # weight -> (projection name, contracted dims): models/project.py prepare_weights
    PROJECTIONS: ClassVar[Projections] = {
        "wq": ("mla.q", (-3,)), "wq_a": ("mla.q_a", (-2,)), "wq_b": ("mla.q_b", (-3,)),
        "wkv_a": ("mla.kv_a", (-2,)), "wkv_b": ("mla.kv_b", (-3,)), "wo": ("mla.o", (-3, -2))}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA):
        d, h, std, dtype = cfg.d_model, cfg.num_heads, cfg.init_std, cfg.param_dtype
        nope, rope, dv, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.wq = param(rngs, (d, h, nope + rope), ("embed", "heads", "head_dim"), std, dtype)
        else:
            self.wq_a = param(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), std, dtype)
            self.q_norm = norm_param((cfg.q_lora_rank,), ("q_lora",), cfg)
            self.wq_b = param(rngs, (cfg.q_lora_rank, h, nope + rope), ("q_lora", "heads", "head_dim"), std, dtype)
        self.wkv_a = param(rngs, (d, rank + rope), ("embed", "kv_lora"), std, dtype)
        self.kv_norm = norm_param((rank,), ("kv_lora",), cfg)
        self.wkv_b = param(rngs, (rank, h, nope + dv), ("kv_lora", "heads", "head_dim"), std, dtype)
        self.wo = param(rngs, (h, dv, d), ("heads", "head_dim", "embed"), std / math.sqrt(2 * cfg.num_layers), dtype)
        self.nope, self.rope, self.dv = nope, rope, dv
        self.eps, self.norm_offset = cfg.latent_norm_eps, cfg.norm_weight_offset
        self.impl = cfg.attention_impl
        # The attention entry scales by d_qk^-1/2; a different scale is folded into q.
        self.q_scale = yarn_softmax_scale(cfg)
        prepare_weights(self, quant, self.PROJECTIONS, DTYPES[cfg.dtype], lora, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array, *, window: None = None, plan: ParallelPlan = SINGLE_DEVICE) -> jax.Array:
        # `window`: always None (model.sliding_window is refused with MLA); the blocks pass it to every attention
        return self._attend(x, positions, segment_ids, rope_freqs, plan)[0]

    def prefill(self, x: jax.Array, positions: jax.Array, rope_freqs: jax.Array, *, window: None = None,
                plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        """The training computation on a (right-padded) prompt, plus what the cache keeps of
        each token: {"latent": c_kv [B, 1, T, kv_lora_rank], "k_rope": [B, 1, T, qk_rope_head_dim]}
        (the cache layout: one "head", shared by all query heads)."""
        return self._attend(x, positions, None, rope_freqs, plan)

    def decode(self, x: jax.Array, positions: jax.Array, rope_freqs: jax.Array, cache: Cache,
               absorb: bool = True, *, window: None = None,
               plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        """One new token per row against the cached latents (see Attention.decode for the
        arguments; cache {"latent" [B, 1, S, rank], "k_rope" [B, 1, S, rope]}).

        absorb=True (DeepSeek-V2 sec. 2.1.2): W_uk is folded into the query and W_uv into
        the output, so the heads attend straight over the latent: as MQA with one shared
        key [c_kv; k_rope] of width rank + rope and value c_kv, then o_h = (p . c_kv) W_uv_h.
        Per step, layer and row that costs ~2 H S (2 rank + rope) + 2 H (nope + v) rank FLOPs;
        reconstructing K/V for all S cached tokens costs 2 S rank H (nope + v) more.
        absorb=False reconstructs K and V from the cached latent and runs the training form."""
        q, latent, k_rope = self._project(x, positions, rope_freqs)  # [B,1,H,nope+rope], [B,1,rank], [B,1,rope]
        new = self._entries(latent, k_rope, plan)
        scale = (self.nope + self.rope) ** -0.5  # the training attention's default (q_scale is in q)
        wkv_b = weight(self, "wkv_b")
        w_uk = slice_weight(wkv_b, (..., slice(None, self.nope)))
        w_uv = slice_weight(wkv_b, (..., slice(self.nope, None)))
        q_nope, q_rope = q[..., :self.nope], q[..., self.nope:]
        # parts: (queries, cached keys, new keys, key scales of an int8 cache or None)
        rope = ([q_rope], [cache["k_rope"]], [new["k_rope"]], [cache.get("k_rope_scale")]) if self.rope else [[]] * 4
        latent_scale = cache.get("latent_scale")
        if absorb:
            q_lat = project_attr(self, "bthn,rhn->bthr", q_nope, "wkv_b", w=w_uk)  # [B, 1, H, rank]
            o_lat = decode_attention([q_lat, *rope[0]], [cache["latent"], *rope[1]], [new["latent"], *rope[2]],
                                     cache["latent"], new["latent"], positions[:, 0], scale,
                                     k_scales=[latent_scale, *rope[3]], v_scale=latent_scale)  # [B, 1, H, rank]
            out = project_attr(self, "bthr,rhv->bthv", o_lat, "wkv_b", w=w_uv)
        else:  # K_nope and V of every cached token from the latent: [B, H, S, nope], [B, H, S, v]
            cached = cache["latent"] if latent_scale is None else dequantize(cache["latent"], latent_scale, q.dtype)
            up = lambda c, w: project_attr(self, "bsr,rhd->bhsd", c[:, 0], "wkv_b", w=w)  # noqa: E731
            out = decode_attention([q_nope, *rope[0]], [up(cached, w_uk), *rope[1]],
                                   [up(new["latent"], w_uk), *rope[2]], up(cached, w_uv),
                                   up(new["latent"], w_uv), positions[:, 0], scale, k_scales=[None, *rope[3]])
        return self._output(out), new

    def _project(self, x: jax.Array, positions: jax.Array,
                 rope_freqs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """(q [B, T, H, nope + rope] with RoPE and the YaRN factor applied, c_kv [B, T, rank],
        k_rope [B, T, rope] with RoPE, or None without a rope part)."""
        b, t, d = x.shape
        rows = x.reshape(b * t, d)  # 2-D matmuls: see models/layers.py MLP for why
        if hasattr(self, "wq"):
            q = self._up(rows, "wq", b, t)
        else:
            q_a = rms_norm(project_attr(self, "nd,dr->nr", rows, "wq_a"), self.q_norm[...], self.eps, self.norm_offset)
            q = self._up(q_a, "wq_b", b, t)
        kv_a = project_attr(self, "nd,dr->nr", rows, "wkv_a")
        latent = rms_norm(kv_a[:, :-self.rope] if self.rope else kv_a, self.kv_norm[...], self.eps, self.norm_offset)
        k_rope = None
        if self.rope:
            q_rope = apply_rope(q[..., self.nope:], positions, rope_freqs)
            k_rope = apply_rope(kv_a[:, -self.rope:].reshape(b, t, 1, self.rope), positions, rope_freqs)[:, :, 0]
            q = jnp.concatenate([q[..., :self.nope], q_rope], axis=-1)
        if self.q_scale != 1.0:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        return q, latent.reshape(b, t, -1), k_rope

    def _up(self, inputs: jax.Array, attr: str, b: int, t: int) -> jax.Array:
        """[N, r] @ [r, H, D] -> [B, T, H, D]."""
        out = project_attr(self, "nr,rhk->nhk", inputs, attr)
        return out.reshape(b, t, *out.shape[1:])

    def _keys_values(self, latent: jax.Array, k_rope: jax.Array | None, b: int, t: int,
                     heads: int) -> tuple[jax.Array, jax.Array]:
        """K [B, T, H, nope + rope] and V [B, T, H, v] up-projected from c_kv (the explicit form)."""
        kv = self._up(latent.reshape(b * t, -1), "wkv_b", b, t)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        if k_rope is None:
            return k_nope, v
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], (b, t, heads, self.rope))], axis=-1)
        return k, v

    def _entries(self, latent: jax.Array, k_rope: jax.Array | None, plan: ParallelPlan) -> Cache:
        """c_kv [B, T, rank], k_rope [B, T, rope] -> the cache layout [B, 1, T, ...] (one shared head)."""
        entries = {"latent": plan.constrain(latent[:, None], ("batch", None, "kv_length", "kv_lora"))}
        if k_rope is not None:
            entries["k_rope"] = plan.constrain(k_rope[:, None], ("batch", None, "kv_length", "head_dim"))
        return entries

    def _output(self, out: jax.Array) -> jax.Array:
        b, t, heads, dv = out.shape
        return project_attr(self, "nhv,hvd->nd", out.reshape(b * t, heads, dv), "wo").reshape(b, t, -1)

    def _attend(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                rope_freqs: jax.Array, plan: ParallelPlan) -> tuple[jax.Array, Cache]:
        b, t, _ = x.shape
        q, latent, k_rope = self._project(x, positions, rope_freqs)
        heads = q.shape[2]
        k, v = self._keys_values(latent, k_rope, b, t, heads)
        q = plan.constrain(checkpoint_name(q, "query_proj"), ("batch", "length", "heads", "head_dim"))
        k = plan.constrain(checkpoint_name(k, "key_proj"), ("batch", "length", "heads", "head_dim"))
        v = plan.constrain(checkpoint_name(v, "value_proj"), ("batch", "length", "heads", "head_dim"))
        out = context_attention(q, k, v, segment_ids=segment_ids, impl=self.impl, plan=plan)
        return self._output(checkpoint_name(out, "attn_out")), self._entries(latent, k_rope, plan)
