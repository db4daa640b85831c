"""Expert parallelism is the same computation: on 8 fake CPU devices, each layout reproduces
the 1-device run's first 5 losses (rtol 1e-5) and final parameters, for both MoE dispatch
paths (tests/test_parallel.py's method; Adam eps 1e-5 as explained in tests/test_step.py).

The model is DeepSeek-shaped and small: MLA, a dense first layer, then MoE with 8 routed
experts (top-2, capacity factor 1 so ~20% of assignments are dropped on the capacity path),
a shared expert, load-balancing and z-losses and the aux-loss-free bias, so drops, router
losses and the bias update must all agree across layouts. The dropless path runs the
ragged exchange (an exact all_to_all emulation on XLA:CPU, which lacks ragged-all-to-all).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from parity import assert_matches, packed_batches, parity_config, run_steps

from jaxinfra.config import Config, ConfigError, OptimizerConfig, TrainConfig
from jaxinfra.runtime import build_runtime
from models import ModelConfig

MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, tie_embeddings=False,
                    attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, moe_num_experts=8, moe_top_k=2, moe_mlp_dim=16, moe_shared_experts=1,
                    moe_first_dense_layers=1, moe_capacity_factor=1.0, moe_aux_loss_weight=0.01,
                    moe_z_loss_weight=1e-3, moe_bias_update_rate=1e-3)
OPT = OptimizerConfig(lr=1e-2, eps=1e-5)
BATCH, SEQ, STEPS = 8, 32, 5


def make_cfg(dispatch: str, mesh: dict, **parallelism) -> Config:
    return parity_config(dataclasses.replace(MODEL, moe_dispatch=dispatch), OPT, mesh, batch=BATCH, seq=SEQ,
                         **parallelism)


BATCHES = packed_batches(BATCH, SEQ, MODEL.vocab_size, STEPS)


def run(cfg: Config, devices) -> dict:
    return run_steps(cfg, devices, BATCHES)


@pytest.fixture(scope="module", params=["capacity", "dropless"])
def baseline(request):
    return request.param, run(make_cfg(request.param, {}), jax.devices()[:1])


LAYOUTS = {  # the default run: the expert exchange together with FSDP
    "expert4-fsdp2": dict(expert=4, fsdp=2),
}
SLOW_LAYOUTS = {  # the same exchange on other meshes (covered by expert4-fsdp2 in the default run)
    "expert8": (dict(expert=8), {}),
    "expert2-fsdp2-tensor2": (dict(expert=2, fsdp=2, tensor=2), {}),
    "expert2-data2-context2-ring": (dict(expert=2, data=2, context=2), dict(context_impl="ring")),
    "expert4-data2-zero1": (dict(expert=4, data=2), dict(strategy="zero1")),
}


def _check(result: dict, base: dict, name: str) -> None:
    assert_matches(result, base, name, metric_keys=("moe_dropped_frac", "moe_load_cv", "moe_aux_loss"),
                   metric_atol=1e-7)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_matches_single_device(baseline, name):
    dispatch, base = baseline
    _check(run(make_cfg(dispatch, LAYOUTS[name]), jax.devices()), base, f"{dispatch} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_expert_parallel_more_layouts(baseline, name):
    dispatch, base = baseline
    mesh, parallelism = SLOW_LAYOUTS[name]
    _check(run(make_cfg(dispatch, mesh, **parallelism), jax.devices()), base, f"{dispatch} {name}")


def test_baseline_reports_moe_metrics_and_moves_the_bias(baseline):
    """The metrics line's MoE fields, and DeepSeek-V3's bias moved by exactly +-rate per step."""
    dispatch, base = baseline
    last = base["metrics"][-1]
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_cv", "moe_load_max", "moe_load_min", "moe_dropped_frac"):
        assert np.isfinite(last[key]) and np.ndim(last[key]) == 0, key
    assert 0.5 < last["moe_aux_loss"] < 2 and last["moe_load_max"] >= 1 >= last["moe_load_min"]
    if dispatch == "capacity":
        assert 0.05 < last["moe_dropped_frac"] < 0.5
    else:
        assert last["moe_dropped_frac"] == 0
    start = np.asarray(base["initial"]["moe_layers"]["moe"]["router"]["bias"][...])
    end = np.asarray(base["params"]["moe_layers"]["moe"]["router"]["bias"][...])
    steps = np.round((end - start) / MODEL.moe_bias_update_rate)
    np.testing.assert_allclose(end - start, steps * MODEL.moe_bias_update_rate, atol=1e-6)
    assert np.abs(steps).max() <= STEPS and np.any(steps != 0)


def test_experts_must_divide_over_expert_axis():
    cfg = make_cfg("capacity", dict(expert=3, data=2))
    with pytest.raises(ConfigError, match=r"model.moe_num_experts=8 is not divisible by mesh.expert=3"):
        build_runtime(cfg, jax.devices()[:6])


def test_batch_must_divide_over_expert_too():
    cfg = dataclasses.replace(make_cfg("capacity", dict(expert=8)), train=TrainConfig(batch_size=4, seq_len=SEQ))
    with pytest.raises(ConfigError, match=r"mesh.data x mesh.fsdp x mesh.expert = 8"):
        build_runtime(cfg, jax.devices())


# ---------------------------------------------------------------- the imported Qwen3-MoE family

def _qwen3_moe_model() -> ModelConfig:
    """The model `jaxinfra hf import` builds from the tiny Qwen3-MoE fixture's config.json (4 experts, top-2,
    softmax router without top-k renormalisation, per-head QK-norm, GQA 8/2, head_dim 16), with every
    layer MoE as in Qwen3-30B-A3B (the fixture keeps layer 0 dense: mlp_only_layers=[0])."""
    import json
    import pathlib

    from jaxinfra.hf.families import from_hf

    hf = json.loads((pathlib.Path(__file__).parent / "fixtures/hf/qwen3_moe/config.json").read_text())
    family, model = from_hf({**hf, "mlp_only_layers": []})
    assert family == "qwen3_moe" and model.moe_first_dense_layers == 0 and model.moe_every == 1
    assert (model.qk_norm, model.qk_norm_scope, model.moe_norm_top_k, model.moe_num_experts) == (True, "head", False, 4)
    return model


# The default run: the expert exchange and ring attention in one layout (one compile); the slow run each alone.
QWEN3_MOE_LAYOUTS = {"expert4-context2-ring": (dict(expert=4, context=2), dict(context_impl="ring"))}
QWEN3_MOE_SLOW_LAYOUTS = {
    "expert4-fsdp2": (dict(expert=4, fsdp=2), {}),
    "context2-fsdp4-ring": (dict(context=2, fsdp=4), dict(context_impl="ring")),
    "fsdp4-tensor2": (dict(fsdp=4, tensor=2), {}),
}


@pytest.fixture(scope="module")
def qwen3_moe_baseline():
    model = _qwen3_moe_model()
    batches = packed_batches(BATCH, SEQ, model.vocab_size, STEPS)
    return model, batches, run_steps(parity_config(model, OPT, {}, batch=BATCH, seq=SEQ), jax.devices()[:1], batches)


def _check_qwen3_moe(baseline, name: str, layouts: dict) -> None:
    model, batches, base = baseline
    mesh, parallelism = layouts[name]
    cfg = parity_config(model, OPT, mesh, batch=BATCH, seq=SEQ, **parallelism)
    _check(run_steps(cfg, jax.devices(), batches), base, f"qwen3_moe {name}")


@pytest.mark.parametrize("name", list(QWEN3_MOE_LAYOUTS))
def test_qwen3_moe_trains_under_parity_layouts(qwen3_moe_baseline, name):
    _check_qwen3_moe(qwen3_moe_baseline, name, QWEN3_MOE_LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QWEN3_MOE_SLOW_LAYOUTS))
def test_qwen3_moe_trains_under_more_layouts(qwen3_moe_baseline, name):
    _check_qwen3_moe(qwen3_moe_baseline, name, QWEN3_MOE_SLOW_LAYOUTS)


# ---------------------------------------------------------------- gpt-oss


# The tiny gpt-oss of tests/fixtures/hf/gpt_oss in kind: GQA with sinks and q/k/v/o biases, windows of 8 on every
# other layer (sequence 32), yarn with HF's attention factor, MoE on every layer with the router logit bias, expert
# biases and the clamped SwiGLU (limit 1: active).
GPT_OSS = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=32,
                      tie_embeddings=False, qkv_bias=True, attn_out_bias=True, attention_sinks=True, sliding_window=8,
                      sliding_window_pattern=2, rope_scaling_type="yarn", rope_scaling_factor=4.0,
                      rope_original_max_len=16, rope_yarn_truncate=False, rope_yarn_attention_factor=1.1386,
                      mlp_activation="clamped_swiglu", mlp_swiglu_limit=1.0, moe_num_experts=4, moe_top_k=2,
                      moe_mlp_dim=16, moe_router_logit_bias=True, moe_expert_bias=True, moe_aux_loss_weight=0.01)
GPT_OSS_LAYOUTS = {
    "expert4-fsdp2": (dict(expert=4, fsdp=2), {}),
    "fsdp4-tensor2": (dict(fsdp=4, tensor=2), {}),
    "context2-fsdp4-allgather": (dict(context=2, fsdp=4), dict(context_impl="allgather")),
}


def _gpt_oss_cfg(mesh: dict, **parallelism) -> Config:
    return parity_config(GPT_OSS, OPT, mesh, batch=BATCH, seq=SEQ, **parallelism)


@pytest.fixture(scope="module")
def gpt_oss_baseline():
    return run(_gpt_oss_cfg({}), jax.devices()[:1])


# Slow (~10 s a layout on 2 cores); the default run covers gpt-oss under expert=2 x fsdp=2 x tensor=2 with the
# imported fixture's eval loss (tests/test_hf.py test_sharded_import_gives_the_reference_loss).
@pytest.mark.slow
@pytest.mark.parametrize("name", list(GPT_OSS_LAYOUTS))
def test_gpt_oss_trains_under_the_parity_layouts_like_one_device(gpt_oss_baseline, name):
    mesh, parallelism = GPT_OSS_LAYOUTS[name]
    _check(run(_gpt_oss_cfg(mesh, **parallelism), jax.devices()), gpt_oss_baseline, f"gpt-oss {name}")
