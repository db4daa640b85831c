"""Mistakes that must never cost a run its work: config changes on resume, poisoned states,
path mistakes, two runs on one directory, duplicated metrics after a resume, and exit
statuses that mean the same in every process.

Each case checks the exit status, the one line the user sees, and what is on disk afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxinfra import cli
from jaxinfra.checkpoint import Checkpointer, CheckpointFitError, abstract_with_shardings, check_fits, restore_params
from jaxinfra.config import ConfigError, load_config
from jaxinfra.exits import EXIT_BAD_INPUT
from jaxinfra.metrics import MetricsLogger
from jaxinfra.rundir import LOCK_NAME, RunDirError, RunDirLock
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_state
from jaxinfra.train import Trainer, train

REPO = pathlib.Path(__file__).resolve().parents[1]
# The same run as tests/test_checkpoint.py's reference, so the compiled programs are shared.
BASE = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=64",
        "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8",
        "train.steps=20", "train.eval_every=0", "log.every=1", "log.progress=false", "log.tensorboard=false",
        "checkpoint.every=5", "mesh.data=1"]
CLI = [*BASE, "mesh.data=-1"]  # the CLI uses all 8 test devices; every refusal here comes before a compile


def cfg(*extra: str):
    return load_config("tiny", [*BASE, *extra])


def snapshot(run_dir: pathlib.Path) -> dict[str, bytes | None]:
    """Every path under the run dir, with file contents: "nothing on disk changed" compares these."""
    return {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(run_dir.rglob("*"))}


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("trained")
    assert train(cfg(), run_dir, jax.devices()[:1])["exit_code"] == 0
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path) -> pathlib.Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


# ------------------------------------------------------------------ a config change on resume


def test_changed_model_shape_is_refused_and_nothing_moves(run_copy, capsys):
    before = snapshot(run_copy)
    status = cli.main(["train", "tiny", "--run-dir", str(run_copy), *CLI, "model.num_layers=3"])
    err = capsys.readouterr().err
    assert status == EXIT_BAD_INPUT
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("jaxinfra: error: checkpoint"), err
    assert "model.num_layers: 2 -> 3" in lines[0] and "nothing was changed" in lines[0]
    assert snapshot(run_copy) == before  # checkpoints, config.yaml and metrics untouched
    # The original command resumes from its last step.
    assert train(cfg(), run_copy, jax.devices()[:1])["resumed_from_step"] == 20


def test_shape_check_without_a_saved_config_names_an_array(trained):
    other = cfg("model.d_model=32")
    rt = build_runtime(other, jax.devices()[:1])
    target = abstract_with_shardings(abstract_state(other.model, rt.tx), rt.state_shardings)
    with pytest.raises(CheckpointFitError, match=r"arrays differ, e\.g\. .*saved \(.*wanted"):
        check_fits(trained / "checkpoints" / "20", target, None)


def test_restore_params_refuses_other_shapes_like_restore_latest(run_copy):
    other = cfg("model.mlp_dim=64")
    rt = build_runtime(other, jax.devices()[:1])
    target = abstract_with_shardings(abstract_state(other.model, rt.tx), rt.state_shardings)
    before = snapshot(run_copy)
    with pytest.raises(CheckpointFitError, match=r"model\.mlp_dim: 128 -> 64"):
        restore_params(run_copy, target.params, config=other.to_dict())
    with pytest.raises(CheckpointFitError, match=r"model\.mlp_dim: 128 -> 64"):
        Checkpointer(run_copy / "checkpoints", other.checkpoint).restore_latest(target, other.to_dict())
    assert snapshot(run_copy) == before


def test_damaged_checkpoint_message_names_the_real_path(run_copy, capsys):
    state_files = sorted((p for p in (run_copy / "checkpoints" / "20" / "state").rglob("*") if p.is_file()),
                         key=lambda p: p.stat().st_size)
    for path in state_files[-3:]:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    rt = build_runtime(cfg(), jax.devices()[:1])
    target = abstract_with_shardings(abstract_state(cfg().model, rt.tx), rt.state_shardings)
    ckpt = Checkpointer(run_copy / "checkpoints", cfg().checkpoint)
    step, *_ = ckpt.restore_latest(target, cfg().to_dict())
    ckpt.close()
    out = capsys.readouterr().out
    assert step == 15
    moved = [line for line in out.splitlines() if "unreadable" in line]
    assert len(moved) == 1
    aside = pathlib.Path(moved[0].split("moved to ")[1].split(",")[0])
    assert aside.is_dir() and aside.name.startswith("20.unreadable-")


# ------------------------------------------------------------------ poisoned states


@pytest.mark.parametrize("override, key", [("optimizer.lr=nan", "optimizer.lr"),
                                           ("optimizer.clip_grad_norm=inf", "optimizer.clip_grad_norm"),
                                           ("log.peak_tflops=-.inf", "log.peak_tflops"),
                                           ("model.rope_theta=.nan", "model.rope_theta")])
def test_non_finite_numbers_are_rejected_anywhere(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}=.* must be finite"):
        load_config("tiny", [override])


def test_step_guard_covers_the_new_params(trained):
    """A poisoned optimizer state: loss and gradients are finite, only the update (new params) is not."""
    rt = build_runtime(cfg(), jax.devices()[:1])
    state = rt.init_state()
    poisoned = dataclasses.replace(state, opt_state=jax.tree.map(lambda x: x * np.nan if x.ndim else x,
                                                                 state.opt_state))
    before = jax.device_get(poisoned.params)
    batch = {k: np.asarray(v) for k, v in next(iter(_synthetic_batches(cfg()))).items()}
    new_state, metrics = rt.train_step(poisoned, rt.to_global(batch))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["nonfinite"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(new_state.params))):
        np.testing.assert_array_equal(a, b)


def _synthetic_batches(config):
    from jaxinfra.data import make_train_iterator

    t = config.train
    return make_train_iterator(config.data, seq_len=t.seq_len, global_batch_size=t.batch_size,
                               vocab_size=config.model.vocab_size, seed=t.seed, process_index=0, process_count=1)


def test_a_state_with_nan_params_is_never_saved(tmp_path, capsys):
    trainer = Trainer(cfg(), tmp_path, jax.devices()[:1])
    state = trainer.rt.init_state()
    poisoned = dataclasses.replace(state, params=jax.tree.map(lambda x: x * np.nan, state.params))
    assert trainer.save(3, poisoned, {}) is None
    trainer.ckpt.close()
    trainer.lock.release()
    assert "no checkpoint written" in capsys.readouterr().out
    assert not any(p.name.isdigit() for p in (tmp_path / "checkpoints").iterdir())


# ------------------------------------------------------------------ path mistakes


def test_run_dir_under_a_regular_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    status = cli.main(["train", "tiny", "--run-dir", str(tmp_path / "afile" / "run"), *CLI])
    lines = error_lines(capsys.readouterr().err)
    assert status == EXIT_BAD_INPUT and len(lines) == 1 and "afile is a regular file" in lines[0]
    assert (tmp_path / "afile").read_text() == "x"


def test_checkpoints_existing_as_a_file(tmp_path, capsys):
    (tmp_path / "checkpoints").write_text("not a directory")
    status = cli.main(["train", "tiny", "--run-dir", str(tmp_path), *CLI])
    lines = error_lines(capsys.readouterr().err)
    assert status == EXIT_BAD_INPUT and len(lines) == 1 and "checkpoints exists and is not a directory" in lines[0]
    assert (tmp_path / "checkpoints").read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # no config.yaml, no lock left


# ------------------------------------------------------------------ one run per run dir


def _write_lock(run_dir: pathlib.Path, pid: int, host: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid,
                                                 "since": "2026-01-01 00:00:00"}))


def test_a_live_run_holds_its_directory(tmp_path, capsys):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, other.pid)
        status = cli.main(["train", "tiny", "--run-dir", str(tmp_path), *CLI])
    finally:
        other.kill()
        other.wait()
    lines = error_lines(capsys.readouterr().err)
    assert status == EXIT_BAD_INPUT and len(lines) == 1
    assert f"in use by a live run (pid {other.pid}" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # nothing else was written


def test_a_lock_from_another_host_is_refused(tmp_path):
    _write_lock(tmp_path, 1234, host="some-other-node")
    with pytest.raises(RunDirError, match=r"pid 1234 on host some-other-node.*delete .*jaxinfra.lock"):
        RunDirLock(tmp_path).acquire()


def test_a_stale_lock_is_taken_over_and_released(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path, gone.pid)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert f"left by pid {gone.pid}, which is gone; taking it over" in capsys.readouterr().out
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------ metrics once per step


def _logged_steps(run_dir: pathlib.Path, key: str = "loss") -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if key in row]


def test_resume_logs_each_step_once(run_copy):
    """Killed after logging step 20 but before checkpoint 20 committed: steps 16..20 run again."""
    shutil.rmtree(run_copy / "checkpoints" / "20")
    summary = train(cfg(), run_copy, jax.devices()[:1])
    assert summary["resumed_from_step"] == 15
    assert _logged_steps(run_copy) == list(range(1, 21))


def test_metrics_logger_cuts_the_stale_tail_and_tells_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(0, 9):
            logger.log(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # the torn line of a killed writer
    with MetricsLogger(tmp_path, tensorboard=True, resume_step=6) as logger:
        for step in (7, 8):
            logger.log(step, {"loss": float(step)})
    assert _logged_steps(tmp_path) == list(range(0, 9))
    assert any(_tensorboard_purges(path) == [7] for path in tmp_path.glob("events.out.tfevents.*"))


def _tensorboard_purges(path: pathlib.Path) -> list[int]:
    """Steps of SessionLog START events in one event file (TensorBoard purges later steps there)."""
    from tensorboardX.proto import event_pb2

    data, steps, at = path.read_bytes(), [], 0
    while at + 12 <= len(data):
        length = int.from_bytes(data[at:at + 8], "little")
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            steps.append(event.step)
        at += 12 + length + 4
    return steps


# ------------------------------------------------------------------ exit statuses across processes


def test_two_processes_with_a_mismatched_checkpoint_both_exit_2(run_copy):
    from jaxinfra.launch import child_env, free_port

    port, procs, before = free_port(), [], snapshot(run_copy)
    args = [*BASE, "mesh.data=2", "model.num_layers=3"]
    for i in range(2):
        env = {**child_env(i, 2, port, 1), "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxinfra", "train", "tiny", "--run-dir", str(run_copy),
                                       *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        lines = error_lines(err)
        assert proc.returncode == EXIT_BAD_INPUT, err[-2000:]
        assert len(lines) == 1 and "model.num_layers: 2 -> 3" in lines[0], err[-2000:]
    assert snapshot(run_copy) == before


def test_cli_output_into_a_closed_pipe_is_quiet():
    """`jaxinfra info | head`: the reader leaves early; no traceback, status 141 (as SIGPIPE in a shell)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfra", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before anything is printed
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()[-2000:]


def test_a_fresh_start_over_an_earlier_history_keeps_it_whole(tmp_path):
    """A run dir whose checkpoints never committed starts from step 0: the metrics it had are moved
    aside whole, never erased, and the new file holds only the new run's lines."""
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"loss": float(step)})
    before = (tmp_path / "metrics.jsonl").read_text()
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=0) as logger:
        logger.log(1, {"loss": 9.0})
    (kept,) = tmp_path.glob("metrics.before-fresh-start-*.jsonl")
    assert kept.read_text() == before
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [9.0]
