"""`jaxinfra quantize`, loading its checkpoint in `eval` and `generate` (int8 KV cache too), `info`,
and every bad quant input as one line with exit status 2. In-process CLI calls (jaxinfra.cli.main)."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from jaxinfra import cli
from jaxinfra.checkpoint import save_params_only
from jaxinfra.config import ConfigError, load_config
from jaxinfra.infer import Generator, load_model
from jaxinfra.info import describe
from jaxinfra.quant_checks import check_trainable
from jaxinfra.state import init_params
from models.quant_config import QuantConfig

OVERRIDES = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
             "model.num_kv_heads=2", "model.mlp_dim=64", "model.tie_embeddings=false", "data.source=synthetic",
             "data.synthetic_vocab=64", "train.seq_len=16", "train.batch_size=8", "mesh.data=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A float params-only run (random weights) and its int8 quantization, through the CLI."""
    root = tmp_path_factory.mktemp("quant")
    cfg = load_config("tiny", OVERRIDES)
    params = jax.jit(init_params, static_argnums=0)(cfg.model, jax.random.key(0))
    save_params_only(root / "float", cfg, params, {"params_only": True, "step": 0})
    assert cli.main(["quantize", str(root / "float"), str(root / "int8"), "--weights", "int8"]) == 0
    assert cli.main(["quantize", str(root / "float"), str(root / "int8-g8"), "--weights", "int8",
                     "--group-size", "8"]) == 0
    tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    np.save(root / "tokens.npy", tokens)
    return root


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_quantized_checkpoint_is_int8_and_eval_loads_it_directly(runs, capsys):
    cfg = load_config(str(runs / "int8" / "config.yaml"))
    assert cfg.quant.weights == "int8" and cfg.quant.train == "none"
    assert load_config(str(runs / "int8-g8" / "config.yaml")).quant.group_size == 8
    losses = {}
    for name in ("float", "int8", "int8-g8"):  # group-wise: the embedding lookup and every projection
        rc, out, _ = _run(["eval", str(runs / name), "--tokens", str(runs / "tokens.npy")], capsys)
        assert rc == 0
        losses[name] = json.loads(out)["eval_loss"]
    assert abs(losses["int8"] / losses["float"] - 1) < 0.01, losses
    assert abs(losses["int8-g8"] / losses["float"] - 1) < 0.01, losses


def test_generate_loads_int8_weights_with_an_int8_kv_cache(runs, capsys):
    rc, out, err = _run(["generate", str(runs / "int8"), "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
                         "--kv-cache", "int8"], capsys)
    assert rc == 0, err
    ids = json.loads(out)
    assert len(ids) == 6 and all(0 <= i < 64 for i in ids)
    # The compiled decode loop (the same program, from the compile cache) never holds a float copy of the
    # stacked layer weights: no float array of any int8 layer weight's [layers, ...] shape. (XLA:CPU does
    # convert each layer's slice, and the output projection, inside the step: see docs/quantization.md.)
    cfg, params = load_model(runs / "int8", ["quant.kv_cache=int8"], devices=jax.devices()[:1])
    _, decode = Generator(cfg, params, devices=jax.devices()[:1])._compile(1, 16, 6, 8)
    text = decode.as_text()
    stacked = {"[" + ",".join(map(str, v.shape)) + "]" for v in jax.tree.leaves(params["layers"])
               if v.dtype == np.int8}
    assert stacked and not [s for s in stacked if re.search(rf"(f32|bf16){re.escape(s)}", text)], stacked


def test_info_shows_int8_bytes_per_device(runs, capsys):
    text = describe(load_config(str(runs / "int8" / "config.yaml"), ["quant.kv_cache=int8", "mesh.data=-1"]))
    assert "quant: weights stored int8 with float32 scales per output channel" in text
    assert "int8" in text.split("layers/mlp/w_gate ")[1].splitlines()[0]
    assert "kv cache: " in text and "of float32" in text
    float_text = describe(load_config(str(runs / "float" / "config.yaml"), ["mesh.data=-1"]))
    mib = lambda t: float(t.split("params:")[-1].split("MiB per device")[0])  # noqa: E731
    assert mib(text) < 0.3 * mib(float_text)


@pytest.mark.parametrize("argv,message", [
    (["quantize", "{int8}", "{out}", "--weights", "int8"], "is already quantized (quant.weights=int8"),
    (["quantize", "{float}", "{out}", "--weights", "int4"], "--weights 'int4' is not a weight quantization"),
    (["quantize", "{float}", "{out}", "--weights", "int8", "--group-size", "24"],
     "--group-size=24 is invalid: must be a divisor of the input dimension model.d_model=32"),
    (["generate", "{float}", "--prompt-ids", "1", "--kv-cache", "int4"], "quant.kv_cache: 'int4' is not allowed"),
    (["train", "tiny", "quant.train=int4"], "quant.train: 'int4' is not allowed; choose one of"),
    (["train", "tiny", "quant.exclude=[unembedd]"], "did you mean 'unembed'?"),
    (["train", "tiny", "quant.train=fp8", "--run-dir", "{out}"], "set quant.fp8_emulation=true"),
    (["train", "{int8}/config.yaml", "--run-dir", "{out}", "mesh.data=-1"], "marks an inference checkpoint"),
])
def test_bad_quant_input_is_one_line_exit_2(runs, capsys, argv, message):
    argv = [a.format(int8=runs / "int8", float=runs / "float", out=runs / "new") for a in argv]
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_fp8_backend_check_names_the_backend_and_what_to_set():
    with pytest.raises(ConfigError, match=r"lacks: XLA would upcast them to float32 dots .* quant.fp8_emulation"):
        check_trainable(QuantConfig(train="fp8"), jax.devices()[:1])
    check_trainable(QuantConfig(train="fp8", fp8_emulation=True), jax.devices()[:1])
    bad = dataclasses.replace(load_config("tiny"), quant=QuantConfig(train="fp8", scaling="delayed"))
    with pytest.raises(ConfigError, match=r"quant.scaling=delayed with mesh.stage=2 is not supported"):
        from jaxinfra.config import validate

        validate(dataclasses.replace(bad, mesh=dataclasses.replace(bad.mesh, stage=2, data=1)), 2)
