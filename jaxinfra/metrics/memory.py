"""Device memory of a compiled step, and the largest batch that fits, found by compiling only.

`compiled_bytes(compiled)`: XLA's buffer assignment of one compiled program. Its peak estimate is
arguments + outputs - aliased (donated) + temporaries: what the program holds at once on the device.
`device_memory(device)`: the allocator's `peak_bytes_in_use` and `bytes_limit` where the backend keeps
them (GPU, TPU); None on XLA:CPU, whose `memory_stats()` is None.
`largest_batch(bytes_at, capacity, start)`: the largest batch whose estimate fits `capacity`, by
ahead-of-time compiles (no execution): doubling (or halving) from `start` to a bracket, then a
binary search inside it whose probes alternate with a linear interpolation of the bracket's ends
(memory grows about linearly with the batch, so that probe usually lands next to the answer).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax


def compiled_bytes(compiled: Any) -> dict[str, int]:
    """{argument, output, alias, temp, peak_estimate} bytes of a `jax.stages.Compiled`."""
    stats = compiled.memory_analysis()
    out = {k: int(getattr(stats, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    out["peak_estimate"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def device_memory(device: jax.Device) -> tuple[int | None, int | None]:
    """(peak_bytes_in_use, bytes_limit) of the device's allocator; (None, None) where the backend
    keeps no statistics (XLA:CPU)."""
    stats = device.memory_stats() or {}
    peak, limit = stats.get("peak_bytes_in_use"), stats.get("bytes_limit")
    return (None if peak is None else int(peak)), (None if limit is None else int(limit))


@dataclasses.dataclass
class BatchFit:
    largest: int | None  # the largest batch seen to fit (None: not even the smallest)
    smallest_failing: int | None  # the smallest batch seen not to fit (None: none failed up to the cap)
    probes: dict[int, int]  # batch -> estimated bytes, every compile made
    complete: bool  # largest + multiple == smallest_failing (or a bound was hit); False: out of time

    def describe(self) -> str:
        if self.largest is None:
            return "none fits"
        if self.complete:
            return str(self.largest) if self.smallest_failing is not None else f">= {self.largest} (cap)"
        return f">= {self.largest}" + (f", < {self.smallest_failing}" if self.smallest_failing else "")


def _toward_capacity(b1: int, b2: int, probes: dict[int, int], capacity: int) -> float | None:
    """The batch where the line through (b1, bytes), (b2, bytes) reaches `capacity`; None if it does not rise."""
    if b1 == b2 or probes[b2] == probes[b1]:
        return None
    slope = (probes[b2] - probes[b1]) / (b2 - b1)
    return None if slope <= 0 else b1 + (capacity - probes[b1]) / slope


def _next_probe(lo: int | None, hi: int | None, probes: dict[int, int], capacity: int, grid: int, top: int,
                interpolate: bool) -> int:
    """The next batch to compile: inside the bracket (lo fits, hi does not) by interpolation or
    bisection; without a bracket, extrapolated along the last two probes (at most 16x / 1/16 away),
    or doubled / halved."""
    snap = lambda x: int(x) // grid * grid  # noqa: E731
    if lo is not None and hi is not None:
        guess = _toward_capacity(lo, hi, probes, capacity) if interpolate else None
        return min(max(snap((lo + hi) / 2 if guess is None else guess), lo + grid), hi - grid)
    seen = sorted(probes)
    if hi is None:  # everything fitted so far
        guess = _toward_capacity(seen[-2], seen[-1], probes, capacity) if len(seen) > 1 else None
        return min(max(snap(2 * lo if guess is None else guess), lo + grid), 16 * lo, top)
    guess = _toward_capacity(seen[0], seen[1], probes, capacity) if len(seen) > 1 else None
    return max(min(snap(hi / 2 if guess is None else guess), hi - grid), snap(hi / 16), grid)


def largest_batch(bytes_at: Callable[[int], int], capacity: int, start: int, *, multiple: int = 1,
                  max_batch: int = 1 << 16, deadline: float | None = None,
                  known: dict[int, int] | None = None) -> BatchFit:
    """The largest batch b (a multiple of `multiple`, <= max_batch) with bytes_at(b) <= capacity.

    `known`: estimates already measured (e.g. the batch the caller compiled). Stops early, with the
    bracket found so far (`complete=False`), once `deadline` (time.monotonic) has passed."""
    probes: dict[int, int] = dict(known or {})
    top = max(multiple, max_batch // multiple * multiple)
    lo = hi = None  # the largest batch seen to fit, the smallest seen not to

    def probe(b: int) -> None:
        nonlocal lo, hi
        if b not in probes:
            probes[b] = int(bytes_at(b))
        if probes[b] <= capacity:
            lo = b if lo is None else max(lo, b)
        else:
            hi = b if hi is None else min(hi, b)

    def settled() -> bool:
        if lo is not None and hi is not None:
            return hi - lo <= multiple
        return lo == top if hi is None else hi == multiple

    probe(min(top, max(multiple, start // multiple * multiple)))
    interpolate = True
    while not settled() and not (deadline is not None and time.monotonic() > deadline):
        probe(_next_probe(lo, hi, probes, capacity, multiple, top, interpolate))
        interpolate = not interpolate
    return BatchFit(lo, hi, probes, settled())
