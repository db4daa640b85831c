"""Hugging Face import/export against tiny checkpoints written by transformers
(scripts/make_hf_fixtures.py; reference logits and loss committed beside them). No torch here."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfra import cli
from jaxinfra.checkpoint import is_params_only, restore_params
from jaxinfra.config import load_config
from jaxinfra.hf.exporter import export_hf
from jaxinfra.hf.families import HFError, from_hf, hf_family
from jaxinfra.hf.importer import import_hf
from jaxinfra.hf.safetensors_io import SafetensorsDir
from jaxinfra.hf.tensors import rope_perm
from jaxinfra.loss import cross_entropy_sums
from jaxinfra.metrics import param_counts
from jaxinfra.state import init_params, model_graphdef, model_state
from models.config import ModelConfig
from models.layers import apply_rope

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "hf"
NAMES = ["llama", "qwen2", "qwen3", "mixtral", "deepseek_v3", "deepseek_v2", "qwen3_moe", "olmo2", "gemma3", "gemma2", "gpt_oss"]
FAMILY = {"gemma3": "gemma3_text"}  # fixture name -> family (HF's model_type) where they differ


def reference(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def one_device() -> list[jax.Device]:
    return jax.devices()[:1]


def restored(run_dir: pathlib.Path) -> tuple[ModelConfig, nnx.State]:
    """The imported run's config and params, on one device (as tools load them)."""
    cfg = load_config(str(run_dir / "config.yaml"))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev),
                          jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0))))
    return cfg.model, restore_params(run_dir, target)[1]


@functools.cache
def forward(cfg: ModelConfig):
    """One jitted forward per model config, shared by all tests (compiles are the budget)."""
    graphdef = model_graphdef(cfg)
    return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))


def logits_of(run_dir: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
    cfg, params = restored(run_dir)
    return np.asarray(forward(cfg)(params, jnp.asarray(tokens)))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def mean_next_token_ce(logits: np.ndarray, tokens: np.ndarray) -> float:
    sums = cross_entropy_sums(jnp.asarray(logits[:, :-1]), jnp.asarray(tokens[:, 1:]),
                              jnp.ones(tokens[:, 1:].shape, bool))
    return float(sums["ce_sum"] / sums["tokens"])


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Each fixture imported once, on one device."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name in NAMES:
        report = import_hf(FIXTURES / name, root / name, devices=one_device())
        assert report["family"] == FAMILY.get(name, name) and report["peak_rss_bytes"] > 0 and report["bytes_on_disk"] > 0
        # The analytic count (metrics) knows the new parameters (q/k/v biases, a fixed router bias).
        assert param_counts(load_config(str(root / name / "config.yaml")).model)["total"] == report["params"]
        out[name] = root / name
    return out


# ---------------------------------------------------------------- numerics vs transformers


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_loss_match_transformers(imported, name):
    ref = reference(name)
    logits = logits_of(imported[name], ref["tokens"])
    assert rel_err(logits, ref["logits"]) <= 1e-5  # float32 imports reproduce transformers to 1e-5
    loss = mean_next_token_ce(logits, ref["tokens"])
    assert loss == pytest.approx(float(ref["loss"]), rel=1e-5)


def test_rope_interleave_permutation_is_needed(imported, tmp_path):
    """Verify, not assume: importing DeepSeek's interleaved rope columns unpermuted breaks the logits."""
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "deepseek_v3", src)
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "rope_interleave": False}))
    import_hf(src, tmp_path / "out", devices=one_device())
    ref = reference("deepseek_v3")
    assert rel_err(logits_of(tmp_path / "out", ref["tokens"]), ref["logits"]) > 1e-2


def test_rope_perm_turns_interleaved_rotation_into_rotate_half():
    """HF DeepSeek's interleaved rotation of x == our rotate-half rotation of x[perm] (plain numpy reference)."""
    rng = np.random.default_rng(0)
    dim, t = 8, 5
    x = rng.standard_normal((1, t, 1, dim)).astype(np.float32)
    freqs = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
    ang = np.arange(t)[:, None] * freqs[None, :]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    hf = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # apply_rotary_pos_emb_interleave
    ours = apply_rope(jnp.asarray(x[..., rope_perm(dim)]), jnp.arange(t)[None], jnp.asarray(freqs, jnp.float32))
    np.testing.assert_allclose(np.asarray(ours), hf, atol=1e-6)


def test_fused_expert_tensors_are_read_too(imported, tmp_path):
    """transformers 5.x's in-memory layout (block_sparse_moe renamed mlp; mlp.experts.gate_up_proj [E, 2F, d],
    down_proj [E, d, F]) imports to the same params as the Hub's per-expert tensors."""
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "mixtral", src)
    files = SafetensorsDir(src)
    tensors = {k.replace(".block_sparse_moe.", ".mlp."): files.read(k) for k in files.where if ".experts." not in k}
    for i in range(2):
        per = lambda j, w: files.read(f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight")  # noqa: E731
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([per(j, "w1"), per(j, "w3")]) for j in range(8)])
        tensors[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack([per(j, "w2") for j in range(8)])
    save_file(tensors, src / "model.safetensors")
    import_hf(src, tmp_path / "out", devices=one_device())
    for x, y in zip(jax.tree.leaves(restored(imported["mixtral"])[1]), jax.tree.leaves(restored(tmp_path / "out")[1]),
                    strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name", [n for n in NAMES if n != "gemma2"])  # gemma2: gemma3's path, a compile less
def test_jaxinfra_eval_on_import_gives_the_transformers_loss(imported, name, tmp_path, capsys):
    """`jaxinfra eval OUT --tokens FILE.npy` (the CLI, in process) on the imported run directory."""
    ref = reference(name)
    np.save(tmp_path / "tokens.npy", ref["tokens"])
    capsys.readouterr()
    assert cli.main(["eval", str(imported[name]), "--tokens", str(tmp_path / "tokens.npy")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    row = json.loads(lines[0])
    assert row["tokens"] == ref["tokens"].shape[0] * (ref["tokens"].shape[1] - 1)
    assert row["eval_loss"] == pytest.approx(float(ref["loss"]), rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_export_then_reimport_is_bitwise_identical(imported, name, tmp_path):
    export_hf(imported[name], tmp_path / "hf")
    # Hub naming (per-expert tensors), the same tensor set transformers wrote.
    assert set(SafetensorsDir(tmp_path / "hf").where) == set(SafetensorsDir(FIXTURES / name).where)
    assert from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())) == \
        from_hf(json.loads((FIXTURES / name / "config.json").read_text()))
    import_hf(tmp_path / "hf", tmp_path / "again", devices=one_device())
    _, a = restored(imported[name])
    _, b = restored(tmp_path / "again")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_export_shards_and_bfloat16(imported, tmp_path):
    out = tmp_path / "hf"
    report = export_hf(imported["deepseek_v3"] / "checkpoints" / "0", out, dtype="bfloat16",
                       max_shard_bytes=200_000)
    assert len(report["files"]) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = SafetensorsDir(out)
    assert set(index["weight_map"]) == set(files.where)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert str(files.read("model.layers.1.self_attn.q_b_proj.weight").dtype) == "bfloat16"
    assert files.read("model.layers.1.mlp.gate.e_score_correction_bias").dtype == np.float32  # as HF keeps it


@pytest.mark.parametrize("preset", ["llama3-8b", "mixtral-8x7b", "deepseek-v3", "tiny", "qwen3-30b-a3b", "olmo2-7b",
                                    "gemma3-27b", "gpt-oss-20b", "gpt-oss-120b"])
def test_preset_configs_map_to_hf_and_back(preset):
    """to_hf then from_hf gives back every field that changes the function (llama3 rope scaling, YaRN, MoE)."""
    from jaxinfra.hf.families import to_hf

    cfg = load_config(preset).model
    if cfg.moe_bias_update_rate:  # a trained balancing bias exports as e_score_correction_bias, imports fixed
        cfg = dataclasses.replace(cfg, moe_bias_update_rate=0.0, moe_router_bias=True)
    _, back = from_hf(to_hf(cfg))
    skip = {"init_std", "scan_layers", "remat_policy", "attention_impl", "moe_dispatch", "moe_capacity_factor",
            "moe_aux_loss_weight", "moe_z_loss_weight", "z_loss_weight", "param_dtype", "dtype", "head_dim",
            "num_kv_heads", "mlp_dim"}
    diff = {k: (v, getattr(back, k)) for k, v in dataclasses.asdict(cfg).items()
            if k not in skip and getattr(back, k) != v}
    assert not diff
    assert (back.resolved_head_dim, back.kv_heads) == (cfg.resolved_head_dim, cfg.kv_heads)


def test_mistral_maps_like_llama_and_sliding_window_is_refused():
    hf = {"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "rms_norm_eps": 1e-5,
          "rope_theta": 1e6, "sliding_window": None, "head_dim": None}
    family, cfg = from_hf(hf)
    assert family == "mistral" and (cfg.kv_heads, cfg.rope_theta, cfg.norm_eps) == (2, 1e6, 1e-5)
    with pytest.raises(HFError, match="sliding_window=4096"):
        from_hf({**hf, "sliding_window": 4096})
    with pytest.raises(HFError, match="unsupported architecture FooForCausalLM; supported: "):
        from_hf({**hf, "architectures": ["FooForCausalLM"]})


def test_export_refuses_models_without_hf_family():
    with pytest.raises(HFError, match="logit_softcap"):
        hf_family(ModelConfig(logit_softcap=30.0))
    with pytest.raises(HFError, match="MoE other than Mixtral"):
        hf_family(ModelConfig(moe_num_experts=4, moe_shared_experts=1))


# ---------------------------------------------------------------- sharded import, eval loss


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_sharded_import_gives_the_reference_loss(tmp_path, name):
    """Import straight into fsdp=4 x tensor=2 (gpt-oss: expert=2 x fsdp=2 x tensor=2, its 6 experts with their
    biases split over `expert`) on the 8 fake devices; the eval step's loss over the
    reference tokens (inputs t[:-1], targets t[1:]) is the loss transformers computed."""
    from jaxinfra.runtime import build_runtime

    ref = reference(name)
    tokens = np.tile(ref["tokens"], (4, 1))  # 8 rows: the batch splits over fsdp; the mean is unchanged
    seq = tokens.shape[1] - 1
    mesh = ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"] if name == "gpt_oss" else ["mesh.fsdp=4", "mesh.tensor=2"]
    overrides = [*mesh, "mesh.data=1", f"train.seq_len={seq}", "train.batch_size=8"]
    import_hf(FIXTURES / name, tmp_path / "run", overrides)
    cfg = load_config(str(tmp_path / "run" / "config.yaml"))
    rt = build_runtime(cfg)
    _, params = restore_params(tmp_path / "run", jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0))), model_state(rt.state_shardings)))
    assert params["moe_layers"]["moe"]["w_gate"][...].sharding.spec != jax.sharding.PartitionSpec()
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((8, seq), np.int32),
             "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (8, seq)).copy()}
    ce, count = rt.eval_sums(params, [batch])
    assert ce / count == pytest.approx(float(ref["loss"]), rel=1e-5)


# ---------------------------------------------------------------- training from an import


def test_train_restores_imported_params(imported, tmp_path, capsys):
    """`train --restore OUT` with the default checkpoint.restore=full falls back to params with one
    line; the first step's loss is the imported params' loss on that batch; 3 steps stay finite."""
    from jaxinfra.data import make_train_iterator
    from jaxinfra.runtime import build_runtime
    from jaxinfra.train import train

    src = imported["llama"]
    assert is_params_only(src) and is_params_only(src / "checkpoints" / "0")
    cfg = load_config(str(src / "config.yaml"), [
        "train.steps=3", "train.batch_size=8", "train.seq_len=16", "train.eval_every=0", "log.every=1",
        "log.progress=false", "log.tensorboard=false", "data.eval_batches=1", "mesh.data=1"])
    summary = train(cfg, tmp_path / "run", one_device(), restore_from=src)
    assert "holds params only" in capsys.readouterr().out
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert summary["exit_code"] == 0 and len(losses) == 3 and np.all(np.isfinite(losses))
    t = cfg.train
    first = next(iter(make_train_iterator(cfg.data, seq_len=t.seq_len, global_batch_size=t.batch_size,
                                          vocab_size=cfg.model.vocab_size, seed=t.seed)))
    rt = build_runtime(cfg, one_device())
    _, params = restored(src)
    ce, count = rt.eval_sums(params, [first])
    assert losses[0] == pytest.approx(ce / count, rel=1e-5)
    # A step directory works as --restore too (same params).
    _, via_step = restore_params(src / "checkpoints" / "0", jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(via_step)))
    # The trained run (a full TrainState checkpoint) exports back to HF.
    assert export_hf(tmp_path / "run", tmp_path / "hf")["step"] == 3
    # Training with the import itself as the run directory starts from its params too (not "unreadable").
    from jaxinfra.train import Trainer

    run_dir = tmp_path / "import-as-run"
    shutil.copytree(src, run_dir)
    step, state, _ = Trainer(cfg, run_dir, one_device()).initial_state()
    assert step == 0 and (run_dir / "checkpoints" / "0").is_dir()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)))


def test_fixed_router_bias_is_not_moved_by_the_step():
    """moe_router_bias with rate 0 (an imported DeepSeek-V3 bias): the step's bias pass keeps it exactly
    (a Stat, outside the optimizer: weight decay never sees it)."""
    from models.router import RouterBias, apply_bias_updates

    old = nnx.State({"bias": RouterBias(jnp.asarray([[0.1, -0.2, 0.3]], jnp.float32))})
    out = apply_bias_updates(old, jnp.asarray([[4.0, 0.0, 2.0]]), 0.0)
    assert np.array_equal(np.asarray(out["bias"][...]), np.asarray(old["bias"][...]))


# ---------------------------------------------------------------- bad input


def _one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("jaxinfra: error: "), err
    return err


def test_unsupported_architecture_exits_2_with_one_line(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"],
                                                 "model_type": "gpt_neox"}))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "jaxinfra", "hf", "import", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPTNeoXForCausalLM" in lines[0] and "LlamaForCausalLM" in lines[0], proc.stderr
    from jaxinfra.hf.families import ARCHITECTURES
    assert all(arch in lines[0] for arch in ARCHITECTURES.values()), lines[0]  # every family, new ones too


def _fixture_with(tmp_path: pathlib.Path, name: str, drop: str | None = None, add: str | None = None,
                  config: dict | None = None) -> pathlib.Path:
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / name, src)
    files = SafetensorsDir(src)
    tensors = {k: files.read(k) for k in files.where if k != drop}
    if add:
        tensors[add] = np.zeros(3, np.float32)
    save_file(tensors, src / "model.safetensors")
    if config:
        (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    return src


def test_missing_tensor_exits_2_naming_it(tmp_path, capsys):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    src = _fixture_with(tmp_path, "mixtral", drop=name)
    err = _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    assert name in err and "model.safetensors" in err


def test_unexpected_tensor_and_unsupported_feature_exit_2(tmp_path, capsys):
    src = _fixture_with(tmp_path, "llama", add="model.layers.0.self_attn.q_proj.bias")
    err = _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    assert "model.layers.0.self_attn.q_proj.bias" in err
    shutil.rmtree(src)
    src = _fixture_with(tmp_path, "qwen2", config={"use_sliding_window": True, "sliding_window": 64})
    assert "use_sliding_window" in _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out2")])


def test_missing_tensors_and_unhonoured_fields_are_named_before_any_data_is_read(tmp_path, capsys):
    """Generic for every family (jaxinfra/hf/importer.py check_complete, safetensors_io's index check,
    families.check_honoured): the first missing tensor in model order with how many more; a shard the index
    names that is not there; a config.json field the mapped model would not compute, with its value."""
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama", src)
    files = SafetensorsDir(src)
    gone = [k for k in files.where if k.startswith("model.layers.1.")] + ["lm_head.weight"]
    save_file({k: files.read(k) for k in files.where if k not in gone}, src / "model.safetensors")
    err = _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    assert "missing tensor model.layers.1." in err and f"and {len(gone) - 1} more in" in err, err
    weight_map = {k: "model.safetensors" for k in files.where}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    assert "missing tensor lm_head.weight" in err and "puts it in model-00002-of-00002.safetensors" in err, err
    shutil.rmtree(src)
    src = _fixture_with(tmp_path, "llama", config={"attn_logit_softcapping": 50.0})
    err = _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    assert "llama: config.json attn_logit_softcapping=50.0 is not supported" in err, err
    qwen3 = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    for extra, needle in [({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
                          ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
                          ({"query_pre_attn_scalar": 144}, "query_pre_attn_scalar=144"),
                          ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
                          ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types=['sliding"),
                          ({"layer_types": ["chunked_attention"] * 2}, "layer_types=['chunked"),
                          ({"rope_parameters": {"full_attention": {"rope_theta": 5e5}}}, "rope_parameters={'full")]:
        with pytest.raises(HFError, match=re.escape(f"qwen3: config.json {needle}")):
            from_hf({**qwen3, **extra})
    # What the mapped model does compute passes: the default scale, full layers, no window in effect.
    assert from_hf({**qwen3, "query_pre_attn_scalar": 24, "partial_rotary_factor": 1.0, "sliding_window": 4096})


def test_ignored_tensors_are_accepted(tmp_path):
    """DeepSeek's multi-token-prediction layer (model.layers.{num_hidden_layers}.*) is dropped, as documented."""
    src = _fixture_with(tmp_path, "deepseek_v3", add="model.layers.3.eh_proj.weight")
    assert import_hf(src, tmp_path / "out", devices=one_device())["family"] == "deepseek_v3"


# ---------------------------------------------------------------- OLMo 2


def test_olmo2_matches_transformers_to_1e5_and_maps_its_block(imported):
    """OLMo 2 (post-sub-layer norms, QK-norm over the whole q / k projections, GQA, head_dim 24 != 64 / 4):
    logits to 1e-5 relative, and the config and params say so."""
    ref = reference("olmo2")
    cfg, params = restored(imported["olmo2"])
    assert (cfg.norm_placement, cfg.qk_norm, cfg.qk_norm_scope, cfg.kv_heads, cfg.resolved_head_dim) == (
        "post", True, "full", 2, 24)
    attn = params["layers"]["attn"]
    assert (attn["q_norm"][...].shape, attn["k_norm"][...].shape) == ((2, 4 * 24), (2, 2 * 24))
    assert "attn_norm" not in params["layers"] and "mlp_post_norm" in params["layers"]
    assert rel_err(logits_of(imported["olmo2"], ref["tokens"]), ref["logits"]) <= 1e-5
    assert hf_family(cfg) == "olmo2"


def test_olmo2_bad_input_is_refused_by_name(tmp_path, capsys):
    """A field we cannot honour names itself and its value; a missing tensor is named; models that are
    half OLMo 2 (post norms with per-head QK-norm, full QK-norm with pre norms) have no HF family."""
    with pytest.raises(HFError, match=r"olmo2: config.json attention_bias=True is not supported"):
        from_hf({**json.loads((FIXTURES / "olmo2" / "config.json").read_text()), "attention_bias": True})
    name = "model.layers.1.post_feedforward_layernorm.weight"
    err = _one_line_error(capsys, ["hf", "import", str(_fixture_with(tmp_path, "olmo2", drop=name)),
                                   str(tmp_path / "out")])
    assert name in err
    for half in (dict(norm_placement="post", qk_norm=True), dict(qk_norm=True, qk_norm_scope="full"),
                 dict(norm_placement="post", qk_norm=True, qk_norm_scope="full", moe_num_experts=4)):
        with pytest.raises(HFError, match=r"no Hugging Face family.*norm_placement"):
            hf_family(ModelConfig(**half))


# ---------------------------------------------------------------- MLA latent norm epsilon


RESIDUAL_WRITERS = ("embed_tokens.", "o_proj.", "down_proj.")  # every tensor that adds to the residual stream


def test_deepseek_with_other_rms_norm_eps_matches_transformers(tmp_path):
    """HF's DeepSeek uses rms_norm_eps for the block/final norms and a fixed 1e-6 for the latent
    q_a/kv_a norms. RMSNorm(c h, w, c^2 e) = RMSNorm(h, w, e): scaling every write to the residual
    stream by c = 64 (exact in float32) and setting rms_norm_eps = c^2 * 1e-6 leaves transformers'
    function unchanged (the latent norms see normalised inputs, so their 1e-6 stays right). The
    stored transformers logits of the fixture are therefore the reference for this checkpoint."""
    from safetensors.numpy import save_file

    c = 64.0
    src = _fixture_with(tmp_path, "deepseek_v3", config={"rms_norm_eps": c * c * 1e-6})
    files = SafetensorsDir(src)
    save_file({k: files.read(k) * np.float32(c) if any(w in k for w in RESIDUAL_WRITERS) else files.read(k)
               for k in files.where}, src / "model.safetensors")
    import_hf(src, tmp_path / "out", devices=one_device())
    cfg, params = restored(tmp_path / "out")
    assert (cfg.norm_eps, cfg.mla_norm_eps, cfg.latent_norm_eps) == (c * c * 1e-6, 1e-6, 1e-6)
    ref = reference("deepseek_v3")
    logits = np.asarray(forward(cfg)(params, jnp.asarray(ref["tokens"])))
    assert rel_err(logits, ref["logits"]) <= 1e-4
    assert mean_next_token_ce(logits, ref["tokens"]) == pytest.approx(float(ref["loss"]), rel=1e-5)
    # The test can fail: the latent norms on rms_norm_eps (what one epsilon for all would do) miss.
    same_eps = dataclasses.replace(cfg, mla_norm_eps=None)
    assert rel_err(np.asarray(forward(same_eps)(params, jnp.asarray(ref["tokens"]))), ref["logits"]) > 1e-3
    # Export writes rms_norm_eps back (the latent 1e-6 is HF's fixed default) and re-imports the same.
    export_hf(tmp_path / "out", tmp_path / "exported")  # not over `src` (tmp_path / "hf"): an export never overwrites
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported["rms_norm_eps"] == c * c * 1e-6
    assert from_hf(exported) == from_hf(json.loads((src / "config.json").read_text()))


def test_mla_latent_norm_eps_defaults_to_norm_eps_and_export_checks_it():
    """Native configs keep one epsilon (null = norm_eps, as before); HF can only hold latent norms at 1e-6."""
    from jaxinfra.hf.families import to_hf

    cfg = load_config("deepseek-v3").model
    assert cfg.mla_norm_eps is None and cfg.latent_norm_eps == cfg.norm_eps == 1e-6
    assert from_hf(to_hf(cfg))[1].mla_norm_eps is None  # rms_norm_eps 1e-6: the config comes back as it was
    other = dataclasses.replace(cfg, norm_eps=1e-5)
    with pytest.raises(HFError, match="MLA latent norms with eps 1e-05"):
        to_hf(other)
    both = dataclasses.replace(other, mla_norm_eps=1e-6)
    assert to_hf(both)["rms_norm_eps"] == 1e-5 and from_hf(to_hf(both))[1].mla_norm_eps == 1e-6
    for bad in (0.0, -1e-6, float("nan"), float("inf")):
        assert [p[0] for p in dataclasses.replace(cfg, mla_norm_eps=bad).problems()] == ["mla_norm_eps"]


# ---------------------------------------------------------------- Qwen3-MoE's layer schedule


def test_qwen3_moe_layer_schedule_maps_both_ways_or_is_refused(tmp_path, capsys):
    """HF makes layer i MoE iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; ours is a
    dense prefix then every n-th layer. What that holds maps (and exports back to the same layers); what it
    cannot (a dense layer after an MoE one, a tail that breaks the period) is refused naming field and value."""
    from jaxinfra.hf.families import to_hf

    hf = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    for extra, flags in [({}, (False, True)), ({"num_hidden_layers": 6, "decoder_sparse_step": 2},
                                                (False, True) * 3),
                         ({"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [0, 1, 2]},
                          (False, False, False, True, False, True)),
                         ({"num_hidden_layers": 6, "decoder_sparse_step": 3, "mlp_only_layers": [0]},
                          (False, False, True, False, False, True))]:
        family, cfg = from_hf({**hf, **extra})
        assert family == "qwen3_moe" and cfg.moe_layer_flags() == flags, extra
        assert from_hf(to_hf(cfg)) == (family, cfg)
    assert not from_hf({**hf, "mlp_only_layers": [0, 1]})[1].is_moe  # no MoE layer left: a dense QK-norm model
    for extra, needle in [({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
                          ({"num_hidden_layers": 3, "decoder_sparse_step": 2, "mlp_only_layers": []},
                           "decoder_sparse_step=2"),
                          ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
                          ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window")]:
        with pytest.raises(HFError, match=needle.replace("[", r"\[")):
            from_hf({**hf, **extra})
    src = _fixture_with(tmp_path, "qwen3_moe", config={"mlp_only_layers": [1]})
    assert "qwen3_moe: config.json mlp_only_layers=[1] is not supported" in _one_line_error(
        capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    shutil.rmtree(src)
    missing = "model.layers.1.mlp.experts.2.up_proj.weight"
    src = _fixture_with(tmp_path, "qwen3_moe", drop=missing)
    assert missing in _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out2")])
    with pytest.raises(HFError, match="MoE with qk_norm other than Qwen3-MoE's"):
        hf_family(ModelConfig(moe_num_experts=4, qk_norm=True, moe_shared_experts=1))


def test_qwen3_30b_a3b_hub_config_imports_as_the_preset():
    """The Hub's Qwen/Qwen3-30B-A3B config.json (transformers 4.51 keys: num_experts, top-level rope_theta,
    rope_scaling null) maps to the qwen3-30b-a3b preset's model in every field that changes the function."""
    hub = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
           "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
           "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
           "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
           "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
           "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
           "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
           "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    family, cfg = from_hf(hub)
    preset = load_config("qwen3-30b-a3b").model
    skip = {"scan_layers", "remat_policy", "dtype", "moe_aux_loss_weight"}
    assert family == "qwen3_moe"
    assert {k: (v, getattr(cfg, k)) for k, v in dataclasses.asdict(preset).items()
            if k not in skip and getattr(cfg, k) != v} == {}


# ---------------------------------------------------------------- hf check


CHECKED = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").is_file())  # every family's fixture


def _hf_check(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    status = cli.main(["hf", "check", *argv])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("name", CHECKED)
def test_hf_check_on_each_fixture_passes(name, capsys):
    """No torch here: the reference is the fixture's reference.npz (transformers' logits and hidden states)."""
    status, out = _hf_check(capsys, [str(FIXTURES / name)])
    assert status == 0, out
    assert "reference.npz (torch/transformers not installed)" in out and out.count("e-0") >= 16
    worst = float(out.split("max rel logit diff ")[-1].split()[0])
    assert worst <= 1e-5


def test_hf_check_names_the_first_diverging_layer(imported, tmp_path, capsys):
    """One tensor transposed (layer 0's square q_proj) -> exit 1 naming layer 0; RUN (an import) is checked
    as saved: the good import passes, an import of the corrupted files does not."""
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama", src)
    files = SafetensorsDir(src)
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors = {k: files.read(k) for k in files.where}
    assert tensors[key].shape[0] == tensors[key].shape[1]
    tensors[key] = np.ascontiguousarray(tensors[key].T)
    save_file(tensors, src / "model.safetensors")
    status, out = _hf_check(capsys, [str(src)])
    assert status == 1 and "MISMATCH" in out, out
    assert "first diverging: layer 0 (model.layers.0;" in out, out
    assert _hf_check(capsys, [str(FIXTURES / "llama"), str(imported["llama"])])[0] == 0
    import_hf(src, tmp_path / "bad", devices=one_device())
    status, out = _hf_check(capsys, [str(FIXTURES / "llama"), str(tmp_path / "bad")])
    assert status == 1 and "first diverging: layer 0 " in out, out


def test_hf_check_without_torch_or_reference_says_what_to_install(tmp_path, capsys):
    from jaxinfra.hf.check import has_transformers

    if has_transformers():
        pytest.skip("torch and transformers are installed here: hf check would use them")
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama", src)
    (src / "reference.npz").unlink()
    err = _one_line_error(capsys, ["hf", "check", str(src)])
    assert "pip install torch transformers" in err and str(src) in err


# ---------------------------------------------------------------- tokenizer files carried through


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def _tiny_tokenizer(folder: pathlib.Path) -> None:
    """A BPE tokenizer.json of < 128 ids (the fixtures' vocabulary), its config with a chat template and
    the special tokens map, written as transformers' save_pretrained lays them out."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # </s> = 2, the fixtures' eos_token_id
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog; user assistant hello"] * 8,
                            trainers.BpeTrainer(vocab_size=100, special_tokens=specials, show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}) + "\n")


def test_tokenizer_files_round_trip_and_runs_use_them(tmp_path, capsys):
    from tokenizers import Tokenizer

    from jaxinfra.data.chat import load_chat_template
    from jaxinfra.hf.tokenizer_files import CARRIED
    from jaxinfra.infer.text import generation_stop_ids

    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama", src)
    _tiny_tokenizer(src)
    out = tmp_path / "import"
    report = import_hf(src, out, devices=one_device())
    carried = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
    assert report["hf_files"] == carried and all(name in CARRIED for name in carried)
    data = load_config(str(out / "config.yaml")).data
    assert (data.source, data.tokenizer, data.chat_template) == ("text", str(out / "tokenizer.json"), "tokenizer")
    # The chat data source of a run configured from the import renders with the model's own template.
    chat = load_config(str(out / "config.yaml"), ["data.source=chat", f"data.paths=[{tmp_path}/c.jsonl]"]).data
    assert load_chat_template(chat.chat_template, chat.tokenizer).source == TEMPLATE
    # So does a byte-level chat config that starts from the import (train --restore OUT or OUT/checkpoints/0),
    # unless the command line names the template.
    from jaxinfra.hf.tokenizer_files import restore_defaults

    byte_chat = ["data.source=chat", f"data.paths=[{tmp_path}/c.jsonl]", "data.chat_template=chatml"]
    imported_cfg = load_config(str(out / "config.yaml"), byte_chat[:2])  # (a byte-level config itself would not
    # validate: 256 ids > vocab 128; the defaults make it valid)
    native = dataclasses.replace(imported_cfg, data=dataclasses.replace(chat, tokenizer=None, chat_template="chatml"))
    for restore in (out, out / "checkpoints" / "0"):
        got, note = restore_defaults(native, str(restore), byte_chat[:2])
        assert (got.data.tokenizer, got.data.chat_template) == (str(out / "tokenizer.json"), "tokenizer"), note
    assert restore_defaults(native, str(out), byte_chat)[0].data.chat_template == "chatml"
    assert restore_defaults(native, str(FIXTURES / "llama"), byte_chat[:2]) == (native, None)
    export_hf(out, tmp_path / "export")
    for name in carried:
        assert (tmp_path / "export" / name).read_bytes() == (src / name).read_bytes(), name
    # generate --chat: the model's template renders the turn, its tokenizer encodes it and decodes the reply
    # (random weights: any text), and generation_config.json's eos_token_id is the default stop id.
    cfg = load_config(str(out / "config.yaml"))
    assert generation_stop_ids(cfg, out) == [2]
    capsys.readouterr()
    assert cli.main(["generate", str(out), "--chat", "--prompt", "hello fox", "--max-new-tokens", "3"]) == 0
    assert "prefill: 7 tokens" in capsys.readouterr().err  # <|im_start|> user hello fox <|im_end|> <|im_start|> ...
    # eval --text: the text through the import's tokenizer, scored as --tokens of the same ids.
    text = "the quick brown fox jumps over the lazy dog " * 4
    (tmp_path / "t.txt").write_text(text)
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    np.save(tmp_path / "t.npy", np.asarray(ids, np.int32))
    rows = []
    for flag, path in (("--text", "t.txt"), ("--tokens", "t.npy")):
        assert cli.main(["eval", str(out), flag, str(tmp_path / path), "--seq-len", "8"]) == 0
        rows.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert rows[0] == rows[1] and rows[0]["tokens"] == (len(ids) // 9) * 8


def test_export_refuses_gemma_features_outside_a_gemma_block():
    for key, value in (("norm_weight_offset", 1.0), ("mlp_activation", "gelu_tanh"), ("embed_scale", True),
                       ("attn_logit_softcap", 50.0), ("norm_placement", "sandwich"), ("logit_softcap", 30.0)):
        with pytest.raises(HFError, match=key):
            hf_family(dataclasses.replace(ModelConfig(), **{key: value}))


# ---------------------------------------------------------------- Gemma 3 / Gemma 2


def _gemma_hf(name: str, **changes) -> dict:
    return {**json.loads((FIXTURES / name / "config.json").read_text()), **changes}


def test_gemma3_maps_its_block_windows_and_ropes():
    """The Gemma 3 fixture's config: sandwich (1 + w) norms, GeGLU, scaled embeddings, QK-norm, softmax scale
    24 ** -0.5, every 3rd layer global with linear x4 RoPE on base 5e4, the others a window of 8 on base 1e4;
    transformers 4.x's keys for the same model (rope_theta + rope_scaling + rope_local_base_freq,
    sliding_window_pattern, no layer_types) map to the same config."""
    family, cfg = from_hf(_gemma_hf("gemma3"))
    assert family == "gemma3_text" and hf_family(cfg) == "gemma3_text"
    assert (cfg.norm_placement, cfg.norm_weight_offset, cfg.mlp_activation, cfg.embed_scale, cfg.qk_norm) == (
        "sandwich", 1.0, "gelu_tanh", True, True)
    assert cfg.attention_scale == 24 ** -0.5 and cfg.layer_windows() == (8, 8, None) * 2
    assert (cfg.rope_theta, cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_local_theta) == (
        5e4, "linear", 4.0, 1e4)
    legacy = _gemma_hf("gemma3", rope_parameters=None, rope_theta=5e4, rope_local_base_freq=1e4,
                       rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=3)
    del legacy["layer_types"]
    assert from_hf(legacy) == (family, cfg)
    gemma2 = _gemma_hf("gemma2")
    del gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]  # transformers' defaults: 50, 30
    family, cfg = from_hf(gemma2)
    assert family == "gemma2" and hf_family(cfg) == "gemma2" and not cfg.qk_norm and cfg.rope_local_theta is None
    assert (cfg.attn_logit_softcap, cfg.logit_softcap, cfg.layer_windows()) == (50.0, 30.0, (8, None) * 2)


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=["full_attention", "sliding_attention"] * 3), r"layer_types=\['full_attention'"),
    (dict(layer_types=["sliding_attention"] * 5), "layer_types="),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_parameters.sliding_attention="),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}),
     "rope_type='yarn'"),
    (dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3"),
     "Gemma3ForConditionalGeneration: config.json has no text_config"),
])
def test_gemma_bad_input_is_refused_by_name(changes, match):
    with pytest.raises(HFError, match=match):
        from_hf(_gemma_hf("gemma3", **changes))


def test_gemma_layer_types_we_cannot_hold_exit_2_with_one_line(tmp_path, capsys):
    src = _fixture_with(tmp_path, "gemma3", config={"layer_types": ["full_attention"] + ["sliding_attention"] * 5})
    err = _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    assert "gemma3_text: config.json layer_types=['full_attention', 'sliding_attention'" in err


def test_gemma_export_picks_the_family_or_refuses():
    cfg = from_hf(_gemma_hf("gemma3"))[1]
    assert hf_family(dataclasses.replace(cfg, qk_norm=False, rope_local_theta=None)) == "gemma2"
    for changes, match in ((dict(attn_logit_softcap=50.0), "attn_logit_softcap=50.0 with qk_norm"),
                           (dict(attention_scale=0.3), "query_pre_attn_scalar .* must be an integer"),
                           (dict(qk_norm=False), "rope_local_theta=10000.0 without qk_norm"),
                           (dict(norm_weight_offset=0.0), "sandwich with model.norm_weight_offset=0.0"),
                           (dict(rope_scaling_type="llama3"), "rope_scaling_type=llama3")):
        with pytest.raises(HFError, match=match):
            hf_family(dataclasses.replace(cfg, **changes))


def test_gemma3_image_text_checkpoint_imports_its_text_decoder(imported, tmp_path):
    """Gemma3ForConditionalGeneration (tests/fixtures/hf/gemma3_mm: the gemma3 fixture's decoder beside a tiny
    SigLIP tower, saved under the Hub's names `language_model.model.*`, and again under transformers 5's in-memory
    `model.language_model.*`): the text decoder imports to the gemma3 fixture's params bit for bit, the image
    side's tensors ignored."""
    from safetensors.numpy import save_file

    src = tmp_path / "v5"
    shutil.copytree(FIXTURES / "gemma3_mm", src)
    files = SafetensorsDir(src)
    hub = ("language_model.model.", "vision_tower.", "multi_modal_projector.")
    v5 = {next((f"model.{p.split('.')[0]}.{k[len(p):]}" for p in hub if k.startswith(p)), k): files.read(k)
          for k in files.where}
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in v5
    save_file(v5, src / "model.safetensors")
    _, want = restored(imported["gemma3"])
    for name, hf_dir in (("hub", FIXTURES / "gemma3_mm"), ("v5", src)):
        out = tmp_path / f"import-{name}"
        report = import_hf(hf_dir, out, devices=one_device())
        assert report["family"] == "gemma3_text" and report["params"] == param_counts(restored(out)[0])["total"]
        for x, y in zip(jax.tree.leaves(restored(out)[1]), jax.tree.leaves(want), strict=True):
            assert np.array_equal(np.asarray(x), np.asarray(y)), name


def test_gemma3_27b_hub_config_imports_as_the_preset():
    """google/gemma-3-27b's text_config as transformers 4.x saved it (rope_scaling linear x8 on the global
    layers, rope_local_base_freq, sliding_window_pattern 6, query_pre_attn_scalar 168): the gemma3-27b preset."""
    hub = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
           "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
           "final_logit_softcapping": None, "head_dim": 128, "hidden_activation": "gelu_pytorch_tanh",
           "hidden_size": 5376, "initializer_range": 0.02, "intermediate_size": 21504,
           "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 62,
           "num_key_value_heads": 16, "pad_token_id": 0, "query_pre_attn_scalar": 168, "rms_norm_eps": 1e-06,
           "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
           "rope_theta": 1000000.0, "sliding_window": 1024, "sliding_window_pattern": 6,
           "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
           "vocab_size": 262208}
    family, cfg = from_hf(hub)
    preset = load_config("gemma3-27b").model
    assert family == "gemma3_text"
    assert {k: (v, getattr(cfg, k)) for k, v in dataclasses.asdict(preset).items()
            if k not in {"scan_layers", "remat_policy", "dtype"} and getattr(cfg, k) != v} == {}
    assert sum(w is None for w in cfg.layer_windows()) == 10  # layers 6, 12, ..., 60 (1-based) are global
    # The released checkpoint is image + text; its config.json's text_config holds only what differs from
    # transformers' Gemma3TextConfig defaults.
    released = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                                "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                                "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
                "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    assert from_hf(released) == (family, cfg)


# ---------------------------------------------------------------- gpt-oss


def test_gpt_oss_maps_its_features_and_refuses_what_it_cannot_hold():
    """The fixture's config maps to gpt-oss's features (window pattern 2 from layer_types, HF's yarn attention_factor
    0.1 ln 4 + 1, truncate=false); export writes the same config back; unmappable fields are named with their value."""
    from jaxinfra.hf.families import to_hf

    hf = json.loads((FIXTURES / "gpt_oss" / "config.json").read_text())
    family, cfg = from_hf(hf)
    assert family == "gpt_oss" and hf_family(cfg) == "gpt_oss"
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.layer_windows()) == (8, 2, (8, None, 8, None))
    assert cfg.rope_yarn_attention_factor == pytest.approx(0.1 * np.log(4.0) + 1) and not cfg.rope_yarn_truncate
    assert (cfg.qkv_bias, cfg.attn_out_bias, cfg.attention_sinks, cfg.moe_expert_bias, cfg.moe_router_logit_bias,
            cfg.mlp_activation, cfg.mlp_swiglu_limit, cfg.moe_num_experts, cfg.moe_top_k) == (
        True, True, True, True, True, "clamped_swiglu", 1.0, 6, 2)
    assert from_hf(to_hf(cfg)) == (family, cfg)
    # The Hub's config.json form: top-level rope_scaling / rope_theta, an MXFP4 quantization_config.
    hub = {k: v for k, v in hf.items() if k != "rope_parameters"}
    hub.update(rope_theta=150000.0, rope_scaling={k: v for k, v in hf["rope_parameters"].items() if k != "rope_theta"},
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    assert from_hf(hub)[1] == cfg
    all_sliding = from_hf({**hf, "layer_types": ["sliding_attention"] * 4})[1]
    assert all_sliding.layer_windows() == (8,) * 4
    for extra, needle in [({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types="),
                          ({"layer_types": ["sliding_attention"] * 3}, "layer_types="),
                          ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'")]:
        with pytest.raises(HFError, match=needle):
            from_hf({**hf, **extra})
    with pytest.raises(HFError, match="moe_router_score='sigmoid'"):
        hf_family(dataclasses.replace(cfg, moe_router_score="sigmoid"))
    with pytest.raises(HFError, match="rope_yarn_truncate=false"):
        hf_family(dataclasses.replace(ModelConfig(), rope_yarn_truncate=False))


def _mxfp4_fixture(tmp_path: pathlib.Path) -> pathlib.Path:
    """The gpt_oss fixture with its expert weights replaced by the MXFP4 blocks and scales of mxfp4/ (as the Hub's
    gpt-oss checkpoints store them) and config.json's quantization_config saying so."""
    quantized = SafetensorsDir(FIXTURES / "gpt_oss" / "mxfp4")
    replaced = {k.removesuffix("_blocks") for k in quantized.where if k.endswith("_blocks")}
    src = _fixture_with(tmp_path, "gpt_oss", config={"quantization_config": {"quant_method": "mxfp4"}})
    from safetensors.numpy import save_file

    files = SafetensorsDir(src)
    tensors = {k: files.read(k) for k in files.where if k not in replaced}
    save_file({**tensors, **{k: quantized.read(k) for k in quantized.where}}, src / "model.safetensors")
    return src


def test_gpt_oss_mxfp4_import_is_transformers_dequantization(tmp_path):
    """MXFP4 experts (uint8 FP4 codes + E8M0 scales) import dequantized: bitwise transformers' own dequantization
    (convert_moe_packed_tensors, stored for layer 0), and the model scores as transformers does on those weights."""
    from jaxinfra.hf.safetensors_io import dequantize_mxfp4

    ref = dict(np.load(FIXTURES / "gpt_oss" / "mxfp4" / "reference.npz"))
    src = _mxfp4_fixture(tmp_path)
    files = SafetensorsDir(src)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert files.read(f"{key}_blocks").dtype == np.uint8 and key not in files.where
    assert np.array_equal(dequantize_mxfp4(files.read(f"{key}_blocks"), files.read(f"{key}_scales")), ref[key])
    assert np.array_equal(files.read_experts(key, slice(2, 5)), ref[key][2:5])  # a device shard's experts only
    import_hf(src, tmp_path / "out", devices=one_device())
    cfg, params = restored(tmp_path / "out")
    moe = params["moe_layers"]["moe"]
    down = "model.layers.0.mlp.experts.down_proj"
    for ours, want in (("w_gate", ref[key][..., 0::2]), ("w_up", ref[key][..., 1::2]), ("w_down", ref[down])):
        assert np.array_equal(np.asarray(moe[ours][...][0]), want), ours
    logits = np.asarray(forward(cfg)(params, jnp.asarray(ref["tokens"])))
    assert rel_err(logits, ref["logits"]) <= 1e-5
    assert mean_next_token_ce(logits, ref["tokens"]) == pytest.approx(float(ref["loss"]), rel=1e-5)


@pytest.mark.slow  # ~10 s (prefill + decode compiles); windows and sinks in decode: tests/test_windows.py, test_infer.py
def test_gpt_oss_kv_cache_greedy_equals_full_forward(imported):
    """The imported gpt-oss (windows of 8, sinks, biases) generates with the KV cache past its window exactly the
    greedy tokens of the full forward recomputed at each step."""
    from jaxinfra.infer import Generator

    run = load_config(str(imported["gpt_oss"] / "config.yaml"))
    cfg, params = restored(imported["gpt_oss"])
    prompts, new = [[5, 9, 1, 33, 2, 7, 3, 60, 12, 40], [7, 3]], 14
    got = Generator(run, params).generate(prompts, max_new_tokens=new).tokens
    fwd = forward(cfg)
    for prompt, row in zip(prompts, got):
        seq = list(prompt)
        for _ in range(new):  # right-padded to one length: one compile (causal: the padding cannot matter)
            tokens = np.zeros((1, len(prompt) + new), np.int32)
            tokens[0, :len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(fwd(params, jnp.asarray(tokens)))[0, len(seq) - 1])))
        assert row == seq[len(prompt):]
    assert len(set(got[0])) > 3


def test_gpt_oss_bad_input_is_one_line_exit_2(tmp_path, capsys):
    """A layer_types list our window pattern cannot hold names the field and its value; a missing sink is named."""
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    src = _fixture_with(tmp_path, "gpt_oss", config={"layer_types": types})
    err = _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out")])
    assert "gpt_oss: config.json layer_types=" in err and "full_attention" in err
    shutil.rmtree(src)
    missing = "model.layers.2.self_attn.sinks"
    src = _fixture_with(tmp_path, "gpt_oss", drop=missing)
    assert missing in _one_line_error(capsys, ["hf", "import", str(src), str(tmp_path / "out2")])
