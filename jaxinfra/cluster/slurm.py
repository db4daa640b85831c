"""A sweep's job array on a real SLURM: submitted with sbatch, followed with squeue, retried by exit status.

    submit(out, script, indices, names, max_parallel)   # sbatch --parsable --array=...; records the job ids
    queue_states(user)                                  # squeue: job -> pending | running | ended | cancelled
    sacct_states(jobs)                                  # the same from accounting, for jobs squeue forgot
    statuses(runs, out, retries)                        # every run's state (attempts.py), from any process
    follow(runs, out, script, retries, max_parallel)    # poll; resubmit 75 / 70 / lost; return when all are final

Each run is one index of OUT/sweep.sbatch (runner.write_slurm); a resubmission is the same
script with `--array=<its index>` (several at once: `--array=1,3`), a new job whose task
writes a new attempt record. 2 (bad input), 3 (diverged) and 74 (an I/O failure) are never
retried: rerunning fails the same way until a person acts.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from jaxinfra.cluster.attempts import FINAL_STATES, RunStatus, record_submitted, run_statuses, submitted
from jaxinfra.config import ConfigError

Echo = Callable[[str], None]
Runs = Sequence[tuple[str, pathlib.Path]]  # (run name, run dir) in array-index order

# squeue's job states (squeue(1), "JOB STATE CODES") as the engine sees them
_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "RESIZING"}
_RUNNING = {"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"}


def require(tool: str = "sbatch") -> str:
    """The path of a SLURM client command; bad input (exit 2, one line) when it is not on PATH."""
    path = shutil.which(tool)
    if path is None:
        raise ConfigError(f"--submit needs SLURM's `{tool}` on PATH and it is not there (on a login node: "
                          f"module load slurm; to try it here: scripts/slurm/local-cluster.sh start)")
    return path


class SchedulerError(ConfigError):
    """sbatch refused the job (a bad partition, account, time limit): one line with its message."""


def _job_env() -> dict[str, str]:
    """The submitter's environment for the job (sbatch exports it), with this interpreter's bin
    directory first on PATH so the script's `jaxinfra` is the one that submitted it."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    return env


def submit(out: pathlib.Path, script: pathlib.Path, indices: Sequence[int], names: Sequence[str],
           max_parallel: int | None, retry: bool = False) -> str:
    """Submits the array tasks `indices` of `script` (names: their runs); returns the array job id."""
    array = ",".join(str(i) for i in indices) + (f"%{max_parallel}" if max_parallel else "")
    proc = subprocess.run([require("sbatch"), "--parsable", f"--array={array}", str(script)], env=_job_env(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        first = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[0]
        raise SchedulerError(f"sbatch {script} refused the job: {first}")
    job = proc.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"
    record_submitted(out, [(name, f"{job}_{i}") for i, name in zip(indices, names)], retry)
    return job


def queue_states(user: str | None = None) -> dict[str, str] | None:
    """Every array task squeue knows (finished ones too, for MinJobAge): job -> pending | running |
    ended | cancelled. None when squeue fails (controller unreachable): states then read "unknown"."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    cmd = [squeue, "-h", "-r", "-t", "all", "-o", "%i|%T"]
    if user:
        cmd += ["-u", user]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    return _parse_states(proc.stdout)


def _parse_states(text: str) -> dict[str, str]:
    """`JOB|STATE` lines (squeue -o '%i|%T', sacct -P -o JobID,State) -> job -> engine state."""
    states = {}
    for line in text.splitlines():
        job, _, state = line.strip().partition("|")
        state = state.split()[0] if state else ""  # sacct: "CANCELLED by 0"
        states[job] = ("pending" if state in _PENDING else "running" if state in _RUNNING
                       else "cancelled" if state == "CANCELLED" else "ended")
    return states


def sacct_states(jobs: Sequence[str]) -> dict[str, str]:
    """Jobs squeue has forgotten (MinJobAge), from accounting; {} where sacct is absent or has no
    database behind it ("Slurm accounting storage is disabled", as on the local cluster)."""
    sacct = shutil.which("sacct")
    if sacct is None or not jobs:
        return {}
    try:
        proc = subprocess.run([sacct, "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(jobs)],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {}
    return _parse_states(proc.stdout) if proc.returncode == 0 else {}


def statuses(runs: Runs, out: pathlib.Path, retries: int) -> list[RunStatus]:
    """Every run's state now (the records in OUT, the queue, accounting for jobs the queue forgot)."""
    queue = queue_states(_user())
    if queue is not None:
        forgotten = [str(s["job"]) for subs in submitted(out).values() for s in subs if str(s["job"]) not in queue]
        queue = {**sacct_states(forgotten), **queue}
    return run_statuses(runs, out, queue, retries)


def _user() -> str | None:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return os.environ.get("USER")


def follow(runs: Runs, out: pathlib.Path, script: pathlib.Path, retries: int, max_parallel: int | None,
           poll_s: float = 10.0, echo: Echo = print,
           before_retry: Callable[[str], None] | None = None) -> list[RunStatus]:
    """Polls until every run is done or failed, resubmitting the "retrying" ones as new jobs
    (before_retry(run) runs first, e.g. to set aside a checkpoint-less run's partial metrics).
    Prints a line whenever a run changes state; returns the final states."""
    index = {name: i for i, (name, _) in enumerate(runs)}
    seen: dict[str, str] = {}
    lost_before: set[str] = set()
    while True:
        now = statuses(runs, out, retries)
        for s in now:
            settling = s.state in FINAL_STATES and s.last is not None and s.last.state in ("pending", "running")
            if seen.get(s.run) != s.state and not settling:  # a final state once its job has recorded its exit
                last = s.last
                why = f" (exit {last.exit})" if last and last.exit is not None else (
                    " (its job vanished: treated as 70)" if last and last.state == "lost" else "")
                echo(f"sweep: {s.run}: {s.state}{why}" + (f", job {last.job}" if last else ""))
                seen[s.run] = s.state
        # a job gone from the queue without a record: wait one more poll before calling it lost
        # (the record may still be on its way through a shared filesystem's caches)
        lost = {s.last.job for s in now if s.state == "retrying" and s.last and s.last.state == "lost"}
        again = [s.run for s in now if s.state == "retrying" and (s.last.job not in lost or s.last.job in lost_before)]
        lost_before = lost
        if again:
            for run in again:
                if before_retry is not None:
                    before_retry(run)
            job = submit(out, script, [index[r] for r in again], again, max_parallel, retry=True)
            echo(f"sweep: resubmitted {', '.join(again)} as job {job}")
            continue
        # final, and no job still writing its record (summary.json lands before the job's exit)
        if all((s.state in FINAL_STATES or s.state == "not submitted")
               and (s.last is None or s.last.state not in ("pending", "running")) for s in now):
            return now
        time.sleep(poll_s)
