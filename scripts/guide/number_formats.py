"""Floating-point formats of training: bit layout, range and precision, from the formula and from ml_dtypes.

    python scripts/guide/number_formats.py

A binary float with e exponent bits and m mantissa bits (bias b = 2^(e-1) - 1) stores
(-1)^s x 1.f x 2^(E - b) for a normal number. Its figures follow from e and m alone:

    machine epsilon        2^-m                 (the gap between 1 and the next number)
    smallest normal        2^(1 - b)
    smallest subnormal     2^(1 - b - m)
    largest finite         (2 - 2^-m) x 2^(2^e - 2 - b)          IEEE-like: the top exponent is inf/NaN
                           (2 - 2^(1-m)) x 2^(2^e - 1 - b)       E4M3 "fn": the top exponent holds numbers,
                                                                 only its all-ones mantissa is NaN, no inf

The first table prints the formula's values and checks each against `ml_dtypes.finfo`
(tf32 is not a storage type, so it has no finfo: its row is the formula's alone). The second
shows what a cast to each format does to a few values a training step meets.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ml_dtypes
import numpy as np

from jaxinfra.metrics.table import Column, format_table


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True  # False: E4M3 "fn" (finite, one NaN pattern per sign)
    dtype: object = None  # the numpy/ml_dtypes type (None: not a storage type)

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def eps(self) -> float:
        return 2.0 ** -self.mantissa_bits

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def max(self) -> float:
        m, top = self.mantissa_bits, 2 ** self.exponent_bits - 1  # the all-ones exponent field
        if self.has_inf:  # IEEE: the all-ones exponent is inf / NaN; the largest number has top - 1
            return (2.0 - 2.0 ** -m) * 2.0 ** (top - 1 - self.bias)
        # fn: the all-ones exponent holds numbers too, but all-ones mantissa there is NaN
        return (2.0 - 2.0 ** (1 - m)) * 2.0 ** (top - self.bias)


FORMATS = (
    Format("float32", 8, 23, dtype=np.float32),
    Format("tf32", 8, 10),  # a tensor-core input format: float32 storage, 10 mantissa bits in the multiply
    Format("bfloat16", 8, 7, dtype=ml_dtypes.bfloat16),
    Format("float16", 5, 10, dtype=np.float16),
    Format("float8_e4m3fn", 4, 3, has_inf=False, dtype=ml_dtypes.float8_e4m3fn),
    Format("float8_e5m2", 5, 2, dtype=ml_dtypes.float8_e5m2),
)


def finfo_values(f: Format) -> dict[str, float] | None:
    """The same figures from ml_dtypes.finfo (None for a format without a dtype)."""
    if f.dtype is None:
        return None
    fi = ml_dtypes.finfo(f.dtype)
    return {"max": float(fi.max), "smallest_normal": float(fi.smallest_normal),
            "smallest_subnormal": float(fi.smallest_subnormal), "eps": float(fi.eps)}


def formula_values(f: Format) -> dict[str, float]:
    return {"max": f.max, "smallest_normal": f.smallest_normal, "smallest_subnormal": f.smallest_subnormal,
            "eps": f.eps}


def format_rows() -> list[list]:
    rows = []
    for f in FORMATS:
        ours, theirs = formula_values(f), finfo_values(f)
        check = "no dtype" if theirs is None else ("yes" if ours == theirs else "NO")
        rows.append([f.name, f"1/{f.exponent_bits}/{f.mantissa_bits}", f.bias, f"{f.max:.6g}",
                     f"{f.smallest_normal:.3g}", f"{f.smallest_subnormal:.3g}", f"{f.eps:.3g}",
                     "yes" if f.has_inf else "no", check])
    return rows


def cast(value: float, f: Format) -> float:
    """value cast to the format (round to nearest even) and back, as numpy / ml_dtypes do it: no saturation."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.array(value, np.float64).astype(np.float32).astype(f.dtype).astype(np.float64))


# What a step meets: a tiny gradient, a weight plus a small update, a large activation.
PROBES = (("grad 1e-8", 1e-8), ("grad 1e-5", 1e-5), ("1 + 1e-3", 1.0 + 1e-3), ("1 + 1e-2", 1.0 + 1e-2),
          ("300", 300.0), ("70000", 70000.0))


def cast_rows() -> list[list]:
    return [[label, *(f"{cast(v, f):.6g}" for f in FORMATS if f.dtype is not None)] for label, v in PROBES]


def main() -> None:
    print(format_table(format_rows(), [
        Column("format"), Column("s/e/m bits", align=">"), Column("bias", align=">"), Column("max", align=">"),
        Column("min normal", align=">"), Column("min subnormal", align=">"), Column("eps", align=">"),
        Column("inf", align=">"), Column("= ml_dtypes", align=">")]))
    print()
    print("x cast to each format (round to nearest even, no saturation):")
    stored = [f.name for f in FORMATS if f.dtype is not None]
    print(format_table(cast_rows(), [Column("x"), *(Column(n, align=">") for n in stored)]))


if __name__ == "__main__":
    main()
