"""The checkpoint interval a failure rate calls for (jaxinfra/plan/reliability.py), from reported counts.

    python scripts/guide/checkpoint_interval.py RUN_DIR [--interruptions 419 --days 54 --devices 16384]
        [--step-s S] [--scales 8,1024,16384,100000] [--checkpoint-s 1,10,60]

Reads the median `checkpoint_block_s` (the seconds an asynchronous save blocked the loop) and
`step_time_s` of a run's metrics.jsonl, derives the per-device MTBF the counts imply, and prints,
per job size: the job's MTBF, Young's interval sqrt(2 C M) for C = the measured block time and
for the `--checkpoint-s` values (a synchronous write of a large state), and `checkpoint.every` at
the step time (`--step-s`, default the run's own).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan.reliability import (
    checkpoint_every,
    daly_interval,
    device_mtbf_s,
    job_mtbf_s,
    lost_fraction,
    young_interval,
)


def measured(run_dir: pathlib.Path) -> tuple[float, float]:
    """(median checkpoint block seconds, median step seconds) of a run, past its first step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    blocks = [r["checkpoint_block_s"] for r in rows if "checkpoint_block_s" in r]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > 1]
    if not blocks or not steps:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no checkpoint_block_s or step_time_s rows "
                         f"(train with checkpoint.every and log.every=1)")
    return statistics.median(blocks), statistics.median(steps)


def table(device_mtbf: float, costs: list[tuple[str, float]], scales: list[int], step_s: float) -> str:
    rows = []
    for n in scales:
        m = job_mtbf_s(device_mtbf, n)
        for label, c in costs:
            t = young_interval(c, m)
            rows.append([f"{n:,}", m / 3600, label, c, t / 60, daly_interval(c, m) / 60,
                         100 * lost_fraction(t, c, m), checkpoint_every(t, step_s)])
    cols = [Column("devices", align=">"), Column("job MTBF h", ".2f", ">"), Column("C is"), Column("C s", ".3f", ">"),
            Column("Young min", ".2f", ">"), Column("Daly min", ".2f", ">"), Column("lost %", ".2f", ">"),
            Column("checkpoint.every", "d", ">")]
    return format_table(rows, cols)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=pathlib.Path)
    p.add_argument("--interruptions", type=int, default=419)
    p.add_argument("--days", type=float, default=54)
    p.add_argument("--devices", type=int, default=16384)
    p.add_argument("--step-s", type=float, default=None, help="step time for checkpoint.every (default: the run's)")
    p.add_argument("--scales", default="8,1024,16384,100000")
    p.add_argument("--checkpoint-s", default="10,60", help="other checkpoint costs C to compare, in seconds")
    args = p.parse_args()
    block, run_step = measured(args.run_dir)
    step_s = args.step_s or run_step
    dev = device_mtbf_s(args.interruptions, args.days, args.devices)
    print(f"run {args.run_dir}: median checkpoint block {block:.4f} s, median step {run_step:.4f} s")
    print(f"{args.interruptions} interruptions in {args.days:g} days on {args.devices:,} devices: job MTBF "
          f"{job_mtbf_s(dev, args.devices) / 3600:.2f} h, per-device MTBF {dev / 3600:,.0f} h "
          f"({dev / 86400 / 365.25:.1f} years)")
    print(f"checkpoint.every below at a step of {step_s:.4f} s; lost % = C/t + (t/2)/M at Young's t, restart excluded")
    costs = [("measured block", block)] + [("assumed write", float(c)) for c in args.checkpoint_s.split(",") if c]
    print(table(dev, costs, [int(s) for s in args.scales.split(",")], step_s))


if __name__ == "__main__":
    main()
