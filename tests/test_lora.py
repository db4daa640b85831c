"""LoRA and QLoRA: adapters on the projections, a frozen base, the optimizer over the adapters only,
merge, restore from a base, sharding, dropout, MoE experts, and the bad inputs.

The independent reference for the adapted forward is the merged model: W + A B * alpha/r computed as
one float32 matrix (jaxinfra/lora/merge.py) in a model without adapters, against the unmerged model's
x W + (x A) B * alpha/r on every projection path (einsum, capacity experts, dropless ragged experts).

The installed entry points may predate the `lora` one, so runs pass the extension explicitly.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity import packed_batches

from jaxinfra.checkpoint import CheckpointError, restore_params, save_params_only
from jaxinfra.config import ConfigError, load_config, validate
from jaxinfra.lora.extension import Lora, for_config
from jaxinfra.lora.merge import merge_lora
from jaxinfra.quant_checks import check_trainable
from jaxinfra.quantize import quantize_loaded
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_params, init_params, model_graphdef, model_state, split_model_state
from models.lora_config import adapter_param_count, lora_targets, projection_dims
from models.project import ADAPTERS, LoraA, LoraB

STEPS, BATCH, SEQ, VOCAB = 4, 8, 32, 64
BASE = ["data.source=synthetic", f"data.synthetic_vocab={VOCAB}", f"model.vocab_size={VOCAB}", "model.d_model=32",
        "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_dim=64",
        f"train.seq_len={SEQ}", f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.eval_every=0",
        "log.every=1", "log.progress=false", "log.tensorboard=false", "schedule.warmup_steps=0",
        "optimizer.lr=1e-2", "mesh.data=1"]
ALL = "lora.targets=[q,k,v,o,gate,up,down]"


def cfg(*extra: str, preset: str = "tiny"):
    return load_config(preset, [*BASE, "lora.rank=4", *extra])


def run(c, devices, steps: int = STEPS, state=None) -> dict:
    """`steps` train steps on one repeated packed batch (the loss falls as the adapters memorise it)."""
    rt = build_runtime(c, devices, extensions=[Lora()])
    state = rt.init_state() if state is None else state(rt)
    initial = jax.device_get(state.params)
    losses = []
    for batch in packed_batches(BATCH, SEQ, VOCAB, steps):
        state, m = rt.train_step(state, rt.to_global(batch))
        losses.append(float(m["loss"]))
    return {"rt": rt, "state": state, "initial": initial, "losses": np.array(losses)}


def flat(state) -> dict[str, nnx.Variable]:
    return {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def trained():
    return run(cfg(ALL), jax.devices()[:1])


# ---------------------------------------------------------------- config and layout (no compile)


@pytest.mark.parametrize("preset, targets", [
    ("tiny", ("q", "k", "v", "o", "gate", "up", "down")),
    ("deepseek-tiny", ("q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")),
    ("mixtral-tiny", ("attention.q", "attention.v", "experts.gate", "experts.up", "experts.down")),
])
def test_trainable_count_is_rank_times_in_plus_out_over_targets_layers_and_experts(preset, targets):
    c = load_config(preset, ["lora.rank=2", f"lora.targets=[{','.join(targets)}]"])
    validate(c)
    variables = jax.eval_shape(lambda: init_params(c.model, jax.random.key(0), c.quant, c.lora))
    adapters, base = nnx.split_state(variables, ADAPTERS, ...)
    count = sum(x.size for x in jax.tree.leaves(adapters))
    dims = projection_dims(c.model)
    want = sum(2 * (i + o) * n for t in lora_targets(c.lora) for i, o, n in dims.get(t, []))
    assert count == want == adapter_param_count(c.model, c.lora) > 0
    # The base is the model without adapters, array for array.
    plain = jax.eval_shape(lambda: init_params(c.model, jax.random.key(0), c.quant))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), base) == jax.tree.map(lambda a: (a.shape, a.dtype), plain)


def test_adapters_shard_a_over_the_input_axis_and_b_over_the_output_axis():
    c = cfg(ALL, "mesh.fsdp=4", "mesh.tensor=2")
    rt = build_runtime(c, jax.devices()[:8], extensions=[Lora()])
    specs = {k: tuple(v.get_value().spec) for k, v in flat(rt.state_shardings.params).items()}
    assert specs["layers/attn/wq_lora_a"] == (None, "fsdp", None)  # [layers, embed, r]
    assert specs["layers/attn/wq_lora_b"] == (None, None, "tensor", None)  # [layers, r, heads, head_dim]
    assert specs["layers/attn/wo_lora_a"] == (None, "tensor", None, None)  # [layers, heads, head_dim, r]
    assert specs["layers/attn/wo_lora_b"] == (None, None, "fsdp")  # [layers, r, embed]
    assert specs["layers/mlp/w_down_lora_a"] == (None, "tensor", None)  # [layers, mlp, r]
    # The optimizer state holds moments for the adapters only, sharded like them.
    opt = [x for x in jax.tree.leaves(rt.abstract_state().opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
           if isinstance(x, nnx.Variable)]
    assert opt and all(isinstance(x, (LoraA, LoraB)) for x in opt)


@pytest.mark.parametrize("extra, message", [
    (["lora.targets=[q_a]"], "lora.targets='q_a' is invalid: must be a projection this model has"),
    (["lora.targets=[qq]"], "did you mean 'q'?"),
    (["lora.targets=[router]"], "lora.targets='router' is invalid"),
    (["lora.targets=[]"], "lora.targets=[] is invalid"),
    (["lora.rank=17", "lora.targets=[k]"], "lora.rank=17 is invalid: must be <= the smallest dimension of target "
                                           "attention.k (d_in=32, d_out=16)"),
    (["lora.alpha=0"], "lora.alpha=0.0 is invalid: must be > 0"),
    (["lora.dropout=1.0"], "lora.dropout=1.0 is invalid: must be in [0, 1)"),
    (["lora.rank=-1"], "lora.rank=-1 is invalid"),
])
def test_bad_lora_config_is_one_line(extra, message):
    with pytest.raises(ConfigError) as e:
        validate(cfg(*extra))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_experts_dropout_and_int8_training_without_lora_are_refused():
    with pytest.raises(ConfigError, match=r"lora\.dropout=0\.1 is invalid: must be 0 when the targets include routed"):
        validate(load_config("mixtral-tiny", ["lora.rank=2", "lora.dropout=0.1", "lora.targets=[up]"]))
    int8 = load_config("tiny", ["quant.weights=int8"]).quant
    with pytest.raises(ConfigError, match="train LoRA adapters over it"):
        check_trainable(int8, jax.devices()[:1])
    check_trainable(int8, jax.devices()[:1], frozen_base=True)  # QLoRA: an int8 base under adapters
    assert for_config(load_config("tiny")) is None and isinstance(for_config(cfg()), Lora)


# ---------------------------------------------------------------- training


def test_base_is_bitwise_frozen_adapters_train_and_loss_falls(trained):
    before, after = flat(trained["initial"]), flat(jax.device_get(trained["state"].params))
    for key, old in before.items():
        same = np.array_equal(np.asarray(old[...]), np.asarray(after[key][...]))
        assert same != isinstance(old, (LoraA, LoraB)), key
    assert trained["losses"][-1] < trained["losses"][0] - 0.05, trained["losses"]


@pytest.mark.slow
def test_base_is_bitwise_frozen_after_50_steps():
    out = run(cfg(ALL, "train.steps=50"), jax.devices()[:1], steps=50)
    before, after = flat(out["initial"]), flat(jax.device_get(out["state"].params))
    assert all(np.array_equal(np.asarray(v[...]), np.asarray(after[k][...])) != isinstance(v, (LoraA, LoraB))
               for k, v in before.items())
    assert out["losses"][-1] < out["losses"][0] - 0.3, out["losses"]


def test_optimizer_state_bytes_are_the_adapters_moments_only(trained):
    rt, state = trained["rt"], trained["state"]
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    adapters = nnx.split_state(state.params, ADAPTERS, ...)[0]
    assert nbytes(state.opt_state) - 8 <= 2 * nbytes(adapters) <= nbytes(state.opt_state)  # Adam mu, nu (+ counts)
    # The compiled step's arguments: the state (params + adapters' moments) and the batch, no base moments.
    batch = rt.to_global(packed_batches(BATCH, SEQ, VOCAB, 1)[0])
    compiled = rt.lower_train_step(state, batch).compile()
    args = compiled.memory_analysis().argument_size_in_bytes
    assert args < nbytes(state.params) + 2 * nbytes(adapters) + nbytes(batch) + 4096, args
    assert args < 2 * nbytes(state.params)


def test_lora_under_fsdp_x_tensor_equals_one_device(trained):
    sharded = run(cfg(ALL, "mesh.fsdp=4", "mesh.tensor=2"), jax.devices()[:8])
    np.testing.assert_allclose(sharded["losses"], trained["losses"], rtol=1e-5)


def test_dropout_changes_the_loss_and_dropout_zero_traces_no_random_numbers(trained):
    rt = trained["rt"]  # lora.dropout=0
    plain = rt.lower_train_step(trained["state"], rt.to_global(packed_batches(BATCH, SEQ, VOCAB, 1)[0])).as_text()
    assert "threefry" not in plain and "rng_bit_generator" not in plain
    dropped = run(cfg(ALL, "lora.dropout=0.5"), jax.devices()[:1], steps=3)
    assert dropped["losses"][0] == trained["losses"][0]  # B = 0 at init: the adapters add nothing yet
    # Adam's first step is ~lr * sign(gradient) whatever dropout did; after it B != 0 and A trains.
    assert abs(dropped["losses"][2] - trained["losses"][2]) > 1e-4


# ---------------------------------------------------------------- merge and restore


# The helpers below are jitted: one program each instead of op-by-op compiles (the cold-cache cost).
def _logits(c, variables, tokens):
    graphdef = model_graphdef(c.model, c.quant, c.lora)
    return jax.jit(lambda v, t: nnx.merge(graphdef, v)(t))(variables, tokens)


def _nonzero_b(variables, key=1):
    """B random instead of zeros, so the adapters change the output (a trained adapter)."""
    return jax.jit(lambda variables: jax.tree.map(
        lambda v: v.replace(0.1 * jax.random.normal(jax.random.key(key), v.shape)) if isinstance(v, LoraB) else v,
        variables, is_leaf=lambda x: isinstance(x, nnx.Variable)))(variables)


def _init_adapted(c, seed: int = 0) -> nnx.State:
    """init_params(c.model, key(seed), c.quant, c.lora), jitted."""
    return jax.jit(lambda k: init_params(c.model, k, c.quant, c.lora))(jax.random.key(seed))


def _merge(c, variables, plain) -> nnx.State:
    """merge_variables into the merged config `plain`'s layout, jitted (as `lora merge` runs it)."""
    from jaxinfra.lora.merge import merge_variables

    target = abstract_params(plain.model, quant=plain.quant)
    return jax.jit(lambda v: merge_variables(c, v, target))(variables)


def test_merged_checkpoint_logits_equal_the_unmerged_model(trained, tmp_path):
    c = cfg(ALL)
    variables = _nonzero_b(jax.device_get(model_state(trained["state"])))
    save_params_only(tmp_path / "run", c, variables, {"params_only": True})
    merge_lora(str(tmp_path / "run"), str(tmp_path / "merged"), jax.devices()[:1])
    merged_cfg = load_config(str(tmp_path / "merged" / "config.yaml"))
    assert merged_cfg.lora.rank == 0 and merged_cfg.model == c.model
    _, merged = restore_params(tmp_path / "merged", abstract_params(merged_cfg.model))
    assert not jax.tree.leaves(nnx.split_state(merged, ADAPTERS, ...)[0])
    tokens = jnp.asarray(packed_batches(2, SEQ, VOCAB, 1)[0]["inputs"])
    want, got = _logits(c, variables, tokens), _logits(merged_cfg, merged, tokens)
    assert float(jnp.max(jnp.abs(want - _logits(merged_cfg, nnx.split_state(variables, ADAPTERS, ...)[1],
                                                 tokens)))) > 1e-3  # the adapters matter
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_moe_experts_adapters_forward_equals_merged_and_a_step_trains(dispatch):
    c = load_config("mixtral-tiny", [*BASE, "model.d_model=32", "model.moe_mlp_dim=32", "model.moe_num_experts=4",
                                     f"model.moe_dispatch={dispatch}", "model.moe_capacity_factor=4.0",
                                     "lora.rank=2", "lora.targets=[q,experts.gate,experts.up,experts.down]"])
    variables = _nonzero_b(_init_adapted(c))
    from jaxinfra.lora.merge import merged_config

    plain = merged_config(c)
    merged = _merge(c, variables, plain)
    tokens = jnp.asarray(packed_batches(2, SEQ, VOCAB, 1)[0]["inputs"])
    want = _logits(plain, merged, tokens)
    np.testing.assert_allclose(_logits(c, variables, tokens), want, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(want))))
    out = run(c, jax.devices()[:1], steps=2)
    assert np.all(np.isfinite(out["losses"])) and out["losses"][1] < out["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_moe_experts_adapters_under_expert_parallelism_equal_one_device(dispatch):
    mk = lambda *x: load_config("mixtral-tiny", [  # noqa: E731
        *BASE, "model.d_model=32", "model.moe_mlp_dim=32", "model.moe_num_experts=4", f"model.moe_dispatch={dispatch}",
        "model.moe_capacity_factor=4.0", "lora.rank=2", "lora.targets=[q,experts.gate,experts.up,experts.down]", *x])
    one = run(mk(), jax.devices()[:1], steps=3)
    ep = run(mk("mesh.expert=2", "mesh.fsdp=2", "mesh.data=2"), jax.devices()[:8], steps=3)
    np.testing.assert_allclose(ep["losses"], one["losses"], rtol=1e-5)


def test_restore_a_base_without_adapters_inits_them_and_another_shape_is_refused(trained, tmp_path):
    c = cfg(ALL)
    base = init_params(c.model, jax.random.key(7), c.quant)  # a run saved without LoRA
    save_params_only(tmp_path / "base", dataclasses.replace(c, lora=dataclasses.replace(c.lora, rank=0)), base,
                     {"params_only": True})
    target = abstract_params(c.model, quant=c.quant, lora=c.lora)
    _, restored = restore_params(tmp_path / "base", target, optional=ADAPTERS)
    assert jax.tree.leaves(nnx.split_state(restored, ADAPTERS, ...)[0]) == []
    for (path, got), want in zip(nnx.to_flat_state(restored), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want), err_msg=str(path))
    other = cfg(ALL, "model.d_model=64")
    with pytest.raises(CheckpointError) as e:
        restore_params(tmp_path / "base", abstract_params(other.model, lora=other.lora), config=other.to_dict(),
                       optional=ADAPTERS)
    assert "written for another model" in str(e.value) and "model.d_model: 32 -> 64" in str(e.value)


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_train_restore_params_from_a_base_then_resume_is_exact(tmp_path, monkeypatch):
    from jaxinfra.train import Trainer, train

    c = cfg(ALL, "checkpoint.every=2", "checkpoint.restore=params")
    base = init_params(c.model, jax.random.key(7), c.quant)
    save_params_only(tmp_path / "base", dataclasses.replace(c, lora=dataclasses.replace(c.lora, rank=0)), base,
                     {"params_only": True})
    go = lambda run: train(c, tmp_path / run, jax.devices()[:1], restore_from=str(tmp_path / "base"),  # noqa: E731
                           extensions=[Lora()])
    go("ref")
    _, final = restore_params(tmp_path / "ref", abstract_params(c.model, lora=c.lora))
    got_base = nnx.split_state(final, ADAPTERS, ...)[1]
    for got, want in zip(jax.tree.leaves(got_base), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # never written again
    assert any(np.any(np.asarray(b) != 0) for b in jax.tree.leaves(nnx.split_state(final, LoraB, ...)[0]))
    # Interrupted after step 2, then resumed from its own checkpoint: adapters and their moments come back.
    calls = {"n": 0}

    def stop_at_2(self, sync):
        calls["n"] += 1
        return calls["n"] == 2

    with monkeypatch.context() as m:
        m.setattr(Trainer, "_stop_requested", stop_at_2)
        assert go("run")["steps"] == 2
    assert go("run")["resumed_from_step"] == 2
    assert _losses(tmp_path / "run") == _losses(tmp_path / "ref")


# ---------------------------------------------------------------- QLoRA


def test_qlora_trains_adapters_over_an_int8_base_from_quantize(trained):
    c = cfg(ALL)
    rt = trained["rt"]
    params = nnx.split_state(model_state(trained["state"]), ADAPTERS, ...)[1]  # the float base
    qcfg, qparams = quantize_loaded(dataclasses.replace(c, lora=dataclasses.replace(c.lora, rank=0)), params,
                                    devices=jax.devices()[:1])
    q = dataclasses.replace(qcfg, lora=c.lora, quant=dataclasses.replace(qcfg.quant))
    assert q.quant.weights == "int8" and rt is not None

    def with_base(rt):
        state = rt.init_state()
        base, stats = split_model_state(qparams)
        return state.replace(params=nnx.merge_state(base, nnx.split_state(state.params, ADAPTERS, ...)[0]))

    # Merging dequantizes the int8 base: the merged float model computes what the int8 + adapters one does.
    from jaxinfra.lora.merge import merged_config

    adapted = _nonzero_b(nnx.merge_state(qparams, nnx.split_state(_init_adapted(c), ADAPTERS, ...)[0]))
    plain = merged_config(q)
    assert plain.quant.weights == "none"
    merged = _merge(q, adapted, plain)
    tokens = jnp.asarray(packed_batches(2, SEQ, VOCAB, 1)[0]["inputs"])
    want = _logits(q, adapted, tokens)
    np.testing.assert_allclose(_logits(plain, merged, tokens), want, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(want))))
    out = run(q, jax.devices()[:1], steps=STEPS, state=with_base)
    assert out["losses"][-1] < out["losses"][0] - 0.05, out["losses"]
    before, after = flat(out["initial"]), flat(jax.device_get(out["state"].params))
    assert after["layers/attn/wq"][...].dtype == jnp.int8
    assert all(np.array_equal(np.asarray(v[...]), np.asarray(after[k][...])) for k, v in before.items()
               if not isinstance(v, (LoraA, LoraB)))


def test_generate_from_an_unmerged_mla_run_equals_the_merged_model():
    """Inference builds the adapters too; MLA's absorbed decode slices kv_b, which merges it first."""
    from jaxinfra.infer.generation import Generator
    from jaxinfra.lora.merge import merged_config

    c = load_config("deepseek-tiny", [*BASE[:3], "model.num_layers=2", "mesh.data=1", "lora.rank=2",
                                      "lora.targets=[q_b,kv_a,kv_b,o]"])
    variables = _nonzero_b(_init_adapted(c))
    plain = merged_config(c)
    merged = _merge(c, variables, plain)
    prompts = [[1, 2, 3, 4], [5, 6]]
    got = Generator(c, variables, devices=jax.devices()[:1]).generate(prompts, max_new_tokens=6).tokens
    assert got == Generator(plain, merged, devices=jax.devices()[:1]).generate(prompts, max_new_tokens=6).tokens


def test_bad_lora_input_on_the_command_line_is_one_line_exit_2(tmp_path, capsys):
    from jaxinfra import cli
    c = load_config("tiny", BASE)
    save_params_only(tmp_path / "base", c, init_params(c.model, jax.random.key(0)), {"params_only": True})
    small = " ".join(BASE).replace("model.d_model=32", "model.d_model=64").split()
    for argv, message in [
        (["lora", "merge", str(tmp_path / "base"), str(tmp_path / "out")], "holds no LoRA adapters (lora.rank=0)"),
        (["train", "tiny", *BASE, "lora.rank=4", "lora.targets=[kv_b]"], "lora.targets='kv_b' is invalid"),
        (["train", "tiny", *BASE, "lora.rank=64"], "lora.rank=64 is invalid: must be <= the smallest dimension"),
        (["train", "tiny", *small, "mesh.data=-1", "lora.rank=4", "--restore", str(tmp_path / "base"), "--run-dir",
          str(tmp_path / "run"), "checkpoint.restore=params"], "was written for another model (config keys "
                                                               "model.d_model: 32 -> 64)"),
    ]:
        capsys.readouterr()
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
