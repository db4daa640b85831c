"""Causal work per context-parallel device, with and without load balancing (sharding/context.py).

    python scripts/guide/context_balance.py [--context 4] [--length 4096]

Under a causal mask query i sees keys 0..i, so when the sequence is cut into `--context`
contiguous pieces the last device has far more visible (query, key) pairs than the first,
and every ring step waits for the slowest device. sharding/context.py: balanced_order gives
device i the chunks i and 2n-1-i instead. This script counts the visible pairs per device
from the token indices the ring attention code uses (`_token_index`), for both orders.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from jaxinfra.metrics.table import Column, format_table
from sharding.context import _token_index, balanced_order


def visible_pairs(length: int, ring: int, balanced: bool) -> np.ndarray:
    """Causally visible (query, key) pairs whose query lives on each device."""
    local = length // ring
    counts = []
    for device in range(ring):
        q = np.asarray(_token_index(device, local, ring, balanced))
        counts.append(int(np.sum(q + 1)))  # query at original index i sees keys 0..i
    return np.asarray(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4, help="devices on the context axis (n)")
    parser.add_argument("--length", type=int, default=4096, help="sequence length T")
    args = parser.parse_args()
    n, t = args.context, args.length
    order = balanced_order(t, n)
    chunk = t // (2 * n)
    print(f"T={t}, n={n}: balanced order gives device i the chunks i and {2 * n - 1}-i of {chunk} tokens; "
          f"device 0 holds tokens {order[0]}..{order[chunk - 1]} and {order[chunk]}..{order[2 * chunk - 1]}")
    plain, balanced = visible_pairs(t, n, False), visible_pairs(t, n, True)
    rows = [[d, int(plain[d]), int(balanced[d])] for d in range(n)]
    rows.append(["max/mean", f"{plain.max() / plain.mean():.3f}", f"{balanced.max() / balanced.mean():.3f}"])
    columns = [Column("device"), Column("contiguous: visible pairs", ",", ">"),
               Column("balanced: visible pairs", ",", ">")]
    print(format_table(rows, columns))


if __name__ == "__main__":
    main()
