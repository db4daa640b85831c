"""How long an asynchronous checkpoint blocks the training loop, as a fraction of a step.

    python benchmarks/checkpoint_block.py [--config small] [KEY=VALUE ...]

Trains a few steps with a checkpoint every 4 steps and reports, from metrics.jsonl, the
seconds `save()` held the loop (device-to-host copy + dispatch) next to the median step
time. The commit itself runs in the background.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

import jax

from jaxinfra.config import load_config
from jaxinfra.metrics import param_counts
from jaxinfra.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, ["train.steps=13", "checkpoint.every=4", "log.every=1", "train.eval_every=0",
                                     "log.progress=false", "mesh.data=1", *args.overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, run_dir, jax.devices()[:1])
        rows = [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 1]
    blocks = [r["checkpoint_block_s"] for r in rows if "checkpoint_block_s" in r]
    step, block = statistics.median(step_times), statistics.median(blocks)
    state_mb = param_counts(cfg.model)["total"] * 4 * 3 / 2**20  # params + two Adam moments, float32
    print(f"config {args.config}: state {state_mb:.0f} MiB; median step {step:.3f}s; median save block "
          f"{block:.3f}s over {len(blocks)} saves; block / step = {block / step:.3f}")


if __name__ == "__main__":
    main()
