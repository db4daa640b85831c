"""The frozen reference policy (jaxinfra/reference.py): a path reference restored onto a sharded mesh
gives a plain forward's logits; the LoRA mode is exactly the base model; another shape is refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity import packed_batches, parity_config

from jaxinfra.checkpoint import save_params_only
from jaxinfra.config import Config, ConfigError, OptimizerConfig
from jaxinfra.extensions import HostContext, StepContext
from jaxinfra.reference import ReferencePolicy
from jaxinfra.runtime import build_runtime
from jaxinfra.state import init_params, model_graphdef
from models import ModelConfig
from models.lora_config import LoraConfig
from models.project import LoraB

V, B, T = 64, 8, 16
MODEL = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    tie_embeddings=False, init_std=0.3, loss_chunk_size=4)
OPT = OptimizerConfig(lr=1e-3)


def _saved(tmp_path_factory, model: ModelConfig, seed: int) -> tuple[str, nnx.State]:
    params = jax.jit(lambda k: init_params(model, k))(jax.random.key(seed))
    out = tmp_path_factory.mktemp("ref")
    save_params_only(out, Config(model=model), params, {"params_only": True, "step": 0})
    return str(out), params


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _saved(tmp_path_factory, MODEL, 3)


def _batch() -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in packed_batches(B, T, V, 1)[0].items()}


def _plain_logits(model: ModelConfig, params, batch, lora: LoraConfig | None = None) -> np.ndarray:
    graphdef = model_graphdef(model, lora=lora) if lora else model_graphdef(model)

    def fn(params, batch):
        m = nnx.merge(graphdef, params)
        h, _ = m.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
        return m.logits(h)

    return np.asarray(jax.jit(fn)(params, batch))


def _ref_logits(ref: ReferencePolicy, rt, batch, model_params=None) -> np.ndarray:
    def fn(inputs, batch, variables):
        model = nnx.merge(rt.graphdef, variables) if variables is not None else None
        ctx = StepContext(model, batch, jnp.int32(0), inputs, None, rt.plan)
        return ref.logits(ctx, ref.hidden(ctx))

    with jax.set_mesh(rt.mesh):
        return np.asarray(jax.jit(fn)(ref.inputs(), rt.to_global({k: np.asarray(v) for k, v in batch.items()}),
                                      model_params))


def test_a_path_reference_is_restored_sharded_and_gives_a_plain_forwards_logits(saved):
    path, params = saved
    cfg = parity_config(MODEL, OPT, dict(fsdp=4, tensor=2), batch=B, seq=T)
    rt = build_runtime(cfg, jax.devices(), extensions=[])
    ref = ReferencePolicy(cfg, path, "dpo.reference")
    ref.setup(rt)
    notes = ref.start(HostContext(rt, [], 0, B), {})
    assert "step 0" in notes[0] and ref.checkpoint_meta() == {"path": path, "step": 0}
    wq = ref.inputs()["layers"]["attn"]["wq"][...]
    assert len(wq.sharding.device_set) == 8 and wq.sharding.spec == rt.state_shardings.params["layers"]["attn"]["wq"].get_raw_value().spec
    for got, want in zip(jax.tree.leaves(jax.device_get(ref.inputs())), jax.tree.leaves(jax.device_get(params)),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    batch = _batch()
    np.testing.assert_allclose(_ref_logits(ref, rt, batch), _plain_logits(MODEL, params, batch), rtol=1e-5, atol=1e-5)


def test_a_null_reference_is_the_runs_start_and_a_random_start_is_refused(saved):
    path, _ = saved
    cfg = parity_config(MODEL, OPT, {}, batch=B, seq=T)
    rt = build_runtime(cfg, jax.devices()[:1], extensions=[])
    ref = ReferencePolicy(cfg, None, "grpo.reference")
    ref.setup(rt)
    with pytest.raises(ConfigError, match=r"grpo.reference is null and the run starts from random weights"):
        ref.start(HostContext(rt, [], 0, B), {})
    ref.start(HostContext(rt, [], 0, B, restore_from=path), {})
    assert ref.checkpoint_meta() == {"path": path, "step": 0}
    with pytest.raises(Exception, match="no committed checkpoint 5"):  # a resume pins the recorded step
        ref.start(HostContext(rt, [], 0, B), {"reference": {"path": path, "step": 5}})


def test_the_lora_reference_is_exactly_the_base_model_and_needs_no_inputs(saved):
    _, base = saved
    lora = LoraConfig(rank=4, alpha=8.0)
    cfg = dataclasses.replace(parity_config(MODEL, OPT, {}, batch=B, seq=T), lora=lora)
    rt = build_runtime(cfg, jax.devices()[:1])  # the lora extension (entry point) joins
    ref = ReferencePolicy(cfg, None, "dpo.reference")
    ref.setup(rt)
    ref.start(HostContext(rt, [], 0, B), {})
    assert ref.inputs() == () and ref.input_shardings() == () and ref.abstract_inputs() == ()
    variables = jax.jit(lambda k: init_params(MODEL, k, lora=lora))(jax.random.key(3))
    adapters, rest = nnx.split_state(variables, LoraB, ...)
    adapters = jax.tree.map(lambda b: jnp.full_like(b, 0.05), adapters)  # adapters on: a different model
    variables = nnx.merge_state(adapters, rest)
    batch = _batch()
    got = _ref_logits(ref, rt, batch, variables)
    np.testing.assert_array_equal(got, _plain_logits(MODEL, base, batch))
    on = _plain_logits(MODEL, variables, batch, lora)
    assert np.max(np.abs(on - got)) > 1e-3


def test_a_reference_of_another_shape_is_refused_in_one_line(saved, tmp_path_factory):
    wide, _ = _saved(tmp_path_factory, dataclasses.replace(MODEL, d_model=48), 4)
    cfg = parity_config(MODEL, OPT, {}, batch=B, seq=T)
    rt = build_runtime(cfg, jax.devices()[:1], extensions=[])
    with pytest.raises(ConfigError) as e:
        ReferencePolicy(cfg, wide, "dpo.reference").setup(rt)
    assert "dpo.reference=" in str(e.value) and "model.d_model=48" in str(e.value) and "\n" not in str(e.value)
