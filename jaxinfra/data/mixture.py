"""Weighted mixtures: which source fills each packed row of each batch.

Row slot r of batch t (t = steps already taken) comes whole from one source, picked by a
low-discrepancy sequence: u = frac(phase_r + t * (sqrt(5) - 1) / 2), mapped through the
cumulative weights in force at t. The pick is a pure function of (seed, r, t), so it is the
same whatever the process count, a resume only needs t, and a stage switch happens exactly at
its step. Unlike independent draws, the realised shares stay within a few rows of the weights
over any stretch of batches (a Weyl sequence with the golden ratio has the lowest discrepancy
of its kind), and each slot's own phase spreads the sources evenly over a batch's rows.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import grain

from jaxinfra.data.config import DataError, weight_at

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


class WeightSchedule:
    """Normalised cumulative weights per stage, for sources in a fixed order."""

    def __init__(self, stages_per_source: Sequence[list[tuple[int, float]]]):
        starts = sorted({start for stages in stages_per_source for start, _ in stages})
        self.starts = starts
        self.cumulative = []
        for start in starts:
            weights = [weight_at(stages, start) for stages in stages_per_source]
            total = sum(weights)
            running, cum = 0.0, []
            for w in weights:
                running += w / total
                cum.append(running)
            cum[-1] = 1.0
            self.cumulative.append(cum)

    def weights(self, t: int) -> list[float]:
        cum = self.cumulative[bisect.bisect_right(self.starts, t) - 1]
        return [b - a for a, b in zip([0.0, *cum[:-1]], cum)]

    def pick(self, t: int, phase: float) -> int:
        """The source of batch t for a slot with this phase."""
        cum = self.cumulative[bisect.bisect_right(self.starts, t) - 1]
        u = (phase + t * _GOLDEN) % 1.0
        return min(bisect.bisect_right(cum, u), len(cum) - 1)


def slot_phase(seed: int, slot: int) -> float:
    digest = hashlib.blake2b(f"jaxinfra-mixture:{seed}:{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class MixedRows(grain.IterDataset):
    """One row slot's packed rows, each taken from the source the schedule picks."""

    def __init__(self, parents: Sequence[grain.IterDataset], names: Sequence[str], schedule: WeightSchedule,
                 phase: float):
        super().__init__(list(parents))
        self._names, self._schedule, self._phase = list(names), schedule, phase

    def __iter__(self) -> grain.DatasetIterator:
        return _MixedRowsIterator([p.__iter__() for p in self._parents], self._names, self._schedule, self._phase)

    def __str__(self) -> str:
        return f"MixedRows(sources={self._names})"


class _MixedRowsIterator(grain.DatasetIterator):
    def __init__(self, parents: list[grain.DatasetIterator], names: list[str], schedule: WeightSchedule,
                 phase: float):
        super().__init__(parents)
        self._names, self._schedule, self._phase = names, schedule, phase
        self._t = 0

    def __next__(self) -> Any:
        source = self._schedule.pick(self._t, self._phase)
        row = next(self._parents[source])
        self._t += 1
        return row

    def get_state(self) -> dict[str, Any]:
        return {"t": self._t, "sources": list(self._names), "parents": [p.get_state() for p in self._parents]}

    def set_state(self, state: dict[str, Any]) -> None:
        if list(state.get("sources", [])) != self._names:
            raise DataError(f"checkpoint data state mixes sources {list(state.get('sources', []))}, this config "
                            f"{self._names}: a run's data.mixture names cannot change on resume")
        self._t = int(state["t"])
        for parent, s in zip(self._parents, state["parents"]):
            parent.set_state(s)
