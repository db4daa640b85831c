"""Supervised fine-tuning (jaxinfra/sft/): the loss mask from a chat batch's role codes, checked
against a whole-sequence cross-entropy written out here, in the train step (gradient accumulation
included) and the eval step; masked targets contribute exactly nothing; the metrics; the config."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx
from parity import PARAM_ATOL, packed_batches, parity_config

from jaxinfra import cli
from jaxinfra.config import ConfigError, OptimizerConfig, load_config
from jaxinfra.config_sections import SftConfig
from jaxinfra.data.chat import CHATML, load_chat_template
from jaxinfra.data.encode import make_encoder
from jaxinfra.hf.exporter import export_hf
from jaxinfra.infer import Generator, load_model
from jaxinfra.infer.chat import end_of_turn_id, reply_text
from jaxinfra.optim import global_norm
from jaxinfra.runtime import build_runtime
from jaxinfra.sft.extension import Sft, for_config
from jaxinfra.sft.tasks import addition_chat, answer, capitals_chat, exact_match, held_out_rate, prompt, write_jsonl
from jaxinfra.state import model_state
from jaxinfra.step import make_eval_step
from jaxinfra.train import train
from models import ModelConfig

V, BATCH, SEQ = 64, 4, 16
MODEL = ModelConfig(vocab_size=V, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    loss_chunk_size=8)  # the mask is cut into loss chunks like the targets
LLAMA3 = pathlib.Path(__file__).parent / "fixtures" / "chat" / "llama3"
OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad_norm=None, eps=1e-5)  # eps: see tests/test_step.py


def chat_batch(seed: int = 1) -> dict[str, np.ndarray]:
    """Two packed conversations per row: the second half of the first is an assistant turn (code 1),
    of the second its last assistant turn (code 2); rows hold very different trained-token counts
    (row 3: none), so a mean of per-microbatch means would differ from the global mean."""
    batch = dict(packed_batches(BATCH, SEQ, V, 1, seed=seed)[0])
    seg = batch["segment_ids"]
    codes = np.zeros((BATCH, SEQ), np.int32)
    truncated = np.zeros((BATCH, SEQ), np.int32)
    for r in range(BATCH - 1):
        for s, code in ((1, 1), (2, 2)):
            idx = np.flatnonzero(seg[r] == s)
            codes[r, idx[len(idx) // (2 + r):]] = code
    truncated[0, 0] = truncated[2, np.flatnonzero(seg[2] == 2)[0]] = 1
    return {**batch, "assistant": codes, "truncated": truncated}


def reference_loss(graphdef, params, batch: dict, mask: np.ndarray) -> jax.Array:
    """Mean next-token cross-entropy over `mask`: whole-sequence logits, optax's cross-entropy, no hooks."""
    model = nnx.merge(graphdef, params)
    h, _ = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(model.logits(h).astype(jnp.float32), batch["targets"])
    return jnp.sum(jnp.where(mask, ce, 0.0)) / mask.sum()


def _runtime(train_on: str, accum: int = 1):
    cfg = parity_config(MODEL, OPT, {}, batch=BATCH, seq=SEQ, accum=accum)
    return build_runtime(cfg, jax.devices()[:1], extensions=[Sft(train_on)])


def _step(rt, batch: dict) -> tuple[dict, dict]:
    state, metrics = rt.train_step(rt.init_state(), rt.to_global(batch))
    return jax.device_get(state.params), jax.device_get(metrics)


@pytest.fixture(scope="module")
def runs():
    return {"assistant": _runtime("assistant"), "all": _runtime("all")}


def test_sft_step_matches_the_masked_cross_entropy(runs):
    rt, batch = runs["assistant"], chat_batch()
    mask = (batch["assistant"] > 0) & (batch["segment_ids"] > 0)
    before = jax.device_get(rt.init_state().params)
    # jitted: one program instead of the reference compiled op by op (the cold-cache cost)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: reference_loss(rt.graphdef, p, batch, mask)))(before)
    params, metrics = _step(rt, batch)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(float(jax.jit(global_norm)(grads)), rel=1e-5)
    assert float(metrics["trained_tokens"]) == float(metrics["tokens"]) == mask.sum()
    assert float(metrics["truncated_conversations"]) == 2
    @jax.jit
    def apply(grads, opt_state, before):
        return optax.apply_updates(before, rt.tx.update(grads, opt_state, before)[0])

    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(apply(grads, rt.init_state().opt_state, before)),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=PARAM_ATOL)


def test_masked_targets_contribute_exactly_nothing(runs):
    """A prompt token's target changed: nothing moves under train_on=assistant (bit for bit), the
    loss moves under train_on=all."""
    batch = chat_batch()
    prompt = (batch["assistant"] == 0) & (batch["segment_ids"] > 0)
    changed = {**batch, "targets": np.where(prompt, (batch["targets"] + 1) % V, batch["targets"])}
    (p0, m0), (p1, m1) = _step(runs["assistant"], batch), _step(runs["assistant"], changed)
    assert float(m0["loss"]) == float(m1["loss"]) and float(m0["grad_norm"]) == float(m1["grad_norm"])
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (_, a0), (_, a1) = _step(runs["all"], batch), _step(runs["all"], changed)
    assert float(a0["loss"]) != float(a1["loss"])
    assert float(a0["trained_tokens"]) == (batch["segment_ids"] > 0).sum()


def test_gradient_accumulation_gives_the_global_per_trained_token_mean(runs):
    batch = chat_batch()
    p1, m1 = _step(runs["assistant"], batch)
    p2, m2 = _step(_runtime("assistant", accum=2), batch)
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    assert float(m2["trained_tokens"]) == float(m1["trained_tokens"])
    assert float(m2["truncated_conversations"]) == 2
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=PARAM_ATOL)


def test_eval_masks_like_training(runs):
    rt, batch = runs["assistant"], chat_batch()
    variables = model_state(rt.init_state())
    ce, tokens = rt.eval_sums(variables, [batch])
    mask = (batch["assistant"] > 0) & (batch["segment_ids"] > 0)
    assert tokens == mask.sum()
    want = jax.jit(lambda v: reference_loss(rt.graphdef, v, batch, mask))(jax.device_get(variables))
    assert ce / tokens == pytest.approx(float(want), rel=1e-5)
    last = jax.jit(make_eval_step(rt.graphdef, MODEL, extensions=[Sft("last_assistant")]))
    assert float(last(variables, batch)["tokens"]) == ((batch["assistant"] == 2) & (batch["segment_ids"] > 0)).sum()


def test_a_few_sft_steps_reduce_the_masked_loss(runs):
    rt, batch = runs["assistant"], chat_batch(seed=3)
    state, losses = rt.init_state(), []
    for _ in range(6):
        state, metrics = rt.train_step(state, rt.to_global(batch))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.8 * losses[0]


def test_extension_is_on_exactly_for_chat_data():
    tiny = load_config("tiny")
    chat = dataclasses.replace(tiny, data=dataclasses.replace(tiny.data, source="chat"),
                               sft=SftConfig(train_on="last_assistant"))
    assert for_config(chat).train_on == "last_assistant"
    assert for_config(tiny) is None


def test_bad_sft_config_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"sft.train_on: 'prompt' is not allowed; choose one of"):
        load_config("tiny", ["sft.train_on=prompt"])
    with pytest.raises(ConfigError, match=r"unknown key 'sft.trainon'"):
        load_config("tiny", ["sft.trainon=all"])
    assert cli.main(["train", "tiny", "--run-dir", str(tmp_path / "run"), "sft.train_on=prompt"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sft.train_on" in err
    with pytest.raises(ConfigError, match=r"data.paths=\(\) is invalid: must be at least one file.*'chat'"):
        load_config("tiny-chat")  # the preset names no bundled data


# ---------------------------------------------------------------- the user path: restore, generate --chat, export

TINY = ["model.vocab_size=384", "model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_dim=64",
        "train.batch_size=4", "train.seq_len=128", "train.steps=2", "data.eval_batches=1", "train.eval_every=0",
        "log.progress=false", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A 2-step tiny pre-training run, then 2 SFT steps restored from it (tiny-chat preset, lr ~0 so the
    params stay the restored ones)."""
    root = tmp_path_factory.mktemp("sft")
    train(load_config("tiny", TINY), root / "pre", devices=jax.devices()[:1])
    rows, _ = addition_chat(200, seed=0, held_out=4)
    path = write_jsonl(rows, root / "chat.jsonl")
    cfg = load_config("tiny-chat", [*TINY, f"data.paths={path}", "optimizer.lr=1e-12", "schedule.warmup_steps=0",
                                    "checkpoint.restore=params"])
    summary = train(cfg, root / "sft", devices=jax.devices()[:1], restore_from=root / "pre", extensions=[Sft()])
    return root, summary


def test_sft_run_starts_from_the_restored_params_and_logs_its_metrics(sft_run):
    root, summary = sft_run
    (_, pre), (_, sft) = load_model(root / "pre"), load_model(root / "sft")
    for a, b in zip(jax.tree.leaves(pre), jax.tree.leaves(sft), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-9)
    lines = [json.loads(x) for x in (root / "sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert steps and all(x["trained_tokens"] > 0 and x["truncated_conversations"] == 0 for x in steps)
    assert any("eval_loss" in x for x in lines)


def test_generate_chat_prints_the_reply_to_the_rendered_user_turn(sft_run, capsys):
    root, _ = sft_run
    argv = ["generate", str(root / "sft"), "--chat", "--prompt", "What is 1 plus 2?", "--max-new-tokens", "12"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    cfg, params = load_model(root / "sft")
    rendered = "<|im_start|>user\nWhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n"  # ChatML, by hand
    ids = Generator(cfg, params).generate([list(rendered.encode())], max_new_tokens=12).tokens[0]
    text = bytes(ids).decode("utf-8", errors="replace")
    assert printed == text.split("<|im_end|>")[0] + "\n"
    assert cli.main(["generate", str(root / "pre"), "--chat", "--prompt", "hi"]) == cli.EXIT_BAD_INPUT
    assert "data.source=chat" in capsys.readouterr().err
    assert cli.main(["generate", str(root / "sft"), "--chat", "--prompt-ids", "1,2"]) == cli.EXIT_BAD_INPUT
    assert cli.main(["generate", str(root / "sft"), "--system", "Be brief", "--prompt", "hi"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--prompt TEXT" in err[0] and "--system needs --chat" in err[1]


def test_a_stop_sequence_ends_a_row_inside_the_decode_loop(sft_run):
    root, _ = sft_run
    cfg, params = load_model(root / "sft")
    gen = Generator(cfg, params)
    prompts = [list(b"Write abc in capitals"), list(b"hello")]
    plain = gen.generate(prompts, max_new_tokens=12)
    sequence = tuple(plain.tokens[0][4:6])
    stopped = gen.generate(prompts, max_new_tokens=12, stop_sequence=sequence)
    for full, got in zip(plain.tokens, stopped.tokens, strict=True):
        ends = [j + 1 for j in range(1, len(full)) if tuple(full[j - 1:j + 1]) == sequence]
        assert got == (full[:ends[0]] if ends else full)
    alone = gen.generate(prompts[:1], max_new_tokens=12, stop_sequence=sequence)
    assert alone.tokens[0] == stopped.tokens[0] and alone.decode_steps == len(alone.tokens[0]) - 1 <= 5


def test_end_of_turn_is_one_stop_id_with_a_tokenizer_and_cut_from_the_text_byte_level():
    template = load_chat_template("tokenizer", str(LLAMA3 / "tokenizer.json"))
    encoder = make_encoder(str(LLAMA3 / "tokenizer.json"))
    eot = end_of_turn_id(template, encoder)
    assert eot is not None and encoder.decode([eot]) == "<|eot_id|>"
    assert reply_text(template, encoder, [*encoder.encode(["Hello"])[0][:-1], eot]) == "Hello"
    chatml, byte = load_chat_template("chatml", None), make_encoder(None)
    assert end_of_turn_id(chatml, byte) is None
    assert reply_text(chatml, byte, list(b"82<|im_end|>\n<|im_start|>")) == "82"


def test_hf_export_carries_the_chat_template_and_tokenizer_files(sft_run, tmp_path):
    root, _ = sft_run
    report = export_hf(root / "sft", tmp_path / "bytes")
    assert report["tokenizer_files"] == ["chat_template.jinja"]
    assert (tmp_path / "bytes" / "chat_template.jinja").read_text() == CHATML
    assert not (tmp_path / "bytes" / "tokenizer.json").exists()
    # The same run as if it had trained with the Llama-3 tokenizer and ChatML: both files, ChatML set in.
    run = tmp_path / "run"
    shutil.copytree(root / "sft", run, ignore=shutil.ignore_patterns("*.lock"))
    tree = yaml.safe_load((run / "config.yaml").read_text())
    tree["data"]["tokenizer"] = str(LLAMA3 / "tokenizer.json")
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    export_hf(run, tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (LLAMA3 / "tokenizer.json").read_bytes()
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    stored = json.loads((LLAMA3 / "tokenizer_config.json").read_text())
    assert config == {**stored, "chat_template": CHATML}
    assert cli.main(["hf", "export", str(run), str(tmp_path / "cli")]) == 0


def test_chat_data_without_the_sft_extension_is_refused(sft_run):
    root, _ = sft_run
    cfg = load_config(str(root / "sft" / "config.yaml"))
    assert isinstance(for_config(cfg), Sft)
    with pytest.raises(ConfigError, match=r"^data: the config turns on 'sft' but no step extension named 'sft'"):
        build_runtime(cfg, jax.devices()[:1], extensions=[])


# ---------------------------------------------------------------- acceptance: the synthetic chat task


def test_task_held_out_prompts_are_disjoint_from_training():
    for make in (capitals_chat, addition_chat):
        rows, held = make(3000, seed=1)
        assert len(rows) == 3000 and len(held) == len({prompt(r) for r in held}) == 100
        assert not {prompt(r) for r in held} & {prompt(r) for r in rows}
    rows, held = capitals_chat(10, seed=1)
    assert all(answer(r) == prompt(r).split()[1].upper() for r in rows + held)
    assert exact_match([" XY", "z"], ["XY", "Z"]) == 0.5


@pytest.mark.slow  # ~17 min on 2 shared CPU cores; the default run covers the mechanics (mask, restore, generate --chat)
def test_sft_learns_the_synthetic_chat_task(tmp_path):
    """tiny pre-trained on its default data, then SFT (tiny-chat preset) on capitals_chat from it:
    greedy `generate --chat` is exactly right on >= 90% of 100 held-out prompts; train_on=all reported."""
    t0 = time.perf_counter()
    one = jax.devices()[:1]  # as `jaxinfra train` on this 1-CPU-device machine (the tests fake 8 devices)
    train(load_config("tiny", ["log.progress=false"]), tmp_path / "pre", devices=one)
    times, rates = {"pretrain_s": time.perf_counter() - t0}, {}
    rows, held = capitals_chat(8000, seed=0)
    path = write_jsonl(rows, tmp_path / "train.jsonl")
    for train_on in ("assistant", "all"):
        cfg = load_config("tiny-chat", [f"data.paths={path}", f"sft.train_on={train_on}", "checkpoint.restore=params",
                                        "log.progress=false"])
        t0 = time.perf_counter()
        train(cfg, tmp_path / train_on, devices=one, restore_from=tmp_path / "pre", extensions=[Sft(train_on)])
        times[f"sft_{train_on}_s"] = time.perf_counter() - t0
        rates[train_on], _ = held_out_rate(tmp_path / train_on, held, max_new_tokens=24)
    print(f"held-out exact match {rates}, times {({k: round(v) for k, v in times.items()})}")
    assert rates["assistant"] >= 0.9


def test_plan_compile_lowers_the_sft_step_with_the_chat_batch_fields(sft_run, monkeypatch):
    """jaxinfra plan --compile lowers the train step from abstract batches: the SFT extension's
    batch_specs give the `assistant` and `truncated` fields its loss mask and metrics read."""
    import jaxinfra.runtime
    from jaxinfra.plan.compiled import analyse

    root, _ = sft_run
    monkeypatch.setattr(jaxinfra.runtime, "extensions_for", lambda cfg: [Sft()])  # as the entry point would
    figures = analyse(load_config(str(root / "sft" / "config.yaml")), jax.devices()[:1])
    assert figures["flops"] > 0 and figures["total_bytes"] > 0
