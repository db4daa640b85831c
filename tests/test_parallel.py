"""Every parallel layout is the same computation: its losses and parameters equal the 1-device run.

The torchtitan "converging" method as a test: one 1-device baseline, then each
layout on 8 fake CPU devices must reproduce its first 5 losses (rtol 1e-5) and its
final parameters. Also: memory per device under fsdp / zero1, bad layouts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from parity import assert_matches, packed_batches, parity_config, run_steps

from jaxinfra.config import Config, ConfigError, OptimizerConfig, TrainConfig
from jaxinfra.runtime import build_runtime
from jaxinfra.state import bytes_per_device
from models import ModelConfig
from sharding.mesh import MeshConfig

# 8 heads so tensor=8 splits them; 4 KV heads, replicated under tensor=8 (GQA practice).
MODEL = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
                    mlp_dim=128, tie_embeddings=False)
# eps=1e-5: see tests/test_step.py (Adam amplifies summation-order noise of tiny gradients by lr/eps).
OPT = OptimizerConfig(lr=1e-2, eps=1e-5)
BATCH, SEQ, STEPS = 8, 32, 5


def make_cfg(mesh: dict, **parallelism) -> Config:
    return parity_config(MODEL, OPT, mesh, batch=BATCH, seq=SEQ, **parallelism)


BATCHES = packed_batches(BATCH, SEQ, MODEL.vocab_size, STEPS)


def run(cfg: Config, devices) -> dict:
    return run_steps(cfg, devices, BATCHES)


@pytest.fixture(scope="module")
def baseline():
    return run(make_cfg({}), jax.devices()[:1])


LAYOUTS = {
    "data8": (dict(data=8), {}),
    "zero1-data8": (dict(data=8), dict(strategy="zero1")),
    "fsdp8": (dict(fsdp=8), {}),
    "fsdp4-tensor2": (dict(fsdp=4, tensor=2), {}),
    "data2-fsdp2-tensor2": (dict(data=2, fsdp=2, tensor=2), {}),
    "context2-fsdp4-allgather": (dict(context=2, fsdp=4), dict(context_impl="allgather")),
    "context2-fsdp4-ring": (dict(context=2, fsdp=4), dict(context_impl="ring")),
    "context4-data2-ring-unbalanced": (dict(context=4, data=2), dict(context_impl="ring", load_balance=False)),
    "tensor8-sequence-parallel": (dict(tensor=8), dict(sequence_parallel=True)),
}


_KEPT = ("fsdp8", "zero1-data8")  # the memory test below reads these layouts' own runs
_RUNS: dict[str, dict] = {}


def layout_run(name: str) -> dict:
    if name in _RUNS:
        return _RUNS[name]
    mesh, parallelism = LAYOUTS[name]
    result = run(make_cfg(mesh, **parallelism), jax.devices())
    if name in _KEPT:
        _RUNS[name] = result
    return result


# Covered in the default run: fsdp x tensor by data2-fsdp2-tensor2, the ring by
# context4-data2-ring-unbalanced and context x fsdp by context2-fsdp4-allgather.
SLOW_LAYOUTS = ("fsdp4-tensor2", "context2-fsdp4-ring")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n
                                  for n in LAYOUTS])
def test_layout_matches_single_device(baseline, name):
    assert_matches(layout_run(name), baseline, name)


def _memory(result: dict) -> dict[str, float]:
    state, rt = result["state"], result["rt"]
    compiled = rt.lower_train_step(state, rt.to_global(BATCHES[0])).compile()
    return {"params": bytes_per_device(state.params), "opt": bytes_per_device(state.opt_state),
            "arguments": compiled.memory_analysis().argument_size_in_bytes}


def test_fsdp_and_zero1_memory_per_device(baseline):
    single = _memory(baseline)
    fsdp, zero1 = _memory(layout_run("fsdp8")), _memory(layout_run("zero1-data8"))
    slack = 1.05
    assert fsdp["params"] + fsdp["opt"] <= (single["params"] + single["opt"]) / 8 * slack
    # Arguments of the compiled step: params + optimizer state + this device's batch rows.
    assert fsdp["arguments"] <= single["arguments"] / 8 * slack
    assert zero1["opt"] <= single["opt"] / 8 * slack
    assert zero1["params"] == single["params"]  # replicated


@pytest.mark.parametrize("overrides, match", [
    (dict(mesh=MeshConfig(data=3)), r"mesh product 3 .* != device count 8"),
    (dict(mesh=MeshConfig(data=-1, tensor=3)), r"mesh.data=-1 cannot fill 8 devices"),
    (dict(mesh=MeshConfig(data=-1, tensor=3)), r"model.num_heads=8 is not divisible by mesh.tensor=3"),
    (dict(mesh=MeshConfig(data=1, context=8), train=TrainConfig(batch_size=8, seq_len=36)),
     r"train.seq_len=36 is not divisible by 8"),
])
def test_bad_layouts_fail_before_compile(overrides, match):
    cfg = dataclasses.replace(make_cfg({}), **overrides)
    devices = jax.devices()[:6] if "tensor=3" in match else jax.devices()  # 6 = 2 x 3 fits; 8 heads do not
    with pytest.raises(ConfigError, match=match) as err:
        build_runtime(cfg, devices)
    assert "\n" not in str(err.value)


def test_info_memory_table_matches_strategy():
    from jaxinfra.info import describe, memory_table
    from sharding.mesh import make_mesh

    fsdp_cfg = make_cfg(dict(fsdp=8))
    fsdp = memory_table(fsdp_cfg, make_mesh(fsdp_cfg.mesh, jax.devices()))
    for name, (total, per_device) in fsdp.items():
        assert per_device <= total / 8 * 1.05, name
    zero1_cfg = make_cfg(dict(data=8), strategy="zero1")
    zero1 = memory_table(zero1_cfg, make_mesh(zero1_cfg.mesh, jax.devices()))
    assert zero1["params"][1] == zero1["params"][0]
    assert zero1["optimizer state"][1] <= zero1["optimizer state"][0] / 8 * 1.05
    text = describe(zero1_cfg)
    assert "ZeRO-1" in text and "optimizer state" in text and "layers/attn/wq" in text


def test_pallas_kernel_runs_per_shard_and_matches(baseline):
    """A Pallas kernel cannot be partitioned by XLA: sharding/context.py runs it per (batch, heads) shard."""
    cfg = dataclasses.replace(make_cfg(dict(data=2, fsdp=2, tensor=2)),
                              model=dataclasses.replace(MODEL, attention_impl="pallas_triton"))
    result = run(cfg, jax.devices())
    np.testing.assert_allclose(result["losses"], baseline["losses"], rtol=1e-5)
    text = result["rt"].lower_train_step(result["state"], result["rt"].to_global(BATCHES[0])).as_text()
    assert "manual_computation" in text  # the kernel ran inside shard_map, not on gathered inputs


# Slow: covered in the default run by tests/test_ring.py::test_ring_matches_reference[pallas_triton-*] (the Pallas
# kernel per ring step, forward and gradients, manual over data x context) and the Gemma and sinks tests below
# (training under this same context2-fsdp4 ring).
@pytest.mark.slow
def test_ring_runs_the_pallas_kernel_and_matches(baseline):
    """Ring attention calls the configured kernel per ring step (sharding/ring.py), here Pallas
    (interpreted), inside a shard_map manual over context and the batch axes: same training."""
    mesh, parallelism = LAYOUTS["context2-fsdp4-ring"]
    cfg = dataclasses.replace(make_cfg(mesh, **parallelism),
                              model=dataclasses.replace(MODEL, attention_impl="pallas_triton"))
    assert_matches(run(cfg, jax.devices()), baseline, "context2-fsdp4-ring-pallas")


def test_gemma_block_trains_under_context2_ring_like_one_device():
    """Gemma 2/3's block (sandwich norms with (1 + w) weights, GeGLU, sqrt(d) embeddings, attention soft-cap,
    which every ring step applies to its piece of the scores) trains under context=2 x fsdp=4 as on one device."""
    gemma = dataclasses.replace(MODEL, norm_placement="sandwich", norm_weight_offset=1.0, mlp_activation="gelu_tanh",
                                embed_scale=True, attn_logit_softcap=0.5, qk_norm=True)
    mesh, parallelism = LAYOUTS["context2-fsdp4-ring"]
    one = run(dataclasses.replace(make_cfg({}), model=gemma), jax.devices()[:1])
    split = run(dataclasses.replace(make_cfg(mesh, **parallelism), model=gemma), jax.devices())
    assert_matches(split, one, "gemma-context2-fsdp4-ring")


# OLMo 2's block with gpt-oss attention sinks: one model, so that both features' layout checks share one 1-device
# baseline and one compile per layout (neither feature's point depends on the other being absent).
SINKS = dataclasses.replace(MODEL, attention_sinks=True, norm_placement="post", qk_norm=True, qk_norm_scope="full")


@pytest.fixture(scope="module")
def sinks_baseline():
    return run(dataclasses.replace(make_cfg({}), model=SINKS), jax.devices()[:1])


def test_olmo2_block_and_attention_sinks_train_under_fsdp4_tensor2_like_one_device(sinks_baseline):
    """OLMo 2's block (norms after the sub-layers, QK-norm over the whole q / k projection, whose mean
    then reduces across the tensor-split heads) and gpt-oss attention sinks (a [heads] logit per layer,
    split with the heads on `tensor`) train under fsdp=4 x tensor=2 as on one device; the sinks learn,
    and take no weight decay."""
    from jaxinfra.optim import decay_mask

    one = sinks_baseline
    split = run(dataclasses.replace(make_cfg(dict(fsdp=4, tensor=2)), model=SINKS), jax.devices())
    assert_matches(split, one, "olmo2-sinks-fsdp4-tensor2")
    learned = np.asarray(one["params"]["layers"]["attn"]["sinks"][...])
    assert learned.shape == (MODEL.num_layers, MODEL.num_heads) and np.abs(learned).min() > 0
    mask = decay_mask(one["state"].params, OPT)
    assert mask["layers"]["attn"]["sinks"] is False


def test_attention_sinks_train_under_context2_ring_like_one_device(sinks_baseline):
    """Sinks under ring attention (context=2 x fsdp=4, balanced): they join once, after the ring's merge."""
    mesh, parallelism = LAYOUTS["context2-fsdp4-ring"]
    split = run(dataclasses.replace(make_cfg(mesh, **parallelism), model=SINKS), jax.devices())
    assert_matches(split, sinks_baseline, "olmo2-sinks-context2-fsdp4-ring")


def _imported_gemma3() -> ModelConfig:
    """The Gemma 3 fixture's config as `hf import` maps it (tests/fixtures/hf/gemma3: every 3rd layer global with
    linear-scaled RoPE, the others a window of 8 < SEQ with their own RoPE base; QK-norm, sandwich (1 + w) norms,
    GeGLU, softmax scale 24 ** -0.5, GQA 4/2 heads of 16), cut to its first 3 layers (one period)."""
    import json
    import pathlib

    from jaxinfra.hf.families import from_hf

    hf = json.loads((pathlib.Path(__file__).parent / "fixtures" / "hf" / "gemma3" / "config.json").read_text())
    gemma3 = dataclasses.replace(from_hf(hf)[1], num_layers=3)
    assert gemma3.layer_windows() == (8, 8, None) and SEQ > 8
    return gemma3


# Parameters to 5e-5: under fsdp4 x tensor2 one of w_gate's entries, whose gradient is ~0, lands 2.3e-5 off
# (summation noise through Adam's lr / eps, see tests/parity.py); a real error moves parameters by ~lr = 1e-2.
GEMMA3_LAYOUTS = {"context2-fsdp2-tensor2-allgather": (dict(context=2, fsdp=2, tensor=2), dict(context_impl="allgather")),
                  "fsdp4-tensor2": (dict(fsdp=4, tensor=2), {}),
                  "context2-fsdp4-allgather": LAYOUTS["context2-fsdp4-allgather"],
                  "context2-fsdp4-ring-unbalanced": (dict(context=2, fsdp=4), dict(context_impl="ring",
                                                                                  load_balance=False))}


# Slow (~17 s of compiles cold): the default run covers the pieces, tests/test_windows.py training windows, the
# local RoPE base, sandwich (1 + w) norms and QK-norm under context2 x fsdp4, and the Gemma block test above
# GeGLU, sqrt(d) embeddings and the soft-cap under the context ring (attention_scale is a multiply of q).
@pytest.mark.slow
@pytest.mark.parametrize("name", list(GEMMA3_LAYOUTS))
def test_imported_gemma3_trains_under_tensor_and_context_splits_like_one_device(name):
    """The imported Gemma 3 config trains as on one device with its heads split over `tensor` and its sequence over
    `context` (allgather, and the ring without load balancing, the one that runs windows): fsdp=4 x tensor=2,
    context=2 x fsdp=4, and both at once."""
    gemma3 = _imported_gemma3()
    mesh, parallelism = GEMMA3_LAYOUTS[name]
    one = _gemma3_baseline(gemma3)
    split = run(dataclasses.replace(make_cfg(mesh, **parallelism), model=gemma3), jax.devices())
    assert_matches(split, one, f"gemma3-{name}", param_atol=5e-5)


@functools.cache
def _gemma3_baseline(gemma3: ModelConfig) -> dict:
    return run(dataclasses.replace(make_cfg({}), model=gemma3), jax.devices()[:1])
