"""The results table of a sweep: one row per finished run, written as CSV and JSONL.

Each row is computed from the run directory alone -- its `config.yaml` (N, D, C from the
FLOPs accounting of jaxinfra.metrics.flops: C = flops_per_token x D) and its
`summary.json` (final eval loss, tokens/s, wall time) and its `metrics.jsonl` (the last value of
each task metric `eval/<task>/<metric>` logged during training, and of any `--metric` named) -- so a
table can be rebuilt after runs finish anywhere (local, SLURM, Kubernetes) with `jaxinfra scaling
collect`, and `jaxinfra scaling fit --metric NAME` can fit a task metric in place of the loss.
"""

from __future__ import annotations

import csv
import io
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxinfra.atomic import atomic_write_bytes, atomic_write_text
from jaxinfra.cluster.attempts import run_finished
from jaxinfra.config import ConfigError, load_config, require_file
from jaxinfra.metrics.flops import flops_per_token, param_counts
from jaxinfra.storage import as_path, check_bucket, is_url

COLUMNS = ("run", "N", "N_nonemb", "D", "C", "eval_loss", "tokens_per_s", "wall_s", "steps", "batch_size",
           "seq_len", "flops_per_token", "lr", "num_layers", "d_model", "C_budget")
PLAN_FILE = "plan.jsonl"


def last_metrics(run_dir: str | pathlib.Path, names: Sequence[str] = ()) -> dict[str, float]:
    """The last logged value of each task metric (`eval/...`) and of each of `names` in the run's
    metrics.jsonl (a resumed run's later lines win); {} without the file."""
    path = as_path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a killed run's torn last line
        out.update({k: float(v) for k, v in row.items() if (k.startswith("eval/") or k in names)
                    and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def run_row(run_dir: str | pathlib.Path, c_budget: float | None = None,
            metrics: Sequence[str] = ()) -> dict[str, Any] | None:
    """The table row of one run directory; None while it has no summary.json (not finished).

    c_budget: the IsoFLOP compute budget the run belongs to (the profile label approach 2
    groups by); None for grid runs. The row also holds `last_metrics` (task scores, `metrics`).
    """
    run_dir = as_path(run_dir)
    summary_path = run_dir / "summary.json"
    if not run_finished(run_dir):  # none yet, or a preempted run's (it resumes)
        return None
    summary = json.loads(summary_path.read_text())
    cfg = load_config(str(run_dir / "config.yaml"))
    counts = param_counts(cfg.model)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    tokens = cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len
    loss = summary.get("final_eval_loss")
    return {
        "run": run_dir.name, "N": counts["total"], "N_nonemb": counts["non_embedding"], "D": tokens,
        "C": fpt * tokens, "eval_loss": math.nan if loss is None else float(loss),
        "tokens_per_s": summary.get("tokens_per_s"), "wall_s": summary.get("wall_s"), "steps": cfg.train.steps,
        "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "flops_per_token": fpt,
        "lr": cfg.optimizer.lr, "num_layers": cfg.model.num_layers, "d_model": cfg.model.d_model,
        "C_budget": c_budget, **last_metrics(run_dir, metrics),
    }


def collect(out_dir: str | pathlib.Path, metrics: Sequence[str] = ()) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of every finished run of a sweep (with the last value of each of `metrics` and of every task
    metric from its metrics.jsonl), and the names of the unfinished ones.

    The runs are those listed in out_dir/plan.jsonl (written by `jaxinfra sweep`), or
    failing that every subdirectory holding a config.yaml.
    """
    if is_url(out_dir):
        check_bucket(str(out_dir), "sweep directory")
    out_dir = as_path(out_dir)
    plan = out_dir / PLAN_FILE
    if plan.is_file():
        entries = [json.loads(line) for line in plan.read_text().splitlines() if line.strip()]
        runs = [(as_path(e["run_dir"]), e.get("C_budget")) for e in entries]
    elif out_dir.is_dir():
        runs = [(p.parent, None) for p in sorted(out_dir.glob("*/config.yaml"))]
    elif out_dir.exists():  # a file is not "not found"
        raise ConfigError(f"sweep directory {out_dir} is a file, not a directory (give the sweep's --out)")
    else:
        raise ConfigError(f"sweep directory not found: {out_dir}")
    rows, missing = [], []
    for run_dir, budget in runs:
        row = run_row(run_dir, budget, metrics)
        if row is None:
            missing.append(run_dir.name)
        else:
            rows.append(row)
    return rows, missing


def write_results(rows: list[dict[str, Any]], out_dir: str | pathlib.Path,
                  stem: str = "results") -> tuple[pathlib.Path, pathlib.Path]:
    """out_dir/results.csv and out_dir/results.jsonl (the same rows, COLUMNS first)."""
    out_dir = as_path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = list(COLUMNS) + sorted({k for r in rows for k in r} - set(COLUMNS))
    csv_path, jsonl_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.jsonl"
    text = io.StringIO()  # then written whole: an object store's files take no newline= option
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    # collected again from the run directories by every `scaling collect`: replaced, atomically
    atomic_write_bytes(csv_path, text.getvalue().encode(), replace=True)
    atomic_write_text(jsonl_path, "".join(json.dumps({k: _json(row.get(k)) for k in columns}) + "\n" for row in rows),
                      replace=True)
    return csv_path, jsonl_path


def _json(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read_table(path: str | pathlib.Path, target: str = "eval_loss") -> tuple[dict[str, np.ndarray], list[str]]:
    """A CSV or JSONL (.jsonl / .json lines) results file -> ({column: array}, notes).

    Needs the columns N, D and `target` (the fitted metric: eval_loss, or a task metric);
    numeric columns become float arrays, others object arrays. Rows whose N, D or target
    is missing or non-finite, or whose N or D is not positive, are dropped (a note says how many).
    """
    path = as_path(path)
    require_file(path, "results file")
    text = path.read_text()
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise ConfigError(f"{path}:{i}: not a JSON object per line") from None
        if not all(isinstance(r, dict) for r in records):
            raise ConfigError(f"{path}: every line must be a JSON object")
    else:
        records = list(csv.DictReader(text.splitlines()))
    if not records:
        raise ConfigError(f"{path}: no rows")
    columns = list(dict.fromkeys(k for r in records for k in r))
    required = ("N", "D", target)
    missing = [c for c in required if c not in columns]
    if missing:
        raise ConfigError(f"{path}: missing column(s) {', '.join(missing)}; need {', '.join(required)} "
                          f"(found: {', '.join(columns)})")
    table = {c: _column([r.get(c) for r in records]) for c in columns}
    ok = np.ones(len(records), bool)
    for c in required:
        col = table[c]
        if col.dtype == object:
            raise ConfigError(f"{path}: column {c} must hold numbers")
        ok &= np.isfinite(col) & ((col > 0) if c != target else True)
    notes = []
    if not ok.all():
        notes.append(f"dropped {int((~ok).sum())} row(s) with a missing or non-positive N or D, or no {target}")
    return {c: v[ok] for c, v in table.items()}, notes


def _column(values: list[Any]) -> np.ndarray:
    out = []
    for v in values:
        if v is None or v == "":
            out.append(math.nan)
            continue
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            return np.array(["" if x is None else x for x in values], dtype=object)
    return np.array(out, dtype=np.float64)
