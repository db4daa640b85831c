"""Checkpointing and fault tolerance: exact resume, preemption, kills, corruption, NaNs, resharding.

The reference is an uninterrupted run of the same config: every recovery path must
reproduce its losses bit for bit (float32, CPU, same compiled program).
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from nan_steps import NanSteps
from subprocs import cli_env

from jaxinfra.checkpoint import Checkpointer, abstract_with_shardings, export_params
from jaxinfra.config import load_config
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_state
from jaxinfra.train import EXIT_DIVERGED, EXIT_PREEMPTED, Trainer, train

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 20
BASE = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=64",
        "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8",
        f"train.steps={STEPS}", "train.eval_every=0", "log.every=1", "log.progress=false", "log.tensorboard=false",
        "checkpoint.every=5", "mesh.data=1"]


def cfg(*extra: str):
    return load_config("tiny", [*BASE, *extra])


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    """Training loss per step; a resumed run re-logs steps after its checkpoint, the last entry wins."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def one_device():
    return jax.devices()[:1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("reference")
    summary = train(cfg(), run_dir, one_device())
    return {"losses": losses(run_dir), "summary": summary, "dir": run_dir}


def assert_same_tail(run_dir: pathlib.Path, reference: dict, first_step: int) -> None:
    got = losses(run_dir)
    for step in range(first_step, STEPS + 1):
        assert got[step] == reference["losses"][step], f"step {step}: {got[step]} != {reference['losses'][step]}"


def test_stop_at_step_10_then_resume_is_bitwise_exact(tmp_path, reference, monkeypatch):
    calls = {"n": 0}

    def stop_at_10(self, sync):
        calls["n"] += 1
        return calls["n"] == 10

    with monkeypatch.context() as m:
        m.setattr(Trainer, "_stop_requested", stop_at_10)
        first = train(cfg(), tmp_path, one_device())
    assert first["exit_code"] == EXIT_PREEMPTED and first["steps"] == 10
    second = train(cfg(), tmp_path, one_device())
    assert second["resumed_from_step"] == 10 and second["exit_code"] == 0
    assert_same_tail(tmp_path, reference, 11)


# Killed and resumed runs happen in subprocesses with 1 CPU device; their reference does too
# (XLA:CPU's thread partitioning, and so the last bit of a reduction, depends on the client's
# device count, so a reference from this 8-device pytest process could differ by one ulp).
SUB_STEPS = 200


def _spawn(run_dir: pathlib.Path, *extra: str) -> subprocess.Popen:
    env = cli_env(1)
    return subprocess.Popen([sys.executable, "-m", "jaxinfra", "train", "tiny", "--run-dir", str(run_dir), *BASE,
                             f"train.steps={SUB_STEPS}", "checkpoint.every=10", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _logged_steps(run_dir: pathlib.Path) -> int:
    return max(losses(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0


@pytest.fixture(scope="module")
def subprocess_reference(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("subprocess-reference")
    _finish(_spawn(run_dir))
    return losses(run_dir)


def _assert_tail_equals(run_dir: pathlib.Path, want: dict[int, float], first_step: int) -> None:
    got = losses(run_dir)
    assert max(got) == SUB_STEPS
    for step in range(first_step, SUB_STEPS + 1):
        assert got[step] == want[step], f"step {step}: {got[step]} != {want[step]}"


def test_sigterm_saves_and_exits_75_then_resumes_exactly(tmp_path, subprocess_reference):
    proc = _spawn(tmp_path)
    _wait_for(lambda: _logged_steps(tmp_path) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    stopped = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert stopped < SUB_STEPS and f"stopping at step {stopped}" in out
    assert (tmp_path / "checkpoints" / str(stopped) / "commit_success.txt").exists()
    assert f"resumed at step {stopped}" in _finish(_spawn(tmp_path))
    _assert_tail_equals(tmp_path, subprocess_reference, stopped + 1)


def test_sigkill_after_commit_resumes_exactly(tmp_path, subprocess_reference):
    proc = _spawn(tmp_path)
    _wait_for(lambda: (tmp_path / "checkpoints" / "10" / "commit_success.txt").exists(), proc)
    proc.kill()
    proc.wait()
    out = _finish(_spawn(tmp_path))
    assert "resumed at step" in out
    _assert_tail_equals(tmp_path, subprocess_reference, 11)


def _copy_run(src: pathlib.Path, dst: pathlib.Path) -> None:
    import shutil

    shutil.copytree(src, dst)


def test_save_killed_in_flight_falls_back_to_the_previous_commit(tmp_path, reference):
    """What a kill during an async save leaves on disk: an uncommitted temp dir for the newest step."""
    run = tmp_path / "run"
    _copy_run(reference["dir"], run)
    ckpts = run / "checkpoints"
    (ckpts / "20").rename(ckpts / "20.orbax-checkpoint-tmp-1234")
    (ckpts / "15" / "commit_success.txt").unlink()  # and one whose commit marker never landed
    summary = train(cfg(), run, one_device())
    assert summary["resumed_from_step"] in (10, 15)
    assert summary["final_loss"] == reference["summary"]["final_loss"]


def test_corrupted_latest_checkpoint_is_reported_and_skipped(tmp_path, reference, capsys):
    run = tmp_path / "run"
    _copy_run(reference["dir"], run)
    files = sorted((p for p in (run / "checkpoints" / "20" / "state").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
    for path in files[-3:]:  # the array data: truncate it
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    summary = train(cfg(), run, one_device())
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "unreadable" in line]
    assert len(warnings) == 1 and "checkpoints/20" in warnings[0]
    assert summary["resumed_from_step"] == 15
    assert summary["final_loss"] == reference["summary"]["final_loss"]


def test_one_nan_step_is_skipped(tmp_path, reference):
    summary = train(cfg(), tmp_path, one_device(), extensions=[NanSteps([5])])
    assert summary["exit_code"] == 0 and summary["skipped_steps"] == 1
    got = losses(tmp_path)
    assert all(np.isfinite(v) for v in got.values())
    for step in range(1, 6):  # up to and including the skipped step, nothing differs
        assert got[step] == reference["losses"][step]
    assert got[6] != reference["losses"][6]  # the skipped update is missing afterwards


def test_persistent_nans_stop_with_last_good_checkpoint(tmp_path):
    summary = train(cfg("train.max_bad_steps=3", "checkpoint.every=4"), tmp_path, one_device(),
                    extensions=[NanSteps(range(5, 13))])
    assert summary["exit_code"] == EXIT_DIVERGED and summary["steps"] == 7
    rt = build_runtime(cfg(), one_device())
    ckpt = Checkpointer(tmp_path / "checkpoints", cfg().checkpoint)
    assert ckpt.steps() == [4]  # nothing was saved after the NaNs began
    step, state, _, _ = ckpt.restore_latest(abstract_with_shardings(abstract_state(cfg().model, rt.tx),
                                                                    rt.state_shardings))
    assert step == 4 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_divergence_is_checked_at_log_steps(tmp_path, capsys):
    """The rule the docs state: stop at the first log step at which >= max_bad_steps consecutive steps
    were bad. NaNs from step 5, limit 3, log.every=2: step 6 has seen 2 bad steps, step 8 has seen 4."""
    summary = train(cfg("train.max_bad_steps=3", "log.every=2", "checkpoint.enabled=false"), tmp_path,
                    one_device(), extensions=[NanSteps(range(5, 13))])
    assert summary["exit_code"] == EXIT_DIVERGED and summary["steps"] == 8
    assert "the last 4 consecutive steps had non-finite" in capsys.readouterr().err


def test_reshard_on_restore_is_bitwise(tmp_path):
    """Saved under fsdp=8, restored under tensor=2 x fsdp=2 (4 devices) and on 1 device."""
    saved = train(cfg("mesh.fsdp=8", "train.steps=3"), tmp_path, jax.devices())
    del saved
    source_rt = build_runtime(cfg("mesh.fsdp=8", "train.steps=3"), jax.devices())
    ckpt = Checkpointer(tmp_path / "checkpoints", cfg().checkpoint)
    _, original, _, _ = ckpt.restore_latest(abstract_with_shardings(abstract_state(cfg().model, source_rt.tx),
                                                                    source_rt.state_shardings))
    for overrides, devices in ((["mesh.tensor=2", "mesh.fsdp=2"], jax.devices()[:4]), ([], jax.devices()[:1])):
        rt = build_runtime(cfg(*overrides, "train.steps=3"), devices)
        _, state, _, _ = ckpt.restore_latest(abstract_with_shardings(abstract_state(cfg().model, rt.tx),
                                                                     rt.state_shardings))
        wq = state.params["layers"]["attn"]["wq"][...]
        assert len(wq.sharding.device_set) == len(devices)
        for a, b in zip(jax.tree.leaves((original.params, original.opt_state)),
                        jax.tree.leaves((state.params, state.opt_state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_params_bfloat16(tmp_path, reference):
    import orbax.checkpoint as ocp

    out = export_params(reference["dir"], tmp_path / "export", "bfloat16")
    restored = ocp.StandardCheckpointer().restore(out)
    leaves = jax.tree.leaves(restored)
    assert leaves and all(x.dtype == jax.numpy.bfloat16 for x in leaves)


def test_peer_killed_mid_run_survivor_exits_and_checkpoint_restores(tmp_path):
    from jaxinfra.launch import child_env, free_port
    from jaxinfra.watchdog import EXIT_HUNG

    port = free_port()
    extra = [f"train.steps={SUB_STEPS}", "checkpoint.every=5", "mesh.data=2", "train.step_timeout_s=20"]
    procs = []
    for i in range(2):
        env = {**child_env(i, 2, port, 1), "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxinfra", "train", "tiny", "--run-dir", str(tmp_path),
                                       *BASE, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    _wait_for(lambda: (tmp_path / "checkpoints" / "10" / "commit_success.txt").exists(), procs[0])
    killed_at = time.monotonic()
    procs[1].kill()
    out, _ = procs[0].communicate(timeout=120)
    assert procs[0].returncode == EXIT_HUNG, out[-3000:]
    assert time.monotonic() - killed_at < 20 + 10  # within the watchdog timeout (plus slack)
    error = [line for line in out.splitlines() if line.startswith("jaxinfra: error: process 0")]
    assert error and "at step" in error[0] and "phase '" in error[0], out[-3000:]
    # The last committed checkpoint restores, here on one process with 2 devices.
    summary = train(load_config("tiny", [*BASE, *extra, "train.steps=25"]), tmp_path, jax.devices()[:2])
    assert summary["resumed_from_step"] >= 10 and summary["exit_code"] == 0


def test_failing_multiprocess_close_does_not_wait_on_a_dead_peer(tmp_path, monkeypatch):
    """A pending save commits only at Orbax's cross-process barriers: with a peer gone, the
    survivor's close must not block on it (CI once saw 89 s, until the coordination service's
    heartbeat timeout). A lost peer waits not at all; another error at most step_timeout_s."""
    import threading

    ckpt = Checkpointer(tmp_path / "checkpoints", cfg().checkpoint)
    released = threading.Event()
    monkeypatch.setattr(ckpt, "close", lambda: released.wait(60))  # a save stuck in its barrier
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="left uncommitted"):
        ckpt.close_within(0.2)
    assert time.monotonic() - started < 5
    released.set()
    monkeypatch.setattr(ckpt, "close", lambda: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):  # a close that ends in time reports its own failure
        ckpt.close_within(5)

    trainer = Trainer.__new__(Trainer)  # only the closer's choice is under test
    trainer.ckpt, trainer.cfg = ckpt, cfg("train.step_timeout_s=7")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    gone = RuntimeError("UNKNOWN: Gloo all-reduce failed: Connection reset by peer")
    assert trainer._checkpoint_closer(gone).args == (0.0,)
    assert trainer._checkpoint_closer(ValueError("bad batch")).args == (7,)
    assert trainer._checkpoint_closer(None) == ckpt.close


@pytest.mark.slow  # a ~34M-parameter state so the async save is slow enough to be caught in flight
def test_real_sigkill_during_async_save(tmp_path):
    big = [*BASE, "model.vocab_size=8192", "model.d_model=512", "model.num_heads=8", "model.mlp_dim=2048",
           "model.num_layers=6", "model.tie_embeddings=false", "train.batch_size=4", "train.steps=12",
           "checkpoint.every=4"]
    env = cli_env(1)

    def spawn(run_dir):
        return subprocess.Popen([sys.executable, "-m", "jaxinfra", "train", "tiny", "--run-dir", str(run_dir), *big],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    reference = tmp_path / "reference"
    assert spawn(reference).wait() == 0
    run = tmp_path / "run"
    proc = spawn(run)
    in_flight = None
    while proc.poll() is None and in_flight is None:
        ckpts = run / "checkpoints"
        names = {p.name for p in ckpts.iterdir()} if ckpts.exists() else set()
        if "4" in names and any("tmp" in n for n in names):
            in_flight = sorted(n for n in names if "tmp" in n)
            proc.kill()
        time.sleep(0.002)
    proc.wait()
    assert in_flight, "the save finished before it could be interrupted"
    out, _ = spawn(run).communicate(timeout=300)
    assert "resumed at step 4" in out
    assert losses(run)[12] == losses(reference)[12]


def test_run_without_eval_batches(tmp_path):
    """data.eval_batches=0: no eval lines, no eval summary, and the run still ends cleanly."""
    summary = train(cfg("data.eval_batches=0", "train.steps=2"), tmp_path, one_device())
    assert summary["exit_code"] == 0 and summary["first_eval_loss"] is None and summary["final_eval_loss"] is None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval_loss" in row for row in rows) and len([r for r in rows if "loss" in r]) == 2


def test_checkpoint_from_before_stats_left_the_params_restores(tmp_path):
    """The old main saved the router bias (and fp8 amax histories) under `params/`, with optimizer
    moments: a full restore maps them to `stats/` and drops those moments; a params restore reads them."""
    from jaxinfra.checkpoint import restore_params
    from jaxinfra.state import model_state

    moe = cfg("model.moe_num_experts=4", "model.moe_top_k=2", "model.moe_mlp_dim=32", "model.moe_bias_update_rate=0.01")
    rt = build_runtime(moe, one_device())
    state = rt.init_state()
    state = state.replace(stats=jax.tree.map(lambda x: x + 0.25, state.stats))  # a moved bias
    variables = model_state(state)
    old = {"step": state.step, "params": variables, "opt_state": rt.tx.init(variables)}  # the old layout
    ckpt = Checkpointer(tmp_path / "checkpoints", moe.checkpoint)
    ckpt.save(3, old, {}, {"step": 3})
    ckpt.close()
    target = abstract_with_shardings(rt.abstract_state(), rt.state_shardings)
    step, restored, _, _ = Checkpointer(tmp_path / "checkpoints", moe.checkpoint).restore_latest(target)
    assert step == 3 and jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, params = restore_params(tmp_path, model_state(target))
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
