"""Attention sinks (gpt-oss): a learned logit per query head in the softmax denominator, no value.

The jnp reference and the `xla` implementation against an independent naive formula (the sink
as an explicit extra score column whose value row is zero), forward and gradients; the sinks'
gradient against central finite differences in float64, and a Pallas kernel's in float32; cuDNN
refuses them. The Pallas kernels against the reference with sinks on their shape grid are in
tests/test_flash_attention.py and tests/test_mosaic_gpu.py, the ring in tests/test_ring.py; a model with
`attention_sinks` trains under fsdp=4 x tensor=2 and a context=2 ring as on one device (tests/test_parallel.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels.attention import reference_attention

B, T, H, D = 2, 12, 4, 8
# (causal, window): causal, a causal local window (left 3), and bidirectional with a two-sided window.
MASKS = [(True, None), (True, (3, 0)), (False, (2, 4))]


def _inputs(kv_heads: int, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((B, T, H, D), (B, T, kv_heads, D),
                                                                (B, T, kv_heads, D)))
    sinks = (2 * rng.standard_normal(H)).astype(dtype)
    sinks[-1] = 30.0  # dominates its rows: the stable logsumexp must not overflow
    return tuple(jnp.asarray(x) for x in (q, k, v, sinks))


def _visible(causal: bool, window) -> np.ndarray:
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    ok = np.ones((T, T), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        left, right = window
        ok &= j >= i - left
        ok &= j <= i + right
    return ok


def naive_attention(q, k, v, sinks, causal: bool, window):
    """Sink as an explicit column of the scores with a zero value row; GQA by repeating k / v."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
    s = jnp.where(_visible(causal, window), s, -jnp.inf)
    sink_col = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1)).astype(s.dtype)
    p = jax.nn.softmax(jnp.concatenate([s, sink_col], axis=-1), axis=-1)
    v0 = jnp.concatenate([v, jnp.zeros_like(v[:, :1])], axis=1)  # the sink's value: zero
    return jnp.einsum("bhqk,bkhd->bqhd", p, v0, precision="highest")


def _impls(causal, window):
    ref = lambda q, k, v, s: reference_attention(q, k, v, causal=causal, window=window, sinks=s)  # noqa: E731
    xla = lambda q, k, v, s: kernels.attention(q, k, v, causal=causal, window=window, sinks=s,  # noqa: E731
                                               impl="xla")
    naive = lambda q, k, v, s: naive_attention(q, k, v, s, causal, window)  # noqa: E731
    return {"ref": ref, "xla": xla, "naive": naive}


@jax.jit
def _outputs_and_grads(q, k, v, sinks, w):
    """{(mask, impl): (out, (dq, dk, dv, dsinks))} for every mask and implementation: one compile."""
    result = {}
    for i, (causal, window) in enumerate(MASKS):
        for name, f in _impls(causal, window).items():
            loss = lambda *a, f=f: jnp.sum(f(*a) * w)  # noqa: E731
            result[i, name] = (f(q, k, v, sinks), jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks))
    return result


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_sinks_forward_and_gradients_match_naive_formula(kv_heads):
    q, k, v, sinks = _inputs(kv_heads)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, H, D)), jnp.float32)
    got = _outputs_and_grads(q, k, v, sinks, w)
    for i, mask in enumerate(MASKS):
        want_out, want_grads = got[i, "naive"]
        for name in ("ref", "xla"):
            out, grads = got[i, name]
            np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6, err_msg=f"{name} {mask}")
            for arg, g, want in zip(("q", "k", "v", "sinks"), grads, want_grads):
                np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5, err_msg=f"d{arg} {name} {mask}")
    # The sink takes weight: rows sum to < 1 (a huge sink leaves its head's output ~0).
    assert float(jnp.max(jnp.abs(got[0, "ref"][0][:, :, -1]))) < 1e-6
    assert float(jnp.max(jnp.abs(want_grads[3]))) > 1e-3  # sinks' gradients compared are not all ~0


def test_sinks_gradient_matches_central_finite_differences_float64():
    with jax.enable_x64(True):
        q, k, v, sinks = _inputs(2, seed=3, dtype=np.float64)
        sinks = sinks.at[-1].set(1.5)
        w = jnp.asarray(np.random.default_rng(7).standard_normal((B, T, H, D)))
        loss = jax.jit(lambda s: jnp.sum(reference_attention(q, k, v, causal=True, window=(3, 0), sinks=s) * w))
        assert loss(sinks).dtype == jnp.float64
        grad = jax.grad(loss)(sinks)
        eps = 1e-5
        fd = np.array([(loss(sinks.at[h].add(eps)) - loss(sinks.at[h].add(-eps))) / (2 * eps) for h in range(H)])
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)  # float32 would miss by ~1e-3
        assert np.all(np.abs(fd) > 1e-3)  # a real check, not zeros against zeros


def test_empty_rows_with_sinks_give_zero_output_and_lse_equal_to_sink():
    q, k, v, sinks = _inputs(4)
    seg = jnp.asarray(np.r_[np.ones(T - 2), [7, 7]].astype(np.int32)[None].repeat(B, 0))
    kv_seg = jnp.ones((B, T), jnp.int32)  # the last two queries (id 7) see no key
    out, lse = kernels.attention_with_lse(q, k, v, segment_ids=(seg, kv_seg), sinks=sinks, impl="xla")
    assert np.all(np.isfinite(out)) and np.all(out[:, -2:] == 0)
    np.testing.assert_allclose(lse[:, :, -1], np.broadcast_to(sinks, (B, H)), rtol=1e-6)


def test_cudnn_refuses_sinks_and_auto_skips_it(monkeypatch):
    """cuDNN returns no log-sum-exp to fold the sinks into: refused in one line; `auto` chooses as without
    sinks, except cuDNN (an H200 bf16 D64 call, cuDNN's measured row, gets Triton with sinks)."""
    import importlib
    attention_module = importlib.import_module("kernels.attention")
    q, k, v, sinks = _inputs(4)
    assert kernels.resolve_impl("auto", q, v, sinks=sinks) == "xla"  # CPU
    monkeypatch.setattr(attention_module, "_platform", lambda: "gpu")
    monkeypatch.setattr(attention_module, "_device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(attention_module, "_compute_capability", lambda: "9.0")
    q16 = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
    assert kernels.resolve_impl("auto", q16, q16) == "cudnn"
    assert kernels.resolve_impl("auto", q16, q16, sinks=sinks) == "pallas_triton"
    with pytest.raises(ValueError, match="impl='cudnn' does not support this call: attention sinks") as info:
        kernels.attention(q16, q16, q16, sinks=sinks, impl="cudnn")
    assert "\n" not in str(info.value)


def test_pallas_sinks_gradient_matches_central_finite_differences():
    """dsinks of the Triton kernel (interpreted) + `apply_sinks` against central differences of its own
    float32 loss: eps 1e-2 keeps rounding noise (~1e-5 of the loss / 2 eps) well under the 2e-3 tolerance,
    and the O(eps^2) truncation too; a sink that were dropped or counted twice would miss by > 10%."""
    q, k, v, sinks = _inputs(2, seed=3)
    sinks = sinks.at[-1].set(1.5)
    w = jnp.asarray(np.random.default_rng(7).standard_normal((B, T, H, D)), jnp.float32)
    loss = jax.jit(lambda s: jnp.sum(kernels.attention(q, k, v, window=(3, 0), sinks=s, impl="pallas_triton") * w))
    grad = jax.grad(loss)(sinks)
    eps = 1e-2
    fd = np.array([(loss(sinks.at[h].add(eps)) - loss(sinks.at[h].add(-eps))) / (2 * eps) for h in range(H)])
    np.testing.assert_allclose(grad, fd, rtol=2e-3, atol=2e-3)
    assert np.sum(np.abs(fd) > 0.4) >= 3  # a real check, not zeros against zeros


def test_bad_sinks_shape_is_refused():
    q, k, v, sinks = _inputs(4)
    with pytest.raises(ValueError, match=r"sinks must be \[q heads\]"):
        kernels.attention(q, k, v, sinks=sinks[:2], impl="xla")
