"""Tests for jaxinfra.config and the CLI's handling of bad configs: presets, one-line errors
naming the key, YAML round trip."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from jaxinfra import cli
from jaxinfra.config import Config, ConfigError, load_config, preset_names, validate
from jaxinfra.data.config import SOURCES, TOKEN_DTYPES
from jaxinfra.metrics import param_counts
from kernels.attention import IMPLEMENTATIONS
from models.config import MLP_ACTIVATIONS, NORM_PLACEMENTS, QK_NORM_SCOPES, REMAT_POLICIES
from sharding.rules import CONTEXT_IMPLS, STRATEGIES

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["tiny", "small", "llama3-8b"])
def test_presets_load_and_validate(name):
    assert name in preset_names()
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    validate(cfg)  # no device count: model/data/train consistency only


def test_llama3_8b_parameter_count():
    """Llama-3.1-8B has 8.03e9 parameters (Meta, 2024: 8,030,261,248)."""
    cfg = load_config("llama3-8b")
    total = param_counts(cfg.model)["total"]
    assert total == pytest.approx(8.03e9, rel=0.005)
    m = cfg.model
    assert (m.num_layers, m.d_model, m.num_heads, m.kv_heads, m.mlp_dim, m.vocab_size) == (
        32, 4096, 32, 8, 14336, 128256)


# ---------------------------------------------------------------- errors


def _error(overrides, source="tiny", device_count=None) -> str:
    with pytest.raises(ConfigError) as info:
        cfg = load_config(source, overrides)
        validate(cfg, device_count=device_count)
    msg = str(info.value)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    return msg


def test_unknown_key_suggests_close_key():
    msg = _error(["model.num_layerz=3"])
    assert "model.num_layerz" in msg
    assert "model.num_layers" in msg


def test_unknown_section():
    msg = _error(["modle.num_layers=3"])
    assert "modle" in msg and "model" in msg


def test_wrong_type_names_key():
    msg = _error(["train.steps=banana"])
    assert "train.steps" in msg
    assert "banana" in msg


@pytest.mark.parametrize("override, key", [
    ("model.tie_embeddings=maybe", "model.tie_embeddings"),
    ("schedule.name=exponential", "schedule.name"),
    ("optimizer.lr=fast", "optimizer.lr"),
])
def test_other_wrong_values_name_key(override, key):
    assert key in _error([override])


@pytest.mark.parametrize("key, allowed", [
    ("parallelism.strategy", STRATEGIES),
    ("parallelism.context_impl", CONTEXT_IMPLS),
    ("parallelism.pipeline_schedule", ("gpipe", "circular", "1f1b")),
    ("model.remat_policy", REMAT_POLICIES),
    ("model.norm_placement", NORM_PLACEMENTS),
    ("model.mlp_activation", MLP_ACTIVATIONS),
    ("model.qk_norm_scope", QK_NORM_SCOPES),
    ("model.attention_impl", IMPLEMENTATIONS),
    ("data.source", SOURCES),
    ("data.token_dtype", TOKEN_DTYPES),
])
def test_allowed_values_come_from_the_config_types(key, allowed):
    """The exported lists are the config's Literal types: the error lists exactly them, in order."""
    assert f"choose one of {list(allowed)}" in _error([f"{key}=bogus"])


def test_olmo2_7b_parameter_count_and_block():
    """OLMo-2-1124-7B: 7.30e9 parameters counted from its shapes (untied 100352 x 4096 tables); post norms and
    full-projection QK-norm (q_norm and k_norm 4096 wide each)."""
    m = load_config("olmo2-7b").model
    assert param_counts(m)["total"] == 7_298_617_344
    assert (m.num_layers, m.d_model, m.num_heads, m.kv_heads, m.mlp_dim, m.vocab_size, m.rope_theta, m.norm_eps) == (
        32, 4096, 32, 32, 11008, 100352, 500000.0, 1e-6)
    assert (m.norm_placement, m.qk_norm, m.qk_norm_scope) == ("post", True, "full")
    assert "model.qk_norm_scope" in _error(["model.qk_norm=false"], source="olmo2-7b")


def test_gemma3_27b_parameter_count_and_block():
    """Gemma 3 27B's text decoder: 27.0e9 parameters counted from its shapes (a tied 262208 x 5376 table, four
    norms a layer, per-head QK-norm); 10 global layers of 62 (every 6th), the rest a 1024-token window."""
    m = load_config("gemma3-27b").model
    assert param_counts(m)["total"] == 27_009_346_304
    assert (m.num_layers, m.d_model, m.num_heads, m.kv_heads, m.resolved_head_dim, m.mlp_dim, m.vocab_size) == (
        62, 5376, 32, 16, 128, 21504, 262208)
    assert m.layer_windows().count(None) == 10 and m.attention_scale == 168 ** -0.5


@pytest.mark.parametrize("overrides, names", [
    (["model.attention_impl=cudnn"], ("model.attention_impl", "cudnn", "attention_sinks")),
    (["model.attention_type=mla", "model.num_kv_heads=null"], ("model.attention_sinks", "mla")),
])
def test_attention_sinks_refuse_what_cannot_run_them(overrides, names):
    """Sinks run everywhere but cuDNN (no log-sum-exp) and MLA: say so before compiling."""
    msg = _error(["model.attention_sinks=true", *overrides], device_count=8)
    assert all(n in msg for n in names), msg
    for ok in (["mesh.context=2", "mesh.data=4"], ["mesh.context=2", "mesh.data=4", "parallelism.context_impl=ring"],
               ["model.attention_impl=pallas_triton"], ["model.attention_impl=pallas_mosaic_tpu"]):
        validate(load_config("tiny", ["model.attention_sinks=true", *ok]), device_count=8)


def test_heads_not_dividing_d_model_names_num_heads():
    msg = _error(["model.num_heads=5", "model.num_kv_heads=2"])
    assert "model.num_heads" in msg


def test_kv_heads_not_dividing_heads_names_num_kv_heads():
    msg = _error(["model.num_heads=4", "model.num_kv_heads=3"])
    assert "model.num_kv_heads" in msg


def test_batch_not_divisible_by_data_parallel_size():
    msg = _error(["train.batch_size=12"], device_count=8)
    assert "train.batch_size" in msg
    assert "12" in msg and "8" in msg


def test_batch_divisible_is_accepted():
    validate(load_config("tiny", ["train.batch_size=16"]), device_count=8)


def test_mesh_product_not_device_count():
    msg = _error(["mesh.data=2", "mesh.fsdp=2"], device_count=8)
    assert "data=2" in msg and "fsdp=2" in msg and "8" in msg


def test_tensor_parallel_must_divide_heads():
    msg = _error(["mesh.data=-1", "mesh.tensor=8"], device_count=8)
    assert "mesh.tensor" in msg


def test_unknown_preset():
    msg = _error([], source="no-such-preset")
    assert "no-such-preset" in msg and "tiny" in msg


# ---------------------------------------------------------------- CLI


def _run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "jaxinfra", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


CLI_CASES = {
    "unknown-key": (["train", "tiny", "model.num_layerz=3"], "model.num_layerz"),
    "bad-heads": (["train", "tiny", "model.num_heads=5", "model.num_kv_heads=2"], "model.num_heads"),
    "wrong-type": (["train", "tiny", "train.steps=banana"], "train.steps"),
}


@pytest.fixture(scope="module")
def cli_results():
    """All CLI subprocesses started at once (each pays the interpreter start-up)."""
    procs = {name: _run_cli(*args) for name, (args, _) in CLI_CASES.items()}
    results = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        results[name] = (p.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_bad_config_is_one_line_without_traceback(cli_results, name):
    rc, stdout, stderr = cli_results[name]
    key = CLI_CASES[name][1]
    assert rc != 0
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert key in lines[0]


def test_cli_overrides_after_run_dir_are_applied(tmp_path, capsys):
    rc = cli.main(["train", "tiny", "--run-dir", str(tmp_path / "run"), "model.num_layerz=3"])
    assert rc == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "model.num_layerz" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # failed before anything was written


def test_cli_overrides_before_and_after_run_dir_are_combined(tmp_path, monkeypatch):
    seen = {}

    def fake_train(args):  # parse only: record what `train` would get, run nothing
        seen.update(config=args.config, overrides=list(args.overrides), run_dir=args.run_dir)
        return 0

    monkeypatch.setattr(cli, "cmd_train", fake_train)
    rc = cli.main(["train", "tiny", "model.num_layers=3", "--run-dir", str(tmp_path), "train.steps=7",
                   "model.d_model=64"])
    assert rc == 0
    assert seen == dict(config="tiny", overrides=["model.num_layers=3", "train.steps=7", "model.d_model=64"],
                        run_dir=str(tmp_path))
    cfg = load_config(seen["config"], seen["overrides"])
    assert (cfg.model.num_layers, cfg.train.steps, cfg.model.d_model) == (3, 7, 64)


def test_cli_parser_accepts_overrides_without_config(capsys):
    rc = cli.main(["train", "model.num_layerz=3"])  # config defaults to tiny
    assert rc == cli.EXIT_BAD_INPUT
    assert "model.num_layerz" in capsys.readouterr().err


def test_cli_parser_structure():
    args, extra = cli.build_parser().parse_known_args(["train", "tiny", "--run-dir", "x", "a.b=1"])
    assert args.command == "train" and args.config == "tiny" and args.run_dir == "x"
    assert [*args.overrides, *extra] == ["a.b=1"]


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("source, overrides", [
    ("tiny", []),
    ("tiny", ["model.num_layers=3", "optimizer.clip_grad_norm=null", "optimizer.lr=3e-4", "mesh.fsdp=2",
              "data.source=synthetic", "schedule.name=wsd", "model.logit_softcap=30.0", "log.peak_tflops=1.5"]),
    ("llama3-8b", []),
    ("small", ["data.paths=[a.txt, b/*.txt]"]),
])
def test_yaml_round_trip(tmp_path, source, overrides):
    cfg = load_config(source, overrides)
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(str(path))
    assert again == cfg
    for section in dataclasses.fields(Config):
        assert getattr(again, section.name) == getattr(cfg, section.name), section.name


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n"])
def test_empty_yaml_file_is_one_line_error_naming_it(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert cli.main(["train", str(path), "--run-dir", str(tmp_path / "run")]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.splitlines()
    assert err == [f"jaxinfra: error: {path}: the config file is empty (write `{{}}` to mean all defaults)"]
    assert not (tmp_path / "run").exists()
    path.write_text("{}\n")  # an explicit empty mapping still means the defaults
    assert load_config(str(path)) == load_config(None)
