"""Reductions that must span shards inside manual (shard_map) regions.

Outside a shard_map, GSPMD completes a `jnp.max` over a sharded dimension by itself. Inside
one, each device sees only its block, so a quantization scale (an absmax over some
dimensions) would differ from the one-device value. The expert-parallel shard_maps
(sharding/expert.py) say, by logical name, which manual mesh axes split each dimension of
the arrays their body sees; models resolve their arrays' logical names (`manual_split`) and
reduce with `complete_max`, so models never name a mesh axis.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence

import jax

_MANUAL: contextvars.ContextVar[Mapping[str, tuple[str, ...]] | None] = contextvars.ContextVar(
    "jaxinfra_manual_reductions", default=None)


@contextlib.contextmanager
def manual_reductions(axes_by_name: Mapping[str, Sequence[str]]) -> Iterator[None]:
    """While tracing a shard_map body: logical dimension name -> the manual mesh axes that split it."""
    token = _MANUAL.set({k: tuple(v) for k, v in axes_by_name.items()})
    try:
        yield
    finally:
        _MANUAL.reset(token)


Split = tuple[tuple[str, ...], ...] | None  # per dim of an array: the manual axes splitting it


def manual_split(names: Sequence[str | None] | None) -> Split:
    """Per dimension (logical `names`), the manual axes that split it in the current shard_map body;
    None outside one. Resolve it while the body is traced and keep it: a custom VJP's backward is
    traced after the body, outside this context."""
    current = _MANUAL.get()
    if current is None or names is None:
        return None
    return tuple(current.get(n, ()) if n is not None else () for n in names)


def complete_max(x: jax.Array, split: Split, dims: Sequence[int]) -> jax.Array:
    """`x`, a max over dimensions `dims` of an array split as `split`, made global: a pmax over the
    manual axes that split any of those dimensions (a no-op outside a manual region)."""
    if split is None:
        return x
    axes = sorted({a for d in dims for a in split[d]})
    return jax.lax.pmax(x, tuple(axes)) if axes else x
