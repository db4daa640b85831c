"""Training-state bytes per device under each strategy (dp, ZeRO-1, ZeRO-3/FSDP), as `jaxinfra info` counts them.

    python scripts/guide/zero_memory.py CONFIG [KEY=VALUE ...] [--plot PNG]

For each `parallelism.strategy` the config is loaded with the same overrides, and
`jaxinfra.info.memory_table` (the function behind `jaxinfra info`'s last three lines) gives
params, gradients and optimizer state per device from the shapes and shardings alone:
nothing is allocated, so full-size presets work on a laptop. Activations are not included
(they depend on batch, sequence and remat: see `scripts/guide/compiled_step.py`).
`--plot` draws the stacked bars (needs matplotlib: pip install -e '.[scaling]').
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax

from jaxinfra.config import load_config, validate
from jaxinfra.info import memory_table
from jaxinfra.metrics.table import Column, format_table
from scripts.guide.plotting import pyplot
from sharding.mesh import make_mesh
from sharding.rules import STRATEGIES

GIB = 2**30
PARTS = ("params", "grads", "optimizer state")


def per_device(config: str, overrides: list[str]) -> dict[str, dict[str, int]]:
    """{strategy: {part: bytes per device}}."""
    out = {}
    for strategy in STRATEGIES:
        cfg = load_config(config, [*overrides, f"parallelism.strategy={strategy}"])
        validate(cfg, jax.device_count())
        table = memory_table(cfg, make_mesh(cfg.mesh, jax.devices()))
        out[strategy] = {part: table[part][1] for part in PARTS}
    return out


def plot(path: str, title: str, table: dict[str, dict[str, int]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    bottom = [0.0] * len(table)
    for part in PARTS:
        values = [table[s][part] / GIB for s in table]
        ax.bar(list(table), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f} GiB", ha="center", va="bottom")
    ax.set_ylabel("GiB per device (no activations)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_intermixed_args()  # KEY=VALUE overrides may follow the options
    table = per_device(args.config, args.overrides)
    n = jax.device_count()
    title = f"{args.config} {' '.join(args.overrides)} on {n} device{'s' if n > 1 else ''}".replace("  ", " ")
    print(title)
    rows = [[s, *(table[s][p] / GIB for p in PARTS), sum(table[s].values()) / GIB] for s in table]
    columns = [Column("strategy"), *(Column(f"{p} GiB", ".2f", ">") for p in PARTS), Column("total GiB", ".2f", ">")]
    print(format_table(rows, columns))
    if args.plot:
        plot(args.plot, title, table)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
