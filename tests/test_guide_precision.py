"""Page 19 of the guide (mixed precision, fp8, stability): its formulas against ml_dtypes and the code."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfra.config import load_config
from models.quant import FP8_MAX, fp8_scale, quantize_fp8
from scripts.guide import number_formats as nf

STORED = [f for f in nf.FORMATS if f.dtype is not None]


@pytest.mark.parametrize("fmt", STORED, ids=lambda f: f.name)
def test_format_formula_matches_ml_dtypes(fmt: nf.Format) -> None:
    """max, smallest normal and subnormal, eps from (e, m) equal ml_dtypes.finfo and jnp.finfo, bit for bit."""
    fi = ml_dtypes.finfo(fmt.dtype)
    assert (fi.nexp, fi.nmant) == (fmt.exponent_bits, fmt.mantissa_bits)
    assert nf.formula_values(fmt) == nf.finfo_values(fmt)
    assert float(jnp.finfo(fmt.dtype).max) == fmt.max
    # the largest finite value is where the next step up overflows: to inf, or to NaN for E4M3fn
    above = nf.cast(fmt.max * (1 + fmt.eps), fmt)
    assert np.isinf(above) if fmt.has_inf else np.isnan(above)


def test_the_named_fp8_figures() -> None:
    e4m3 = next(f for f in STORED if f.name == "float8_e4m3fn")
    e5m2 = next(f for f in STORED if f.name == "float8_e5m2")
    assert (e4m3.max, e5m2.max) == (448.0, 57344.0)
    assert (e4m3.bias, e5m2.bias) == (7, 15)
    assert FP8_MAX == {"e4m3": e4m3.max, "e5m2": e5m2.max}  # the training code's constants


def test_tf32_is_float32_range_with_float16_precision() -> None:
    tf32 = next(f for f in nf.FORMATS if f.name == "tf32")
    f32 = ml_dtypes.finfo(np.float32)
    assert tf32.smallest_normal == float(f32.smallest_normal)
    assert tf32.eps == float(ml_dtypes.finfo(np.float16).eps)
    assert float(f32.max) > tf32.max > 0.999 * float(f32.max)


def test_casts_the_page_reads() -> None:
    by = {f.name: f for f in STORED}
    assert nf.cast(1e-8, by["float16"]) == 0.0 and nf.cast(1e-8, by["bfloat16"]) > 0  # fp16 underflows
    assert nf.cast(1.0 + 1e-3, by["bfloat16"]) == 1.0  # an update below eps/2 is lost in bf16
    assert np.isinf(nf.cast(70000.0, by["float16"])) and np.isnan(nf.cast(70000.0, by["float8_e4m3fn"]))


def test_the_code_saturates_where_a_plain_cast_gives_nan() -> None:
    """models/quant.py quantize_fp8 of a value above the scaled range gives the format's max, not NaN."""
    x = jnp.array([1.0, 2.0, 1000.0], jnp.float32)
    scale = fp8_scale(jnp.float32(2.0), "e4m3")  # a stale (delayed) amax: 1000 is far outside it
    q = np.asarray(quantize_fp8(x, scale, "e4m3").astype(jnp.float32))
    assert np.all(np.isfinite(q)) and q[-1] == 448.0


def test_max_attention_logit_matches_a_loop() -> None:
    """scripts/guide/logit_stats.py: the largest |q.k|/sqrt(d) over visible pairs, GQA heads mapped h -> h // group."""
    from scripts.guide.logit_stats import max_attention_logit

    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, 5, 4, 2, 8
    q, k = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, kv, d))
    seg = np.array([[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]])
    best = 0.0
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                for j in range(i + 1):
                    if seg[bi, i] == seg[bi, j]:
                        best = max(best, abs(q[bi, i, hi] @ k[bi, j, hi // (h // kv)]) / np.sqrt(d))
    got = max_attention_logit(jnp.asarray(q), jnp.asarray(k), d ** -0.5, jnp.asarray(seg))
    assert float(got) == pytest.approx(best, rel=1e-5)


def test_precision_map_of_a_bfloat16_model() -> None:
    """scripts/guide/precision_map.py: float32 params and optimizer state, float32 softmax / loss / norms,
    bf16 x bf16 -> float32 matmuls, float32 logits: what the page says the code does."""
    from scripts.guide import precision_map as pm

    cfg = load_config("tiny", ["model.dtype=bfloat16", "model.num_layers=1"])
    state, counts = pm.trace(cfg)
    assert set(pm.dtype_counts(state.params)) == {"float32"}
    assert set(pm.dtype_counts(state.opt_state)) <= {"float32", "int32"}
    kinds = {(kind, dtypes) for kind, dtypes in counts}
    for kind in ("exp (softmax, loss)", "log (loss)", "rsqrt (RMSNorm)"):
        assert {d for k, d in kinds if k == kind} == {"float32"}
    # every matmul, forward and backward, projections and attention alike: bf16 operands, float32
    # accumulation (kernels/mixed.py); no float32 operand, no bf16 result
    assert {d for k, d in kinds if k == "matmul"} == {"bfloat16,bfloat16 -> float32"}


def test_adam_update_ignores_a_common_gradient_scale() -> None:
    """Page 19's reading of the spike runs: scaling every step's gradient by the same factor (what clipping
    does when every norm is above the threshold by a similar amount) leaves the optimizer's updates
    unchanged up to eps, so clipping cannot shrink Adam's steps; a one-step outlier is what it damps."""
    import optax

    from jaxinfra.config import OptimizerConfig
    from jaxinfra.optim import make_optimizer

    tx = make_optimizer(OptimizerConfig(clip_grad_norm=None, weight_decay=0.0), optax.constant_schedule(1e-2))
    from flax import nnx

    params = nnx.state(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Param)
    keys = jax.random.split(jax.random.key(1), 3)
    grads = [jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys]

    def updates(scale: float) -> list[np.ndarray]:
        state, out = tx.init(params), None
        for g in grads:
            out, state = tx.update(jax.tree.map(lambda x: x * scale, g), state, params)
        return [np.asarray(x) for x in jax.tree.leaves(out)]

    for a, b in zip(updates(1.0), updates(0.05), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_grad_spike_scales_the_objective_at_its_steps_only() -> None:
    """scripts/guide/grad_spike.py: the objective (so every gradient) times the factor at the chosen 1-based steps."""
    import types

    from scripts.guide.grad_spike import GradSpike

    spike = GradSpike([12], 1000.0)
    sums = {"loss_sum": jnp.float32(2.0), "ce_sum": jnp.float32(2.0)}
    at = lambda step: spike.objective(types.SimpleNamespace(step=jnp.int32(step)), sums)  # noqa: E731
    assert float(at(11)["loss_sum"]) == 2000.0 and float(at(11)["ce_sum"]) == 2.0  # step index 11 is step 12
    assert float(at(10)["loss_sum"]) == 2.0 and float(at(12)["loss_sum"]) == 2.0
