"""The link table, which link each mesh axis uses, and collective times on it.

    link      GB/s per device, one way  latency  source
    nvlink4   450                       10 us    H100/H200 SXM: NVLink 4, 900 GB/s bidirectional
    nvlink3   300                       10 us    A100 SXM: NVLink 3, 600 GB/s bidirectional
    ib-ndr     50                       20 us    one 400 Gb/s InfiniBand NDR port per GPU (DGX H100/H200)
    ib-hdr     25                       20 us    one 200 Gb/s HDR port per GPU (DGX A100)
    ici-v5p   200                        5 us    TPU v5p: 1200 GB/s bidirectional over 6 links; an axis rides 2
    ici-v5e    90                        5 us    TPU v5e: 45 GB/s per link one way, 2 links per axis
    ici-v6e   180                        5 us    TPU v6e: 90 GB/s per link one way, 2 links per axis
    dcn         6.25                    50 us    50 Gb/s per TPU chip between slices
    host        2                      300 us    fake CPU devices: memcpy on shared cores (bench collectives)

A mesh axis stays on the fast link when all its devices fall in one fast-link domain (an 8-GPU
NVLink node, a TPU slice): with the mesh's device order (jax.make_mesh, axes data, stage, fsdp,
expert, context, tensor, the last varying fastest), an axis of size n and stride s spans n x s
neighbouring devices. `mesh.dcn_<axis>` > 1 puts the axis on the slow link. A collective over
several axes runs at the slowest one's speed.

Collective time on n devices for a message of S bytes per device (nccl-tests' convention, so
measured bus bandwidths drop straight in): latency + S x f / bandwidth, with f = 2(n-1)/n for
all-reduce, (n-1)/n for all-gather (S = the gathered output), reduce-scatter (S = the input)
and all-to-all, 1 for a ring shift (ppermute).

`--links FILE` replaces the table with measurements: FILE is what `jaxinfra bench collectives`
prints (rows `axis n op bytes time_us algbw busbw`); for each (axis, op) the bus bandwidth of its
largest message becomes the bandwidth and the time of its smallest message the latency.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

from jaxinfra.config import ConfigError
from sharding.mesh import MESH_AXES


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds per collective


LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4", 450e9, 10e-6),
    "nvlink3": Link("NVLink 3", 300e9, 10e-6),
    "ib-ndr": Link("InfiniBand NDR", 50e9, 20e-6),
    "ib-hdr": Link("InfiniBand HDR", 25e9, 20e-6),
    "ici-v5p": Link("ICI v5p", 200e9, 5e-6),
    "ici-v5e": Link("ICI v5e", 90e9, 5e-6),
    "ici-v6e": Link("ICI v6e", 180e9, 5e-6),
    "dcn": Link("DCN", 6.25e9, 50e-6),
    "host": Link("host memory", 2e9, 300e-6),
}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
Measured = dict[tuple[str, str], Link]  # (axis, op) -> measured link


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "ppermute": 1.0}.get(op, (n - 1) / n)


def axis_link(axis: str, sizes: dict[str, int], dcn: dict[str, int], domain: int, fast: str, slow: str) -> str:
    """The link an axis's collectives use: fast inside one domain, slow across domains or slices."""
    if dcn.get(axis, 1) > 1:
        return slow
    ici = {a: sizes[a] // dcn.get(a, 1) for a in MESH_AXES}
    stride = math.prod(ici[a] for a in MESH_AXES[MESH_AXES.index(axis) + 1:])
    return fast if ici[axis] * stride <= domain else slow


def collective_seconds(op: str, size: float, n: int, link: Link) -> float:
    """One collective of `size` bytes per device over n devices (see the module doc)."""
    if n <= 1 or size <= 0:
        return 0.0
    return link.latency + size * bus_factor(op, n) / link.bandwidth


def read_measured(path: str) -> Measured:
    """`jaxinfra bench collectives` output -> {(axis, op): Link}; a file with no rows is a ConfigError."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--links {path}: cannot read it ({e.strerror})") from None
    rows: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 7 or parts[2] not in OPS:
            continue
        try:
            size, time_us, busbw = int(parts[3].replace(",", "")), float(parts[4]), float(parts[6])
        except ValueError:
            continue
        rows.setdefault((parts[0], parts[2]), []).append((size, time_us, busbw))
    if not rows:
        raise ConfigError(f"--links {path}: no `jaxinfra bench collectives` rows (axis n op bytes time_us algbw "
                          f"busbw) found")
    out = {}
    for key, found in rows.items():
        found.sort()
        out[key] = Link(f"measured {key[0]} {key[1]}", found[-1][2] * 1e9, found[0][1] * 1e-6)
    return out
