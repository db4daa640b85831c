"""Where metrics go: a JSONL file (+ TensorBoard and the trackers), a console progress bar, a run summary.

`MetricsLogger` is the run's one metrics writer: W&B and MLflow (jaxinfra/metrics/trackers.py) are fed
from it, never written to beside it. Only one process (process 0) should write; choosing it is the
caller's job.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import sys
import time
from typing import Any

from tqdm import tqdm

from jaxinfra.atomic import atomic_write_text
from jaxinfra.metrics.trackers import Trackers, scalars_of


def _json_value(value: Any) -> Any:
    """A JSON-legal version of `value`: numpy / jax scalars become Python numbers and
    non-finite floats become None (JSON has no NaN/inf; `null` keeps every line
    parseable by strict readers such as jq or pandas)."""
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:  # numpy / jax scalar or 0-d array
        value = value.item()
        if isinstance(value, (bool, int)):
            return value
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return value  # anything else: json.dumps decides (and fails loudly if it must)


def _truncate_jsonl(path: pathlib.Path, resume_step: int) -> None:
    """Keep the lines of steps <= resume_step, rewriting the file atomically. A start from step 0 over an
    earlier history (a run dir whose checkpoints were never committed) keeps that history whole beside it,
    as metrics.before-fresh-start-<time>.jsonl: a restart never erases what a run measured."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if not resume_step:
        if any(line.strip() for line in lines):
            path.rename(path.with_name(f"{path.stem}.before-fresh-start-{int(time.time())}{path.suffix}"))
        return
    kept = [line for line in lines if _line_step(line) <= resume_step]
    if len(kept) == len(lines):
        return
    atomic_write_text(path, "".join(kept), replace=True)


def _line_step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except (ValueError, AttributeError):
        return math.inf  # a torn last line of a killed run: dropped


class MetricsLogger:
    """Appends one JSON line per `log` call to run_dir/metrics.jsonl and mirrors the
    scalars to TensorBoard (tensorboardX event files under run_dir).

    Non-finite values (NaN, +-inf) are written to the JSONL file as `null`; TensorBoard
    receives the raw float, which its format represents (a NaN loss shows up there).
    The file is opened in append mode, so a resumed run continues the same file. With
    `resume_step=S` the lines a killed run wrote after its checkpoint at step S (which the
    resumed run writes again) are dropped first, and TensorBoard is told to purge its events
    after S, so every step appears once in both (S=0, a fresh start over an earlier history: that
    history is kept whole as metrics.before-fresh-start-<time>.jsonl).
    `trackers` (W&B, MLflow; see trackers.py) get the same scalars as TensorBoard, `log_summary` the
    run summary's, and `close(outcome)` ends their runs as finished, failed or killed.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        jsonl_name: str = "metrics.jsonl",
        resume_step: int | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / jsonl_name
        resumed = resume_step is not None and self.jsonl_path.is_file()  # an earlier run wrote here
        if resumed:
            _truncate_jsonl(self.jsonl_path, resume_step)
        self._file = open(self.jsonl_path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: optional dependency

            purge = resume_step + 1 if resumed and resume_step else 0 if resumed else None
            self._tb = SummaryWriter(logdir=str(self.run_dir), purge_step=purge)
        self.trackers = trackers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write `{"step": step, **metrics}`; nothing is added or renamed."""
        if self._file is None:
            raise RuntimeError("MetricsLogger.log called after close()")
        if "step" in metrics and metrics["step"] != step:
            raise ValueError(f"metrics['step']={metrics['step']!r} disagrees with step={step}")
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # Flush per line: a crash (OOM, preemption, NaN abort) must not lose logged lines.
        self._file.flush()
        if self._tb is not None:
            for key, scalar in scalars_of(metrics).items():
                self._tb.add_scalar(key, scalar, global_step=int(step))
            self._tb.flush()
        if self.trackers is not None:
            self.trackers.log(int(step), metrics)

    def log_summary(self, step: int, summary: dict[str, Any]) -> None:
        """The run summary's numbers to the trackers (W&B's run summary, MLflow `summary/<key>` metrics)."""
        if self.trackers is not None:
            self.trackers.summary(int(step), summary)

    def close(self, outcome: str = "finished") -> None:
        """Flush and close every output (the trackers' runs end as `outcome`: finished, failed or killed);
        safe to call twice."""
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            trackers.close(outcome)
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _format_rate(value: float) -> str:
    """Compact tokens/s: 950, 12.3k, 4.56M."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


class ProgressBar:
    """A tqdm bar on stderr over training steps; postfix shows loss, tok/s and MFU (%).

    tqdm supplies the rate and ETA. With enabled=False nothing is printed (non-zero
    processes, or logs captured to a file where a bar would be noise).
    """

    def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool = True) -> None:
        self._bar = tqdm(
            total=total_steps,
            initial=initial,
            disable=not enabled,
            file=sys.stderr,
            unit="step",
            dynamic_ncols=True,
        )
        self._step = initial

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Move the bar to `step` (absolute, not an increment) and refresh the postfix."""
        postfix: dict[str, str] = {}
        if metrics.get("loss") is not None:
            postfix["loss"] = f"{float(metrics['loss']):.4f}"
        if metrics.get("tokens_per_s") is not None:
            postfix["tok/s"] = _format_rate(float(metrics["tokens_per_s"]))
        if metrics.get("mfu") is not None:
            postfix["MFU"] = f"{100.0 * float(metrics['mfu']):.1f}%"
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        delta = step - self._step
        self._step = step
        if delta > 0:
            self._bar.update(delta)
        else:
            self._bar.refresh()

    def write(self, message: str, *, error: bool = False) -> None:
        """Print a line without breaking the bar (printed even when the bar is disabled): to stdout, or with
        `error` to stderr, where every `jaxinfra: error:` line goes (a log of stdout holds results only)."""
        tqdm.write(message, file=sys.stderr if error else sys.stdout)

    @property
    def n(self) -> int:
        """The step the bar is at."""
        return self._step

    def close(self) -> None:
        self._bar.close()


def write_summary(run_dir: str | os.PathLike, summary: dict) -> pathlib.Path:
    """Write run_dir/summary.json atomically: a temp file in the same directory, fsync,
    then os.replace, so readers never see a half-written file. Non-finite floats -> null."""
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "summary.json"
    text = json.dumps(_json_value(summary), indent=2, sort_keys=True, allow_nan=False) + "\n"
    return atomic_write_text(path, text, replace=True)


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_s_per_device * flops_per_token / peak_flops
