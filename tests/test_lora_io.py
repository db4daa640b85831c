"""LoRA adapters <-> PEFT (jaxinfra/hf/adapters.py) against an adapter PEFT itself wrote
(tests/fixtures/lora/llama, made by scripts/make_lora_fixtures.py; torch and peft are never imported here).

The mapping tests are numpy only: an adapter's weight update B_hf @ A_hf in PEFT's layout must equal
our A @ B put through the base weight's own export rule, for every family's rules (Mixtral's experts,
DeepSeek's permuted rope columns). The logits tests load the fixture into a jaxinfra LoRA model.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from jaxinfra.hf import adapters
from jaxinfra.hf.families import HFError, from_hf
from jaxinfra.hf.tensors import rules

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
HF = REPO_ROOT / "tests" / "fixtures" / "hf"
LORA = REPO_ROOT / "tests" / "fixtures" / "lora" / "llama"
RANK = 4


def hf_config(name: str):
    return from_hf(json.loads((HF / name / "config.json").read_text()))


def our_lora_shapes(rule, shape: tuple[int, ...], contracted: int, rank: int = RANK) -> tuple[tuple, tuple]:
    """A [*lead, *contracted, r], B [*lead, r, *output] beside a weight of `shape` whose first
    `contracted` dims after the lead are its inputs (models/lora_config.py's layout)."""
    n = len(rule.lead)
    inputs, outputs = shape[n:n + contracted], shape[n + contracted:]
    return (*rule.lead, *inputs, rank), (*rule.lead, rank, *outputs)


def weight_shapes(cfg, family: str) -> dict[str, tuple[int, ...]]:
    """Our stacked weights' shapes from the rules' HF shapes (load turns zeros of HF shape into ours)."""
    hf, out = _hf_shapes(cfg, family), {}
    for rule in rules(cfg, family):
        names = rule.names(*(0,) * len(rule.lead))
        out[rule.path] = (*rule.lead, *rule.load([np.zeros(hf[n], np.float32) for n in names]).shape)
    return out


def _hf_shapes(cfg, family: str) -> dict[str, tuple[int, ...]]:
    from jaxinfra.hf.safetensors_io import SafetensorsDir

    files = SafetensorsDir(HF / family)
    out = {}
    for rule in rules(cfg, family):
        for idx in np.ndindex(*rule.lead):
            for name in rule.names(*idx):
                out[name] = tuple(files.read(name).shape)
    return out


# our weight (path below the stack) -> how many of its dims after the lead are contracted (models/)
TARGETS = {"attn/wq": 1, "attn/wk": 1, "attn/wv": 1, "attn/wo": 2, "mlp/w_gate": 1, "mlp/w_up": 1, "mlp/w_down": 1,
           "moe/w_gate": 1, "moe/w_up": 1, "moe/w_down": 1, "attn/wq_a": 1, "attn/wq_b": 1, "attn/wkv_a": 1,
           "attn/wkv_b": 1}


@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3", "deepseek_v2"])
def test_peft_update_equals_ours_through_the_base_export_rule(family):
    """B_hf @ A_hf == rule.save(A @ B) slice by slice, and from_peft inverts to_peft exactly."""
    _, cfg = hf_config(family)
    shapes = weight_shapes(cfg, family)
    rng = np.random.default_rng(0)
    checked = 0
    for rule in rules(cfg, family):
        suffix = rule.path.partition("/")[2]
        if suffix not in TARGETS:
            continue
        a_shape, b_shape = our_lora_shapes(rule, shapes[rule.path], TARGETS[suffix])
        n = len(rule.lead)
        a = rng.standard_normal(a_shape[n:]).astype(np.float32)
        b = rng.standard_normal(b_shape[n:]).astype(np.float32)
        lora_a, lora_b = adapters.to_peft(rule, a, b)
        delta = np.tensordot(a, b, axes=([a.ndim - 1], [0]))  # [*inputs, *outputs]: ours, like the weight
        assert delta.shape == shapes[rule.path][n:]
        np.testing.assert_allclose(lora_b @ lora_a, rule.save(delta)[0], rtol=1e-5, atol=1e-5)
        back_a, back_b = adapters.from_peft(rule, lora_a, lora_b, a_shape[n:], b_shape[n:])
        assert np.array_equal(back_a, a) and np.array_equal(back_b, b)
        checked += 1
    assert checked >= 4


def test_target_modules_use_short_names_only_when_they_cover_every_module():
    _, cfg = hf_config("llama")
    every_q = {f"model.layers.{i}.self_attn.q_proj" for i in range(cfg.num_layers)}
    assert adapters.target_modules(cfg, "llama", every_q) == ["q_proj"]
    assert adapters.target_modules(cfg, "llama", {"model.layers.1.mlp.up_proj"}) == ["model.layers.1.mlp.up_proj"]


def test_peft_adapter_reads_into_our_layout():
    """The fixture's adapter read into our shapes, then written back with to_peft, is what PEFT wrote."""
    from jaxinfra.hf.safetensors_io import SafetensorsDir

    family, cfg = hf_config("llama")
    shapes = {}
    for path, shape in weight_shapes(cfg, family).items():
        suffix = path.partition("/")[2]
        if suffix in TARGETS:
            rule = next(r for r in rules(cfg, family) if r.path == path)
            shapes[path + adapters.LORA_A], shapes[path + adapters.LORA_B] = our_lora_shapes(rule, shape,
                                                                                            TARGETS[suffix])
    ours = adapters.read_adapters(LORA, cfg, family, shapes)
    assert len(ours) == 2 * 7
    files = SafetensorsDir(LORA, only=adapters.WEIGHTS_FILE)
    for rule in adapters.adapter_rules(cfg, family, shapes):
        for idx, module in adapters.modules(rule):
            lora_a, lora_b = adapters.to_peft(rule, ours[rule.path + adapters.LORA_A][idx],
                                              ours[rule.path + adapters.LORA_B][idx])
            key_a, key_b = adapters.peft_keys(module)
            assert np.array_equal(lora_a, files.read(key_a)) and np.array_equal(lora_b, files.read(key_b))
    assert set(files.used) == set(files.where)


def test_unsupported_peft_options_are_one_line_errors(tmp_path):
    config = json.loads((LORA / "adapter_config.json").read_text())
    for key, value, message in (("use_dora", True, "use_dora=True is not supported"),
                                ("peft_type", "IA3", "only LORA adapters"),
                                ("rank_pattern", {"q_proj": 8}, "rank_pattern")):
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(HFError, match=message):
            adapters.read_adapter_config(tmp_path)
    assert adapters.scale_alpha({**config, "use_rslora": True}) == pytest.approx(8.0 * 2)


# ---------------------------------------------------------------- logits: PEFT's model vs ours
def _restored(run_dir: pathlib.Path):
    """A run's config and params (adapters included) on one device."""
    import jax

    from jaxinfra.checkpoint import restore_params
    from jaxinfra.config import load_config
    from jaxinfra.state import abstract_params

    cfg = load_config(str(run_dir / "config.yaml"))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev),
                          abstract_params(cfg.model, quant=cfg.quant, lora=cfg.lora))
    return cfg, restore_params(run_dir, target)[1]


def logits_of(run_dir: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfra.state import model_graphdef

    cfg, params = _restored(run_dir)
    graphdef = model_graphdef(cfg.model, cfg.quant, cfg.lora)
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens)))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory) -> pathlib.Path:
    """`jaxinfra hf import` of the base with the PEFT adapter: a LoRA run directory."""
    import jax

    from jaxinfra.hf.importer import import_hf

    out = tmp_path_factory.mktemp("peft") / "run"
    import_hf(HF / "llama", out, devices=jax.devices()[:1], adapter=LORA)
    return out


def test_imported_peft_adapter_gives_peft_logits(peft_run):
    """Acceptance: the PEFT model's logits (base + adapters, float32) equal ours within 1e-4."""
    from jaxinfra.config import load_config

    lora = load_config(str(peft_run / "config.yaml")).lora
    assert (lora.rank, lora.alpha, lora.dropout) == (4, 8.0, 0.0)
    assert set(lora.targets) == {"attention.q", "attention.k", "attention.v", "attention.o", "mlp.gate", "mlp.up",
                                 "mlp.down"}
    ref = np.load(LORA / "reference.npz")
    assert rel_err(logits_of(peft_run, ref["tokens"]), ref["logits"]) <= 1e-4


@pytest.fixture(scope="module")
def trained_run(peft_run, tmp_path_factory) -> pathlib.Path:
    """The imported LoRA run with every adapter redrawn (as a fine-tune changes them): a run that no PEFT
    file ever held, for the export direction."""
    import jax
    from flax import nnx

    from jaxinfra.checkpoint import save_params_only
    from models.project import LoraA, LoraB

    cfg, params = _restored(peft_run)
    rng = np.random.default_rng(3)

    def redraw(var):
        if not isinstance(var, LoraA | LoraB):
            return var
        return var.replace(jax.numpy.asarray(rng.standard_normal(var.shape).astype(np.float32) / var.shape[-2]))

    params = jax.tree.map(redraw, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = tmp_path_factory.mktemp("trained") / "run"
    save_params_only(out, cfg, params, {"params_only": True, "step": 0})
    return out


def test_export_adapters_writes_pefts_files(peft_run, tmp_path):
    """The PEFT adapter imported then exported with --adapters: the same tensors, bit for bit, the same
    LoRA settings, and the base exactly as a plain export of the base writes it (unmerged)."""
    from jaxinfra.hf.exporter import export_hf
    from jaxinfra.hf.safetensors_io import SafetensorsDir

    report = export_hf(peft_run, tmp_path / "hf", adapters=True)
    assert report["adapter_tensors"] == 2 * 7 * 2
    ours, theirs = (SafetensorsDir(d, only=adapters.WEIGHTS_FILE) for d in (tmp_path / "hf", LORA))
    assert set(ours.where) == set(theirs.where)
    for key in theirs.where:
        assert np.array_equal(ours.read(key), theirs.read(key)), key
    ours, theirs = SafetensorsDir(tmp_path / "hf"), SafetensorsDir(HF / "llama")
    assert ours.files == ["model.safetensors"] and set(ours.where) == set(theirs.where)
    for key in theirs.where:
        assert np.array_equal(ours.read(key), theirs.read(key)), key
    config = json.loads((tmp_path / "hf" / adapters.CONFIG_FILE).read_text())
    fixture = json.loads((LORA / adapters.CONFIG_FILE).read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora",
                "use_dora"):
        assert config[key] == fixture[key], key
    assert sorted(config["target_modules"]) == sorted(fixture["target_modules"])
    assert config["base_model_name_or_path"] == "."


def test_export_then_import_gives_the_runs_logits(trained_run, tmp_path):
    """Round trip of a run no PEFT file held: export --adapters, import base + adapter, same logits."""
    import jax

    from jaxinfra.hf.exporter import export_hf
    from jaxinfra.hf.importer import import_hf

    export_hf(trained_run, tmp_path / "hf", adapters=True)
    import_hf(tmp_path / "hf", tmp_path / "again", devices=jax.devices()[:1], adapter=tmp_path / "hf")
    tokens = np.load(LORA / "reference.npz")["tokens"]
    want = logits_of(trained_run, tokens)
    assert rel_err(want, np.load(LORA / "reference.npz")["logits"]) > 0.1  # the redrawn adapters matter
    assert rel_err(logits_of(tmp_path / "again", tokens), want) <= 1e-6


def test_adapters_flag_errors_are_one_line_exit_2(peft_run, tmp_path, capsys):
    from jaxinfra import cli

    assert cli.main(["hf", "export", str(peft_run), str(tmp_path / "a")]) == 2
    assert "is a LoRA run (lora.rank=4): pass --adapters" in capsys.readouterr().err
    plain = tmp_path / "plain"
    import jax

    from jaxinfra.hf.importer import import_hf

    import_hf(HF / "llama", plain, devices=jax.devices()[:1])
    assert cli.main(["hf", "export", str(plain), str(tmp_path / "b"), "--adapters"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a LoRA run" in err and len(err.splitlines()) == 1


def test_mixtral_expert_adapters_round_trip(tmp_path, capsys):
    """Routed experts' adapters as PEFT names them on the Hub layout (`block_sparse_moe.experts.{j}.w1`),
    export -> import bit for bit; `hf import` with lora.* but no adapter is a one-line error."""
    import jax
    from flax import nnx

    from jaxinfra import cli
    from jaxinfra.checkpoint import save_params_only
    from jaxinfra.hf.exporter import export_hf
    from jaxinfra.hf.importer import build_config, import_hf
    from jaxinfra.hf.safetensors_io import SafetensorsDir
    from jaxinfra.state import init_params
    from models.project import LoraB

    family, model = hf_config("mixtral")
    cfg = build_config(model, ["lora.rank=2", "lora.targets=[q,experts.gate,experts.up,experts.down]"], 1)
    params = init_params(cfg.model, jax.random.key(0), lora=cfg.lora)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda v: v.replace(jax.numpy.asarray(rng.standard_normal(v.shape), np.float32))
                          if isinstance(v, LoraB) else v, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    save_params_only(tmp_path / "run", cfg, params, {"params_only": True, "step": 0})
    report = export_hf(tmp_path / "run", tmp_path / "hf", adapters=True)
    assert report["target_modules"] == ["q_proj", "w1", "w2", "w3"]
    files = SafetensorsDir(tmp_path / "hf", only=adapters.WEIGHTS_FILE)
    d, e = cfg.model.d_model, cfg.model.moe_num_experts
    assert files.shape(f"base_model.model.model.layers.1.block_sparse_moe.experts.{e - 1}.w2.lora_B.weight") == [d, 2]
    assert len(files.where) == 2 * cfg.model.num_layers * (1 + 3 * e)
    import_hf(tmp_path / "hf", tmp_path / "again", devices=jax.devices()[:1], adapter=tmp_path / "hf")
    _, back = _restored(tmp_path / "again")
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert cli.main(["hf", "import", str(HF / "llama"), str(tmp_path / "x"), "lora.rank=4"]) == 2
    assert "needs --adapter PEFT_DIR" in capsys.readouterr().err
