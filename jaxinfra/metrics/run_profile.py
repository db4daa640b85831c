"""A training run's profile window (`log.profile_steps=[start, stop]`) and `jaxinfra profile RUN`.

The window traces the steps after `start` steps are done until `stop` are (0-based step indices
start..stop-1; metrics.jsonl's step numbers start+1..stop) with `jax.profiler` (Python tracer off)
into RUN/profile, the directory layout TensorBoard's profile plugin reads (`tensorboard --logdir
RUN/profile`: RUN/profile/plugins/profile/<timestamp>/<host>.xplane.pb, next to jax's
<host>.trace.json.gz and a Perfetto-ready perfetto_trace.json.gz). The device is drained before the
trace starts and again after the last step, so the window holds exactly those steps' device work.
Beside the trace: the train step's compiled HLO text (what classifies each op, jaxinfra/metrics/hlo.py)
and window.json (the steps, the trace file, the program's name), which `jaxinfra profile RUN` reads
to print the per-category shares and top ops (jaxinfra/metrics/trace.py). Only process 0 traces, so a
multi-host run's profile is process 0's devices.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
from typing import Any

import jax

from jaxinfra.atomic import atomic_write_text
from jaxinfra.metrics.trace import StepProfile, load_events, op_events, summarize

PROFILE_DIR = "profile"
WINDOW_FILE = "window.json"
HLO_FILE = "train_step.hlo.txt.gz"
_ACCELERATORS = ("/device:GPU", "/device:TPU")  # the trace's process names of device lines


class ProfileWindow:
    """Starts and stops one trace around the configured steps (a no-op without a window)."""

    def __init__(self, run_dir: str | os.PathLike, steps: tuple[int, ...], enabled: bool = True):
        self.dir = pathlib.Path(run_dir) / PROFILE_DIR
        self.start, self.stop = (steps[0], steps[1]) if steps and enabled else (None, None)
        self.module: str | None = None
        self.tracing = False

    @property
    def wanted(self) -> bool:
        return self.start is not None

    def keep_program(self, compiled: Any) -> None:
        """Save the compiled step's HLO text (the op classification reads it)."""
        if not self.wanted:
            return
        text = compiled.as_text()
        self.module = text.split(None, 2)[1].rstrip(",") if text.startswith("HloModule") else None
        self.dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(self.dir / HLO_FILE, "wt") as f:
            f.write(text)

    def before(self, step: int, state: Any) -> None:
        """Before dispatching `step` (1-based): start the trace when it opens the window."""
        if self.wanted and step == self.start + 1:
            jax.block_until_ready(state)  # earlier steps' device work stays out of the window
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # the loop's Python calls would dwarf the ops in the file
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True, profiler_options=options)
            self.tracing = True

    def after(self, step: int, outputs: Any) -> str | None:
        """After dispatching `step`: at the window's end wait for its work, stop, and say where it is."""
        if not (self.tracing and step == self.stop):
            return None
        jax.block_until_ready(outputs)
        self.close()
        trace = _newest_trace(self.dir)
        atomic_write_text(self.dir / WINDOW_FILE, json.dumps({
            "start": self.start, "stop": self.stop, "steps": self.stop - self.start, "module": self.module,
            "trace": str(trace.relative_to(self.dir)) if trace else None}, indent=1), replace=True)
        return (f"profile: steps {self.start + 1}..{self.stop} traced into {self.dir} (tensorboard --logdir "
                f"{self.dir}; `jaxinfra profile {self.dir.parent}` for the shares)")

    def close(self) -> None:
        """Stop a trace still running (the run ended inside the window: what was traced is kept)."""
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()


def _newest_trace(directory: pathlib.Path) -> pathlib.Path | None:
    traces = sorted(directory.glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    return traces[-1] if traces else None


class NoProfileError(ValueError):
    """The run holds no finished profile window (bad input for `jaxinfra profile`)."""


def read_run_profile(run_dir: str | os.PathLike) -> tuple[StepProfile, dict[str, Any]]:
    """The step profile of a run's window (and window.json's facts); NoProfileError when there is none."""
    from jaxinfra.metrics.hlo import parse_hlo

    run = pathlib.Path(run_dir)
    if not run.is_dir():
        raise NoProfileError(f"{run_dir}: no such run directory")
    window_file = run / PROFILE_DIR / WINDOW_FILE
    if not window_file.is_file():
        raise NoProfileError(f"{run_dir} holds no profile: train it with log.profile_steps=[START,STOP] "
                             f"(e.g. log.profile_steps=[5,8] traces steps 6..8 into RUN/{PROFILE_DIR})")
    window = json.loads(window_file.read_text())
    hlo_path, trace = run / PROFILE_DIR / HLO_FILE, window.get("trace")
    if not trace or not (run / PROFILE_DIR / trace).is_file() or not hlo_path.is_file():
        raise NoProfileError(f"{run / PROFILE_DIR}: the trace or the step's HLO text is missing")
    with gzip.open(hlo_path, "rt") as f:
        module = parse_hlo(f.read())
    events = load_events(run / PROFILE_DIR / trace)
    # An accelerator's trace must hold device op events (host launches alone are no profile of the step).
    on_device = any(e.get("ph") == "M" and str(e.get("args", {}).get("name", "")).startswith(_ACCELERATORS)
                    for e in events)
    return summarize(op_events(events, module.name, device=on_device), module, window["steps"]), window
