"""Declared ranges of numeric config fields, and the one walker that checks them (jax-free).

Every int or float field of the run config (optional ones and tuples of numbers too) is declared with
`ranged(default, lo, hi, ...)`: the range sits beside the field, and `range_problems` walks a section
(nested sections and `dict[str, section]` included) and returns each value outside its range as
(key, value, what is allowed), the form the sections' `problems()` use. It lives here, in the lowest
layer that holds a config section (`MeshConfig`), so that every section module can import it;
tests/test_config_ranges.py fails on a numeric field declared without a range.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Range:
    """lo <= x <= hi (lo < x, x < hi when open); None: unbounded on that side. `also`: single values
    allowed outside the interval (mesh.data=-1: fill); `note` says what a special value means."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[float, ...] = ()
    note: str = ""
    what: str = ""  # a noun before the bounds where a section words it so ("a number")

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if value in self.also:
            return True
        if not math.isfinite(value):  # never a setting (and the comparisons below would pass inf)
            return False
        low = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        high = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return low and high

    def describe(self, optional: bool = False) -> str:
        """What is allowed, in the words of the config's messages: "> 0", "in [0, 1)", ">= 1 or -1"."""
        if self.lo is not None and self.hi is not None:
            bounds = f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            bounds = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            bounds = f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            bounds = "a finite number"
        text = " ".join(p for p in (self.what, bounds) if p)
        text += "".join(f" or {_num(v)}" for v in self.also) + (" or null" if optional else "")
        return f"{text} ({self.note})" if self.note else text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(x)


def ranged(default: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, also: tuple[float, ...] = (), note: str = "", what: str = "") -> Any:
    """A dataclass field with `default` and its declared Range (for a tuple field: each element's)."""
    return dataclasses.field(default=default, metadata={"range": Range(lo, hi, lo_open, hi_open, also, note, what)})


def field_range(field: dataclasses.Field) -> Range | None:
    return field.metadata.get("range")


def _numbers(value: Any) -> list[Any]:
    """The numbers of a tuple field (nested tuples flattened), or the value itself."""
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _numbers(v)]
    return [value]


def range_problems(section: Any, prefix: str = "") -> list[tuple[str, object, str]]:
    """Every declared range `section` (a config dataclass) breaks, recursively, as (key, value, allowed);
    keys are dotted from `section` (`prefix` before them). Null optional fields are skipped."""
    out: list[tuple[str, object, str]] = []
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            out += range_problems(value, key + ".")
        elif isinstance(value, dict) and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, part in value.items():
                out += range_problems(part, f"{key}.{name}.")
        elif (r := field_range(f)) is not None and value is not None:
            if not all(r.holds(x) for x in _numbers(value)):
                out.append((key, value, r.describe("None" in str(f.type))))
    return out
