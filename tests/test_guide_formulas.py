"""The guide's formulas (docs/guide/*.md), written out by hand, against what the stack computes.

Each test states one page's formula as the page prints it (and checks that the page still
prints it), then compares it with the stack's own figure: `jaxinfra info`'s memory table,
the pipeline's schedule tables, the cache layout, the model's parameter shapes, the ring
attention's token order, the sweep planner, the quantized params and the distillation loss. No
training; a few small jitted functions.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfra.bench import _bus_factor
from jaxinfra.config import load_config
from jaxinfra.info import memory_table
from jaxinfra.metrics import flops_per_token, param_counts
from jaxinfra.state import abstract_params
from models import cache
from sharding.context import _token_index
from sharding.mesh import make_mesh
from sharding.pipeline import bubble_fraction, forward_tables, one_f_one_b_tables

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide"


def page(number: int) -> str:
    return next(GUIDE.glob(f"{number:02d}-*.md")).read_text()


def norm_params(cfg) -> int:
    """RMSNorm scales of a dense model without q/k norms: two per layer and the final one."""
    return 2 * cfg.num_layers * cfg.d_model + cfg.d_model


def per_device(config: str, overrides: list[str]) -> dict[str, int]:
    cfg = load_config(config, overrides)
    return {k: v[1] for k, v in memory_table(cfg, make_mesh(cfg.mesh, jax.devices())).items()}


@pytest.mark.parametrize("strategy", ["dp", "zero1", "fsdp"])
def test_zero_bytes_per_device_formula_matches_jaxinfra_info(strategy):
    assert "16 P / N" in page(2) and "4P + 4P + 8P / N" in page(2)
    overrides = ["mesh.data=1", "mesh.fsdp=8", f"parallelism.strategy={strategy}"]
    got = per_device("tiny", overrides)
    model = load_config("tiny").model
    p, n, r = param_counts(model)["total"], 8, norm_params(model)
    want = {"dp": (4 * p, 8 * p), "zero1": (4 * p, 8 * p / n),
            "fsdp": (4 * ((p - r) / n + r), 8 * ((p - r) / n + r))}[strategy]
    assert got["params"] == got["grads"] == want[0]
    # AdamW's state also holds step counters (a few int32 scalars, replicated): allow 64 bytes.
    assert want[1] <= got["optimizer state"] <= want[1] + 64


def test_tensor_parallel_weights_per_device_formula_matches_jaxinfra_info():
    assert "4 bytes x (P_split / n + P_replicated)" in page(3)
    got = per_device("tiny", ["mesh.data=4", "mesh.tensor=2"])
    model = load_config("tiny").model  # 2 KV heads, 4 query heads, MLP 384, vocab 256: all divide by 2
    p, r = param_counts(model)["total"], norm_params(model)
    assert got["params"] == 4 * ((p - r) / 2 + r)


@pytest.mark.parametrize("stages, micro, repeats", [(4, 8, 1), (4, 8, 2), (2, 6, 3), (8, 32, 1)])
def test_bubble_formula_equals_the_idle_slots_of_the_code_schedule(stages, micro, repeats):
    assert "bubble = (S - 1) / (R M + S - 1)" in page(4)
    tab = forward_tables(stages, micro, repeats)
    idle = 1 - tab["valid"].mean()
    assert idle == pytest.approx((stages - 1) / (repeats * micro + stages - 1), abs=1e-12)
    assert idle == pytest.approx(bubble_fraction(stages, micro, repeats), abs=1e-12)


@pytest.mark.parametrize("stages, micro", [(4, 8), (2, 4), (8, 16)])
def test_lockstep_1f1b_backward_idles_as_the_page_says(stages, micro):
    assert "(2S - 2) / (M + 2S - 2)" in page(4)
    tab = one_f_one_b_tables(stages, micro)
    assert tab["f"].shape[0] == micro + 2 * stages - 2
    for valid in (tab["f_valid"], tab["b_valid"]):
        assert valid.sum() == stages * micro  # every (microbatch, stage) exactly once
        assert 1 - valid.mean() == pytest.approx((2 * stages - 2) / (micro + 2 * stages - 2), abs=1e-12)


@pytest.mark.parametrize("preset", ["tiny", "small", "llama3-8b", "mixtral-tiny", "deepseek-v3", "deepseek-tiny"])
def test_kv_cache_bytes_per_token_formula_matches_models_cache(preset):
    assert "2 L h_kv d_h s" in page(7) and "L (r + d_rope) s" in page(7)
    m = load_config(preset).model
    s = jnp.dtype(m.dtype).itemsize
    if m.is_mla:
        want = m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * s
    else:
        want = 2 * m.num_layers * m.kv_heads * m.resolved_head_dim * s
    assert cache.bytes_per_token(m) == want


def _attention_params_per_layer(model) -> int:
    flat = nnx.to_flat_state(abstract_params(model))
    return sum(math.prod(v.shape) for path, v in flat if path[:2] == ("layers", "attn")) // model.num_layers


@pytest.mark.parametrize("kv_overrides", [["model.num_kv_heads=null"], [], ["model.num_kv_heads=1"]])
def test_attention_parameter_formula_matches_the_model_gqa(kv_overrides):
    assert "d h d_h (wq) + 2 d h_kv d_h (wk, wv) + h d_h d (wo)" in page(7)
    m = load_config("llama3-8b", kv_overrides).model
    d, h, hkv, dh = m.d_model, m.num_heads, m.kv_heads, m.resolved_head_dim
    assert _attention_params_per_layer(m) == d * h * dh + 2 * d * hkv * dh + h * dh * d


def test_attention_parameter_formula_matches_the_model_mla():
    assert "+ h d_v d  (wo)  + r_q + r (the latents' RMSNorm scales)" in page(7)
    m = load_config("llama3-8b", ["model.attention_type=mla", "model.num_kv_heads=null", "model.q_lora_rank=1536",
                                  "model.kv_lora_rank=512", "model.qk_nope_head_dim=128",
                                  "model.qk_rope_head_dim=64", "model.v_head_dim=128"]).model
    d, h, rq, r = m.d_model, m.num_heads, m.q_lora_rank, m.kv_lora_rank
    nope, rope, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    want = (d * rq + rq * h * (nope + rope)) + (d * (r + rope) + r * h * (nope + dv)) + h * dv * d + rq + r
    assert _attention_params_per_layer(m) == want


@pytest.mark.parametrize("preset", ["mixtral-tiny", "qwen3-moe-tiny", "deepseek-v3"])
def test_moe_active_parameter_formula_matches_param_counts(preset):
    assert "active = total - (E - k) x 3 d f x (MoE layers)" in page(6)
    m = load_config(preset).model
    counts = param_counts(m)
    moe_layers = sum(m.moe_layer_flags())
    assert counts["active"] == counts["total"] - (m.moe_num_experts - m.moe_top_k) * 3 * m.d_model * m.expert_dim \
        * moe_layers


def test_switch_aux_loss_is_one_when_the_load_is_uniform():
    from models.router import router_losses

    assert "its floor, 1 (`E x sum f_i P_i` with both uniform)" in page(6)
    e, k, tokens = 8, 2, 64.0
    counts = np.full((e,), tokens * k / e, np.float32)  # every expert gets its share
    prob_sum = np.full((e,), tokens / e, np.float32)  # mean router probability 1/E
    aux, _ = router_losses(counts, prob_sum, np.float32(0), np.float32(tokens), k)
    assert float(aux) == pytest.approx(1.0)


@pytest.mark.parametrize("ring, length", [(2, 64), (4, 4096), (8, 1024)])
def test_causal_load_balance_formula_matches_the_ring_token_order(ring, length):
    assert "L²(i + 1/2) + L/2" in page(5) and "(2n - 1) / n" in page(5)
    local = length // ring
    contiguous = [int(np.sum(np.asarray(_token_index(i, local, ring, False)) + 1)) for i in range(ring)]
    balanced = [int(np.sum(np.asarray(_token_index(i, local, ring, True)) + 1)) for i in range(ring)]
    assert contiguous == [local**2 * i + local * (local + 1) // 2 for i in range(ring)]  # = L²(i + 1/2) + L/2
    assert len(set(balanced)) == 1
    ratio = max(contiguous) / np.mean(contiguous)
    assert ratio == pytest.approx((2 * ring - 1) / ring, rel=2 / local)


@pytest.mark.parametrize("op, factor", [("all_reduce", lambda n: 2 * (n - 1) / n), ("all_gather", lambda n: (n - 1) / n),
                                        ("reduce_scatter", lambda n: (n - 1) / n), ("all_to_all", lambda n: (n - 1) / n),
                                        ("ppermute", lambda n: 1.0)])
def test_bus_bandwidth_factors_are_the_pages(op, factor):
    assert "busbw = algbw x 2(n-1)/n" in page(1) and "busbw = algbw x (n-1)/n" in page(1)
    for n in (2, 4, 8):
        assert _bus_factor(op, n) == pytest.approx(factor(n))


def test_isoflop_runs_train_budget_over_flops_per_token_tokens():
    from jaxinfra.scaling.spec import expand, load_spec

    assert "D = C /\n  FLOPs-per-token(N)" in page(13) or "D = C / FLOPs-per-token(N)" in page(13).replace("\n  ", " ")
    spec_path = GUIDE.parents[1] / "examples" / "sweeps" / "cpu-isoflop.yaml"
    plan = expand(load_spec(spec_path))
    assert len(plan.runs) == 6
    for run in plan.runs:
        step_tokens = run.batch_size * run.seq_len
        fpt = flops_per_token(run.config.model, run.seq_len)
        assert run.flops_per_token == fpt
        assert abs(run.D - run.C_budget / fpt) <= step_tokens / 2  # rounded to whole steps


def _int8_weight_bytes(model, group_size: int) -> int:
    """Page 11's `1 + 4 / K` bytes per weight (K: the inputs one output sums, or the group size), float32
    norm scales, from the float model's shapes and a hand list of each dense weight's contracted dims."""
    contracted = {"embed": model.d_model, "wq": model.d_model, "wk": model.d_model, "wv": model.d_model,
                  "wo": model.num_heads * model.resolved_head_dim, "w_gate": model.d_model, "w_up": model.d_model,
                  "w_down": model.mlp_dim}
    total = 0
    for path, var in nnx.to_flat_state(abstract_params(model)):
        n = math.prod(var.shape)
        k = group_size or contracted.get(path[-1])
        total += 4 * n if path[-1] == "scale" else n + 4 * n // k
    return total


@pytest.mark.parametrize("group_size", [0, 32])
def test_int8_bytes_per_weight_formula_matches_the_quantized_params(group_size):
    assert "s = max|w| / 127" in page(11) and "bytes per weight = 1 + 4 / K" in page(11)
    cfg = load_config("tiny", ["quant.weights=int8", f"quant.group_size={group_size}"])
    assert cfg.model.tie_embeddings and not cfg.model.is_moe  # the hand list above is a tied dense model's
    total, _ = memory_table(cfg, make_mesh(cfg.mesh, jax.devices()))["params"]
    want = _int8_weight_bytes(cfg.model, group_size)
    assert total == want
    # ... and the ratio `jaxinfra quantize` printed on the page is this one
    float_bytes = 4 * param_counts(cfg.model)["total"]
    assert f"{want / float_bytes:.3f})" in page(11)


def test_int8_scale_is_max_abs_over_127_per_output_channel():
    from models.quant import quantize_int8

    w = np.random.default_rng(0).standard_normal((48, 5)).astype(np.float32)
    q, s = jax.jit(lambda w: quantize_int8(w, axis=0))(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(s).ravel(), np.abs(w).max(axis=0) / 127, rtol=1e-6)
    assert np.all(np.abs(np.asarray(q, np.float32) * np.asarray(s) - w) <= np.asarray(s) / 2 + 1e-7)


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b"])
def test_int8_kv_cache_bytes_per_token_formula_matches_models_cache(preset):
    assert "2 L h_kv (d_h + 4)" in page(11)
    m = load_config(preset).model
    assert cache.bytes_per_token(m, quantized=True) == 2 * m.num_layers * m.kv_heads * (m.resolved_head_dim + 4)


def test_distillation_loss_formula_matches_jaxinfra_distill():
    from jaxinfra.distill.loss import mix, soft_loss_sum

    assert "loss = alpha · T² · KL(softmax(t / T) ‖ softmax(s / T)) + (1 - alpha) · CE(s, label)" in page(12)
    assert "T · (softmax(s / T) - softmax(t / T))" in page(12)
    rng = np.random.default_rng(1)
    s, t = rng.standard_normal((2, 6, 11)) * 3  # [tokens, vocab] student / teacher logits, float64 reference
    temp, alpha, ce = 2.0, 0.3, 1.7

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, log_q = np.exp(log_softmax(t / temp)), log_softmax(s / temp)
    want = temp**2 * np.sum(p * (log_softmax(t / temp) - log_q))

    @jax.jit  # one program: eager dispatch would compile every op on its own
    def soft_mixed_and_grad(s, t):
        soft, grad = jax.value_and_grad(lambda x: soft_loss_sum(x, t, jnp.ones((6,), bool), temp))(s)
        sums = {"ce_sum": jnp.float32(ce), "soft_sum": soft, "loss_sum": jnp.float32(ce), "teacher_ce_sum": 0.0}
        return soft, mix(sums, jnp.float32(alpha))["means"]["loss"], grad

    soft, mixed, grad = soft_mixed_and_grad(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32))
    assert float(soft) == pytest.approx(want, rel=1e-5)
    assert float(mixed) == pytest.approx(alpha * want + (1 - alpha) * ce, rel=1e-5)
    # the soft term's gradient in the student's logits is T (q_T - p_T): on the hard term's scale
    np.testing.assert_allclose(np.asarray(grad), temp * (np.exp(log_q) - p), rtol=1e-4, atol=1e-6)
