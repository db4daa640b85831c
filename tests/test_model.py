"""Tests for models/: causality, GQA/MQA vs MHA, scan vs unrolled, remat, packing, RoPE,
parameter/FLOP counts, dtypes, soft-cap and z-loss.

Every check is against an independent reference (a second model run with rearranged
weights, a hand computation, numpy) rather than the code under test. All model runs
share one tiny float32 config (BASE) and a few jitted functions, so each distinct
shape compiles once for the whole module.
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

from jaxinfra.loss import cross_entropy_sums
from jaxinfra.metrics import flops_per_token, param_counts
from jaxinfra.state import init_params, model_graphdef
from jaxinfra.step import loss_fn
from models import ModelConfig, Transformer
from models.config import REMAT_POLICIES
from models.layers import apply_rope, rope_frequencies

BASE = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   mlp_dim=64, tie_embeddings=True, scan_layers=True, remat_policy="none",
                   param_dtype="float32", dtype="float32")
B, T = 2, 16


def variant(**changes) -> ModelConfig:
    return dataclasses.replace(BASE, **changes)


# ---------------------------------------------------------------- shared jitted functions

@functools.cache
def params_for(cfg: ModelConfig, seed: int = 0):
    """Random params in the model's own (stacked) layout, filled from numpy: no init compile.

    Norm scales get values around 1 (not exactly 1) so that they matter in every check."""
    rng = np.random.default_rng(seed)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)

    def fill(path, x):
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        if names[-1] in ("scale", "q_norm", "k_norm"):
            value = 1 + 0.1 * rng.standard_normal(x.shape)
        else:
            value = cfg.init_std * rng.standard_normal(x.shape)
        return jnp.asarray(value, x.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens, positions, segment_ids):
    return nnx.merge(graphdef, params)(tokens, positions, segment_ids)


def logits(cfg, params, tokens, positions=None, segment_ids=None) -> np.ndarray:
    return np.asarray(_logits(model_graphdef(cfg), params, tokens, positions, segment_ids))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_and_grad(graphdef, cfg, params, batch):
    return jax.value_and_grad(loss_fn(graphdef, cfg))(params, batch)


def loss_and_grad(cfg, params, batch):
    return jax.device_get(_loss_and_grad(model_graphdef(cfg), cfg, params, batch))


def _tokens(seed=0, shape=(B, T)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, BASE.vocab_size, size=shape), jnp.int32)


def _packed_batch():
    """Row 0: two documents (9 + 5 tokens) and 2 padding; row 1: one document filling the row."""
    rng = np.random.default_rng(1)
    seg = np.array([[1] * 9 + [2] * 5 + [0] * 2, [1] * T], np.int32)
    pos = np.array([list(range(9)) + list(range(5)) + [0, 0], list(range(T))], np.int32)
    inputs = rng.integers(0, BASE.vocab_size, size=(B, T)).astype(np.int32)
    targets = rng.integers(0, BASE.vocab_size, size=(B, T)).astype(np.int32)
    return {k: jnp.asarray(v) for k, v in
            dict(inputs=inputs, targets=targets, segment_ids=seg, positions=pos).items()}


def _assert_trees_close(a, b, rtol, atol):
    assert len(jax.tree.leaves(a)) == len(jax.tree.leaves(b))
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def _leaf(tree, *keys) -> np.ndarray:
    node = tree
    for k in keys:
        node = node[k]
    return np.asarray(node[...])


def _set(params, keys, value):
    """A copy of `params` with the variable at `keys` set to `value`."""
    def one(path, x):
        names = tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))
        return jnp.asarray(value, x.dtype) if names == tuple(keys) else x

    return jax.tree_util.tree_map_with_path(one, params)


def test_test_params_have_the_layout_of_init_params():
    """The numpy-filled params used below have exactly init_params' tree, shapes and dtypes."""
    for cfg in (BASE, variant(tie_embeddings=False, qk_norm=True)):
        want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        got = params_for(cfg)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert (g.shape, g.dtype) == (w.shape, w.dtype)


# ---------------------------------------------------------------- 1. causality

PREFIX_T = 7  # the loss is taken at this position
TARGET = 20
PREFIX_IDS = np.arange(0, 16)  # token ids used at positions <= PREFIX_T
FUTURE_IDS = np.arange(32, 48)  # token ids used only at positions > PREFIX_T
OTHER_FUTURE_IDS = np.arange(48, 64)


@functools.partial(jax.jit, static_argnums=0)
def _loss_at_t_and_grad(graphdef, params, tokens):
    def loss_t(p):
        lg = nnx.merge(graphdef, p)(tokens)
        return jax.nn.logsumexp(lg[0, PREFIX_T]) - lg[0, PREFIX_T, TARGET], lg

    return jax.grad(loss_t, has_aux=True)(params)


def _causal_tokens(future_ids, seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.choice(PREFIX_IDS, size=PREFIX_T + 1)
    future = rng.choice(future_ids, size=T - PREFIX_T - 1)
    return jnp.asarray(np.concatenate([prefix, future])[None], jnp.int32), prefix


def test_causality_untied_future_embeddings_get_exactly_zero_gradient():
    cfg = variant(tie_embeddings=False)
    params = params_for(cfg)
    graphdef = model_graphdef(cfg)
    tokens, prefix = _causal_tokens(FUTURE_IDS)
    grads, lg = _loss_at_t_and_grad(graphdef, params, tokens)
    g_embed = _leaf(grads, "embed")
    # Rows of tokens that appear only after t: exactly zero (not merely small).
    assert np.all(g_embed[FUTURE_IDS] == 0.0)
    # Rows of tokens at positions <= t all receive gradient.
    for tok in np.unique(prefix):
        assert np.linalg.norm(g_embed[tok]) > 1e-6, f"prefix token {tok} got no gradient"
    # Rows never used at all are zero too (an untied input table is a lookup).
    unused = np.setdiff1d(np.arange(cfg.vocab_size), np.concatenate([prefix, FUTURE_IDS]))
    assert np.all(g_embed[unused] == 0.0)

    # Replacing every future token changes neither the logits up to t nor any gradient.
    tokens2, prefix2 = _causal_tokens(OTHER_FUTURE_IDS)
    np.testing.assert_array_equal(prefix, prefix2)
    grads2, lg2 = _loss_at_t_and_grad(graphdef, params, tokens2)
    np.testing.assert_array_equal(np.asarray(lg)[0, :PREFIX_T + 1], np.asarray(lg2)[0, :PREFIX_T + 1])
    _assert_trees_close(grads, grads2, rtol=0, atol=0)
    assert not np.allclose(np.asarray(lg)[0, PREFIX_T + 1:], np.asarray(lg2)[0, PREFIX_T + 1:])


def test_causality_tied_future_tokens_only_reach_the_loss_through_the_output_layer():
    """With tied embeddings every row feeds the output softmax: d loss_t / d E[v] = p_v * h_t
    for every token v that is neither an input at positions <= t nor the target.

    So future-only rows must receive exactly the same gradient (per unit probability) as
    rows of tokens absent from the sequence, while prefix rows get an extra input-path term.
    """
    cfg = BASE
    params = params_for(cfg)
    graphdef = model_graphdef(cfg)
    tokens, prefix = _causal_tokens(FUTURE_IDS)
    grads, lg = _loss_at_t_and_grad(graphdef, params, tokens)
    g_embed = _leaf(grads, "embed").astype(np.float64)
    p = np.asarray(jax.nn.softmax(np.asarray(lg, np.float64)[0, PREFIX_T]))

    outside = np.setdiff1d(np.arange(cfg.vocab_size), np.concatenate([prefix, [TARGET]]))
    assert set(FUTURE_IDS) <= set(outside)
    per_prob = g_embed[outside] / p[outside, None]  # each row should equal h_t
    h_t = per_prob.mean(axis=0)
    np.testing.assert_allclose(per_prob, np.broadcast_to(h_t, per_prob.shape), rtol=1e-5, atol=1e-6)
    # Prefix rows also get the input-path gradient, so they differ from p_v * h_t.
    for tok in np.unique(prefix):
        assert np.linalg.norm(g_embed[tok] - p[tok] * h_t) > 1e-6, f"prefix token {tok}"

    # And the gradient does not depend on which tokens come after t.
    tokens2, _ = _causal_tokens(OTHER_FUTURE_IDS)
    grads2, lg2 = _loss_at_t_and_grad(graphdef, params, tokens2)
    np.testing.assert_array_equal(np.asarray(lg)[0, :PREFIX_T + 1], np.asarray(lg2)[0, :PREFIX_T + 1])
    _assert_trees_close(grads, grads2, rtol=0, atol=0)


# ---------------------------------------------------------------- 2. GQA / MQA == MHA with repeated K/V


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_kv_equals_mha_with_repeated_heads(kv_heads):
    cfg = variant(num_kv_heads=kv_heads)
    mha = variant(num_kv_heads=None)
    params = params_for(cfg)
    group = cfg.num_heads // kv_heads
    # Stacked layout [layers, d_model, kv_heads, head_dim]; query head h reads kv head h // group,
    # so each kv head is repeated `group` times consecutively.
    mha_params = params
    for name in ("wk", "wv"):
        w = _leaf(params, "layers", "attn", name)
        assert w.shape == (cfg.num_layers, cfg.d_model, kv_heads, cfg.resolved_head_dim)
        mha_params = _set(mha_params, ("layers", "attn", name), np.repeat(w, group, axis=2))
    tokens = _tokens()
    got = logits(cfg, params, tokens)
    want = logits(mha, mha_params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    if kv_heads > 1:  # the other grouping (tile) is a different model: the check is sensitive to order
        tiled = params
        for name in ("wk", "wv"):
            w = _leaf(params, "layers", "attn", name)
            tiled = _set(tiled, ("layers", "attn", name), np.tile(w, (1, 1, group, 1)))
        assert np.max(np.abs(logits(mha, tiled, tokens) - want)) > 1e-4


# ---------------------------------------------------------------- 3/4. scan vs unrolled, remat


@functools.cache
def _reference_loss_and_grad():
    return loss_and_grad(BASE, params_for(BASE), _packed_batch())


def test_scan_equals_unrolled():
    loss_s, grads_s = _reference_loss_and_grad()
    loss_u, grads_u = loss_and_grad(variant(scan_layers=False), params_for(BASE), _packed_batch())
    assert np.isfinite(loss_s)
    np.testing.assert_allclose(loss_u, loss_s, rtol=1e-6)
    _assert_trees_close(grads_u, grads_s, rtol=1e-5, atol=1e-7)


# Every policy under scan; "full" also unrolled (the prevent_cse=True path).
REMAT_CASES = [(p, True) for p in REMAT_POLICIES if p != "none"] + [("full", False)]


@pytest.mark.parametrize("policy, scan", REMAT_CASES,
                         ids=[f"{p}-{'scan' if s else 'unrolled'}" for p, s in REMAT_CASES])
def test_remat_policy_matches_no_remat(policy, scan):
    loss_ref, grads_ref = _reference_loss_and_grad()
    loss, grads = loss_and_grad(variant(remat_policy=policy, scan_layers=scan), params_for(BASE), _packed_batch())
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    _assert_trees_close(grads, grads_ref, rtol=1e-5, atol=1e-7)


def test_loss_fn_matches_numpy_cross_entropy():
    """The mean loss over unmasked tokens, recomputed in float64 from the model's logits."""
    batch = _packed_batch()
    loss, _ = _reference_loss_and_grad()
    lg = logits(BASE, params_for(BASE), batch["inputs"], batch["positions"], batch["segment_ids"]).astype(np.float64)
    ce = _np_logsumexp(lg) - np.take_along_axis(lg, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    mask = np.asarray(batch["segment_ids"]) > 0
    np.testing.assert_allclose(loss, ce[mask].mean(), rtol=1e-6)


# ---------------------------------------------------------------- 5. packing


def test_packed_sequences_match_unpacked():
    """Two documents packed into a row (positions restarting at 0, padding at the end) give the
    same logits as each document run alone at the start of its own row.

    The lone rows are filled after the document with unrelated tokens; by causality
    (tested above) those cannot affect the document's logits."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, BASE.vocab_size, size=6)
    b = rng.integers(0, BASE.vocab_size, size=7)
    pad = T - len(a) - len(b)
    filler = lambda n: rng.integers(0, BASE.vocab_size, size=n)  # noqa: E731
    packed = np.stack([np.concatenate([a, b, filler(pad)]), np.concatenate([b, a, filler(pad)])])
    seg = np.array([[1] * len(a) + [2] * len(b) + [0] * pad, [1] * len(b) + [2] * len(a) + [0] * pad])
    pos = np.array([list(range(len(a))) + list(range(len(b))) + [0] * pad,
                    list(range(len(b))) + list(range(len(a))) + [0] * pad])
    alone = np.stack([np.concatenate([a, filler(T - len(a))]), np.concatenate([b, filler(T - len(b))])])

    params = params_for(BASE)
    lp = logits(BASE, params, jnp.asarray(packed, jnp.int32), jnp.asarray(pos, jnp.int32),
                jnp.asarray(seg, jnp.int32))
    la = logits(BASE, params, jnp.asarray(alone, jnp.int32))
    assert np.all(np.isfinite(lp))
    na, nb = len(a), len(b)
    pairs = [(lp[0, :na], la[0, :na]), (lp[0, na:na + nb], la[1, :nb]),
             (lp[1, :nb], la[1, :nb]), (lp[1, nb:nb + na], la[0, :na])]
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # Hence equal per-document losses (next-token targets inside each document).
    def doc_loss(lg, toks):
        lg = lg[:-1].astype(np.float64)
        return np.sum(_np_logsumexp(lg) - lg[np.arange(len(toks) - 1), toks[1:]])

    np.testing.assert_allclose(doc_loss(lp[0, na:na + nb], b), doc_loss(la[1, :nb], b), rtol=1e-6)
    np.testing.assert_allclose(doc_loss(lp[1, nb:nb + na], a), doc_loss(la[0, :na], a), rtol=1e-6)


def _np_logsumexp(x):
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


# ---------------------------------------------------------------- 7. RoPE


def test_rope_frequencies_default_match_hand_computation():
    cfg = variant(rope_theta=10000.0)
    dh = cfg.resolved_head_dim
    want = 10000.0 ** (-np.arange(0, dh, 2) / dh)
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), want, rtol=1e-6)


def test_rope_matches_hand_rotation_and_preserves_norm():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    positions = rng.integers(0, 50, size=(2, 5)).astype(np.int32)
    freqs = np.asarray(rope_frequencies(BASE), np.float64)
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(freqs, jnp.float32)))

    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # Rotate-half convention: pair (i, i + D/2) rotated by angle position * freq_i.
    ang = positions[..., None, None].astype(np.float64) * freqs  # [B, T, 1, D/2]
    x1, x2 = x[..., :4].astype(np.float64), x[..., 4:].astype(np.float64)
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
    freqs = rope_frequencies(BASE)

    def score(m, n):
        qm = apply_rope(q, jnp.asarray([[m]]), freqs)
        kn = apply_rope(k, jnp.asarray([[n]]), freqs)
        return float(jnp.sum(qm * kn))

    for m, n in [(5, 2), (3, 3), (0, 7), (12, 1)]:
        base = score(m, n)
        for shift in (1, 10, 37):
            assert score(m + shift, n + shift) == pytest.approx(base, rel=1e-5, abs=1e-5)
    # ... and really does depend on the offset.
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def test_llama3_rope_scaling_matches_hand_computation():
    cfg = variant(head_dim=128, num_heads=4, d_model=32, rope_theta=500000.0, rope_scaling_factor=8.0,
                  rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192)
    dh = 128
    base = 500000.0 ** (-np.arange(0, dh, 2, dtype=np.float64) / dh)
    wavelen = 2 * np.pi / base
    want = np.empty_like(base)
    for i, (f, w) in enumerate(zip(base, wavelen)):
        if w < 8192 / 4.0:  # high frequency: unchanged
            want[i] = f
        elif w > 8192 / 1.0:  # low frequency: divided by the factor
            want[i] = f / 8.0
        else:  # in between: smooth interpolation (Llama 3.1 / HF _compute_llama3_parameters)
            smooth = (8192 / w - 1.0) / (4.0 - 1.0)
            want[i] = (1 - smooth) * f / 8.0 + smooth * f
    got = np.asarray(rope_frequencies(cfg), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    high, low = wavelen < 2048, wavelen > 8192
    assert high.any() and low.any() and (~high & ~low).any()  # all three bands are exercised
    np.testing.assert_allclose(got[high], base[high], rtol=2e-6)
    np.testing.assert_allclose(got[low], base[low] / 8, rtol=2e-6)


# ---------------------------------------------------------------- 8. parameter and FLOP counts

COUNT_CONFIGS = {
    "tied-mha": dict(num_kv_heads=None),
    "untied-gqa": dict(tie_embeddings=False),
    "qk-norm-mqa": dict(qk_norm=True, num_kv_heads=1),
    "untied-qknorm-headdim": dict(tie_embeddings=False, qk_norm=True, head_dim=16, num_layers=3),
    "olmo2-post-fullqk-gqa": dict(norm_placement="post", qk_norm=True, qk_norm_scope="full", head_dim=16),
    "gemma-sandwich-qknorm": dict(norm_placement="sandwich", qk_norm=True, norm_weight_offset=1.0),
    "attention-sinks-gqa": dict(attention_sinks=True),
}


def _abstract_params(cfg):
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.to_flat_state(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("name", list(COUNT_CONFIGS))
def test_param_count_matches_instantiated_model(name):
    cfg = variant(**COUNT_CONFIGS[name])
    total = sum(math.prod(v.shape) for _, v in _abstract_params(cfg))
    assert param_counts(cfg)["total"] == total


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_flops_per_token_is_palm_6n_plus_attention(tied):
    """PaLM (Chowdhery et al. 2022, appendix B): training FLOPs per token = 6N + 12 L d T for a
    dense MHA model with H * Dh = d, N the matmul parameters, here counted from the model."""
    cfg = variant(num_kv_heads=None, head_dim=None, tie_embeddings=tied, num_layers=3)
    assert cfg.num_heads * cfg.resolved_head_dim == cfg.d_model
    n = 0
    for path, v in _abstract_params(cfg):
        if path[-1] in ("scale", "q_norm", "k_norm"):
            continue  # norm scales: elementwise, not matmuls
        if path == ("embed",) and not tied:
            continue  # an untied input table is a lookup
        n += math.prod(v.shape)
    for seq in (16, 128, 2048):
        want = 6 * n + 12 * cfg.num_layers * cfg.d_model * seq
        assert flops_per_token(cfg, seq) == want


# ---------------------------------------------------------------- 9/10. dtypes, soft-cap, z-loss


@functools.cache
def _scaled_params():
    """BASE params with the embedding x5 so logits are of order 1 (not ~0.1 as at init)."""
    params = params_for(BASE)
    return _set(params, ("embed",), 5 * _leaf(params, "embed"))


def test_bfloat16_compute_close_to_float32():
    params = _scaled_params()
    tokens = _tokens()
    ref = logits(BASE, params, tokens)
    got = logits(variant(dtype="bfloat16"), params, tokens)
    assert got.dtype == np.float32  # logits come out in float32
    assert 0.3 < np.abs(ref).max() < 10
    diff = np.abs(got - ref).max()
    assert diff < 0.05
    assert diff > 0  # the bfloat16 path really ran


def test_logit_softcap_bounds_logits():
    cap = 0.5
    params = _scaled_params()
    tokens = _tokens()
    raw = logits(BASE, params, tokens)
    assert np.abs(raw).max() > 2 * cap  # the cap is active
    got = logits(variant(logit_softcap=cap), params, tokens)
    assert np.abs(got).max() <= cap
    np.testing.assert_allclose(got, cap * np.tanh(raw.astype(np.float64) / cap), rtol=1e-5, atol=1e-6)


def test_z_loss_sums_match_numpy():
    rng = np.random.default_rng(0)
    lg = rng.standard_normal((2, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(0, 11, size=(2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    w = 1e-2
    out = jax.device_get(cross_entropy_sums(jnp.asarray(lg), jnp.asarray(targets), jnp.asarray(mask), w))
    lse = _np_logsumexp(lg.astype(np.float64))
    ce = lse - np.take_along_axis(lg.astype(np.float64), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(out["z_sum"], w * np.sum(lse[mask] ** 2), rtol=1e-5)
    np.testing.assert_allclose(out["ce_sum"], np.sum(ce[mask]), rtol=1e-5)
    np.testing.assert_allclose(out["loss_sum"], np.sum(ce[mask]) + w * np.sum(lse[mask] ** 2), rtol=1e-5)
    assert out["tokens"] == mask.sum()


def test_z_loss_in_model_loss_equals_weight_times_mean_logsumexp_squared():
    w = 1e-1
    batch = _packed_batch()
    params = _scaled_params()
    cfg = variant(z_loss_weight=w)
    loss_z = float(jax.jit(loss_fn(model_graphdef(cfg), cfg))(params, batch))
    lg = logits(BASE, params, batch["inputs"], batch["positions"], batch["segment_ids"]).astype(np.float64)
    mask = np.asarray(batch["segment_ids"]) > 0
    lse = _np_logsumexp(lg)
    ce = lse - np.take_along_axis(lg, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    want = ce[mask].mean() + w * np.mean(lse[mask] ** 2)
    assert w * np.mean(lse[mask] ** 2) > 1e-3 * want  # the term is not negligible
    np.testing.assert_allclose(loss_z, want, rtol=1e-5)


# ---------------------------------------------------------------- Gemma 2/3 features against a numpy reference

GEMMA = variant(norm_placement="sandwich", norm_weight_offset=1.0, mlp_activation="gelu_tanh", embed_scale=True,
                attn_logit_softcap=1.0, qk_norm=True, logit_softcap=30.0)


def _np_rms(x, w, cfg):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps) * (cfg.norm_weight_offset + w)


def _np_rope(x, positions, dim, theta):
    angles = positions[:, :, None] * (1.0 / theta ** (np.arange(0, dim, 2) / dim))
    sin, cos = np.sin(angles)[:, :, None], np.cos(angles)[:, :, None]
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_attention(x, p, cfg, caps):
    """Causal GQA with per-head QK-norm and RoPE; scores capped as cap * tanh(s / cap); `caps` collects max |s|."""
    positions = np.broadcast_to(np.arange(x.shape[1]), x.shape[:2])
    q = np.einsum("btd,dhk->bthk", x, p["wq"])
    k, v = (np.einsum("btd,dhk->bthk", x, p[w]) for w in ("wk", "wv"))
    q, k = (_np_rope(_np_rms(a, p[n], cfg), positions, cfg.resolved_head_dim, cfg.rope_theta)
            for a, n in ((q, "q_norm"), (k, "k_norm")))
    group = cfg.num_heads // cfg.kv_heads
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhk,bshk->bhqs", q, k) * (cfg.attention_scale or cfg.resolved_head_dim ** -0.5)
    caps.append(np.abs(s).max())
    s = cfg.attn_logit_softcap * np.tanh(s / cfg.attn_logit_softcap)
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", probs, v), p["wo"])


def _np_gemma_logits(cfg, params, tokens, caps):
    """Gemma's decoder in float64 numpy: embeddings * sqrt(d), sandwich norms with (offset + w), GeGLU (tanh GELU)."""
    leaf = lambda *keys: np.asarray(_leaf(params, *keys), np.float64)  # noqa: E731
    table = leaf("embed")
    h = table[np.asarray(tokens)] * np.float32(np.sqrt(cfg.d_model))
    gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # noqa: E731
    for i in range(cfg.num_layers):
        p = {n: leaf("layers", "attn", n)[i] for n in ("wq", "wk", "wv", "wo", "q_norm", "k_norm")}
        p.update({n: leaf("layers", "mlp", n)[i] for n in ("w_gate", "w_up", "w_down")})
        norm = lambda x, name: _np_rms(x, leaf("layers", name, "scale")[i], cfg)  # noqa: E731
        h = h + norm(_np_attention(norm(h, "attn_norm"), p, cfg, caps), "attn_post_norm")
        x = norm(h, "mlp_norm")
        h = h + norm((gelu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"], "mlp_post_norm")
    logits = _np_rms(h, leaf("final_norm", "scale"), cfg) @ table.T
    return cfg.logit_softcap * np.tanh(logits / cfg.logit_softcap)


def test_gemma_features_match_numpy_reference():
    """Sandwich norms, (1 + w) norm weights (QK and final norms too), GeGLU with tanh GELU, sqrt(d) embedding
    scale and attention soft-capping together equal a plain numpy Gemma decoder."""
    params, tokens, caps = params_for(GEMMA), _tokens(), []
    want = _np_gemma_logits(GEMMA, params, tokens, caps)
    assert max(caps) > 2 * GEMMA.attn_logit_softcap  # the attention cap is active
    np.testing.assert_allclose(logits(GEMMA, params, tokens), want, rtol=2e-5, atol=2e-5)


def test_attention_scale_is_the_softmax_scale():
    """model.attention_scale (Gemma's query_pre_attn_scalar ** -0.5) multiplies q . k in the softmax: the numpy
    decoder with that explicit scale, which differs from the head_dim ** -0.5 default's."""
    cfg, params, tokens = dataclasses.replace(GEMMA, attention_scale=0.2), params_for(GEMMA), _tokens()
    want = _np_gemma_logits(cfg, params, tokens, [])
    assert np.abs(want - _np_gemma_logits(GEMMA, params, tokens, [])).max() > 1e-2
    np.testing.assert_allclose(logits(cfg, params, tokens), want, rtol=2e-5, atol=2e-5)


def test_norm_weight_offset_init_is_the_same_function():
    """norm_weight_offset=1 stores the norm weights as 0 and computes the same model at step 0."""
    models = [Transformer(variant(qk_norm=True, norm_weight_offset=off), nnx.Rngs(0)) for off in (0.0, 1.0)]
    (g0, s0), (g1, s1) = (nnx.split(m) for m in models)
    assert float(s1["final_norm"]["scale"][...].max()) == 0.0 and float(s1["layers"]["attn"]["q_norm"][...].max()) == 0
    tokens = _tokens()
    np.testing.assert_array_equal(np.asarray(_logits(g0, s0, tokens, None, None)),
                                  np.asarray(_logits(g1, s1, tokens, None, None)))


def test_decode_attention_softcap_matches_reference():
    from kernels import reference_attention
    from models.attention import decode_attention
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s) * 2, jnp.float32) for s in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    want = reference_attention(q, k, v, causal=True, softcap=1.5)[:, -1:]
    cache = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, kv_heads, S, d]
    got = decode_attention([q[:, -1:]], [cache(k)], [cache(k[:, -1:])], cache(v), cache(v[:, -1:]),
                           jnp.full((2,), 5), 8 ** -0.5, softcap=1.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("changes, key", [
    (dict(attn_logit_softcap=1.0, attention_impl="cudnn"), "attn_logit_softcap"),
    (dict(attn_logit_softcap=0.0), "attn_logit_softcap"),
    (dict(attn_logit_softcap=1.0, attention_type="mla"), "attn_logit_softcap"),
    (dict(mlp_activation="gelu_tanh", moe_num_experts=4), "mlp_activation"),
    (dict(norm_weight_offset=math.inf), "norm_weight_offset"),
])
def test_gemma_feature_problems_name_the_key(changes, key):
    assert key in [k for k, _, _ in variant(**changes).problems()]


# ---------------------------------------------------------------- gpt-oss's block features against numpy

GPT_OSS = variant(qkv_bias=True, attn_out_bias=True, attention_sinks=True, mlp_activation="clamped_swiglu",
                  mlp_swiglu_limit=0.5, rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_max_len=64,
                  rope_yarn_truncate=False, rope_yarn_attention_factor=0.1 * math.log(4.0) + 1.0)


def _np_yarn_inv_freq(cfg):
    """transformers' _compute_yarn_parameters (truncate=False), written out in float64."""
    dim, base, factor, orig = cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_max_len
    corr = lambda rot: dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = max(corr(cfg.rope_yarn_beta_fast), 0), min(corr(cfg.rope_yarn_beta_slow), dim - 1)
    pos = base ** (np.arange(0, dim, 2) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1 / (factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation


def _np_gpt_oss_logits(cfg, params, tokens, clamped):
    """gpt-oss's decoder as transformers computes it (float64): q/k/v/o biases, yarn RoPE with cos and sin times
    attention_factor, sinks joining the softmax denominator, the clamped SwiGLU (dense here)."""
    leaf = lambda *keys: np.asarray(_leaf(params, *keys), np.float64)  # noqa: E731
    table = leaf("embed")
    h = table[np.asarray(tokens)]
    t = h.shape[1]
    ang = np.arange(t)[:, None] * _np_yarn_inv_freq(cfg)[None]
    f = cfg.rope_yarn_attention_factor
    cos, sin = (np.cos(ang) * f)[None, :, None], (np.sin(ang) * f)[None, :, None]
    half = cfg.resolved_head_dim // 2

    def rope(x):
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    for i in range(cfg.num_layers):
        a = {n: leaf("layers", "attn", n)[i] for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "sinks")}
        m = {n: leaf("layers", "mlp", n)[i] for n in ("w_gate", "w_up", "w_down")}
        x = _np_rms(h, leaf("layers", "attn_norm", "scale")[i], cfg)
        q, k, v = (np.einsum("btd,dhk->bthk", x, a[w]) + a[b] for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
        q, k = rope(q), rope(k)
        k, v = (np.repeat(y, cfg.num_heads // cfg.kv_heads, axis=2) for y in (k, v))
        s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(cfg.resolved_head_dim)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        sinks = np.broadcast_to(a["sinks"][None, :, None, None], s.shape[:3] + (1,))
        z = np.concatenate([s, sinks], -1)
        p = np.exp(z - z.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True))[..., :-1]
        h = h + np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", p, v), a["wo"]) + a["bo"]
        x = _np_rms(h, leaf("layers", "mlp_norm", "scale")[i], cfg)
        gate, up = x @ m["w_gate"], x @ m["w_up"]
        clamped.append(np.mean(gate > cfg.mlp_swiglu_limit))
        gate, up = np.minimum(gate, cfg.mlp_swiglu_limit), np.clip(up, -cfg.mlp_swiglu_limit, cfg.mlp_swiglu_limit)
        h = h + ((up + 1) * gate / (1 + np.exp(-cfg.mlp_swiglu_alpha * gate))) @ m["w_down"]
    return _np_rms(h, leaf("final_norm", "scale"), cfg) @ table.T


def test_gpt_oss_block_features_match_numpy_reference():
    """q/k/v + o biases, attention sinks, YaRN with truncate=false and HF's attention_factor (folded into the query
    pre-scale) and the clamped SwiGLU (active for some values: checked) equal a float64 numpy gpt-oss decoder."""
    assert GPT_OSS.query_prescale == pytest.approx(GPT_OSS.rope_yarn_attention_factor ** 2)
    params = jax.tree.map(lambda x: x * 10, params_for(GPT_OSS))  # weights ~0.2: the clamp and the biases matter
    params = _set(params, ("final_norm", "scale"), np.ones(BASE.d_model, np.float32))
    tokens, clamped = _tokens(), []
    want = _np_gpt_oss_logits(GPT_OSS, params, tokens, clamped)
    assert 0.01 < min(clamped) and max(clamped) < 0.99
    np.testing.assert_allclose(logits(GPT_OSS, params, tokens), want, rtol=1e-4, atol=1e-4)
    # truncate and the attention factor each change the function
    for other in (dict(rope_yarn_truncate=True), dict(rope_yarn_attention_factor=None)):
        assert np.max(np.abs(logits(dataclasses.replace(GPT_OSS, **other), params, tokens) - want)) > 1e-3


@pytest.mark.parametrize("changes, key", [
    (dict(rope_yarn_attention_factor=1.2), "rope_yarn_attention_factor"),  # no yarn
    (dict(rope_yarn_attention_factor=0.0, rope_scaling_type="yarn", rope_scaling_factor=4.0),
     "rope_yarn_attention_factor"),
    (dict(moe_expert_bias=True), "moe_expert_bias"),
    (dict(moe_router_logit_bias=True), "moe_router_logit_bias"),
    (dict(mlp_swiglu_limit=0.0), "mlp_swiglu_limit"),
    (dict(attn_out_bias=True, attention_type="mla"), "attn_out_bias"),
])
def test_gpt_oss_feature_problems_name_the_key(changes, key):
    assert key in [k for k, _, _ in variant(**changes).problems()]
