"""Selected fields of a run's metrics.jsonl as a table (the training lines; the eval lines with --eval).

    python scripts/guide/metrics_table.py RUN_DIR [RUN_DIR ...] [--keys step,loss,grad_norm] [--eval]

With several run dirs, one block of rows per run, labelled by the run dir's name. Fields a
line lacks print as '-'. The fields are the `metrics.jsonl` contract (README, Metrics).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxinfra.metrics.table import Column, format_table


def read_lines(run_dir: str, evals: bool) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [x for x in lines if ("eval_loss" if evals else "loss") in x]  # (checkpoint lines have neither)


def _fmt(value) -> object:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--keys", default="step,loss,grad_norm,tokens_per_s")
    parser.add_argument("--eval", action="store_true", help="the eval lines instead of the training lines")
    args = parser.parse_args()
    keys = args.keys.split(",")
    rows = []
    for run in args.run_dirs:
        for line in read_lines(run, args.eval):
            rows.append([pathlib.Path(run).name, *(_fmt(line.get(k)) for k in keys)])
    columns = ([Column("run")] if len(args.run_dirs) > 1 else []) + [Column(k, align=">") for k in keys]
    print(format_table([r if len(args.run_dirs) > 1 else r[1:] for r in rows], columns))


if __name__ == "__main__":
    main()
