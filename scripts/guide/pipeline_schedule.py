"""The pipeline schedules as sharding/pipeline.py runs them: idle slots counted from its own tables.

    python scripts/guide/pipeline_schedule.py [--stages 4] [--microbatches 8] [--repeats 2] [--plot PNG]

The pipeline is SPMD: every tick, every stage runs one slot (a chunk of layers on one
microbatch, or masked work in a bubble). This script reads the static timetables the code
executes (`forward_tables` for gpipe and circular, `one_f_one_b_tables` for 1F1B's backward)
and counts, per phase, the ticks and the fraction of stage-slots that hold no microbatch,
beside the analytic bubble (S-1)/(R*M+S-1) (`bubble_fraction`). gpipe and circular run
their backward by autodiff through the same tick loop, reversed, so it has the forward's
idle fraction; 1F1B's custom VJP runs its forward pass (no stash kept) and then a backward
pass in which each tick holds one forward (recomputed, stashed) and one backward slot.
`--plot` draws the timetables (needs matplotlib: pip install -e '.[scaling]').
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from jaxinfra.metrics.table import Column, format_table
from scripts.guide.plotting import pyplot
from sharding.pipeline import bubble_fraction, forward_tables, one_f_one_b_tables, stash_slots


def timetables(stages: int, micro: int, repeats: int) -> dict[str, list[tuple[str, np.ndarray, np.ndarray]]]:
    """{schedule: [(phase, microbatch [ticks, S], valid [ticks, S]), ...]} in execution order."""
    out = {}
    for name, reps in (("gpipe", 1), (f"circular (R={repeats})", repeats)):
        tab = forward_tables(stages, micro, reps)
        label = tab["mb"] if reps == 1 else tab["mb"] * 10 + tab["rep"]  # m and round: "m.r"
        out[name] = [("forward", label, tab["valid"]), ("backward", label[::-1], tab["valid"][::-1])]
    fwd = forward_tables(stages, micro, 1)
    onefb = one_f_one_b_tables(stages, micro)
    out["1f1b"] = [("forward (no stash)", fwd["mb"], fwd["valid"]),
                   ("1F1B: forward slot", onefb["f"], onefb["f_valid"]),
                   ("1F1B: backward slot", onefb["b"], onefb["b_valid"])]
    return out


def summary_rows(stages: int, micro: int, repeats: int) -> list[list]:
    rows = []
    for name, phases in timetables(stages, micro, repeats).items():
        reps = repeats if name.startswith("circular") else 1
        for phase, _, valid in phases:
            rows.append([name, phase, valid.shape[0], int(valid.sum()), valid.size, 1 - valid.mean(),
                         bubble_fraction(stages, micro, reps)])
    return rows


def plot(path: str, stages: int, micro: int, repeats: int) -> None:
    plt = pyplot()
    tables = timetables(stages, micro, repeats)
    fig, axes = plt.subplots(len(tables), 1, figsize=(13, 2.0 + 1.1 * stages * len(tables)), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, (name, phases) in zip(axes[:, 0], tables.items()):
        _draw(ax, name, phases, stages, repeats if name.startswith("circular") else 1, colours)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _draw(ax, name: str, phases, stages: int, repeats: int, colours) -> None:
    x0 = 0
    onefb = [p for p in phases if p[0].startswith("1F1B")]
    plain = [p for p in phases if not p[0].startswith("1F1B")]
    for phase, mb, valid in plain:  # full-height cells
        _cells(ax, mb, valid, x0, 0.0, 1.0, "B" if phase == "backward" else "F", repeats, colours)
        ax.axvline(x0, color="black", lw=1.5)
        x0 += mb.shape[0]
    for k, (_, mb, valid) in enumerate(onefb):  # one tick = a forward (top half) and a backward (bottom half)
        _cells(ax, mb, valid, x0, 0.5 * k, 0.5, "FB"[k], 1, colours)
    if onefb:
        ax.axvline(x0, color="black", lw=1.5)
        x0 += onefb[0][1].shape[0]
    ax.set_xlim(0, x0)
    ax.set_ylim(stages, 0)
    ax.set_yticks(np.arange(stages) + 0.5, [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("tick")
    idle = 1 - np.mean([v.mean() for _, _, v in phases])
    ax.set_title(f"{name}: {x0} ticks, {idle:.0%} of stage-slots idle (white)", loc="left")


def _cells(ax, mb, valid, x0: int, y_off: float, height: float, kind: str, repeats: int, colours) -> None:
    for t in range(mb.shape[0]):
        for s in range(mb.shape[1]):
            if not valid[t, s]:
                continue
            m, r = (mb[t, s] // 10, mb[t, s] % 10) if repeats > 1 else (mb[t, s], 0)
            shade = 0.55 if kind == "B" else 1.0
            ax.add_patch(_rect(x0 + t, s + y_off, height, colours(m % 10), shade))
            label = f"{kind}{m}" + (f".{r}" if repeats > 1 else "")
            ax.text(x0 + t + 0.5, s + y_off + height / 2, label, ha="center", va="center", fontsize=6)


def _rect(x: float, y: float, height: float, colour, shade: float):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1, height, facecolor=tuple(c * shade for c in colour[:3]), edgecolor="white", lw=0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="circular: layer chunks per stage")
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_args()
    s, m, r = args.stages, args.microbatches, args.repeats
    print(f"S={s} stages, M={m} microbatches, circular R={r}; 1F1B stash: {stash_slots(s)} slots per stage")
    columns = [Column("schedule"), Column("phase"), Column("ticks", align=">"), Column("busy slots", align=">"),
               Column("all slots", align=">"), Column("idle (tables)", ".3f", ">"),
               Column("(S-1)/(R*M+S-1)", ".3f", ">")]
    print(format_table(summary_rows(s, m, r), columns))
    if args.plot:
        plot(args.plot, s, m, r)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
