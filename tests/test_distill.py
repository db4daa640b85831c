"""Distillation (jaxinfra/distill/): the loss against numpy, alpha = 0 against plain training, the
teacher outside the gradient and the optimizer, sharded parity of online distillation, offline
logits (exact resume after SIGTERM, mismatches refused) and bad input in one line.

One teacher for the whole module: a wider MHA model (the student is GQA) with random weights of a
large init scale (peaked, non-uniform predictions), saved as an `hf import` output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from parity import assert_matches, packed_batches, parity_config, run_steps

from jaxinfra.checkpoint import CheckpointError, _saved_shapes
from jaxinfra.cli import main
from jaxinfra.config import Config, OptimizerConfig, ScheduleConfig, load_config
from jaxinfra.distill.config import DistillConfig
from jaxinfra.distill.extension import Distillation
from jaxinfra.distill.logits import LogitsDir, LogitsError
from jaxinfra.distill.loss import mix, scheduled, soft_loss_sum, teacher_soft_loss_sum, top_k_soft_loss_sum
from jaxinfra.distill.save import save_logits
from jaxinfra.extensions import HostContext
from jaxinfra.loss import chunked_sums, cross_entropy_sums
from jaxinfra.state import abstract_state, init_params
from jaxinfra.step import forward_sums
from jaxinfra.train import EXIT_PREEMPTED, Trainer
from models import ModelConfig

V, BATCH, SEQ, STEPS = 64, 8, 16, 3
STUDENT = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                      tie_embeddings=True, loss_chunk_size=4)
TEACHER = ModelConfig(vocab_size=V, d_model=48, num_layers=2, num_heads=4, head_dim=12, mlp_dim=96,
                      tie_embeddings=False, init_std=0.3)
OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad_norm=1.0, eps=1e-5)  # eps: see tests/test_step.py
SCHED = ScheduleConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.1)
# float32 teacher: bfloat16 matmuls round differently per layout (tested here: the mechanism's parity).
DISTILL = dict(alpha=0.7, temperature=2.0, teacher_dtype="float32")


def teacher_params():
    return jax.jit(lambda key: init_params(TEACHER, key))(jax.random.key(7))  # one program, not op by op


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    from jaxinfra.checkpoint import save_params_only

    out = tmp_path_factory.mktemp("teacher")
    save_params_only(out, Config(model=TEACHER), teacher_params(), {"params_only": True, "step": 0})
    return str(out)


def start(rt, eval_batches: list, meta: dict) -> list[str]:
    """The run's distillation extension started as jaxinfra/train.py starts it; returns its notes."""
    return rt.extension("distill").start(HostContext(rt, eval_batches, 0, rt.cfg.train.batch_size), meta)


def load_teacher(rt) -> None:
    start(rt, [], {})


def distill_config(teacher: str, mesh: dict, **distill) -> Config:
    cfg = parity_config(STUDENT, OPT, mesh, batch=BATCH, seq=SEQ, schedule=SCHED, total_steps=10)
    return dataclasses.replace(cfg, distill=DistillConfig(teacher=teacher, **{**DISTILL, **distill}))


# ---------------------------------------------------------------- the loss against numpy


def _np_log_softmax(x: np.ndarray, temp: float) -> np.ndarray:
    x = x.astype(np.float64) / temp
    x = x - np.max(x, axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def _np_kl(s: np.ndarray, t: np.ndarray, temp: float) -> np.ndarray:
    log_p, log_q = _np_log_softmax(t, temp), _np_log_softmax(s, temp)
    return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


def _logits(seed: int, shape=(3, 5, V), scale=3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# One compiled program each, whatever the temperature (a traced argument).
SOFT, SOFT_GRAD = jax.jit(soft_loss_sum), jax.jit(jax.grad(soft_loss_sum))
TOP_K_SOFT, TEACHER_SOFT = jax.jit(top_k_soft_loss_sum), jax.jit(teacher_soft_loss_sum, static_argnums=4)


def test_kl_of_a_distribution_with_itself_is_zero():
    x, mask = _logits(0), np.ones((3, 5), bool)
    ids = np.argsort(-x, axis=-1)[..., :7]
    for temp in (0.5, 1.0, 4.0):
        assert float(SOFT(x, x, mask, temp)) == 0.0
        assert float(TOP_K_SOFT(x, ids, np.take_along_axis(x, ids, -1), mask, temp)) == 0.0


@pytest.mark.parametrize("temp", [1.0, 2.0, 5.0])
def test_soft_loss_is_t_squared_kl_with_gradient_t_times_q_minus_p(temp):
    """T^2 * KL against float64 numpy; its gradient T * (q_T - p_T) keeps the hard loss's scale."""
    s, t = _logits(1), _logits(2)
    mask = np.random.default_rng(3).random((3, 5)) < 0.7
    want = temp ** 2 * np.sum(_np_kl(s, t, temp) * mask)
    np.testing.assert_allclose(float(SOFT(s, t, mask, temp)), want, rtol=1e-5)
    q, p = np.exp(_np_log_softmax(s, temp)), np.exp(_np_log_softmax(t, temp))
    np.testing.assert_allclose(SOFT_GRAD(s, t, mask, temp), temp * (q - p) * mask[..., None], atol=1e-6)


def test_top_k_over_the_whole_vocabulary_is_the_full_loss():
    s, t, mask = _logits(4), _logits(5), np.ones((3, 5), bool)
    full = float(TEACHER_SOFT(s, t, mask, 2.0, 0))
    np.testing.assert_allclose(float(TEACHER_SOFT(s, t, mask, 2.0, V)), full, rtol=1e-6)
    # k < V: the KL of both distributions renormalised over the teacher's top k (numpy reference).
    ids = np.argsort(-t, axis=-1)[..., :8]
    sk, tk = (np.take_along_axis(x, ids, -1) for x in (s, t))
    got = float(TEACHER_SOFT(s, t, mask, 2.0, 8))
    np.testing.assert_allclose(got, 4.0 * np.sum(_np_kl(sk, tk, 2.0)), rtol=1e-5)
    assert abs(got - full) > 1e-3 * full


def test_schedules_move_alpha_and_temperature():
    assert float(scheduled(0.9, None, "cosine", 50, 100)) == pytest.approx(0.9)
    assert float(scheduled(1.0, 0.0, "linear", 25, 100)) == pytest.approx(0.75)
    assert float(scheduled(1.0, 0.0, "cosine", 25, 100)) == pytest.approx(0.5 * (1 + np.cos(np.pi / 4)), rel=1e-6)
    assert float(scheduled(4.0, 1.0, "linear", 100, 100)) == pytest.approx(1.0)
    assert float(scheduled(4.0, 1.0, "linear", 150, 100)) == pytest.approx(1.0)


def _np_loss_and_grads(w, h, ht, wt, targets, mask, alpha: float, temp: float):
    """Whole-sequence float64 reference: ((1 - alpha) * CE + alpha * T^2 KL) / tokens and its
    gradients by hand (dCE/ds = softmax(s) - onehot, dsoft/ds = T (q_T - p_T); teacher constant)."""
    w, h, ht, wt = (np.asarray(x, np.float64) for x in (w, h, ht, wt))
    s, te, m = h @ w, ht @ wt, np.asarray(mask, np.float64)
    log_q1, log_qt, log_pt = _np_log_softmax(s, 1.0), _np_log_softmax(s, temp), _np_log_softmax(te, temp)
    ce = -np.take_along_axis(log_q1, np.asarray(targets)[..., None], -1)[..., 0]
    soft = temp ** 2 * np.sum(np.exp(log_pt) * (log_pt - log_qt), axis=-1)
    tokens = m.sum()
    loss = np.sum(((1 - alpha) * ce + alpha * soft) * m) / tokens
    onehot = np.eye(s.shape[-1])[np.asarray(targets)]
    g = ((1 - alpha) * (np.exp(log_q1) - onehot) + alpha * temp * (np.exp(log_qt) - np.exp(log_pt)))
    g = g * m[..., None] / tokens
    return loss, np.einsum("btd,btv->dv", h, g), g @ w.T


def test_chunked_distillation_loss_is_the_whole_sequence_loss_and_holds_one_chunk_of_each_logits():
    """Student and teacher logits per sequence chunk (rematerialised in the backward): the loss and
    gradients of a whole-sequence float64 reference to float32 rounding, and no [B, T, vocab]
    float32 buffer of either model in the compiled gradient (4 x 256 x 2048 x 4 B = 8 MiB each;
    the unchunked step's figures are in benchmarks/RESULTS.md)."""
    b, t, d, v = 4, 256, 32, 2048
    rng = np.random.default_rng(0)
    h, ht = (rng.standard_normal((b, t, d)).astype(np.float32) for _ in range(2))
    w, wt = ((rng.standard_normal((d, v)) * 0.3).astype(np.float32) for _ in range(2))
    targets, mask = rng.integers(0, v, (b, t)).astype(np.int32), rng.random((b, t)) < 0.9

    def loss(w, h):
        def token_sums(h, ht, y, m):
            s, te = h @ w, jax.lax.stop_gradient(ht @ wt)
            return {**cross_entropy_sums(s, y, m), "soft_sum": soft_loss_sum(s, te, m, 2.0),
                    "teacher_ce_sum": cross_entropy_sums(te, y, m)["ce_sum"]}

        sums = mix(chunked_sums(token_sums, 16, h, ht, targets, mask), 0.5)
        return sums["loss_sum"] / sums["tokens"]

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(w, h).compile()
    got_loss, (got_w, got_h) = jax.device_get(compiled(w, h))
    want_loss, want_w, want_h = _np_loss_and_grads(w, h, ht, wt, targets, mask, 0.5, 2.0)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-7)
    assert compiled.memory_analysis().temp_size_in_bytes < 0.5 * b * t * v * 4


# ---------------------------------------------------------------- the train step


@pytest.fixture(scope="module")
def single(teacher):
    """The 1-device baseline; its teacher is also evaluated on the first training batch."""
    runs = []

    def setup(rt):
        start(rt, packed_batches(BATCH, SEQ, V, 1), {})
        runs.append(rt.extension("distill"))

    result = run_steps(distill_config(teacher, {}), jax.devices()[:1], packed_batches(BATCH, SEQ, V, STEPS),
                       setup=setup)
    return {**result, "distill_run": runs[0]}


def test_alpha_zero_is_exactly_plain_cross_entropy(single, teacher):
    """alpha = 0: the distillation step's losses, gradient norms and parameters are the plain step's,
    bit for bit. Both programs are compiled once per session: alpha is a step input (this run reuses
    `single`'s program) and the plain one is tests/test_step.py's chunked-loss step."""
    batches = packed_batches(BATCH, SEQ, V, STEPS)
    plain = run_steps(parity_config(STUDENT, OPT, {}, batch=BATCH, seq=SEQ, schedule=SCHED, total_steps=10),
                      jax.devices()[:1], batches)
    zero = run_steps(distill_config(teacher, {}, alpha=0.0), jax.devices()[:1], batches, setup=load_teacher)
    assert all(float(m["distill_soft_loss"]) > 0.05 for m in zero["metrics"])  # only alpha removes the teacher
    assert_matches(zero, plain, "alpha=0", rtol=0, param_atol=0, metric_keys=("grad_norm",))


def test_online_distillation_trains_and_keeps_the_teacher_out_of_the_optimizer(single):
    m = single["metrics"]
    for key in ("distill_soft_loss", "distill_hard_loss", "teacher_loss"):
        assert all(np.isfinite(float(x[key])) for x in m), key
    alpha = DISTILL["alpha"]
    mixed = alpha * float(m[0]["distill_soft_loss"]) + (1 - alpha) * float(m[0]["distill_hard_loss"])
    assert float(m[0]["loss"]) == pytest.approx(mixed, rel=1e-6)
    assert float(m[-1]["distill_soft_loss"]) < float(m[0]["distill_soft_loss"])
    assert float(m[0]["teacher_loss"]) == pytest.approx(float(m[-1]["teacher_loss"]), rel=1e-6)  # frozen
    rt = single["rt"]
    plain_opt = abstract_state(STUDENT, rt.tx).opt_state
    assert len(jax.tree.leaves(single["state"].opt_state)) == len(jax.tree.leaves(plain_opt))
    ext = rt.extension("distill")
    used = ext.inputs()[0]
    fresh = jax.tree.leaves(jax.device_get(teacher_params()))
    for got, want in zip(jax.tree.leaves(jax.device_get(used)), fresh, strict=True):
        np.testing.assert_array_equal(got, want)  # unchanged after the steps

    # No gradient reaches the teacher: the soft loss (which alpha does not scale) against its params.
    sums_fn = forward_sums(rt.graphdef, STUDENT, [ext])
    params, batch = jax.device_put(single["initial"]), {k: jnp.asarray(v) for k, v in
                                                         packed_batches(BATCH, SEQ, V, 1)[0].items()}
    soft = lambda tp: sums_fn((params,), batch, jnp.int32(0), ((tp, ext.knobs),))["soft_sum"]  # noqa: E731
    grads = jax.jit(jax.grad(soft))(used)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))


def test_online_teacher_eval_checkpoint_meta_and_pinned_teacher_step(single, teacher):
    """What the train loop asks of an online run: the teacher's eval loss (here on the first training
    batch: the step's teacher_loss), the checkpoint meta (teacher and step, no params), and on resume
    the checkpoint's teacher step (a step the teacher lacks is refused; another teacher is noted)."""
    run = single["distill_run"]
    assert run.teacher_eval_loss == pytest.approx(float(single["metrics"][0]["teacher_loss"]), rel=1e-6)
    assert run.eval_fields() == {"teacher_eval_loss": run.teacher_eval_loss}
    assert run.checkpoint_meta() == {"teacher": teacher, "teacher_step": 0}
    with pytest.raises(CheckpointError, match="no committed checkpoint 5"):
        start(single["rt"], [], {"distill": {"teacher": teacher, "teacher_step": 5}})
    notes = start(single["rt"], [], {"distill": {"teacher": "/elsewhere", "teacher_step": 5}})
    assert "distilled from /elsewhere (step 5)" in notes[0]


@pytest.mark.parametrize("layout", [pytest.param(dict(fsdp=4, tensor=2), marks=pytest.mark.slow),  # a subset of:
                                    dict(data=2, fsdp=2, tensor=2)], ids=["fsdp4-tensor2", "data2-fsdp2-tensor2"])
def test_online_distillation_sharded_matches_single_device(single, teacher, layout):
    run = run_steps(distill_config(teacher, layout), jax.devices(), packed_batches(BATCH, SEQ, V, STEPS),
                    setup=load_teacher)
    assert_matches(run, single, str(layout), metric_keys=("grad_norm", "distill_soft_loss", "distill_hard_loss",
                                                          "teacher_loss"))
    wq = run["rt"].extension("distill").inputs()[0]["layers"]["attn"]["wq"][...]  # the teacher's, sharded by the same rules
    assert wq.addressable_shards[0].data.size < wq.size


@pytest.mark.slow  # the default run covers sharded online distillation (full vocabulary) and the top-k loss
def test_online_top_k_distillation_sharded_matches_single_device(teacher):
    batches = packed_batches(BATCH, SEQ, V, STEPS)
    one = run_steps(distill_config(teacher, {}, top_k=16), jax.devices()[:1], batches, setup=load_teacher)
    run = run_steps(distill_config(teacher, dict(fsdp=4, tensor=2), top_k=16), jax.devices(), batches,
                    setup=load_teacher)
    assert_matches(run, one, "top_k=16", metric_keys=("grad_norm", "distill_soft_loss", "teacher_loss"))


# ---------------------------------------------------------------- offline logits and the train loop

DATA = ["data.source=synthetic", f"data.synthetic_vocab={V}", f"train.seq_len={SEQ}", f"train.batch_size={BATCH}",
        "train.seed=3", "mesh.data=-1"]
RUN = [*DATA, f"model.vocab_size={V}", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
       "model.num_kv_heads=2", "model.mlp_dim=64", "model.loss_chunk_size=4", "train.eval_every=4",
       "data.eval_batches=1", "log.every=1", "log.progress=false", "log.tensorboard=false", "checkpoint.every=0",
       "distill.alpha=0.5", "distill.temperature=2.0", "distill.top_k=8"]
OFFLINE_STEPS = 8


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def logits_dir(teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("logits") / "logits"
    report = save_logits(teacher, DATA, out, top_k=16, steps=OFFLINE_STEPS, teacher_dtype="float32", progress=False,
                         devices=jax.devices()[:1])
    assert report["steps"] == OFFLINE_STEPS and report["teacher_eval_loss"] > 0
    return out


def _train(run_dir, *extra) -> Trainer:
    cfg = load_config("tiny", [*RUN, f"train.steps={OFFLINE_STEPS}", *extra])
    trainer = Trainer(cfg, run_dir, jax.devices()[:1])
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def offline_reference(logits_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("offline-reference")
    return run_dir, _train(run_dir, f"distill.logits={logits_dir}")


def test_offline_run_logs_distillation_and_teacher_losses(offline_reference, logits_dir):
    run_dir, trainer = offline_reference
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "loss" in x]
    assert all({"distill_soft_loss", "distill_hard_loss", "teacher_loss"} <= set(x) for x in train_lines)
    evals = [x for x in lines if "eval_loss" in x]
    assert evals and all(x["teacher_eval_loss"] == LogitsDir.open(logits_dir).meta["teacher_eval_loss"]
                         for x in evals)
    step_dir = run_dir / "checkpoints" / str(OFFLINE_STEPS)
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    assert meta["distill"]["logits"] == str(logits_dir) and meta["distill"]["logits_teacher"]["step"] == 0
    saved = _saved_shapes(step_dir)  # the student's TrainState alone, none of the teacher's arrays
    want = {k: tuple(v.shape) for k, v in ocp.tree.to_flat_dict(
        abstract_state(trainer.cfg.model, trainer.rt.tx), sep="/").items()}
    assert saved == want


def test_offline_resume_after_sigterm_is_bitwise_exact(offline_reference, logits_dir, tmp_path, monkeypatch):
    ref_dir, ref = offline_reference
    original = Distillation.host_batch

    def sigterm_at_5(self, local, step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # the Trainer's handler: finish the step, checkpoint, exit 75
        return original(self, local, step)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with monkeypatch.context() as m:
            m.setattr(Distillation, "host_batch", sigterm_at_5)
            first = _train(tmp_path, f"distill.logits={logits_dir}")
        assert first.state is not None and json.loads((tmp_path / "summary.json").read_text())["exit_code"] == \
            EXIT_PREEMPTED
        second = _train(tmp_path, f"distill.logits={logits_dir}")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from_step"] == 5
    assert _losses(tmp_path) == _losses(ref_dir)
    for got, want in zip(jax.tree.leaves(jax.device_get(second.state.params)),
                         jax.tree.leaves(jax.device_get(ref.state.params))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("override, named", [("train.seq_len=32", "train.seq_len: 16 -> 32"),
                                             ("train.seed=4", "train.seed: 3 -> 4"),
                                             ("data.source=text model.vocab_size=256", "data.source: synthetic -> text"),
                                             ("train.steps=9", "holds 8 steps")])
def test_logits_of_other_batches_are_refused_in_one_line(logits_dir, tmp_path, capsys, override, named):
    code = main(["train", "tiny", "--run-dir", str(tmp_path / "run"), *RUN, f"train.steps={OFFLINE_STEPS}",
                 f"distill.logits={logits_dir}", *override.split()])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_changed_batch_is_caught_by_its_row_checksum(logits_dir):
    logits = LogitsDir.open(logits_dir)
    batch = {k: np.zeros((BATCH, SEQ), np.int32) for k in ("inputs", "targets", "segment_ids")}
    with pytest.raises(LogitsError, match=r"the batch of step 2 \(row 0\) is not the one"):
        logits.rows(2, 0, BATCH, batch)


def _bad_teacher(tmp_path, teacher, what: str) -> str:
    import shutil

    bad = tmp_path / "bad-teacher"
    shutil.copytree(teacher, bad)
    if what == "config":
        (bad / "config.yaml").write_text("model: [unclosed\n")
    else:  # every array file of the checkpoint truncated
        for f in (bad / "checkpoints").rglob("*"):
            if f.is_file() and "state" in f.parts and f.stat().st_size > 100:
                f.write_bytes(f.read_bytes()[:50])
    return str(bad)


def test_a_teacher_is_a_run_dir_or_one_of_its_step_dirs(teacher):
    from jaxinfra.distill.teacher import resolve_teacher

    run, step = resolve_teacher(teacher, V), resolve_teacher(f"{teacher}/checkpoints/0", V)
    assert run.step is None and step.step == 0 and run.saved_model == step.saved_model == TEACHER


def test_a_teacher_with_damaged_checkpoint_files_is_bad_input(teacher, tmp_path):
    """Caught when the run loads the teacher (after its own state): CheckpointError, exit 2 in the CLI."""
    from jaxinfra.distill.teacher import load_teacher_params, resolve_teacher
    from jaxinfra.exits import bad_input_errors
    from jaxinfra.state import sharding_rules
    from sharding.mesh import MeshConfig, make_mesh

    source = resolve_teacher(_bad_teacher(tmp_path, teacher, "checkpoint"), V)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    with pytest.raises(bad_input_errors(), match="no readable checkpoint under"):
        load_teacher_params(source, "float32", mesh, sharding_rules(Config().parallelism))


@pytest.mark.parametrize("case", ["vocab", "missing", "config", "top_k", "both"])
def test_bad_distillation_input_is_one_line_exit_2(teacher, logits_dir, tmp_path, capsys, case):
    extra = {"vocab": [f"distill.teacher={teacher}", "model.vocab_size=128"],
             "missing": [f"distill.teacher={tmp_path / 'nowhere'}"],
             "config": [f"distill.teacher={_bad_teacher(tmp_path, teacher, 'config') if case == 'config' else ''}"],
             "top_k": [f"distill.teacher={teacher}", f"distill.top_k={V + 1}"],
             "both": [f"distill.teacher={teacher}", f"distill.logits={logits_dir}"]}[case]
    code = main(["train", "tiny", "--run-dir", str(tmp_path / "run"), *RUN, "train.steps=2", *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxinfra: error")]
    assert code == 2 and len(err) == 1, err
    named = {"vocab": "model.vocab_size=128", "missing": "nowhere", "config": "invalid YAML",
"top_k": "distill.top_k=65", "both": "distill.logits"}[case]
    assert named in err[0], err


def test_save_logits_bad_input_is_one_line_exit_2(teacher, tmp_path, capsys):
    for args, named in (([f"--top-k={V + 1}"], "--top-k 65"), (["--data", "model.d_model=8"], "model.d_model=8"),
                        (["--steps=0"], "--steps 0")):
        code = main(["distill", "save-logits", teacher, "--out", str(tmp_path / "out"), "--steps", "2", *args])
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxinfra: error")]
        assert code == 2 and len(err) == 1 and named in err[0], err
    assert main(["distill", "save-logits", str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--steps", "2"]) == 2


def test_an_interrupted_logits_directory_continues_and_a_finished_one_is_kept(tmp_path):
    from jaxinfra.distill.logits import LogitsWriter

    meta = {"train": {"batch_size": 2, "seq_len": 3}, "top_k": 2, "steps": 4, "ids_dtype": "uint16"}
    step = [np.ones((2, 3, 2)), np.ones((2, 3, 2)), np.ones((2, 3)), np.ones(2)]
    first = LogitsWriter(tmp_path / "l", meta, flush_every=1)
    first.write(1, *step)
    first.write(2, *step)  # then the process dies
    again = LogitsWriter(tmp_path / "l", meta)
    assert again.next_step == 3
    with pytest.raises(LogitsError, match="unfinished logits of another"):
        LogitsWriter(tmp_path / "l", {**meta, "top_k": 3})
    with pytest.raises(LogitsError, match="unfinished"):
        LogitsDir.open(tmp_path / "l")
    again.write(3, *step)
    again.write(4, *step)
    again.finish()
    assert LogitsDir.open(tmp_path / "l").steps == 4
    with pytest.raises(LogitsError, match="already holds complete logits"):
        LogitsWriter(tmp_path / "l", meta)
