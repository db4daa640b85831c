"""Tests for the jaxinfra.infer package and the models' prefill/decode paths.

Every check is against an independent reference: greedy decoding by full recomputation
(the training forward on the whole sequence at each step, argmax of the last real
position), the training forward's logits, numpy cross-entropy, each prompt run alone,
the unsharded run. Models are tiny and shared by module-scoped fixtures; sampling settings
are traced values, so one compiled prefill/decode pair serves every sampling test.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from subprocs import cli_env

from jaxinfra.config import load_config
from jaxinfra.infer import (
    Generator,
    InferenceError,
    Sampling,
    check_token_array,
    inference_model_config,
    load_model,
    sample,
    score,
    token_rows,
)
from jaxinfra.state import init_params, model_graphdef
from models import cache as kv_cache

NEW = 32
SMALL = ["data.source=synthetic", "model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=64",
         "model.tie_embeddings=false", "model.init_std=0.3", "mesh.data=1"]
GQA = [*SMALL, "model.num_kv_heads=2", "model.head_dim=8"]
MLA = [*SMALL, "model.num_kv_heads=null", "model.attention_type=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8"]
# DeepSeek-style MLA + MoE, configured for *capacity* dispatch with the aux-loss-free bias:
# inference must route dropless and use the bias for selection.
MOE = [*MLA, "model.num_layers=3", "model.moe_num_experts=4", "model.moe_top_k=2", "model.moe_mlp_dim=16",
       "model.moe_shared_experts=1", "model.moe_first_dense_layers=1", "model.moe_router_score=sigmoid",
       "model.moe_num_groups=2", "model.moe_top_k_groups=1", "model.moe_dispatch=capacity",
       "model.moe_capacity_factor=1.0", "model.moe_bias_update_rate=0.01"]
# OLMo 2's block: norms after the sub-layers, QK-norm over the whole q / k projections.
OLMO2 = [*GQA, "model.norm_placement=post", "model.qk_norm=true", "model.qk_norm_scope=full"]
# Gemma 2/3's block: sandwich norms with (1 + w) weights, GeGLU (tanh GELU), sqrt(d) embeddings, attention soft-cap.
GEMMA = [*GQA, "model.norm_placement=sandwich", "model.norm_weight_offset=1.0", "model.mlp_activation=gelu_tanh",
         "model.embed_scale=true", "model.attn_logit_softcap=1.0", "model.qk_norm=true"]
# gpt-oss attention sinks (set nonzero by the fixture: their init is 0).
SINKS = [*GQA, "model.attention_sinks=true"]
PROMPTS = [[5, 9, 1, 33, 2], [7, 3, 60, 12, 40, 41, 8, 19, 22, 50, 11]]


def make(overrides: list[str], seed: int = 0):
    cfg = load_config("tiny", overrides)
    params = init_params(cfg.model, jax.random.key(seed))

    def fill_bias(path, x):  # nonzero router bias so that selection depends on it
        if "bias" in jax.tree_util.keystr(path):
            return jax.random.normal(jax.random.key(seed + 1), x.shape, x.dtype)
        return x

    return cfg, jax.tree_util.tree_map_with_path(fill_bias, params)


@functools.cache
def forward_fn(model_cfg):
    graphdef = model_graphdef(model_cfg)
    return jax.jit(lambda p, t: nnx.merge(graphdef, p).forward(t)[0])


def recompute_greedy(cfg, params, prompt: list[int], n: int) -> list[int]:
    """Reference: at each step the training forward on the whole sequence (right-padded to a
    fixed length, so one compile; causal, so padding after the last token cannot matter)."""
    fwd = forward_fn(inference_model_config(cfg.model))
    total = len(prompt) + n
    seq = list(prompt)
    for _ in range(n):
        tokens = np.zeros((1, total), np.int32)
        tokens[0, :len(seq)] = seq
        logits = np.asarray(fwd(params, jnp.asarray(tokens)))
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def gqa():
    cfg, params = make(GQA)
    return cfg, params, Generator(cfg, params)


@pytest.fixture(scope="module")
def mla():
    cfg, params = make(MLA, seed=1)
    return cfg, params, Generator(cfg, params, absorb=True), Generator(cfg, params, absorb=False)


@pytest.fixture(scope="module")
def moe():
    cfg, params = make(MOE, seed=2)
    return cfg, params, Generator(cfg, params)


@pytest.fixture(scope="module")
def olmo2():
    return make(OLMO2, seed=3)


@pytest.fixture(scope="module")
def gemma():
    return make(GEMMA, seed=4)


@pytest.fixture(scope="module")
def sinks():
    cfg, params = make(SINKS, seed=4)
    attn = params["layers"]["attn"]
    attn["sinks"][...] = 2 * jax.random.normal(jax.random.key(5), attn["sinks"][...].shape)
    return cfg, params


# ---------------------------------------------------------------- exactness of the cache


@pytest.mark.slow  # ~9 s cold; tests/test_windows.py's windowed generation (ring-buffer caches) runs by default
def test_imported_gemma3_greedy_with_cache_equals_recomputation(tmp_path_factory):
    """Gemma 3 as `hf import` builds it from the transformers fixture (window 8, every 3rd layer global with its
    own RoPE): greedy decoding with the KV cache, 32 new tokens well past the window, equals recomputation."""
    from jaxinfra.hf.importer import import_hf

    out = tmp_path_factory.mktemp("gemma3") / "run"
    import_hf(pathlib.Path(__file__).parent / "fixtures" / "hf" / "gemma3", out, devices=jax.devices()[:1])
    cfg, params = load_model(out, ["mesh.data=1"], devices=jax.devices()[:1])
    assert cfg.model.layer_windows() == (8, 8, None) * 2
    got = Generator(cfg, params).generate(PROMPTS, max_new_tokens=NEW).tokens
    for prompt, row in zip(PROMPTS, got):
        assert row == recompute_greedy(cfg, params, prompt, NEW)
    assert len(set(got[1])) > 4


def test_gqa_greedy_with_cache_equals_recomputation(gqa):
    cfg, params, gen = gqa
    got = gen.generate(PROMPTS, max_new_tokens=NEW).tokens
    for prompt, row in zip(PROMPTS, got):
        assert row == recompute_greedy(cfg, params, prompt, NEW)
    assert len(set(got[1])) > 4  # a non-degenerate model: the check compares real choices


def test_mla_absorbed_and_explicit_decode_equal_recomputation(mla):
    cfg, params, absorbed, explicit = mla
    a = absorbed.generate(PROMPTS, max_new_tokens=NEW).tokens
    e = explicit.generate(PROMPTS, max_new_tokens=NEW).tokens
    assert a == e
    for prompt, row in zip(PROMPTS, a):
        assert row == recompute_greedy(cfg, params, prompt, NEW)


def test_mla_moe_greedy_with_cache_equals_dropless_recomputation(moe):
    cfg, params, gen = moe
    got = gen.generate(PROMPTS, max_new_tokens=NEW).tokens
    for prompt, row in zip(PROMPTS, got):
        assert row == recompute_greedy(cfg, params, prompt, NEW)


@pytest.mark.parametrize("which", ["gqa", "mla", "moe", "olmo2", "gemma", "sinks"])
def test_decode_step_logits_equal_training_forward(which, request):
    """One prefill + one decode step by hand: the decode logits (absorbed and explicit for
    MLA) equal the training forward's at that position; prefill logits equal it too."""
    cfg, params = request.getfixturevalue(which)[:2]
    model_cfg = inference_model_config(cfg.model)
    graphdef = model_graphdef(model_cfg)
    prompt, nxt = jnp.asarray([PROMPTS[1]]), 17
    full = jnp.asarray([PROMPTS[1] + [nxt]])
    t = prompt.shape[1]

    @jax.jit
    def run(params):
        model = nnx.merge(graphdef, params)
        pre_logits, entries = model.prefill(prompt)
        cache = kv_cache.write(kv_cache.init(model_cfg, 1, t + 4), entries, jnp.zeros((1,), jnp.int32))
        step = jnp.asarray([[nxt]])
        pos = jnp.asarray([[t]])
        outs = [model.decode(step, pos, cache, absorb)[0][:, 0] for absorb in (True, False)]
        return pre_logits, outs, model(full)

    pre_logits, outs, ref = jax.device_get(run(params))
    np.testing.assert_allclose(pre_logits[0], ref[0, :t], rtol=1e-5, atol=1e-5)
    for out in outs:
        np.testing.assert_allclose(out[0], ref[0, t], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_batched_prompts_of_different_lengths_equal_each_alone(gqa):
    _, _, gen = gqa
    prompts = [PROMPTS[1], [4], PROMPTS[0] + [1, 2, 3]]
    together = gen.generate(prompts, max_new_tokens=NEW).tokens
    alone = [gen.generate([p], max_new_tokens=NEW).tokens[0] for p in prompts]
    assert together == alone


def test_cache_layout_and_bytes_per_token():
    gqa_cfg, mla_cfg, moe_cfg = (load_config("tiny", o).model for o in (GQA, MLA, MOE))
    lay = kv_cache.layout(gqa_cfg, 3, 20)
    assert lay["layers"]["k"] == ((2, 3, 2, 20, 8), ("layers", "batch", "kv_heads", "kv_length", "head_dim"))
    assert kv_cache.bytes_per_token(gqa_cfg) == 4 * 2 * 2 * 2 * 8  # fp32 * 2 L kv_heads head_dim
    assert kv_cache.bytes_per_token(mla_cfg) == 4 * 2 * (16 + 4)  # fp32 * L (rank + rope)
    lay = kv_cache.layout(moe_cfg, 1, 5)
    assert lay["layers"]["latent"][0] == (1, 1, 1, 5, 16) and lay["moe_layers"]["k_rope"][0] == (2, 1, 1, 5, 4)


# ---------------------------------------------------------------- sampling and stopping


def test_top_k_1_and_tiny_top_p_equal_greedy(gqa):
    _, _, gen = gqa
    greedy = gen.generate(PROMPTS, max_new_tokens=NEW).tokens
    assert gen.generate(PROMPTS, max_new_tokens=NEW, sampling=Sampling(temperature=1.5, top_k=1, seed=3)).tokens == greedy
    assert gen.generate(PROMPTS, max_new_tokens=NEW, sampling=Sampling(temperature=1.5, top_p=1e-6, seed=4)).tokens == greedy


def test_sampling_is_seeded(gqa):
    _, _, gen = gqa
    run = lambda seed: gen.generate(PROMPTS, max_new_tokens=NEW, sampling=Sampling(temperature=2.0, seed=seed)).tokens  # noqa: E731
    first = run(7)
    assert run(7) == first
    assert run(8) != first
    assert first != gen.generate(PROMPTS, max_new_tokens=NEW).tokens


def test_sample_support_matches_top_k_and_top_p():
    """Empirical support of many draws against the sets computed by hand in numpy."""
    logits = np.log(np.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]] * 4000, np.float32))
    keys = jax.random.split(jax.random.key(0), logits.shape[0])
    draw = jax.jit(sample)

    def support(top_k, top_p, temperature=1.0):
        ids = np.asarray(draw(jnp.asarray(logits), keys, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p)))
        return set(ids.tolist()), ids

    assert support(2, 1.0)[0] == {1, 3}
    assert support(0, 0.5)[0] == {1, 3}  # 0.4 < 0.5, 0.4 + 0.3 >= 0.5
    assert support(0, 0.71)[0] == {1, 3, 4}  # 0.7 < 0.71: the next most likely joins
    assert support(2, 0.3)[0] == {1}
    assert support(0, 1.0, temperature=0.0)[0] == {1}  # greedy
    s, ids = support(0, 1.0)
    assert s == {0, 1, 2, 3, 4}
    freq = np.bincount(ids, minlength=5) / len(ids)
    np.testing.assert_allclose(freq, [0.05, 0.4, 0.1, 0.3, 0.15], atol=0.03)


def test_stop_token_ends_its_row(gqa):
    _, _, gen = gqa
    greedy = gen.generate(PROMPTS, max_new_tokens=NEW).tokens
    stop = greedy[1][5]
    got = gen.generate(PROMPTS, max_new_tokens=NEW, stop_ids=[stop, 63]).tokens
    for row, full in zip(got, greedy):
        cut = [i for i, x in enumerate(full) if x in (stop, 63)]
        assert row == (full[:cut[0] + 1] if cut else full)
    assert got[1][-1] == stop and len(got[1]) <= 6


def test_bad_generation_input_raises():
    cfg, params = make(GQA)
    gen = Generator.__new__(Generator)  # argument checks run before anything compiles
    gen.model_cfg = cfg.model
    with pytest.raises(InferenceError, match="vocabulary"):
        gen.generate([[1, 64]], max_new_tokens=2)
    with pytest.raises(InferenceError, match="at least one token"):
        gen.generate([[]], max_new_tokens=2)
    with pytest.raises(InferenceError, match="max_new_tokens"):
        gen.generate([[1]], max_new_tokens=0)
    with pytest.raises(InferenceError, match="cache limit"):
        gen.generate([[1]], max_new_tokens=10**6)
    with pytest.raises(InferenceError, match="top_p"):
        gen.generate([[1]], sampling=Sampling(top_p=0.0))


# ---------------------------------------------------------------- scoring


def test_eval_loss_equals_numpy_cross_entropy_of_training_forward(moe):
    cfg, params, _ = moe
    tokens = np.random.default_rng(0).integers(0, 64, (3, 12)).astype(np.int32)
    loss, count = score(cfg, params, tokens, batch_size=2)  # the last batch is padded and masked
    logits = np.asarray(forward_fn(inference_model_config(cfg.model))(params, jnp.asarray(tokens[:, :-1])), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    ref = -np.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    assert count == 3 * 11
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((4,), np.int32), "2-D"), (np.zeros((2, 3), np.float32), "integer"),
    (np.zeros((2, 1), np.int32), "seq >= 2"), (np.full((2, 3), 64), r"\[0, 64\)"), (np.full((2, 3), -1), "found -1")])
def test_token_array_validation(bad, match):
    with pytest.raises(InferenceError, match=match):
        check_token_array(bad, 64)


def test_token_rows_cut_a_flat_array_into_seq_len_plus_1_rows():
    rows, dropped = token_rows(np.arange(10, dtype=np.int64), seq_len=2)
    np.testing.assert_array_equal(rows, np.arange(9).reshape(3, 3))
    assert dropped == 1
    two_d = np.ones((2, 5), np.int32)
    assert token_rows(two_d, seq_len=2)[0] is two_d and token_rows(two_d, seq_len=2)[1] == 0
    for bad, match in ((np.zeros((2, 2, 2), np.int32), "1-D array of ids or a 2-D"),
                       (np.zeros((9,), np.float32), "integer"), (np.zeros((2,), np.int32), "at least seq_len \\+ 1 = 3")):
        with pytest.raises(InferenceError, match=match):
            token_rows(bad, seq_len=2)


# ---------------------------------------------------------------- sharding


def test_sharded_decode_equals_unsharded(gqa):
    cfg, params, gen = gqa
    sharded_cfg = load_config("tiny", [*GQA, "mesh.data=1", "mesh.tensor=2", "mesh.fsdp=2"])
    sharded = Generator(sharded_cfg, params)
    assert sharded.mesh.size == 4
    k = jax.tree.leaves(sharded.params["layers"]["attn"]["wq"])[0]
    assert k.sharding.spec != jax.sharding.PartitionSpec()  # really sharded
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]] * 2
    assert sharded.generate(prompts, max_new_tokens=NEW).tokens == gen.generate(prompts, max_new_tokens=NEW).tokens


# ---------------------------------------------------------------- CLI end to end


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxinfra", *args], env=cli_env(1), capture_output=True, text=True,
                          timeout=timeout)


def _cli_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (no interpreter start and jax import per call): for bad input, which
    is refused before anything compiles. Same result shape as `_cli`."""
    from jaxinfra import cli

    capsys.readouterr()
    status = cli.main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out.out, out.err)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("infer-run")
    out = _cli("train", "tiny", "--run-dir", str(run_dir), "train.steps=2", "train.batch_size=2", "train.seq_len=32",
               "log.progress=false", "log.tensorboard=false", "mesh.data=1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return run_dir


def test_cli_generate_prompt_ids_prints_one_json_list(trained_run):
    out = _cli("generate", str(trained_run), "--prompt-ids", "100,101,32,61", "--max-new-tokens", "12")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 1
    ids = json.loads(lines[0])
    assert isinstance(ids, list) and len(ids) == 12 and all(isinstance(i, int) and 0 <= i < 256 for i in ids)
    assert "tok/s" in out.stderr
    # Orbax's "Given directory is read only" (restoring with a read-only manager) is not the user's business.
    assert "read only" not in out.stderr, out.stderr
    # The same checkpoint in this process (8 devices, config mesh) through load_model: same greedy ids.
    step_dir = trained_run / "checkpoints" / "2"
    cfg, params = load_model(step_dir)
    assert Generator(cfg, params).generate([[100, 101, 32, 61]], max_new_tokens=12).tokens[0] == ids


def test_cli_eval_prints_one_json_line(trained_run, tmp_path):
    tokens = np.random.default_rng(1).integers(0, 256, (3, 17)).astype(np.int64)
    np.save(tmp_path / "t.npy", tokens)
    out = _cli("eval", str(trained_run / "checkpoints" / "2"), "--tokens", str(tmp_path / "t.npy"), "--batch-size", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "read only" not in out.stderr, out.stderr  # Orbax's read-only restore notice stays out
    lines = out.stdout.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert set(result) == {"eval_loss", "tokens"} and result["tokens"] == 3 * 16
    cfg, params = load_model(trained_run)
    loss, _ = score(cfg, params, tokens, batch_size=3)
    np.testing.assert_allclose(result["eval_loss"], loss, rtol=1e-5)


def test_load_model_takes_a_relative_run_dir(trained_run, monkeypatch, capsys):
    """`jaxinfra generate runs/x`: Orbax wants absolute paths; a relative run dir loads (it was
    reported unreadable, every checkpoint of it)."""
    monkeypatch.chdir(trained_run.parent)
    _, relative = load_model(trained_run.name)
    _, absolute = load_model(trained_run)
    assert "unreadable" not in capsys.readouterr().out
    jax.tree.map(np.testing.assert_array_equal, relative, absolute)


def test_cli_bad_input_is_one_line_exit_2(trained_run, tmp_path, capsys):
    np.save(tmp_path / "f.npy", np.zeros((2, 5), np.float32))
    for args in (["eval", str(trained_run), "--tokens", str(tmp_path / "f.npy")],
                 ["generate", str(trained_run), "--prompt-ids", "1,999"],
                 ["generate", str(tmp_path), "--prompt-ids", "1"]):
        out = _cli_here(capsys, *args)
        assert out.returncode == 2, (args, out.stderr[-2000:])
        errors = [l for l in out.stderr.splitlines() if l.startswith("jaxinfra: error:")]
        assert len(errors) == 1 and "Traceback" not in out.stderr and out.stdout == ""


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    errors = [l for l in out.stderr.splitlines() if l.startswith("jaxinfra: error:")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr and out.stdout == "", out.stderr
    return errors[0]


def test_cli_eval_cuts_a_1d_token_file_into_rows(trained_run, tmp_path):
    flat = np.random.default_rng(2).integers(0, 256, 3 * 33 + 5).astype(np.int32)  # the run's seq_len is 32
    np.save(tmp_path / "flat.npy", flat)
    cfg, params = load_model(trained_run)
    for flags, row in (([], 33), (["--seq-len", "16"], 17)):
        out = _cli("eval", str(trained_run), "--tokens", str(tmp_path / "flat.npy"), *flags)
        assert out.returncode == 0, out.stderr[-2000:]
        n = len(flat) // row
        result = json.loads(out.stdout)
        assert result["tokens"] == n * (row - 1)
        loss, _ = score(cfg, params, flat[:n * row].reshape(n, row))
        np.testing.assert_allclose(result["eval_loss"], loss, rtol=1e-5)
        notes = [l for l in out.stderr.splitlines() if l.startswith("jaxinfra eval:")]
        assert notes == [f"jaxinfra eval: {tmp_path / 'flat.npy'}: {n} rows of {row} ids (seq_len {row - 1} + 1); "
                         f"dropped the last {len(flat) - n * row} ids"]


def test_cli_eval_bad_token_files_are_one_line_exit_2(trained_run, tmp_path, capsys):
    for name, arr in (("float.npy", np.zeros(100, np.float32)), ("short.npy", np.zeros(32, np.int32)),
                      ("cube.npy", np.zeros((2, 2, 2), np.int32)), ("rows.npy", np.zeros((2, 5), np.int32))):
        np.save(tmp_path / name, arr)
    for args, match in ((["--tokens", str(tmp_path / "float.npy")], "integer token ids"),
                        (["--tokens", str(tmp_path / "short.npy")], "at least seq_len + 1 = 33 ids"),
                        (["--tokens", str(tmp_path / "cube.npy")], "1-D array of ids or a 2-D array"),
                        (["--tokens", str(tmp_path / "rows.npy"), "--seq-len", "4"], "--seq-len applies to 1-D"),
                        (["--tokens", str(tmp_path / "short.npy"), "--seq-len", "0"], "--seq-len=0 is invalid")):
        assert match in _one_error_line(_cli_here(capsys, "eval", str(trained_run), *args)), args


def test_expert_and_tensor_parallel_moe_decode_equals_unsharded(moe):
    """MLA + MoE with experts split over `expert` (dropless exchange) and heads over `tensor`."""
    cfg, params, gen = moe
    sharded = Generator(load_config("tiny", [*MOE, "mesh.data=1", "mesh.expert=2", "mesh.tensor=2"]), params)
    assert sharded.mesh.shape["expert"] == 2 and sharded.mesh.shape["tensor"] == 2
    prompts = PROMPTS + PROMPTS[::-1]
    assert sharded.generate(prompts, max_new_tokens=16).tokens == gen.generate(prompts, max_new_tokens=16).tokens


def test_load_model_reads_a_params_only_checkpoint(tmp_path):
    """The HF importer's layout: config.yaml + checkpoints/<step> whose `state` item holds
    {"params": ...} only (no optimizer state, no data or meta items)."""
    import orbax.checkpoint as ocp

    cfg, params = make(GQA, seed=5)
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    manager = ocp.CheckpointManager((tmp_path / "checkpoints").absolute(), item_names=("state",))
    manager.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params})))
    manager.wait_until_finished()
    manager.close()
    for path in (tmp_path, tmp_path / "checkpoints" / "7"):
        loaded_cfg, loaded = load_model(path)
        assert loaded_cfg.model == cfg.model
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), loaded, params))


def test_text_codec_byte_level_and_tokenizer_json(tmp_path):
    from jaxinfra.infer import text_codec

    encode, decode = text_codec(load_config("tiny"))
    assert encode("hé") == [104, 195, 169] and decode(encode("hé")) == "hé"
    with pytest.raises(InferenceError, match="prompt-ids"):
        text_codec(load_config("tiny", ["data.source=synthetic"]))
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox", "the lazy dog"], tokenizers.trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = load_config("tiny", [f"data.tokenizer={tmp_path / 'tokenizer.json'}", "model.vocab_size=512"])
    # A relative data.tokenizer is also looked up in the run directory.
    rel = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="tokenizer.json"))
    for c in (cfg, rel):
        encode, decode = text_codec(c, tmp_path)
        ids = encode("the quick dog")
        assert ids == tok.encode("the quick dog", add_special_tokens=False).ids and decode(ids) == "the quick dog"
