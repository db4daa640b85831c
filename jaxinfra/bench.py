"""`jaxinfra bench collectives`: time each collective over each mesh axis, nccl-tests style.

For every mesh axis of size n > 1 and every message size, each op runs inside
`shard_map` on a per-device buffer of `size` bytes (float32):

    op              jax                         bus bandwidth factor (nccl-tests)
    all_reduce      psum                        2 (n-1) / n
    all_gather      all_gather(tiled)           (n-1) / n      size = gathered output
    reduce_scatter  psum_scatter(tiled)         (n-1) / n      size = input
    all_to_all      all_to_all                  (n-1) / n
    ppermute        ring shift by one           1

algbw = size / time; busbw = algbw x factor, the figure comparable to link
bandwidth whatever n is (see nccl-tests' doc/PERFORMANCE.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfra.metrics import table

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")


def _bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "ppermute": 1.0}.get(op, (n - 1) / n)


def _collective(op: str, axis: str, n: int) -> Callable[[jax.Array], jax.Array]:
    if op == "all_reduce":
        return lambda x: jax.lax.psum(x, axis)
    if op == "all_gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if op == "reduce_scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    if op == "all_to_all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    if op == "ppermute":
        return lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
    raise ValueError(f"unknown collective {op!r}; choose from {OPS}")


def time_collective(mesh: Mesh, op: str, axis: str, size_bytes: int, iters: int = 5) -> dict[str, float]:
    """Median seconds of one collective on `size_bytes` per device, with algbw/busbw in GB/s."""
    n = mesh.shape[axis]
    elems = max(size_bytes // 4 // n, 1) * n  # divisible by n for scatter / all-to-all
    if op == "all_gather":
        elems //= n  # nccl-tests' all_gather size is the gathered output
    all_axes = tuple(mesh.axis_names)
    spec = P(all_axes)
    x = jax.device_put(jnp.ones((mesh.size * elems,), jnp.float32), NamedSharding(mesh, spec))
    fn = jax.jit(jax.shard_map(_collective(op, axis, n), mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))
    jax.block_until_ready(fn(x))  # compile + warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    size = elems * 4 * (n if op == "all_gather" else 1)
    algbw = size / seconds / 1e9
    return {"op": op, "axis": axis, "n": n, "bytes": size, "time_us": seconds * 1e6, "algbw_GBps": algbw,
            "busbw_GBps": algbw * _bus_factor(op, n)}


def collectives_table(mesh: Mesh, sizes: Sequence[int], ops: Sequence[str] = OPS,
                      axes: Sequence[str] | None = None) -> list[dict[str, float]]:
    """One row per (axis of size > 1, op, size)."""
    axes = [a for a in (axes or mesh.axis_names) if mesh.shape[a] > 1]
    return [time_collective(mesh, op, axis, size) for axis in axes for op in ops for size in sizes]


COLUMNS = (table.Column("axis", width=8), table.Column("n", align=">", width=3), table.Column("op", width=15),
           table.Column("bytes", ",", ">", 12), table.Column("time us", ".1f", ">", 11),
           table.Column("algbw GB/s", ".3f", ">", 11), table.Column("busbw GB/s", ".3f", ">", 11))


def format_table(rows: list[dict[str, float]]) -> str:
    """collectives_table's rows, as `jaxinfra bench collectives` prints them."""
    keys = ("axis", "n", "op", "bytes", "time_us", "algbw_GBps", "busbw_GBps")
    return table.format_table([[r[k] for k in keys] for r in rows], COLUMNS, sep=" ")


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes
