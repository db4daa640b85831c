"""Every attempt of every run of a sweep on a scheduler, and what the engine does next.

Two writers, so that no file is ever written by two processes:

    OUT/jobs.jsonl                  the submitter: one line per attempt it submitted
                                    {"run", "job": "<array job>_<index>", "submitted"}
    OUT/RUN/attempts/<job>.json     the job itself (the generated sweep.sbatch): "start" when
                                    it begins, then "exit" and "end" when the training ends

A fresh process (`jaxinfra sweep SPEC --status`, the submitter gone) rebuilds every run's
state from these files and the scheduler's queue (`queue`: job -> pending | running | ended | cancelled,
from squeue, else sacct). An attempt the queue no longer knows, without an exit in its record
(node lost, `scancel` with KILL, cancelled while pending), is "lost" and treated like exit 70.

Run states: done (`run_finished`: a summary.json not left by a 75/70 stop) | pending | running |
retrying (the last attempt ended 75 or 70 or was lost, and retries are left: `--wait`
resubmits it) | failed (2, 3, 74, any other status, or retries used up) | cancelled (by
`scancel` without --signal: not retried) | not submitted | unknown (the queue could not be read).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Iterable, Mapping

from jaxinfra.exits import EXIT_HUNG, EXIT_PREEMPTED

JOBS_FILE = "jobs.jsonl"
RETRYABLE = frozenset({EXIT_PREEMPTED, EXIT_HUNG})  # rerunning the same command resumes the run
FINAL_STATES = frozenset({"done", "failed", "cancelled"})


@dataclasses.dataclass(frozen=True)
class Attempt:
    job: str  # "<array job id>_<index>", as squeue -r prints it
    submitted: float | None = None
    start: float | None = None
    end: float | None = None
    exit: int | None = None  # the training command's status, as the job recorded it
    state: str = "pending"  # pending | running | ended | cancelled | lost | unknown
    retry: bool = False  # submitted by `--wait` as a retry of the attempt before

    @property
    def retryable(self) -> bool:
        """Ended 75 or 70, or vanished without a status (treated like 70)."""
        return self.state == "lost" or (self.state == "ended" and self.exit in RETRYABLE)


@dataclasses.dataclass(frozen=True)
class RunStatus:
    run: str
    state: str
    attempts: tuple[Attempt, ...]

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def row(self) -> dict[str, object]:
        last = self.last
        return {"run": self.run, "state": self.state, "exit": None if last is None else last.exit,
                "attempts": len(self.attempts), "job": None if last is None else last.job}


def run_finished(run_dir: pathlib.Path) -> bool:
    """summary.json, and not one a preempted or hung run leaves behind (exit_code 75 / 70: the
    same command resumes it). Every launcher skips a finished run; collect reads only those."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return not isinstance(summary, dict) or summary.get("exit_code") not in RETRYABLE


# The same test in bash, for the job scripts (summary.json is written with indent=2).
FINISHED_SH = ('[ -f "$RUN_DIR/summary.json" ] && '
               '! grep -qE \'"exit_code": (70|75),?$\' "$RUN_DIR/summary.json"')


def record_submitted(out: pathlib.Path, runs_jobs: Iterable[tuple[str, str]], retry: bool) -> None:
    """Appends one line per (run, job) just submitted to OUT/jobs.jsonl; `retry`: a resubmission
    by `--wait` (counted against launcher.retries) rather than a fresh `--submit`."""
    now = time.time()
    with (out / JOBS_FILE).open("a") as f:
        for run, job in runs_jobs:
            f.write(json.dumps({"run": run, "job": job, "submitted": now, "retry": retry}) + "\n")


def submitted(out: pathlib.Path) -> dict[str, list[dict[str, object]]]:
    """run -> its submissions in order, from OUT/jobs.jsonl."""
    path = out / JOBS_FILE
    by_run: dict[str, list[dict[str, object]]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_run.setdefault(row["run"], []).append(row)
    return by_run


def _job_record(run_dir: pathlib.Path, job: str) -> dict[str, object]:
    path = run_dir / "attempts" / f"{job}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # not started yet (or a half-visible write on a slow FS)
        return {}


def attempt(run_dir: pathlib.Path, sub: Mapping[str, object], queue: Mapping[str, str] | None) -> Attempt:
    """One attempt: the job's own record (its exit status is the truth) and the queue's word.

    A recorded exit counts once the queue no longer runs the job (a plain `scancel` lets the
    training record 75, then the queue says CANCELLED: a person's decision, not retried)."""
    job = str(sub["job"])
    rec = _job_record(run_dir, job)
    exit_status = rec.get("exit")
    queued = None if queue is None else queue.get(job)
    if exit_status is not None:
        state = queued if queued in ("pending", "running", "cancelled") else "ended"
    elif queue is None:
        state = "unknown"
    else:
        state = queued or "lost"
        if state == "ended":  # the scheduler says it ended, but the job never recorded a status
            state = "lost"
    return Attempt(job=job, submitted=sub.get("submitted"), start=rec.get("start"), end=rec.get("end"),
                   exit=None if exit_status is None else int(exit_status), state=state,
                   retry=bool(sub.get("retry")))


def run_state(done: bool, attempts: tuple[Attempt, ...], retries: int) -> str:
    """The run's state from its attempts (see the module docstring)."""
    if done:
        return "done"
    if not attempts:
        return "not submitted"
    last = attempts[-1]
    if last.state in ("pending", "running", "unknown", "cancelled"):
        return last.state
    if last.retryable:
        return "retrying" if retries_used(attempts) < retries else "failed"
    return "failed"  # 2, 3, 74, another status, or 0 without a finished summary.json


def retries_used(attempts: tuple[Attempt, ...]) -> int:
    """The resubmissions since the run was last submitted afresh (`--submit`)."""
    used = 0
    for a in reversed(attempts):
        if not a.retry:
            break
        used += 1
    return used


def run_statuses(runs: Iterable[tuple[str, pathlib.Path]], out: pathlib.Path, queue: Mapping[str, str] | None,
                 retries: int) -> list[RunStatus]:
    """Every run's state; `runs` are (name, run dir) in the plan's order."""
    subs = submitted(out)
    statuses = []
    for name, run_dir in runs:
        attempts = tuple(attempt(run_dir, s, queue) for s in subs.get(name, []))
        done = run_finished(run_dir)
        statuses.append(RunStatus(name, run_state(done, attempts, retries), attempts))
    return statuses


def format_status(statuses: Iterable[RunStatus]) -> str:
    """One line per run: run, state, last exit status, attempts, job id."""
    rows = [s.row() for s in statuses]
    header = ("run", "state", "exit", "attempts", "job")
    cells = [header] + [tuple("-" if r[k] is None else str(r[k]) for k in header) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells)
