"""Running a sweep's runs: one after another here, or as a SLURM job array / Kubernetes Indexed Job / JobSets.

Every launcher runs the same command per run,

    jaxinfra train <out>/<run>/config.yaml --run-dir <out>/<run>

after `prepare` has written each run's resolved config.yaml, so a run is reproducible from
its directory alone. Paths are as given to --out (relative paths resolve against the
directory the jobs start in: the submission directory for SLURM, `launcher.k8s.workdir` or
`launcher.jobset.workdir` for Kubernetes). A run whose directory holds summary.json is complete and skipped by
every launcher, unless that summary says the run was preempted or hung (exit_code 75 or
70); one without it (never started, or interrupted) is run again with the same command,
which resumes from the run's last checkpoint when it has one (checkpoint.enabled) and
otherwise starts over. `--submit` hands the SLURM array to jaxinfra/cluster/slurm.py.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from jaxinfra.atomic import atomic_write_text
from jaxinfra.cluster.attempts import FINISHED_SH, run_finished
from jaxinfra.scaling.results import PLAN_FILE
from jaxinfra.scaling.spec import Plan, RunPlan

LAUNCHERS = ("local", "slurm", "k8s", "jobset")


def is_complete(run: RunPlan) -> bool:
    return run_finished(run.run_dir)


def prepare(plan: Plan) -> list[str]:
    """Writes out/plan.jsonl and every unfinished run's config.yaml; returns warnings.

    A finished run keeps its config; if the spec now gives it a different one, a warning
    says so (delete the run directory to re-run it).
    """
    plan.out.mkdir(parents=True, exist_ok=True)
    # the sweep's own files, written again from the spec by every `sweep`: replaced, atomically
    atomic_write_text(plan.out / PLAN_FILE, "".join(json.dumps(run.row()) + "\n" for run in plan.runs), replace=True)
    warnings = []
    for run in plan.runs:
        text = run.config.to_yaml()
        if is_complete(run):
            if run.config_path.is_file() and run.config_path.read_text() != text:
                warnings.append(f"{run.name}: finished with a different config than the spec now gives; "
                                f"delete {run.run_dir} to re-run it")
            continue
        run.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.config_path, text, replace=True)
    return warnings


def set_aside_partial_metrics(run: RunPlan) -> None:
    """An interrupted run without a checkpoint restarts from step 0: keep its old metrics.jsonl
    under another name. (With a checkpoint, `jaxinfra train` resumes and appends to it.)"""
    from jaxinfra.checkpoint import committed_steps  # jax and Orbax: loaded only when a sweep runs

    metrics = run.run_dir / "metrics.jsonl"
    if committed_steps(run.run_dir / "checkpoints"):  # an uncommitted or temporary step dir resumes nothing
        return
    if metrics.is_file():
        k = 1
        while (run.run_dir / f"metrics.interrupted-{k}.jsonl").exists():
            k += 1
        metrics.rename(run.run_dir / f"metrics.interrupted-{k}.jsonl")


def run_local(plan: Plan, *, in_process: bool = False, devices: Sequence[Any] | None = None,
              echo: Callable[[str], None] = print) -> dict[str, str]:
    """Runs the unfinished runs one after another; returns {run: skipped | done | failed}.

    By default each run is a child process, `python -m jaxinfra train ...` (the same CLI as
    the `jaxinfra` script, so nothing depends on PATH). in_process=True calls
    jaxinfra.train.train on the run's config.yaml in this process instead (with `devices`),
    which is what the tests do. A failed run does not stop the sweep.
    """
    status: dict[str, str] = {}
    todo = [r for r in plan.runs if not is_complete(r)]
    for run in plan.runs:
        if is_complete(run):
            status[run.name] = "skipped"
    if len(todo) < len(plan.runs):
        echo(f"sweep: {len(plan.runs) - len(todo)} of {len(plan.runs)} runs complete, skipping them")
    for i, run in enumerate(todo, 1):
        echo(f"sweep: [{i}/{len(todo)}] {run.name}: {shlex.join(run.command)}")
        set_aside_partial_metrics(run)
        if in_process:
            ok = _train_in_process(run, devices, echo)
        else:
            ok = subprocess.run([sys.executable, "-m", "jaxinfra", *run.command[1:]]).returncode == 0
        status[run.name] = "done" if ok and is_complete(run) else "failed"
        if status[run.name] == "failed":
            echo(f"sweep: {run.name} failed; continuing with the next run")
    return status


def _train_in_process(run: RunPlan, devices: Sequence[Any] | None, echo: Callable[[str], None]) -> bool:
    from jaxinfra.config import load_config
    from jaxinfra.train import train

    try:
        train(load_config(str(run.config_path)), run.run_dir, devices=devices)
    except Exception as e:  # noqa: BLE001 - one failed run must not end the sweep
        echo(f"sweep: {run.name}: {type(e).__name__}: {e}")
        return False
    return True


# ---------------------------------------------------------------- cluster files


def _case_lines(plan: Plan) -> list[str]:
    """One `case` branch per run: index -> the run's exact command, as a bash array."""
    return [f"  {i}) CMD=({shlex.join(run.command)}) ;;" for i, run in enumerate(plan.runs)]


_RUN_ONE = """\
RUN_DIR="${{CMD[${{#CMD[@]}}-1]}}"  # the value of --run-dir, the command's last argument
if {finished}; then
  echo "$RUN_DIR: complete (summary.json), skipping"
  exit 0
fi
{launch}"${{CMD[@]}}"
"""


# A SLURM task records each attempt in RUN_DIR/attempts/<array job>_<index>.json: once when it
# starts, again with the exit status when the training command ends, so `sweep --status` reads
# the outcome from any process (jaxinfra/cluster/attempts.py). `srun` starts the training as a
# job step: `scancel --signal=TERM JOB` signals job steps, not the batch shell, so the training
# gets the TERM, commits a checkpoint and exits 75, and this shell survives to record it.
_RUN_ONE_SLURM = """\
RUN_DIR="${CMD[${#CMD[@]}-1]}"  # the value of --run-dir, the command's last argument
if FINISHED_SH; then
  echo "$RUN_DIR: complete (summary.json), skipping"
  exit 0
fi
JOB="${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
mkdir -p "$RUN_DIR/attempts"
record() {  # record [EXIT END]: the attempt's JSON, written whole (tmp + rename)
  local rec="$RUN_DIR/attempts/$JOB.json"
  printf '{"job": "%s", "job_id": "%s", "node": "%s", "start": %s%s}\\n' "$JOB" "$SLURM_JOB_ID" \\
    "$(hostname -s)" "$START" "${1:+, \\"exit\\": $1, \\"end\\": $2}" >"$rec.tmp" && mv "$rec.tmp" "$rec"
}
START=$(date +%s.%N)
record
# SLURM's time limit (and some preemption modes) TERM the batch shell too: a handler (not an
# ignore, which the step would inherit) lets it outlive the step and record the step's status
trap 'echo "$JOB: SIGTERM; recording the attempt when the training ends" >&2' TERM
set +e
srun --kill-on-bad-exit=1 "${CMD[@]}"
STATUS=$?
set -e
record "$STATUS" "$(date +%s.%N)"
exit "$STATUS"
"""


def write_slurm(plan: Plan) -> pathlib.Path:
    """out/sweep.sbatch: a job array with one task per run (`sbatch out/sweep.sbatch`)."""
    s = plan.spec.launcher.slurm
    n = len(plan.runs)
    array = f"0-{n - 1}" + (f"%{s.max_parallel}" if s.max_parallel else "")
    opts = [f"--job-name={s.job_name or plan.spec.name}", f"--array={array}", f"--time={s.time}",
            f"--nodes={s.nodes}", "--ntasks-per-node=1", f"--output={plan.out}/slurm-%A_%a.out",
            f"--chdir={pathlib.Path.cwd()}"]
    if s.partition:
        opts.append(f"--partition={s.partition}")
    if s.account:
        opts.append(f"--account={s.account}")
    if s.gpus_per_node:
        opts.append(f"--gpus-per-node={s.gpus_per_node}")
    if s.cpus_per_task:
        opts.append(f"--cpus-per-task={s.cpus_per_task}")
    opts += list(s.extra)
    lines = ["#!/bin/bash",
             f"# jaxinfra sweep '{plan.spec.name}': {n} runs, one per array task. Submit with:",
             f"#   sbatch {plan.out}/sweep.sbatch",
             *(f"#SBATCH {o}" for o in opts),
             "set -euo pipefail", *s.setup,
             'case "$SLURM_ARRAY_TASK_ID" in', *_case_lines(plan),
             '  *) echo "no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 1 ;;', "esac",
             # several nodes per run: one process per node, jax.distributed finds the SLURM job
             _RUN_ONE_SLURM.replace("FINISHED_SH", FINISHED_SH)]
    path = plan.out / "sweep.sbatch"
    plan.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines), replace=True)
    return path


def write_k8s(plan: Plan) -> pathlib.Path:
    """out/sweep-job.yaml: an Indexed Job, one completion index per run (`kubectl apply -f`).

    Each pod runs in `launcher.k8s.workdir`; mount the volume that holds --out there
    (`launcher.k8s.pvc`), so configs go in and results come back.
    """
    k = plan.spec.launcher.k8s
    n = len(plan.runs)
    script = "\n".join(["set -euo pipefail", *k.setup, 'case "$JOB_COMPLETION_INDEX" in', *_case_lines(plan),
                        '  *) echo "no run for index $JOB_COMPLETION_INDEX" >&2; exit 1 ;;', "esac",
                        _RUN_ONE.format(launch="exec ", finished=FINISHED_SH)])
    name = "".join(ch if ch.isalnum() else "-" for ch in (k.job_name or plan.spec.name).lower()).strip("-")
    container: dict[str, Any] = {"name": "train", "image": k.image, "workingDir": k.workdir,
                                 "command": ["bash", "-c", script]}
    resources: dict[str, Any] = {}
    if k.gpus:
        resources["limits"] = {"nvidia.com/gpu": k.gpus}
    requests = {key: v for key, v in (("cpu", k.cpu), ("memory", k.memory)) if v}
    if requests:
        resources["requests"] = requests
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if k.pvc:
        container["volumeMounts"] = [{"name": "work", "mountPath": k.workdir}]
        pod["volumes"] = [{"name": "work", "persistentVolumeClaim": {"claimName": k.pvc}}]
    metadata: dict[str, Any] = {"name": name or "jaxinfra-sweep", "labels": {"app": "jaxinfra-sweep"}}
    if k.namespace:
        metadata["namespace"] = k.namespace
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
           "spec": {"completionMode": "Indexed", "completions": n, "parallelism": k.parallelism or n,
                    "backoffLimitPerIndex": k.backoff_limit_per_index, "template": {"spec": pod}}}
    path = plan.out / "sweep-job.yaml"
    plan.out.mkdir(parents=True, exist_ok=True)
    header = f"# jaxinfra sweep '{plan.spec.name}': {n} runs, one per completion index. kubectl apply -f {path}\n"
    atomic_write_text(path, header + yaml.dump(job, Dumper=_BlockDumper, sort_keys=False, width=10_000), replace=True)
    return path


def jobset_manifests(plan: Plan) -> list[tuple[RunPlan, dict[str, Any]]]:
    """One JobSet per unfinished run (`launcher.jobset.hosts` pods each), checked, nothing written.

    Each JobSet runs the run's command in `launcher.jobset.workdir`; the out dir must be a gs:// / s3://
    URL or lie on the claim mounted there (`launcher.jobset.pvc`), so configs go in and results come back.
    """
    from jaxinfra.cluster import jobset as js

    spec = plan.spec.launcher.jobset
    longest = js.max_name_length(spec.hosts)
    sweep_label = js.dns_name(plan.spec.name, 63)
    names: set[str] = set()
    out = []
    for run in (r for r in plan.runs if not is_complete(r)):
        js.check_run_dir(str(run.run_dir), spec, f"run {run.name}: its run dir")
        name = js.dns_name(f"{plan.spec.name}-{run.name}", longest)
        if name in names:  # two run names that read the same once cleaned
            name = js.dns_name(f"{plan.spec.name}-{run.name}", longest, unique=True)
        names.add(name)
        labels = {"jaxinfra/sweep": sweep_label, "jaxinfra/run": js.dns_name(run.name, 63)}
        out.append((run, js.jobset(name, run.command, spec, labels=labels)))
    return out


def write_jobsets(plan: Plan, manifests: list[tuple[RunPlan, dict[str, Any]]] | None = None) -> list[pathlib.Path]:
    """out/jobsets/<run>.yaml per unfinished run, and all of them in out/sweep-jobsets.yaml (returned first)."""
    from jaxinfra.cluster.jobset import to_yaml

    manifests = jobset_manifests(plan) if manifests is None else manifests
    folder = plan.out / "jobsets"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for run, obj in manifests:
        paths.append(folder / f"{run.name}.yaml")
        atomic_write_text(paths[-1], to_yaml([obj], f"jaxinfra sweep '{plan.spec.name}', run {run.name}"), replace=True)
    everything = plan.out / "sweep-jobsets.yaml"
    atomic_write_text(everything, to_yaml([obj for _, obj in manifests],
                                          f"jaxinfra sweep '{plan.spec.name}': {len(manifests)} JobSets, one per "
                                          f"unfinished run ({len(plan.runs) - len(manifests)} complete). kubectl apply "
                                          f"-f {everything}"), replace=True)
    return [everything, *paths]


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (the pod's script) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)
