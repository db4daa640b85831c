"""Tests for the train step, state creation under a mesh, schedules, the decay mask and
one short end-to-end run.

Parity is the backbone: gradient accumulation and every mesh layout must reproduce the
1-device, 1-microbatch run in float32 (relative 1e-5).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compiles import assert_no_recompile, compile_log
from parity import PARAM_ATOL, assert_series_close, assert_trees_close, parity_config, run_steps, series

from jaxinfra.config import Config, OptimizerConfig, ScheduleConfig, load_config
from jaxinfra.optim import decay_mask, make_optimizer, make_schedule
from jaxinfra.state import init_params
from models import ModelConfig

MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp_dim=64, tie_embeddings=True, param_dtype="float32", dtype="float32")
# eps: Adam's step lr * g / (|g| + eps) has slope lr / eps for gradient elements much smaller
# than eps. A few elements here are ~1e-8 (wo, w_down) or ~1e-6 (tied-embedding rows whose
# output-path terms nearly cancel), and their float32 summation-order noise (different for
# accumulation and for each mesh) is amplified by that slope: with eps=1e-8 one wo element
# differed by 1.7e-4 after a single step. eps=1e-5 bounds the slope at 1e3.
OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad_norm=1.0, eps=1e-5)
SCHED = ScheduleConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.1)  # lr > 0 from the first step
TOTAL_STEPS = 10
BATCH, SEQ, N_STEPS = 8, 16, 3


def _batches():
    """N_STEPS packed batches. Rows 4..7 are mostly padding, so the two microbatches of
    grad_accum_steps=2 hold very different token counts (a mean of per-microbatch means
    would differ from the large-batch mean)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(N_STEPS):
        seg = np.zeros((BATCH, SEQ), np.int32)
        pos = np.zeros((BATCH, SEQ), np.int32)
        for r in range(BATCH):
            if r < 4:
                cut = int(rng.integers(3, SEQ - 3))
                seg[r, :cut], seg[r, cut:] = 1, 2
                pos[r, :cut], pos[r, cut:] = np.arange(cut), np.arange(SEQ - cut)
            else:
                n = int(rng.integers(2, 5))
                seg[r, :n], pos[r, :n] = 1, np.arange(n)
        inputs = rng.integers(0, MODEL.vocab_size, size=(BATCH, SEQ)).astype(np.int32)
        targets = rng.integers(0, MODEL.vocab_size, size=(BATCH, SEQ)).astype(np.int32)
        out.append(dict(inputs=inputs, targets=targets, segment_ids=seg, positions=pos))
    return out


def run_layout(mesh: dict, grad_accum_steps=1, devices=None):
    """Build the runtime the way jaxinfra/train.py does and run N_STEPS steps."""
    cfg = parity_config(MODEL, OPT, mesh, batch=BATCH, seq=SEQ, schedule=SCHED, total_steps=TOTAL_STEPS,
                        accum=grad_accum_steps)
    return run_steps(cfg, devices if devices is not None else jax.devices(), _batches())


@pytest.fixture(scope="module")
def single():
    return run_layout({}, devices=jax.devices()[:1])


def test_single_device_run_trains(single):
    losses = series(single, "loss")
    assert np.all(np.isfinite(losses))
    assert abs(losses[0] - math.log(MODEL.vocab_size)) < 0.2  # near-uniform predictions at init
    assert int(single["state"].step) == N_STEPS
    tokens = sum(int((b["segment_ids"] > 0).sum()) for b in _batches()[:1])
    assert float(single["metrics"][0]["tokens"]) == tokens
    # The lr reported for step s is the schedule at s (cosine from the peak, no warmup).
    np.testing.assert_allclose(series(single, "lr"), [float(make_schedule(SCHED, OPT.lr, TOTAL_STEPS)(s))
                                                       for s in range(N_STEPS)], rtol=1e-6)


def test_grad_accumulation_equals_large_batch(single):
    accum = run_layout({}, grad_accum_steps=2, devices=jax.devices()[:1])
    assert_series_close(accum, single, ("loss", "grad_norm", "tokens"), rtol=1e-5)
    assert_trees_close(accum["params"], single["params"], rtol=1e-5, atol=PARAM_ATOL)


@pytest.mark.parametrize("layout", [dict(fsdp=4, tensor=2),
                                    pytest.param(dict(data=8), marks=pytest.mark.slow)],  # data8: test_parallel.py
                         ids=["fsdp4-tensor2", "data8"])
def test_sharded_matches_single_device(single, layout, monkeypatch):
    assert jax.device_count() == 8, "conftest must give 8 fake CPU devices"
    with compile_log(monkeypatch) as compiles:
        run = run_layout(layout)
    # The step's outputs come back with the shardings its inputs have: step 2 reuses step 1's program.
    assert [step for step, name in compiles.compiles if name == "jit(train_step)"] == [1], compiles.compiles
    assert_trees_close(run["initial"], single["initial"], rtol=0, atol=0)
    assert_series_close(run, single, ("loss", "grad_norm"), rtol=1e-5)
    assert_trees_close(run["params"], single["params"], rtol=1e-5, atol=PARAM_ATOL)

    wq = run["state"].params["layers"]["attn"]["wq"][...]
    shard = wq.addressable_shards[0].data
    if "fsdp" in layout:  # [layers, embed/fsdp, heads/tensor, head_dim]
        assert wq.shape == (2, 32, 4, 8)
        assert shard.shape == (2, 32 // 4, 4 // 2, 8)
        assert shard.size < wq.size
    else:  # pure data parallelism: parameters replicated
        assert shard.shape == wq.shape


@pytest.mark.skipif(not os.environ.get("JAX_COMPILATION_CACHE_DIR"), reason="compile cache turned off")
def test_same_runtime_built_again_is_not_recompiled(single):
    """tests/conftest.py's persistent compile cache: a second build_runtime of the `single` config
    (fresh jitted functions) loads every program from the cache instead of compiling it."""
    events = []

    def listen(event, **_):
        events.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        again = run_layout({}, devices=jax.devices()[:1])
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert "/jax/compilation_cache/cache_misses" not in events
    assert events.count("/jax/compilation_cache/cache_hits") >= 2  # init and train_step at least
    np.testing.assert_array_equal(again["losses"], single["losses"])


# ---------------------------------------------------------------- schedules


def _hand_schedule(name, step, *, peak, total, warmup, floor_ratio, decay_fraction):
    floor = peak * floor_ratio
    if step < warmup:
        return peak * step / warmup
    frac = min((step - warmup) / (total - warmup), 1.0)
    if name == "constant":
        return peak
    if name == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))
    if name == "linear":
        return peak + (floor - peak) * frac
    if name == "wsd":
        decay_start = total - round(total * decay_fraction)
        if step <= decay_start:
            return peak
        return peak + (floor - peak) * min((step - decay_start) / (total - decay_start), 1.0)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd", "constant"])
def test_schedule_matches_hand_computation(name):
    peak, total, warmup, ratio, frac = 2e-3, 100, 10, 0.1, 0.2
    sched = make_schedule(ScheduleConfig(name=name, warmup_steps=warmup, min_lr_ratio=ratio, decay_fraction=frac),
                          peak, total)
    steps = np.arange(0, total + 1)
    got = np.array(jax.vmap(sched)(jnp.asarray(steps)))
    want = np.array([_hand_schedule(name, int(s), peak=peak, total=total, warmup=warmup, floor_ratio=ratio,
                                    decay_fraction=frac) for s in steps])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-10)
    assert got[0] == 0.0
    assert got[warmup] == pytest.approx(peak, rel=1e-6)
    assert got.max() == pytest.approx(peak, rel=1e-6)
    if name == "constant":
        assert got[total] == pytest.approx(peak, rel=1e-6)
    else:
        assert got[total] == pytest.approx(peak * ratio, rel=1e-5)
    if name == "wsd":  # at the peak until the last decay_fraction of steps, then strictly lower
        assert np.allclose(got[warmup:81], peak, rtol=1e-6)
        assert np.all(np.diff(got[80:]) < 0)


def test_schedule_without_warmup_starts_at_peak():
    sched = make_schedule(ScheduleConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.0), 1.0, 10)
    assert float(sched(0)) == pytest.approx(1.0)
    assert float(sched(10)) == pytest.approx(0.0, abs=1e-7)


# ---------------------------------------------------------------- decay mask


def _flat_mask(model_cfg, opt):
    abstract = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    mask = decay_mask(abstract, opt)
    return {tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey)): bool(v)
            for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]}


NORMS = {("final_norm", "scale"), ("layers", "attn_norm", "scale"), ("layers", "mlp_norm", "scale"),
         ("layers", "attn", "q_norm"), ("layers", "attn", "k_norm")}
EMBEDDINGS = {("embed",), ("unembed",)}
BIASES = {("layers", "attn", b) for b in ("bq", "bk", "bv")}  # Qwen2's q/k/v biases: decayed like norms
MATRICES = {("layers", "attn", w) for w in ("wq", "wk", "wv", "wo")} | {
    ("layers", "mlp", w) for w in ("w_gate", "w_up", "w_down")}


@pytest.mark.parametrize("decay_norms, decay_embeddings", [(False, False), (True, False), (False, True),
                                                           (True, True)])
def test_decay_mask(decay_norms, decay_embeddings):
    cfg = dataclasses.replace(MODEL, tie_embeddings=False, qk_norm=True, qkv_bias=True)
    mask = _flat_mask(cfg, OptimizerConfig(decay_norms=decay_norms, decay_embeddings=decay_embeddings))
    assert set(mask) == NORMS | EMBEDDINGS | MATRICES | BIASES
    for key in NORMS | BIASES:
        assert mask[key] is decay_norms, key
    for key in EMBEDDINGS:
        assert mask[key] is decay_embeddings, key
    for key in MATRICES:
        assert mask[key] is True, key


def test_optimizer_applies_weight_decay_only_where_masked():
    """With zero gradients Adam's step is 0, so one update is exactly the decoupled decay
    p <- p * (1 - lr * wd) on masked parameters and nothing elsewhere."""
    cfg = dataclasses.replace(MODEL, tie_embeddings=False)
    lr, wd = 0.1, 0.5
    opt = OptimizerConfig(lr=lr, weight_decay=wd, clip_grad_norm=1.0)
    tx = make_optimizer(opt, optax.constant_schedule(lr))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
                          jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    new = jax.device_get(optax.apply_updates(params, updates))
    old = jax.device_get(params)
    mask = _flat_mask(cfg, opt)
    for path, value in jax.tree_util.tree_flatten_with_path(new)[0]:
        key = tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))
        before = np.asarray(_get(old, key))
        if mask[key]:
            np.testing.assert_allclose(value, before * (1 - lr * wd), rtol=1e-6, err_msg=str(key))
        else:
            np.testing.assert_array_equal(value, before, err_msg=str(key))


def _get(tree, key):
    for k in key:
        tree = tree[k]
    return tree[...]


# ---------------------------------------------------------------- end to end


E2E = ["data.source=synthetic", "model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
       "model.num_kv_heads=2", "model.mlp_dim=64", "train.steps=30", "train.batch_size=8", "train.seq_len=16",
       "schedule.warmup_steps=5", "optimizer.lr=1e-2", "log.progress=false", "log.tensorboard=false", "mesh.data=1"]


def test_train_end_to_end(tmp_path, monkeypatch):
    """30 steps with evaluation at 0, 15 and 30; no step recompiles (tests/compiles.py counts the compiles)."""
    cfg = load_config("tiny", [*E2E, "data.eval_batches=2", "train.eval_every=15", "log.every=5"])
    from jaxinfra.train import train

    with compile_log(monkeypatch) as compiles:
        summary = train(cfg, tmp_path, devices=jax.devices()[:1])
    assert compiles.step == 30
    assert_no_recompile(compiles)

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "loss" in x]
    eval_lines = [x for x in lines if "eval_loss" in x]
    required = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "step_time_s"}
    assert [x["step"] for x in train_lines] == [5, 10, 15, 20, 25, 30]
    for line in train_lines:
        assert required <= set(line), required - set(line)
        for key in required:
            assert isinstance(line[key], (int, float)) and math.isfinite(line[key]), (key, line)
        assert line["tokens_per_s"] > 0 and line["step_time_s"] > 0 and line["mfu"] > 0
        np.testing.assert_allclose(line["tokens_per_s"] * line["step_time_s"], 8 * 16, rtol=1e-6)
    # lr on the step-5 line: the step with state.step=4, inside the 5-step linear warmup.
    assert train_lines[0]["lr"] == pytest.approx(1e-2 * 4 / 5, rel=1e-6)
    # Later lines: cosine from the peak to 0.1 * peak over the remaining 25 steps.
    for line in train_lines[1:]:
        frac = (line["step"] - 1 - 5) / 25
        assert line["lr"] == pytest.approx(1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * frac)), rel=1e-5)
    assert [x["step"] for x in eval_lines] == [0, 15, 30]
    assert all(math.isfinite(x["eval_loss"]) for x in eval_lines)
    assert eval_lines[-1]["eval_loss"] < eval_lines[0]["eval_loss"] - 0.1

    reloaded = load_config(str(tmp_path / "config.yaml"))
    assert isinstance(reloaded, Config)
    assert reloaded == cfg

    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["steps"] == 30
    assert written["final_eval_loss"] == pytest.approx(eval_lines[-1]["eval_loss"])
    assert summary["final_eval_loss"] == pytest.approx(written["final_eval_loss"])


def test_recompile_check_sees_a_batch_of_another_shape(tmp_path, monkeypatch):
    """The check above can fail: step 3 gets half-length sequences, its train step compiles anew, and the
    compile log places it at step 3 (the run is the end-to-end one's program: a persistent-cache hit)."""
    from jaxinfra.train import Trainer, train

    batches = Trainer.batches

    def halved_at_step_3(self, first_step: int = 1):
        for step, batch in enumerate(batches(self, first_step), first_step):
            yield {k: v[:, :8] for k, v in batch.items()} if step == 3 else batch

    monkeypatch.setattr(Trainer, "batches", halved_at_step_3)
    cfg = load_config("tiny", [*E2E, "data.eval_batches=0", "checkpoint.enabled=false", "log.every=30"])
    with compile_log(monkeypatch) as compiles:
        train(cfg, tmp_path, devices=jax.devices()[:1])
    assert [step for step, name in compiles.compiles if name == "jit(train_step)"] == [0, 3]
    with pytest.raises(AssertionError, match=r"train_step compiled at steps \[0, 3\]"):
        assert_no_recompile(compiles)


# ---------------------------------------------------------------- chunked loss


def test_chunked_loss_matches_whole_sequence(single):
    """model.loss_chunk_size: logits and cross-entropy per sequence chunk (rematerialised in the
    backward) give the whole-sequence run's losses, gradients and parameters."""
    cfg = parity_config(dataclasses.replace(MODEL, loss_chunk_size=4), OPT, {}, batch=BATCH, seq=SEQ,
                        schedule=SCHED, total_steps=TOTAL_STEPS)
    chunked = run_steps(cfg, jax.devices()[:1], _batches())
    assert_series_close(chunked, single, ("loss", "grad_norm", "tokens"), rtol=1e-5)
    assert_trees_close(chunked["params"], single["params"], rtol=1e-5, atol=PARAM_ATOL)


def test_chunked_sums_hold_one_chunk_of_logits():
    """The backward of a chunked loss keeps no [B, T, vocab] buffer: XLA's temporary memory for
    the gradient falls by about the logits' size (here 4 x 256 x 2048 float32 = 8 MiB)."""
    from jaxinfra.loss import chunked_sums, cross_entropy_sums

    b, t, d, v = 4, 256, 32, 2048
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, v)) * 0.1, jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(rng.random((b, t)) < 0.9)

    def loss(w, h, chunk):
        sums = chunked_sums(lambda h, y, m: cross_entropy_sums(h @ w, y, m, 1e-4), chunk, h, targets, mask)
        return sums["loss_sum"] / sums["tokens"]

    grads, temps = {}, {}
    for chunk in (0, 32):
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
        temps[chunk] = fn.lower(w, h, chunk).compile().memory_analysis().temp_size_in_bytes
        grads[chunk] = jax.device_get(fn(w, h, chunk))
    np.testing.assert_allclose(grads[32][0], grads[0][0], rtol=1e-6)
    for got, want in zip(grads[32][1], grads[0][1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    logits_bytes = b * t * v * 4
    assert temps[0] >= logits_bytes, temps
    assert temps[32] < temps[0] - 0.75 * logits_bytes, temps
