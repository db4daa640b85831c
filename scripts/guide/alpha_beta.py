"""The alpha-beta cost model of a collective, fitted to `jaxinfra bench collectives` and checked against it.

    python scripts/guide/alpha_beta.py [--n 8] [--sizes 1048576,2097152,4194304,8388608] [--repeats 3]
    python scripts/guide/alpha_beta.py --ring-vs-tree [--link ib-ndr]

The measurement runs `jaxinfra.bench.collectives_table` (the code behind `jaxinfra bench
collectives`) over one mesh axis of n devices, `--repeats` times, and keeps the fastest time of
each (op, size): on a shared machine noise only ever adds time. Two fits follow.

Per op, time = alpha + slope x S (least squares). The model (jaxinfra/plan/links.py:
collective_seconds) says slope = bus_factor(op, n) / B on one link, so the ratio of two ops'
slopes should be the ratio of their bus factors: all_reduce / all_gather = 2(n-1)/n / ((n-1)/n) = 2.

One link for all ops: time = alpha + bus_factor(op, n) x S / B, one alpha and one B fitted over
every row; the table prints each measured time next to `collective_seconds` on that fitted link.

`--ring-vs-tree` prints, for the links table's `--link`, the textbook ring all-reduce
2(n-1) alpha + 2(n-1)/n x S/B next to a pipelined double-binary-tree estimate
2 log2(n) alpha + 2 S/B (each byte goes up a tree and back down; the two trees split the data),
where alpha is one hop's latency. Nothing is measured; no devices are needed.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan.links import LINKS, Link, bus_factor, collective_seconds

FIT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "ppermute")
MIB = 2**20
Row = dict[str, float]


def measure(n: int, sizes: Sequence[int], ops: Sequence[str] = FIT_OPS, repeats: int = 3) -> list[Row]:
    """`jaxinfra bench collectives` rows over one axis of n devices, the fastest of `repeats` runs."""
    import jax
    from jax.sharding import AxisType

    from jaxinfra.bench import collectives_table

    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    best: dict[tuple[str, int], Row] = {}
    for _ in range(repeats):
        for row in collectives_table(mesh, sizes, ops):
            key = (row["op"], row["bytes"])
            if key not in best or row["time_us"] < best[key]["time_us"]:
                best[key] = row
    return list(best.values())


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope x."""
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(intercept), float(slope)


def fit_per_op(rows: Sequence[Row]) -> dict[str, tuple[float, float]]:
    """{op: (alpha seconds, slope seconds per byte)} from each op's own rows."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        out[op] = fit_line([r["bytes"] for r in mine], [r["time_us"] * 1e-6 for r in mine])
    return out


def fit_link(rows: Sequence[Row], n: int) -> Link:
    """One alpha and one bandwidth B for every op: time = alpha + bus_factor(op, n) x bytes / B."""
    alpha, slope = fit_line([bus_factor(r["op"], n) * r["bytes"] for r in rows],
                            [r["time_us"] * 1e-6 for r in rows])
    return Link("fitted", 1 / slope, alpha)


def ring_all_reduce(size: float, n: int, alpha: float, bandwidth: float) -> float:
    """2(n-1) steps of alpha, and 2(n-1)/n x S bytes out of every device."""
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bandwidth


def tree_all_reduce(size: float, n: int, alpha: float, bandwidth: float) -> float:
    """Pipelined double binary tree: log2(n) hops up and down, about 2 S out of every device."""
    return 2 * math.log2(n) * alpha + 2 * size / bandwidth


def per_op_table(rows: Sequence[Row], n: int) -> str:
    fits = fit_per_op(rows)
    ref_slope, ref_factor = fits["all_gather"][1], bus_factor("all_gather", n)
    table = [[op, bus_factor(op, n), alpha * 1e6, slope * MIB * 1e6, slope / ref_slope,
              bus_factor(op, n) / ref_factor] for op, (alpha, slope) in fits.items()]
    cols = [Column("op", width=14), Column("bus factor", ".3f", ">"), Column("alpha us", ".0f", ">"),
            Column("us per MiB", ".0f", ">"), Column("slope / all_gather's", ".2f", ">"),
            Column("model's ratio", ".2f", ">")]
    return format_table(table, cols)


def model_table(rows: Sequence[Row], n: int, link: Link) -> str:
    table = [[r["op"], int(r["bytes"]), r["time_us"], collective_seconds(r["op"], r["bytes"], n, link) * 1e6]
             for r in rows]
    table = [[*row, row[3] / row[2]] for row in table]
    cols = [Column("op", width=14), Column("bytes", ",", ">"), Column("measured us", ".0f", ">"),
            Column("model us", ".0f", ">"), Column("model / measured", ".2f", ">")]
    return format_table(table, cols)


def ring_vs_tree(link: Link, sizes: Sequence[int], ns: Sequence[int]) -> str:
    table = []
    for size in sizes:
        for n in ns:
            ring = ring_all_reduce(size, n, link.latency, link.bandwidth)
            tree = tree_all_reduce(size, n, link.latency, link.bandwidth)
            table.append([size, n, ring * 1e6, tree * 1e6, "tree" if tree < ring else "ring"])
    cols = [Column("bytes", ",", ">"), Column("n", ",", ">"), Column("ring us", ",.0f", ">"),
            Column("tree us", ",.0f", ">"), Column("faster", width=6)]
    return format_table(table, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="devices on the benchmarked axis")
    parser.add_argument("--sizes", default="1048576,2097152,4194304,8388608", help="bytes per device, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ring-vs-tree", action="store_true", help="print the ring/tree model table and exit")
    parser.add_argument("--link", default="ib-ndr", choices=sorted(LINKS))
    args = parser.parse_args()
    if args.ring_vs_tree:
        link = LINKS[args.link]
        print(f"link {args.link} ({link.name}, jaxinfra/plan/links.py): its latency {link.latency * 1e6:g} us "
              f"as alpha per hop, B {link.bandwidth / 1e9:g} GB/s per device")
        print(ring_vs_tree(link, [65536, 256 * MIB], [8, 64, 512, 4096]))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = measure(args.n, sizes, repeats=args.repeats)
    print(f"{args.n} devices, fastest of {args.repeats} runs per (op, size); per-op fit time = alpha + slope x S:")
    print(per_op_table(rows, args.n))
    link = fit_link(rows, args.n)
    host = LINKS["host"]
    print(f"\none link for all ops: alpha {link.latency * 1e6:.0f} us, B {link.bandwidth / 1e9:.2f} GB/s "
          f"(links.py's 'host' entry: {host.latency * 1e6:.0f} us, {host.bandwidth / 1e9:.2f} GB/s)")
    print(model_table(rows, args.n, link))


if __name__ == "__main__":
    main()
