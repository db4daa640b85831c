"""Tests for multi-head latent attention (models/mla.py): against an explicit numpy
computation on reconstructed K/V (with and without decoupled RoPE, low-rank queries and
YaRN's softmax scale), causality of an MLA + MoE model, YaRN frequencies, and the
parameter / FLOP accounting.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfra.config import ConfigError, load_config
from jaxinfra.metrics import flops_per_token, param_counts
from jaxinfra.state import model_graphdef
from models import ModelConfig, Transformer
from models.layers import rope_frequencies, yarn_softmax_scale
from models.mla import MLA

D, H = 32, 4
# No rope split, full-rank queries, a latent as wide as the model: plain attention on K/V
# reconstructed from the latent. d_qk = 8, d_v = 6 (they differ, as in DeepSeek).
PLAIN = ModelConfig(vocab_size=64, d_model=D, num_layers=2, num_heads=H, mlp_dim=64, attention_type="mla",
                    q_lora_rank=None, kv_lora_rank=D, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=6)
# Everything on: query latent, decoupled RoPE (4 of 12 qk dims), YaRN x4 (scale 1.28^2).
FULL = dataclasses.replace(PLAIN, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, rope_scaling_factor=4.0,
                           rope_scaling_type="yarn", rope_original_max_len=8, rope_theta=100.0)
B, T = 2, 16


@functools.cache
def layer_params(cfg: ModelConfig):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MLA(cfg, nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def fill(path, x):
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        value = 1 + 0.1 * rng.standard_normal(x.shape) if name.endswith("norm") else 0.3 * rng.standard_normal(x.shape)
        return jnp.asarray(value, x.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(fill, abstract)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, x, positions, segment_ids, freqs):
    return nnx.merge(graphdef, state)(x, positions, segment_ids, freqs)


def _packed():
    """Row 0: documents of 9 and 5 tokens then 2 padding; row 1: one document."""
    seg = np.array([[1] * 9 + [2] * 5 + [0] * 2, [1] * T], np.int32)
    pos = np.array([list(range(9)) + list(range(5)) + [0, 0], list(range(T))], np.int32)
    x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
    return x, pos, seg


def np_yarn_frequencies(dim, base, factor, orig, beta_fast, beta_slow):
    """YaRN as in DeepSeek-V3's reference inference code (precompute_freqs_cis)."""
    freqs = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    corr = lambda rot: dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth


def np_rope(x, pos, freqs):
    """Rotate-half RoPE on [B, T, H, D] in float64."""
    ang = pos[:, :, None, None] * freqs
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def np_rms(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_mla(cfg: ModelConfig, p, x, pos, seg):
    """Explicit MLA: reconstruct per-head K/V from the latent, then masked softmax attention."""
    g = lambda name: np.asarray(p[name][...], np.float64)  # noqa: E731
    x = x.astype(np.float64)
    nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = np.einsum("btd,dhk->bthk", x, g("wq"))
    else:
        q = np.einsum("btr,rhk->bthk", np_rms(x @ g("wq_a"), g("q_norm")), g("wq_b"))
    kv_a = x @ g("wkv_a")
    latent = np_rms(kv_a[..., :cfg.kv_lora_rank], g("kv_norm"))
    kv = np.einsum("btr,rhk->bthk", latent, g("wkv_b"))
    k, v = kv[..., :nope], kv[..., nope:]
    assert v.shape[-1] == dv  # wkv_b holds [k_nope | v] per head
    if rope:
        freqs = np_yarn_frequencies(rope, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_max_len,
                                    cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow)
        q = np.concatenate([q[..., :nope], np_rope(q[..., nope:], pos, freqs)], -1)
        k_rope = np_rope(kv_a[..., None, cfg.kv_lora_rank:], pos, freqs)  # one rope key for all heads
        k = np.concatenate([k, np.repeat(k_rope, cfg.num_heads, axis=2)], -1)
    scale = (nope + rope) ** -0.5
    if cfg.rope_scaling_factor:
        scale *= (0.1 * math.log(cfg.rope_scaling_factor) + 1) ** 2  # YaRN mscale, applied to q and k
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = (np.arange(T)[None, :] <= np.arange(T)[:, None])[None] & (seg[:, :, None] == seg[:, None, :])
    s = np.where(visible[:, None], s, -np.inf)
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", probs, v)
    return np.einsum("bqhd,hde->bqe", o, g("wo"))


@pytest.mark.parametrize("cfg", [PLAIN, FULL], ids=["latent-no-rope", "q-lora-decoupled-rope-yarn"])
def test_mla_equals_explicit_attention_on_reconstructed_kv(cfg):
    graphdef, params = layer_params(cfg)
    x, pos, seg = _packed()
    got = np.asarray(_apply(graphdef, params, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg),
                            rope_frequencies(cfg)))
    want = np_mla(cfg, params, x, pos, seg)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_yarn_frequencies_and_softmax_scale():
    cfg = dataclasses.replace(FULL, qk_rope_head_dim=64, rope_theta=10000.0, rope_scaling_factor=40.0,
                              rope_original_max_len=4096)
    want = np_yarn_frequencies(64, 10000.0, 40.0, 4096, 32.0, 1.0)
    got = np.asarray(rope_frequencies(cfg), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    base = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    assert np.allclose(got[:4], base[:4]) and np.allclose(got[-4:], base[-4:] / 40)  # extrapolated / interpolated
    assert 0 < np.sum(~np.isclose(got, base) & ~np.isclose(got, base / 40))  # and a ramp between
    # DeepSeek-V3: softmax scale x (0.1 * 1.0 * ln 40 + 1)^2 = 1.8738...
    assert yarn_softmax_scale(cfg) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert yarn_softmax_scale(PLAIN) == 1.0


# ---------------------------------------------------------------- causality (model level)

CAUSAL = dataclasses.replace(FULL, rope_scaling_factor=None, tie_embeddings=False, moe_num_experts=4, moe_top_k=2,
                             moe_mlp_dim=16, moe_shared_experts=1, moe_first_dense_layers=1,
                             moe_dispatch="dropless")
PREFIX_T = 7


def test_mla_moe_model_is_causal():
    """Loss at position t: exactly zero gradient into embedding rows of tokens that appear
    only after t, and the logits up to t do not change when every later token does."""
    params = nnx.state(nnx.eval_shape(lambda: Transformer(CAUSAL, nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), params)
    graphdef = model_graphdef(CAUSAL)

    @jax.jit
    def grad_at_t(p, tokens):
        def loss(p):
            lg = nnx.merge(graphdef, p)(tokens)
            return jax.nn.logsumexp(lg[0, PREFIX_T]) - lg[0, PREFIX_T, 3], lg

        return jax.grad(loss, has_aux=True)(p)

    prefix = rng.integers(0, 16, PREFIX_T + 1)
    tokens_a = jnp.asarray(np.concatenate([prefix, rng.integers(32, 48, T - PREFIX_T - 1)])[None], jnp.int32)
    tokens_b = jnp.asarray(np.concatenate([prefix, rng.integers(48, 64, T - PREFIX_T - 1)])[None], jnp.int32)
    g_a, lg_a = grad_at_t(params, tokens_a)
    g_b, lg_b = grad_at_t(params, tokens_b)
    embed = np.asarray(g_a["embed"][...])
    assert np.all(embed[32:64] == 0.0)
    assert all(np.linalg.norm(embed[t]) > 0 for t in np.unique(prefix))
    np.testing.assert_array_equal(np.asarray(lg_a)[0, :PREFIX_T + 1], np.asarray(lg_b)[0, :PREFIX_T + 1])
    for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- accounting and config


def _abstract(cfg):
    return nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param))


@pytest.mark.parametrize("cfg", [PLAIN, FULL, CAUSAL], ids=["plain", "full", "mla-moe"])
def test_param_and_flop_counts_match_instantiated_model(cfg):
    flat = _abstract(cfg)
    assert param_counts(cfg)["total"] == sum(math.prod(v.shape) for _, v in flat)
    if cfg.is_moe:
        return
    # Matmul parameters counted from the shapes: everything but norm scales and the untied input table.
    n = sum(math.prod(v.shape) for path, v in flat
            if not path[-1].endswith(("scale", "norm")) and not (path == ("embed",) and not cfg.tie_embeddings))
    dqk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    for seq in (16, 256):
        assert flops_per_token(cfg, seq) == 6 * n + 3 * cfg.num_layers * 2 * H * (dqk + dv) * seq


@pytest.mark.parametrize("override, key", [
    ("model.qk_rope_head_dim=3", "model.qk_rope_head_dim"),
    ("model.qk_norm=true", "model.qk_norm"),
    ("model.kv_lora_rank=0", "model.kv_lora_rank"),
    ("model.num_kv_heads=2", "model.num_kv_heads"),
])
def test_bad_mla_config_names_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("deepseek-tiny", [override])
