"""The guide's formulas (docs/guide/*.md), written out by hand, against what the stack computes.

Each test states one page's formula as the page prints it (and checks that the page still
prints it), then compares it with the stack's own figure: `jaxinfra info`'s memory table,
the pipeline's schedule tables, the cache layout, the model's parameter shapes, the ring
attention's token order, the sweep planner. No training, no compilation.
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
