"""Experiment trackers behind the one metrics writer: Weights & Biases (`log.wandb`) and MLflow (`log.mlflow`).

`MetricsLogger` (writers.py) is the only writer: each record it writes to metrics.jsonl and TensorBoard
(train lines, eval lines, host metrics such as `eval/<task>/<metric>`, checkpoint times) goes through
`Trackers.log` to every tracker here, and the run summary through `Trackers.summary`. Only process 0
opens them (the caller's job, as for the writer). The resolved config is the W&B run config and the
MLflow run's params (dotted keys, values as strings cut to MLflow's length limit).

Defaults keep everything inside the run directory and off the network: W&B runs offline unless
`log.wandb.mode=online` (files under RUN/wandb, `wandb sync` uploads them later; no console capture,
no system stats), and MLflow's store is `sqlite:///<RUN>/mlflow.db` with artifacts under RUN/mlflow-artifacts
(never mlflow's ./mlruns in the current directory).

Resume: RUN/trackers.json keeps each tracker's run id and the last step it received. A run resumed from
a checkpoint (start step > 0) continues the same tracker runs (W&B: the same id, resume="allow"; MLflow:
the same run id set RUNNING again) and skips records at steps <= that last step: an exact resume replays
the same values, and a tracker cannot take a step back, so every step appears once. A fresh start
(step 0) opens new tracker runs, as metrics.jsonl starts over. `close` records the outcome: W&B's exit
code (and preemption mark), MLflow's FINISHED / FAILED / KILLED.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from jaxinfra.atomic import atomic_write_text
from jaxinfra.config_sections import MlflowConfig, WandbConfig

STATE_FILE = "trackers.json"
OUTCOMES = ("finished", "failed", "killed")


class Tracker:
    """One tracker run: `log` scalars at a step, `summary` values at the end, `close` with the outcome."""

    name: ClassVar[str] = "tracker"
    run_id: str = ""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def summary(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, outcome: str) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What trackers.json keeps to continue this run (its id; the last step is added by `Trackers`)."""
        return {"run_id": self.run_id}


def requested(wandb: WandbConfig, mlflow: MlflowConfig) -> list[tuple[str, str]]:
    """(package, the config key that asks for it) of each tracker `log.wandb` / `log.mlflow` turn on."""
    out = []
    if wandb.project is not None:
        out.append(("wandb", "log.wandb.project"))
    if mlflow.enabled:
        out.append(("mlflow", "log.mlflow.tracking_uri" if mlflow.tracking_uri else "log.mlflow.experiment"))
    return out


def missing_package(wandb: WandbConfig, mlflow: MlflowConfig) -> str | None:
    """The line for a tracker asked for whose package does not import (naming the extra to install), or
    None; callers raise it as a ConfigError before anything is compiled or written."""
    for package, key in requested(wandb, mlflow):
        try:
            __import__(package)
        except ImportError:
            return f"{key} is set but {package} is not installed: pip install 'jaxinfra[{package}]'"
    return None


# ---------------------------------------------------------------- W&B


_WANDB_EXIT = {"finished": 0, "failed": 1, "killed": 75}  # 75: jaxinfra's "preempted, rerun to resume"


class WandbTracker(Tracker):
    """A wandb run in RUN/wandb (offline by default): config = the resolved config, name = the run dir's."""

    name = "wandb"

    def __init__(self, w: WandbConfig, config: dict[str, Any], run_dir: pathlib.Path, name: str,
                 run_id: str | None = None):
        import wandb

        # No console capture, system stats or environment scan: the run's lines stay plain and tests fast.
        settings = wandb.Settings(mode=w.mode, console="off", x_disable_stats=True, x_disable_meta=True,
                                  x_save_requirements=False, silent=True)
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.name or name,
                              tags=list(w.tags) or None, group=w.group, config=config, dir=str(run_dir),
                              id=run_id, resume="allow", settings=settings,
                              reinit="create_new")
        self.run_id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def summary(self, step: int, scalars: dict[str, float]) -> None:
        self.run.summary.update(scalars)

    def close(self, outcome: str) -> None:
        if outcome == "killed":
            self.run.mark_preempting()
        self.run.finish(exit_code=_WANDB_EXIT[outcome])


# ---------------------------------------------------------------- MLflow


_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
_MLFLOW_KEY = re.compile(r"[^\w\-. /]")  # MLflow keys: alphanumerics, _ - . space /


def default_tracking_uri(run_dir: pathlib.Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def flat_params(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value as text) of a nested config dict, lists as JSON."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_params(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value)


class MlflowTracker(Tracker):
    """An MLflow run (MlflowClient, so no process-global active run): params = the resolved config,
    run name = the run dir's, tag `group` (sweeps: the sweep's name)."""

    name = "mlflow"

    def __init__(self, m: MlflowConfig, config: dict[str, Any], run_dir: pathlib.Path, name: str,
                 saved: dict[str, Any] | None = None):
        from mlflow.tracking import MlflowClient

        self.uri = m.tracking_uri or default_tracking_uri(run_dir)
        self.client = MlflowClient(self.uri)
        params = dict(flat_params(config))
        if saved and saved.get("tracking_uri") == self.uri:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            # Params cannot change once logged: a resume adds only keys the run does not have yet.
            params = {k: v for k, v in params.items() if k not in self.client.get_run(self.run_id).data.params}
        else:
            tags = {"group": m.group} if m.group else {}
            run = self.client.create_run(self._experiment(m.experiment or "jaxinfra", run_dir),
                                         run_name=name, tags=tags)
            self.run_id = run.info.run_id
        self._log_params(params)

    def _experiment(self, name: str, run_dir: pathlib.Path) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        local = self.uri.startswith(("sqlite:", "file:")) or "://" not in self.uri
        # A local store keeps artifacts beside it, not in mlflow's default ./mlruns of the current directory.
        where = (run_dir / "mlflow-artifacts").resolve().as_uri() if local else None
        return self.client.create_experiment(name, artifact_location=where)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        items = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_KEY.sub("_", k), v, now, step) for k, v in scalars.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def summary(self, step: int, scalars: dict[str, float]) -> None:
        self.log(step, {f"summary/{k}": v for k, v in scalars.items()})

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, _MLFLOW_STATUS[outcome])

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}


# ---------------------------------------------------------------- all of them


def scalars_of(metrics: dict[str, Any]) -> dict[str, float]:
    """The entries a tracker (or TensorBoard) can plot: numbers (NaN and inf kept), not text, flags or None;
    nested dicts flattened with '/' (the summary's param counts)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in scalars_of(value).items()})
            continue
        if key == "step" or isinstance(value, (str, bool)) or value is None:
            continue
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue  # not a scalar: JSONL only
    return out


class Trackers:
    """The trackers of one run and RUN/trackers.json: records at or below a tracker's resume floor (the
    last step an earlier attempt gave it) are skipped; a tracker that fails is dropped with one warning,
    so a tracker outage never stops a training run."""

    def __init__(self, run_dir: pathlib.Path, trackers: list[Tracker], floors: dict[str, int]):
        self.path = run_dir / STATE_FILE
        self.trackers = trackers
        self.floors = floors
        self.last = dict(floors)
        self._save()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = scalars_of(metrics)
        if scalars:
            self._each(lambda t: t.log(step, scalars), step, skip_floor=True)

    def summary(self, step: int, summary: dict[str, Any]) -> None:
        self._each(lambda t: t.summary(step, scalars_of(summary)), step, skip_floor=False)

    def close(self, outcome: str) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close(outcome)
            except Exception as e:  # noqa: BLE001 - the others still close
                _warn(f"closing {t.name} failed: {type(e).__name__}: {e}")

    def _each(self, call: Any, step: int, skip_floor: bool) -> None:
        for t in list(self.trackers):
            if skip_floor and step <= self.floors.get(t.name, -1):
                continue
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - a tracker outage must not end the run
                _warn(f"{t.name} failed at step {step} ({type(e).__name__}: {e}); it logs nothing more this run")
                self.trackers.remove(t)
                continue
            self.last[t.name] = max(self.last.get(t.name, -1), step)
        self._save()

    def _save(self) -> None:
        state = {t.name: {**t.state(), "last_step": self.last.get(t.name, -1)} for t in self.trackers}
        atomic_write_text(self.path, json.dumps(state, indent=1) + "\n", replace=True)


def _warn(text: str) -> None:
    print(f"jaxinfra: warning: {text}", file=sys.stderr, flush=True)


def open_trackers(wandb: WandbConfig, mlflow: MlflowConfig, config: dict[str, Any], run_dir: str | os.PathLike,
                  start_step: int, name: str | None = None) -> Trackers | None:
    """The trackers `log.wandb` / `log.mlflow` ask for (None: none), logging `config` (the resolved run
    config) for a run starting after `start_step`, their files in `run_dir`, named `name` (default: the
    run dir's name; a bucket run passes its URL's); a resume (start_step > 0) continues the runs
    RUN/trackers.json names."""
    wanted = [package for package, _ in requested(wandb, mlflow)]
    if not wanted:
        return None
    run_dir = pathlib.Path(run_dir)
    name = name or run_dir.name
    saved = _read_state(run_dir / STATE_FILE) if start_step > 0 else {}
    trackers: list[Tracker] = []
    if "wandb" in wanted:
        trackers.append(WandbTracker(wandb, config, run_dir, name, saved.get("wandb", {}).get("run_id")))
    if "mlflow" in wanted:
        trackers.append(MlflowTracker(mlflow, config, run_dir, name, saved.get("mlflow")))
    floors = {t.name: int(saved[t.name].get("last_step", -1)) for t in trackers
              if saved.get(t.name, {}).get("run_id") == t.run_id}
    return Trackers(run_dir, trackers, floors)


def _read_state(path: pathlib.Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: new tracker runs
    return state if isinstance(state, dict) else {}

