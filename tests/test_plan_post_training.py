"""`jaxinfra plan` for DPO and GRPO runs (jaxinfra/plan/memory.py): the reference policy's params,
the rollout's KV cache, its prefill logits and the sampler's batch, each against a hand computation
for a small config; the rollout KV cache against the compiled decode of a Generator on the run's
mesh; and a plain pre-training plan unchanged by them."""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest

from jaxinfra.config import load_config
from jaxinfra.plan.devices import device_spec
from jaxinfra.plan.estimate import make_plan
from jaxinfra.plan.memory import COMPONENTS, reference_params, rollout_kv_cache, rollout_prefill, sampler_batch
from jaxinfra.plan.report import describe
from jaxinfra.state import abstract_params

NEW = (reference_params, rollout_kv_cache, rollout_prefill, sampler_batch)
# tiny: d_model 128, 4 heads of 32, 2 KV heads, 4 layers
SMALL = ["model.vocab_size=512", "train.batch_size=16", "train.seq_len=128"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3", "answer": "2"}\n')
    return str(path)


def grpo(data: str, *extra: str) -> list[str]:
    return [*SMALL, "data.source=prompts", f"data.paths=[{data}]", "grpo.reward=[r.py:f]", "grpo.group_size=4",
            "grpo.max_new_tokens=40", *extra]


def dpo(data: str, *extra: str) -> list[str]:
    return [*SMALL, "data.source=preference", f"data.paths=[{data}]", *extra]


def memory(overrides: list[str], devices: int = 8) -> dict[str, int]:
    return make_plan(load_config("tiny", overrides), devices, device_spec("h100")).memory.as_dict()


def param_bytes(overrides: list[str]) -> int:
    """Every parameter of the run's model (no adapters), 4 bytes each: the whole frozen copy."""
    model = load_config("tiny", overrides).model
    return sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(abstract_params(model)))


def test_dpo_and_grpo_price_a_separate_reference_like_the_runs_own_params(data, tmp_path):
    dp = ["mesh.data=8", "parallelism.strategy=dp"]  # replicated: the whole model on every device
    assert memory(dpo(data, *dp))["reference_params"] == param_bytes(dpo(data)) > 0
    fsdp = memory(dpo(data, "mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1"))  # sharded as the run's params
    assert fsdp["reference_params"] == fsdp["params"] < param_bytes(dpo(data)) / 4
    assert memory(grpo(data, *dp))["reference_params"] == param_bytes(grpo(data))
    assert "reference_params" not in memory(grpo(data, *dp, "grpo.kl_beta=0"))  # no KL: no reference
    lora = ["lora.rank=4", "lora.targets=[q,v]"]
    assert "reference_params" not in memory(dpo(data, *dp, *lora))  # the base with adapters off
    named = memory(dpo(data, *dp, *lora, f"dpo.reference={tmp_path}"))  # a separate reference
    assert named["reference_params"] == named["frozen_params"] == param_bytes(dpo(data))
    (tmp_path / "dpo_reference.json").write_text("{}")  # `jaxinfra dpo save-reference` output: log-probs only
    assert "reference_params" not in memory(dpo(data, *dp, f"dpo.reference={tmp_path}"))
    assert not set(memory(dpo(data, *dp))) & {"rollout_kv_cache", "rollout_prefill", "sampler_batch"}


def test_rollout_kv_cache_prefill_and_sampler_batch_by_hand(data):
    mesh = ["mesh.data=4", "mesh.tensor=2"]  # 4 rows per device, KV heads and vocabulary over tensor
    rows, length, layers = 16 // 4, 128, 4
    got = memory(grpo(data, *mesh))
    assert got["rollout_kv_cache"] == layers * 2 * rows * (2 // 2) * length * 32 * 4  # k and v, float32
    int8 = memory(grpo(data, *mesh, "quant.kv_cache=int8"))["rollout_kv_cache"]
    assert int8 == layers * 2 * rows * 1 * length * (32 * 1 + 4)  # int8 values + a float32 scale per token
    mla = memory(grpo(data, *mesh, "model.attention_type=mla", "model.num_kv_heads=null", "model.kv_lora_rank=64",
                      "model.qk_rope_head_dim=16", "model.qk_nope_head_dim=32", "model.v_head_dim=32",
                      "model.dtype=bfloat16"))
    assert mla["rollout_kv_cache"] == layers * rows * length * (64 + 16) * 2  # latent + rope key, not split
    bucket = 96  # seq_len 128 - max_new_tokens 40 = 88, rounded up to the Generator's 16
    assert got["rollout_prefill"] == rows * bucket * (512 // 2) * 4
    assert got["sampler_batch"] == 2 * rows * (512 // 2) * 4 + rows * 40 * (4 + 4)


def test_the_rollout_is_a_phase_of_its_own_in_the_total(data):
    """total = resident + max(step + max(head, layer), update, rollout); a rollout-bound config
    (64 narrow MHA layers, remat full, a flash kernel, seq 512) peaks in it."""
    cfg = load_config("tiny", grpo(data, "mesh.data=8", "model.vocab_size=257", "model.num_layers=64",
                                   "model.d_model=64", "model.mlp_dim=128", "model.num_kv_heads=4",
                                   "model.remat_policy=full", "model.attention_impl=cudnn", "train.seq_len=512"))
    plan = make_plan(cfg, 8, device_spec("h100"))
    mem = plan.memory
    step = mem.phase("step") + max(mem.phase("head"), mem.phase("layer"))
    rollout = sum(c.bytes for c in mem.components if c.name in ("rollout kv cache", "rollout prefill", "sampler batch"))
    assert mem.phase("rollout") == rollout > max(step, mem.phase("update"))
    assert mem.total == mem.phase("resident") + rollout and mem.peak_phase == "rollout"
    text = describe(plan)
    assert "max(step + max(head, layer), update, rollout))" in text and "rollout kv cache" in text


def test_a_pre_training_plan_is_unchanged():
    """Without DPO or GRPO the new components add nothing: the same text and JSON as without them."""
    for overrides in (["mesh.data=8"], ["mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1", "lora.rank=4"]):
        cfg = load_config("tiny", overrides)
        plan = make_plan(cfg, 8, device_spec("h100"))
        old = make_plan(cfg, 8, device_spec("h100"), components=[c for c in COMPONENTS if c not in NEW])
        assert describe(plan) == describe(old) and plan.as_json() == old.as_json()
        assert "update))" in describe(plan) and "rollout" not in describe(plan) and "reference" not in describe(plan)


def test_rollout_kv_cache_and_params_are_what_the_compiled_decode_takes(data):
    """A Generator on the run's own mesh (data=4 x tensor=2) with prompt bucket + new tokens =
    seq_len: its compiled decode's arguments are the params, the cache and a few small arrays."""
    from jaxinfra.infer import Generator, inference_mesh
    from jaxinfra.state import init_params

    cfg = load_config("tiny", [*grpo(data, "mesh.data=4", "mesh.tensor=2", "grpo.max_new_tokens=32"),
                               "train.seq_len=48", "train.batch_size=8"])
    params = jax.jit(lambda key: init_params(cfg.model, key))(jax.random.key(0))
    mesh, _ = inference_mesh(cfg, jax.devices()[:8])
    _, decode = Generator(cfg, params, mesh=mesh)._compile(8, 16, 32, 8, ())
    mem = make_plan(dataclasses.replace(cfg), 8, device_spec("h100")).memory.as_dict()
    args = decode.memory_analysis().argument_size_in_bytes
    assert mem["params"] + mem["rollout_kv_cache"] == pytest.approx(args, rel=0.02)
