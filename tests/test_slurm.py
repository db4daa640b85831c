"""The SLURM engine: attempt records, retry by exit status, the job scripts, and a real SLURM.

The tests marked `needs_slurm` submit to a real cluster (`scripts/slurm/local-cluster.sh start`
brings up a one-node one in seconds; .ci/run does it) and skip with the reason when `sbatch` is
absent or `sinfo` cannot reach a controller. The rest need no SLURM.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from jaxinfra import cli
from jaxinfra.cluster import attempts as A
from jaxinfra.config import ConfigError, load_config
from jaxinfra.scaling import runner
from jaxinfra.scaling.spec import expand, load_spec

REPO = pathlib.Path(__file__).resolve().parents[1]


def _slurm_reason() -> str | None:
    if shutil.which("sbatch") is None:
        return "no SLURM here (`sbatch` not on PATH; apt-get install slurm-wlm munge, then "\
               "scripts/slurm/local-cluster.sh start)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no SLURM controller reachable (sinfo: {e})"
    if proc.returncode != 0 or not re.search(r"idle|mixed|alloc", proc.stdout):
        return f"no idle SLURM node reachable (sinfo: {(proc.stderr or proc.stdout).strip()[:200]})"
    return None


_REASON = _slurm_reason()
needs_slurm = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _spec(tmp_path: pathlib.Path, overrides: list[str] = (), **changes) -> pathlib.Path:
    spec = {
        "name": "s",
        "base": "tiny",
        "overrides": ["data.source=synthetic", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0",
                      "data.eval_batches=1", "log.progress=false", "log.tensorboard=false", "log.peak_tflops=1",
                      "log.every=1", "checkpoint.every=5", *overrides],
        "sizes": {"rule": {"aspect_ratio": 32, "head_dim": 16, "mlp_ratio": 2, "multiple_of": 16}, "depths": [1]},
        "grid": {"tokens": [2560]},
        "launcher": {"slurm": {"max_parallel": 2, "time": "00:10:00"}, "retries": 1},
    }
    spec.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# ---------------------------------------------------------------- no SLURM needed


@pytest.mark.parametrize("exit_status, lost, used, want", [
    (75, False, 0, "retrying"), (70, False, 0, "retrying"), (None, True, 0, "retrying"),
    (75, False, 1, "failed"), (None, True, 1, "failed"),  # launcher.retries=1 used up
    (2, False, 0, "failed"), (3, False, 0, "failed"), (74, False, 0, "failed"), (1, False, 0, "failed"),
    (0, False, 0, "failed"),  # ended 0 but no finished summary.json: nothing to resume, a person looks
])
def test_retry_decision_by_exit_status(exit_status, lost, used, want):
    last = A.Attempt("2_0", state="lost" if lost else "ended", exit=exit_status, retry=used > 0)
    attempts = (A.Attempt("1_0", state="ended", exit=75), last) if used else (last,)
    assert A.run_state(False, attempts, retries=1) == want
    assert A.run_state(True, attempts, retries=1) == "done"


def test_status_from_records_and_queue(tmp_path):
    """What a fresh process reads: jobs.jsonl (submitter), attempts/<job>.json (the jobs), the queue."""
    out = tmp_path / "out"
    runs = [(name, out / name) for name in ("a", "b", "c", "d", "e", "f", "g", "h")]
    for _, run_dir in runs:
        (run_dir / "attempts").mkdir(parents=True)
    A.record_submitted(out, [(n, f"7_{i}") for i, (n, _) in enumerate(runs)], retry=False)
    A.record_submitted(out, [("a", "9_0")], retry=True)

    def record(run: str, job: str, **fields):
        (out / run / "attempts" / f"{job}.json").write_text(json.dumps({"job": job, "start": 1.0, **fields}))

    record("a", "7_0", exit=75, end=2.0)
    record("a", "9_0", exit=0, end=3.0)
    (out / "a" / "summary.json").write_text(json.dumps({"exit_code": 0}))
    record("b", "7_1", exit=2, end=2.0)
    record("c", "7_2")  # started, no exit: running per the queue
    record("e", "7_4")  # started, then its job vanished (scancel -s KILL, node lost)
    record("f", "7_5", exit=75, end=2.0)
    (out / "f" / "summary.json").write_text(json.dumps({"exit_code": 75}))  # a preempted run's summary
    record("g", "7_6", exit=75, end=2.0)  # a plain `scancel`: the training recorded 75, the queue says CANCELLED
    record("h", "7_7", exit=75, end=2.0)  # recorded, but its job is still completing: not final yet
    queue = {"7_2": "running", "7_3": "pending", "7_4": "ended", "7_6": "cancelled", "7_7": "running"}
    got = {s.run: s.row() for s in A.run_statuses(runs, out, queue, retries=1)}
    assert got == {
        "a": {"run": "a", "state": "done", "exit": 0, "attempts": 2, "job": "9_0"},
        "b": {"run": "b", "state": "failed", "exit": 2, "attempts": 1, "job": "7_1"},
        "c": {"run": "c", "state": "running", "exit": None, "attempts": 1, "job": "7_2"},
        "d": {"run": "d", "state": "pending", "exit": None, "attempts": 1, "job": "7_3"},
        "e": {"run": "e", "state": "retrying", "exit": None, "attempts": 1, "job": "7_4"},
        "f": {"run": "f", "state": "retrying", "exit": 75, "attempts": 1, "job": "7_5"},
        "g": {"run": "g", "state": "cancelled", "exit": 75, "attempts": 1, "job": "7_6"},
        "h": {"run": "h", "state": "running", "exit": 75, "attempts": 1, "job": "7_7"},
    }
    from jaxinfra.cluster.slurm import _parse_states

    assert _parse_states("7_6|CANCELLED by 0\n7_7|COMPLETING\n7_8|NODE_FAIL\n7_9|PENDING\n7_1|PREEMPTED\n") == {
        "7_6": "cancelled", "7_7": "running", "7_8": "ended", "7_9": "pending", "7_1": "ended"}
    assert A.run_statuses(runs[2:3], out, None, retries=1)[0].state == "unknown"  # squeue unreachable
    table = A.format_status(A.run_statuses(runs, out, queue, retries=1)).splitlines()
    assert table[0].split() == ["run", "state", "exit", "attempts", "job"]
    assert table[1].split() == ["a", "done", "0", "2", "9_0"] and table[4].split() == ["d", "pending", "-", "1", "7_3"]


def test_follow_resubmits_a_lost_job_after_a_second_look_and_never_a_bad_input_run(tmp_path, monkeypatch):
    """--wait's loop with the scheduler stubbed: a job that vanished without a record (scancel -s
    KILL, node lost) is resubmitted on the second poll that finds it gone; a run that ended 2 is not."""
    from jaxinfra.cluster import slurm

    out = tmp_path / "out"
    runs = [("a", out / "a"), ("b", out / "b")]
    for _, run_dir in runs:
        (run_dir / "attempts").mkdir(parents=True)
    A.record_submitted(out, [("a", "5_0"), ("b", "5_1")], retry=False)
    (out / "b" / "attempts" / "5_1.json").write_text(json.dumps({"job": "5_1", "start": 1, "exit": 2, "end": 2}))
    polls, submitted = [], []

    def fake_submit(out_dir, script, indices, names, max_parallel, retry=False):
        submitted.append((list(indices), list(names), retry))
        A.record_submitted(out_dir, [("a", "6_0")], retry)
        (out / "a" / "attempts" / "6_0.json").write_text(json.dumps({"job": "6_0", "start": 3, "exit": 0, "end": 4}))
        (out / "a" / "summary.json").write_text(json.dumps({"exit_code": 0}))
        return "6"

    monkeypatch.setattr(slurm, "queue_states", lambda user=None: polls.append(1) or {})
    monkeypatch.setattr(slurm, "submit", fake_submit)
    lines = []
    final = slurm.follow(runs, out, out / "sweep.sbatch", retries=2, max_parallel=None, poll_s=0.01, echo=lines.append)
    assert submitted == [([0], ["a"], True)] and len(polls) == 3, (submitted, lines)
    assert [(s.run, s.state, len(s.attempts)) for s in final] == [("a", "done", 2), ("b", "failed", 1)]
    assert "sweep: a: retrying (its job vanished: treated as 70), job 5_0" in lines
    assert "sweep: b: failed (exit 2), job 5_1" in lines


def test_sweep_sbatch_records_each_attempt(tmp_path):
    """The generated array script: srun starts the command, the attempt record gets its exit status,
    a finished run is skipped, a preempted run's summary.json is not "finished"."""
    plan = expand(load_spec(_spec(tmp_path, sizes={"rule": {"head_dim": 16}, "depths": [1, 2]})), tmp_path / "out")
    runner.prepare(plan)
    script = runner.write_slurm(plan).read_text()
    assert "srun --kill-on-bad-exit=1" in script and "exec " not in script
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/bash\nshift\necho \"srun: $*\"\nexit 75\n")
    (fake / "srun").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_JOB_ID": "40", "SLURM_JOB_ID": "41"}
    body = script[script.index("set -euo"):]
    proc = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True)
    assert proc.returncode == 75, proc.stderr
    run = plan.runs[1]
    assert f"srun: {' '.join(run.command)}" in proc.stdout
    record = json.loads((run.run_dir / "attempts" / "40_1.json").read_text())
    assert record["exit"] == 75 and record["job_id"] == "41" and record["end"] >= record["start"] > 0
    # SLURM's time limit TERMs the batch shell too: it outlives the step and still records its status
    (fake / "srun").write_text("#!/bin/bash\nsleep 1\nexit 75\n")
    shell = subprocess.Popen(["bash", "-c", body], env={**env, "SLURM_ARRAY_JOB_ID": "42"}, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(lambda: (run.run_dir / "attempts" / "42_1.json").is_file(), 10, "the start record")
    shell.terminate()
    _, err = shell.communicate(timeout=10)
    assert shell.returncode == 75 and "SIGTERM" in err
    assert json.loads((run.run_dir / "attempts" / "42_1.json").read_text())["exit"] == 75
    (run.run_dir / "summary.json").write_text(json.dumps({"exit_code": 75, "steps": 3}, indent=2))
    assert subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True).returncode == 75
    (run.run_dir / "summary.json").write_text(json.dumps({"exit_code": 0, "steps": 3}, indent=2))
    done = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "skipping" in done.stdout


@pytest.mark.parametrize("status, restarts, requeued", [
    (75, 0, True), (70, 2, True), (75, 3, False),  # MAX_RESTARTS=3 used up
    (2, 0, False), (3, 0, False), (74, 0, False), (0, 0, False)])
def test_train_sbatch_requeues_only_resumable_statuses(tmp_path, status, restarts, requeued):
    """scripts/slurm/train.sbatch's own logic, with stand-ins for srun and scontrol."""
    text = (REPO / "scripts/slurm/train.sbatch").read_text()
    assert "#SBATCH --requeue" in text
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(f"#!/bin/bash\necho \"srun $*\"\nexit {status}\n")
    (fake / "scontrol").write_text("#!/bin/bash\necho \"scontrol $*\"\n")
    for tool in ("srun", "scontrol"):
        (fake / tool).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "j", "MAX_RESTARTS": "3",
           "SLURM_RESTART_COUNT": str(restarts), "RUN_DIR": str(tmp_path / "run")}
    proc = subprocess.run(["bash", str(REPO / "scripts/slurm/train.sbatch"), "cfg.yaml", "a=1"], env=env,
                          capture_output=True, text=True)
    assert f"srun --kill-on-bad-exit=1 jaxinfra train cfg.yaml --run-dir {tmp_path}/run a=1" in proc.stdout
    assert ("scontrol requeue 5" in proc.stdout) == requeued, proc.stdout
    assert proc.returncode == (0 if requeued else status)


def test_submit_without_sbatch_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    out = tmp_path / "out"
    assert cli.main(["sweep", str(_spec(tmp_path)), "--launcher", "slurm", "--submit", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`sbatch`" in err[0] and "PATH" in err[0], err
    assert not out.exists()  # nothing written
    assert cli.main(["sweep", str(_spec(tmp_path)), "--submit"]) == 2  # --submit needs --launcher slurm
    assert "--launcher slurm" in capsys.readouterr().err


def test_retries_is_a_validated_spec_key(tmp_path):
    assert load_spec(_spec(tmp_path)).launcher.retries == 1
    with pytest.raises(ConfigError, match=r"launcher\.retries=-1 is invalid"):
        load_spec(_spec(tmp_path, launcher={"retries": -1}))


def test_process_group_from_srun_variables(monkeypatch):
    from jaxinfra.distributed import slurm_group

    env = {"SLURM_JOB_ID": "4100", "SLURM_STEP_NODELIST": "gpu[007-009]", "SLURM_NTASKS": "3", "SLURM_PROCID": "2",
           "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "3"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    group, local = slurm_group()
    assert (group.coordinator, group.num_processes, group.process_id, local) == ("gpu007:61444", 3, 2, None)
    monkeypatch.setenv("SLURM_NTASKS", "6")  # two tasks per node: one device each
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert slurm_group()[1] == [1]
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert slurm_group() is None


# ---------------------------------------------------------------- a real SLURM


@needs_slurm
def test_train_sbatch_bad_override_ends_2_without_requeue(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUN_DIR": str(tmp_path / "run"),
           "JAXINFRA": f"{sys.executable} -m jaxinfra"}
    job = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--no-requeue",
                          f"--output={tmp_path}/%j.out", str(REPO / "scripts/slurm/train.sbatch"), "tiny",
                          "model.num_layerz=1"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    job = job.split(";")[0]
    deadline = time.monotonic() + 120
    while True:
        show = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        if re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", show):
            break
        assert time.monotonic() < deadline, show
        time.sleep(0.5)
    assert "JobState=FAILED" in show and "ExitCode=2:0" in show and "Restarts=0" in show, show
    log = (tmp_path / f"{job}.out").read_text()
    assert "unknown key 'model.num_layerz'" in log and "exit 2 (not requeued)" in log


def _job_state(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout


@pytest.mark.slow
@needs_slurm
def test_train_sbatch_trains_and_requeues_itself_after_sigterm(tmp_path):
    """train.sbatch on a real SLURM (the default run checks its requeue logic with stand-ins and a bad
    override for real): SIGTERM mid-way -> exit 75 -> requeued, same job id -> resumes -> 0."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUN_DIR": str(run_dir), "JAXINFRA": f"{sys.executable} -m jaxinfra"}
    overrides = ["data.source=synthetic", "model.d_model=32", "model.num_layers=1", "model.num_heads=2",
                 "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "train.steps=300", "train.seq_len=32",
                 "train.batch_size=8", "train.eval_every=0", "log.every=1", "log.progress=false",
                 "log.tensorboard=false", "checkpoint.every=10"]
    job = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1",
                          f"--output={tmp_path}/%j.out", str(REPO / "scripts/slurm/train.sbatch"), "tiny", *overrides],
                         env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    _wait_for(lambda: _steps_logged(run_dir) >= 15, 240, "training mid-way")
    subprocess.run(["scancel", "--signal=TERM", job], capture_output=True)
    _wait_for(lambda: "Restarts=1" in _job_state(job) and "JobState=PENDING" in _job_state(job), 120, "the requeue")
    # SLURM holds a requeued job for a while (its eligible time); let it start now
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    _wait_for(lambda: re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", _job_state(job)), 240, "the rerun")
    show = _job_state(job)
    assert "JobState=COMPLETED" in show and "Restarts=1" in show, show
    log = (tmp_path / f"{job}.out").read_text()
    stopped = int(re.search(r"stopping at step (\d+) on signal 15", log).group(1))
    assert "exit 75 (resumable); requeueing" in log and f"resumed at step {stopped}" in log, log[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 300


@needs_slurm
def test_sweep_submit_wait_bad_input_is_not_retried_and_status_reads_it(tmp_path):
    """The CLI end to end on a real SLURM, cheaply: a run whose data path is wrong ends 2 (bad input);
    --wait does not retry it and exits 1; --status from a fresh process reports it."""
    spec = _spec(tmp_path, overrides=["data.source=tokens", f"data.paths=[{tmp_path}/missing.npy]"])
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXINFRA_SLURM_POLL_S": "0.5"}
    base = [sys.executable, "-m", "jaxinfra", "sweep", str(spec), "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run([*base, "--launcher", "slurm", "--submit", "--wait"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resubmitted" not in proc.stdout and re.search(r"L1-d32-\S+: failed \(exit 2\)", proc.stdout), proc.stdout
    status = subprocess.run([*base, "--status"], env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    row = status.stdout.strip().splitlines()[-1].split()
    assert row[1:4] == ["failed", "2", "1"] and re.fullmatch(r"\d+_0", row[4])
    print(f"\nsubmit --wait of a bad-input run + --status: {time.perf_counter() - start:.1f}s")


@needs_slurm
def test_srun_two_tasks_equal_one_process(tmp_path):
    """Acceptance 2: `srun --ntasks=2` with no coordinator flags (jax.distributed from SLURM's
    variables), 4 fake devices per task; the losses equal 1 process x 8 devices."""
    from jaxinfra.train import train

    overrides = ["data.source=synthetic", "model.vocab_size=64", "model.num_layers=1", "model.d_model=32",
                 "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64",
                 "train.steps=5", "train.seq_len=32", "train.batch_size=8", "train.eval_every=0", "log.every=1",
                 "log.progress=false", "log.tensorboard=false", "mesh.data=2", "mesh.fsdp=4"]
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=4"])}
    multi = tmp_path / "multi"
    proc = subprocess.run(["srun", "--ntasks=2", "--cpus-per-task=1", "--time=10", sys.executable, "-m", "jaxinfra",
                           "train", "tiny", "--run-dir", str(multi), *overrides], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single = tmp_path / "single"
    train(load_config("tiny", overrides), single)

    def losses(run_dir):
        return np.array([r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                         if "loss" in r])

    got, want = losses(multi), losses(single)
    assert len(got) == len(want) == 5
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _steps_logged(run_dir: pathlib.Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


@pytest.mark.slow
@needs_slurm
def test_sweep_submit_wait_retries_preempted_run_and_fits(tmp_path):
    """Acceptance 1 (the fast test above covers submit / wait / no retry of 2 / --status): 6 runs,
    max_parallel 2. One long run is sent SIGTERM mid-way with scancel; it resumes in a new attempt
    from its checkpoint and ends with the loss of an uninterrupted run. One run's config carries
    a bad override: it ends 2 and is not retried. The rest collects and fits; --status from a fresh
    process reports all of it."""
    from jaxinfra.scaling.workflow import sweep
    from jaxinfra.train import train

    spec = _spec(tmp_path, sizes={"rule": {"aspect_ratio": 32, "head_dim": 16, "mlp_ratio": 2, "multiple_of": 16},
                                  "depths": [1, 2, 3]}, grid={"tokens": [2560, 25600]})
    out = tmp_path / "out"
    plan = expand(load_spec(spec), out)
    killed, bad = plan.runs[3], plan.runs[5]  # 100 steps each; index 5 starts last (max_parallel 2)
    assert killed.steps == 100
    result: dict = {}
    start = time.perf_counter()
    follower = threading.Thread(target=lambda: result.update(
        sweep(spec, launcher="slurm", out=out, submit=True, wait=True, poll_s=0.5, bootstrap=5)))
    follower.start()
    _wait_for(lambda: (out / A.JOBS_FILE).is_file(), 60, "the submission")
    assert not (bad.run_dir / "attempts").exists()  # not started: the array throttle holds it back
    bad.config_path.write_text(bad.config_path.read_text().replace("model:\n", "model:\n  num_layerz: 1\n", 1))
    _wait_for(lambda: _steps_logged(killed.run_dir) >= 12, 240, f"{killed.name} to train mid-way")
    job = next(r["job"] for r in A.submitted(out)[killed.name])
    # scancel may exit non-zero when the batch shell itself takes no signal; the step gets it
    cancel = subprocess.run(["scancel", "--signal=TERM", job], capture_output=True, text=True)
    print(f"scancel --signal=TERM {job}: exit {cancel.returncode} {cancel.stderr.strip()}")
    follower.join(timeout=600)
    wall = time.perf_counter() - start
    assert not follower.is_alive()
    status = result["status"]
    assert status == {**{r.name: "done" for r in plan.runs}, bad.name: "failed"}, status
    assert (out / "results.csv").is_file() and "frontier" in json.loads((out / "fit.json").read_text())

    first, second = (json.loads(p.read_text()) for p in sorted((killed.run_dir / "attempts").glob("*.json"),
                                                                 key=lambda p: json.loads(p.read_text())["start"]))
    assert first["exit"] == 75 and second["exit"] == 0
    summary = json.loads((killed.run_dir / "summary.json").read_text())
    assert 0 < summary["resumed_from_step"] < killed.steps
    reference = train(load_config(str(killed.config_path)), tmp_path / "reference")
    assert summary["final_loss"] == reference["final_loss"]

    fresh = subprocess.run([sys.executable, "-m", "jaxinfra", "sweep", str(spec), "--out", str(out), "--status"],
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    rows = {line.split()[0]: line.split()[1:4] for line in fresh.stdout.strip().splitlines()[1:]}
    assert rows[killed.name] == ["done", "0", "2"] and rows[bad.name] == ["failed", "2", "1"]
    assert all(rows[r.name] == ["done", "0", "1"] for r in plan.runs if r not in (killed, bad)), fresh.stdout
    print(f"\nSLURM sweep of 6 runs (one preempted and resumed, one bad input): {wall:.1f}s")
