"""Print the device table `jaxinfra plan` uses (jaxinfra/plan/devices.py: DEVICES), one row per kind.

    python scripts/guide/device_table.py

Peaks are dense FLOP/s from jaxinfra/metrics/peak.py (what MFU divides by); the fast link is the
one-way bandwidth per device of jaxinfra/plan/links.py's table; `flop/byte` is the bfloat16 peak
over the memory bandwidth: below that many FLOPs per byte read, a kernel is memory-bound.
"""

from __future__ import annotations

from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan.devices import DEVICES, DeviceSpec, GiB
from jaxinfra.plan.links import LINKS

COLUMNS = [Column("kind"), Column("device"), Column("memory GiB", ".1f", ">"), Column("bf16 TFLOP/s", ".0f", ">"),
           Column("fp32 TFLOP/s", ".1f", ">"), Column("HBM TB/s", ".3f", ">"), Column("flop/byte", ".0f", ">"),
           Column("domain", "d", ">"), Column("fast link", "<"), Column("GB/s one way", ".0f", ">"),
           Column("slow link"), Column("efficiency", ".2f", ">")]


def row(spec: DeviceSpec) -> list[object]:
    """One device's numbers, in the units the page quotes."""
    bf16 = spec.peak("bfloat16")
    return [spec.kind, spec.name, spec.memory_bytes / GiB, bf16 / 1e12, spec.peak("float32") / 1e12,
            spec.memory_bandwidth / 1e12, bf16 / spec.memory_bandwidth, spec.domain, spec.fast_link,
            LINKS[spec.fast_link].bandwidth / 1e9, spec.slow_link, spec.efficiency]


def main() -> None:
    print(format_table([row(spec) for spec in DEVICES.values()], COLUMNS))


if __name__ == "__main__":
    main()
