"""Quantized matmuls, weights and KV cache against plain numpy / jnp references.

models/qdot.py (training: int8 and fp8 custom VJPs, einsum and ragged), models/project.py
(weight-only int8, delayed-scaling histories), models/cache.py + decode attention (int8 KV),
sharding/reductions.py (scales inside the expert shard_maps), and the quant section's bad input.
Small shapes, one jit per check; the model-level checks are in tests/test_quant_model.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from models import qdot
from models.attention import decode_attention
from models.cache import quantize_entries
from models.project import AmaxHistory, Int8Weight, project, project_ragged, roll_histories
from models.quant import dequantize, quantize_int8, quantize_int8_grouped
from models.quant_config import MatmulQuant
from models.stat import Stat

RNG = np.random.default_rng(0)
F32_RTOL = 2e-6  # float32 rounding of the scale products (the int32 sums are exact)


def _a(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale, jnp.float32)


def _value_and_vjp(f, args: tuple, g: jax.Array):
    """(f(*args), its VJP at g) in one jitted program (eager op-by-op dispatch compiles every op)."""

    def both(args, g):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(g)

    return jax.jit(both)(args, g)


def _np_broadcast(s: np.ndarray, labels: str, out: str) -> np.ndarray:
    """numpy: a keepdims scale over `labels` laid out to broadcast over `out`."""
    kept = "".join(c for c in labels if c in out)
    s = s.reshape([d for c, d in zip(labels, s.shape) if c in out])
    ordered = "".join(sorted(kept, key=out.index))
    s = np.einsum(f"{kept}->{ordered}", s)
    return s.reshape([dict(zip(ordered, s.shape)).get(c, 1) for c in out])


def _np_int8(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference: symmetric int8 over `axes` (round half to even, as jnp.round)."""
    amax = np.abs(x).max(axis=axes, keepdims=True)
    s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.round(x / s), -127, 127), s


SPECS = [("nd,df->nf", (6, 8), (8, 5)),  # a dense projection
         ("nhk,hkd->nd", (6, 2, 4), (2, 4, 5)),  # attention's output projection: two contracted dims
         ("...ecd,edf->...ecf", (2, 3, 4, 8), (3, 8, 5))]  # capacity experts: a batch dim and an ellipsis


@pytest.mark.parametrize("spec,xs,ws", SPECS)
def test_int8_dot_equals_the_dequantized_float_dot_and_its_vjp_the_formula(spec, xs, ws):
    x, w = _a(*xs), _a(*ws, scale=0.1)
    xl, wl, ol = qdot.parse_einsum(spec, x.ndim, w.ndim)
    plan = qdot.EinsumPlan(xl, wl, ol)
    x_axes = tuple(i for i, c in enumerate(xl) if c not in ol)
    w_axes = tuple(i for i, c in enumerate(wl) if c not in ol)
    (xq, sx), (wq, sw) = _np_int8(np.asarray(x), x_axes), _np_int8(np.asarray(w), w_axes)
    want = np.einsum(f"{xl},{wl}->{ol}", xq * sx, (wq * sw).astype(np.float64))
    g = _a(*want.shape)
    out, (dx, dw) = _value_and_vjp(lambda x, w: qdot.int8_einsum(plan, x, w), (x, w), g)
    np.testing.assert_allclose(np.asarray(out), want, rtol=F32_RTOL, atol=1e-6)
    # dx: the weight's scale folded into g, g requantized over the weight's output dims; dw alike.
    w_out = "".join(c for c in ol if c in wl and c not in xl)
    tokens = "".join(c for c in ol if c in xl and c not in wl)
    g1 = np.asarray(g) * _np_broadcast(sw, wl, ol)
    gq, sg = _np_int8(g1, tuple(i for i, c in enumerate(ol) if c in w_out))
    np.testing.assert_allclose(np.asarray(dx), np.einsum(f"{ol},{wl}->{xl}", gq * sg, wq), rtol=F32_RTOL, atol=1e-6)
    g2 = np.asarray(g) * _np_broadcast(sx, xl, ol)
    gq, sg = _np_int8(g2, tuple(i for i, c in enumerate(ol) if c in tokens))
    np.testing.assert_allclose(np.asarray(dw), np.einsum(f"{xl},{ol}->{wl}", xq, gq * sg), rtol=F32_RTOL, atol=1e-6)
    # Straight-through: near the float VJP (int8 steps are 1/127 of each slice's absmax).
    _, float_grads = _value_and_vjp(lambda x, w: jnp.einsum(spec, x, w), (x, w), g)
    for got, ref in zip((dx, dw), float_grads):
        assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 0.03


def _np_fp8(x: np.ndarray, amax: float, fmt) -> tuple[np.ndarray, float]:
    limit = float(ml_dtypes.finfo(fmt).max)
    s = amax / limit if amax > 0 else 1.0
    return np.clip(x / s, -limit, limit).astype(fmt).astype(np.float64), s


def test_fp8_dot_and_vjp_match_ml_dtypes_casts_with_current_scaling():
    x, w, g = _a(6, 8), _a(8, 5, scale=0.1), _a(6, 5, scale=1e-3)
    plan = qdot.EinsumPlan("nd", "df", "nf")
    out, (dx, dw) = _value_and_vjp(lambda x, w: qdot.fp8_einsum(plan, x, w, None), (x, w), g)
    (xq, sx), (wq, sw) = (_np_fp8(np.asarray(a), np.abs(np.asarray(a)).max(), ml_dtypes.float8_e4m3fn) for a in (x, w))
    np.testing.assert_allclose(np.asarray(out), (xq @ wq) * sx * sw, rtol=F32_RTOL, atol=1e-7)
    gq, sg = _np_fp8(np.asarray(g), np.abs(np.asarray(g)).max(), ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(np.asarray(dx), (gq @ wq.T) * sg * sw, rtol=F32_RTOL, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dw), (xq.T @ gq) * sx * sg, rtol=F32_RTOL, atol=1e-9)


def test_fp8_delayed_scaling_uses_the_history_max_and_reports_this_steps_amax():
    x, w, g = _a(6, 8), _a(8, 5, scale=0.1), _a(6, 5, scale=1e-3)
    plan = qdot.EinsumPlan("nd", "df", "nf")
    history = jnp.asarray([[2.0, 9.0, 1.0, 0.0], [0.05, 0.01, 0.0, 0.0], [1e-3, 4e-3, 0.0, 0.0]], jnp.float32)
    out, (_, _, seen) = _value_and_vjp(lambda x, w, h: qdot.fp8_einsum(plan, x, w, h), (x, w, history), g)
    # Scales from max(history) of each row (x: 9, w: 0.05), not from this step's absmax; saturated above it.
    xq, sx = _np_fp8(np.asarray(x), 9.0, ml_dtypes.float8_e4m3fn)
    wq, sw = _np_fp8(np.asarray(w), 0.05, ml_dtypes.float8_e4m3fn)
    np.testing.assert_allclose(np.asarray(out), (xq @ wq) * sx * sw, rtol=F32_RTOL, atol=1e-7)
    amax = [np.abs(np.asarray(a)).max() for a in (x, w, g)]
    np.testing.assert_allclose(np.asarray(seen[:, 0]), amax, rtol=1e-7)
    assert not np.asarray(seen[:, 1:]).any()
    # An empty history (the first step) means current scaling.
    empty, current = jax.jit(lambda x, w: (qdot.fp8_einsum(plan, x, w, jnp.zeros_like(history)),
                                           qdot.fp8_einsum(plan, x, w, None)))(x, w)
    np.testing.assert_array_equal(np.asarray(empty), np.asarray(current))


def test_train_step_history_update_rolls_in_the_observation_and_ignores_the_optimizer():
    def state(value):
        return nnx.State({"w": nnx.Param(jnp.ones(2)), "w_amax": AmaxHistory(jnp.asarray(value, jnp.float32))})

    old = state([[3.0, 2.0, 1.0], [6.0, 5.0, 4.0], [9.0, 8.0, 7.0]])
    grads = state([[0.5, 0.0, 0.0], [0.6, 0.0, 0.0], [0.7, 0.0, 0.0]])
    # The optimizer's share is the Params alone: the history (a Stat) is outside it.
    trained, observed = nnx.split_state(grads, nnx.Param, Stat)
    assert "w_amax" not in trained and np.asarray(trained["w"][...]).all()
    params, stats = nnx.split_state(old, nnx.Param, Stat)
    new = nnx.merge_state(params, roll_histories(stats, observed))
    want = np.float32([[0.5, 3, 2], [0.6, 6, 5], [0.7, 9, 8]])
    np.testing.assert_array_equal(np.asarray(new["w_amax"][...]), want)
    np.testing.assert_array_equal(np.asarray(new["w"][...]), [1.0, 1.0])


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_ragged_dot_equals_the_per_group_quantized_einsum(mode):
    x, w, g = _a(7, 8), _a(3, 8, 5, scale=0.1), _a(7, 5)
    sizes = jnp.asarray([2, 0, 4])  # the last row is past the groups
    fn = qdot.int8_ragged_dot if mode == "int8" else qdot.fp8_ragged_dot
    out, grads = _value_and_vjp(lambda x, w: fn(qdot.RaggedPlan(), x, w, sizes), (x, w), g)
    groups = np.repeat(np.arange(3), np.asarray(sizes))
    xn, wn = np.asarray(x), np.asarray(w)
    if mode == "int8":
        xq, sx = _np_int8(xn, (1,))
        wq, sw = _np_int8(wn, (1,))
        want = np.stack([(xq[r] * sx[r]) @ (wq[e] * sw[e]) for r, e in enumerate(groups)])
    else:
        (xq, sx), (wq, sw) = (_np_fp8(a, np.abs(a).max(), ml_dtypes.float8_e4m3fn) for a in (xn, wn))
        want = np.stack([xq[r] @ wq[e] * sx * sw for r, e in enumerate(groups)])
    np.testing.assert_allclose(np.asarray(out[:6]), want, rtol=F32_RTOL, atol=1e-6)
    assert not np.asarray(out[6]).any()
    _, float_grads = _value_and_vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), (x, w), g)
    for got, ref in zip(grads, float_grads):
        assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < (0.03 if mode == "int8" else 0.15)


# ---------------------------------------------------------------- weight-only int8


def _stored(w: jax.Array, contract: tuple[int, ...], group: int = 0) -> tuple[Int8Weight, np.ndarray]:
    axes = tuple(a % w.ndim for a in contract)
    q, s = jax.jit(lambda w: quantize_int8_grouped(w, group, axes[-1]) if group else quantize_int8(w, axes))(w)
    back = np.asarray(q, np.float64) * np.repeat(np.asarray(s), group, axis=axes[-1]) if group else \
        np.asarray(q, np.float64) * np.asarray(s)
    return Int8Weight(q, s), back


@pytest.mark.parametrize("spec,xs,ws,contract,group", [
    ("nd,df->nf", (5, 8), (8, 6), (-2,), 0),
    ("nd,df->nf", (5, 8), (8, 6), (-2,), 4),
    ("nhk,hkd->nd", (5, 2, 4), (2, 4, 6), (-3, -2), 2),  # groups inside each head
    ("btd,vd->btv", (2, 3, 8), (10, 8), (-1,), 0),  # the tied unembedding: contracted on the table's last dim
    ("bthn,rhn->bthr", (2, 1, 3, 4), (6, 3, 4), (-3,), 0),  # MLA's absorbed W_uk: the scale multiplies x
    ("bthn,rhn->bthr", (2, 1, 3, 4), (6, 3, 4), (-3,), 2),  # ... group-wise: dequantized (one layer's slice)
])
def test_weight_only_int8_equals_the_dequantized_weight(spec, xs, ws, contract, group):
    x, w = _a(*xs), _a(*ws, scale=0.1)
    qw, back = _stored(w, contract, group)
    got = jax.jit(lambda x, qw: project(spec, x, qw, MatmulQuant("t"), dtype=jnp.float32))(x, qw)
    np.testing.assert_allclose(np.asarray(got), np.einsum(spec, np.asarray(x, np.float64), back), rtol=1e-5,
                               atol=1e-6)


def test_weight_only_int8_ragged_per_channel_scales_each_rows_expert():
    x, w = _a(6, 8), _a(3, 8, 5, scale=0.1)
    sizes = jnp.asarray([3, 1, 2])
    qw, back = _stored(w, (-2,))
    got = jax.jit(lambda x, qw: project_ragged(x, qw, sizes, MatmulQuant("t"), dtype=jnp.float32))(x, qw)
    want = jax.lax.ragged_dot(x, jnp.asarray(back, jnp.float32), sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- int8 KV cache


def test_int8_cache_decode_attention_equals_attention_over_the_dequantized_cache():
    b, hq, hk, s, d = 2, 4, 2, 6, 8
    q, k, v = _a(b, 1, hq, d), _a(b, hk, s, d), _a(b, hk, s, d)
    k_new, v_new = _a(b, hk, 1, d), _a(b, hk, 1, d)
    pos = jnp.asarray([3, 6])
    cache = jax.jit(quantize_entries)({"k": k[None], "v": v[None]})
    assert cache["k"].dtype == jnp.int8 and cache["k_scale"].shape == (1, b, hk, s, 1)
    k8, ks, v8, vs = (cache[n][0] for n in ("k", "k_scale", "v", "v_scale"))

    @jax.jit
    def both(q, k8, ks, v8, vs, k_new, v_new):
        got = decode_attention([q], [k8], [k_new], v8, v_new, pos, d ** -0.5, k_scales=[ks], v_scale=vs)
        return got, decode_attention([q], [dequantize(k8, ks)], [k_new], dequantize(v8, vs), v_new, pos, d ** -0.5)

    got, want = both(q, k8, ks, v8, vs, k_new, v_new)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Per token and head: the error of every cached element is at most half its scale.
    assert np.all(np.abs(np.asarray(dequantize(k8, ks)) - np.asarray(k)) <= np.asarray(ks) / 2 * (1 + 1e-6))
