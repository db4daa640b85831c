"""Which keys a query may see: the one definition shared by the reference, the XLA path
and both Pallas kernels (element masks and block-level skipping).

Visibility of key j from query i is the conjunction of

* a *band* on positions: ``i - left <= j <= i + right`` (either side may be unbounded).
  ``causal=True`` is the band ``right = 0``; a sliding window ``(left, right)`` is the
  band itself; causal plus a window clips ``right`` to 0. Positions are aligned at the
  top-left (query i and key i are the same position), as in
  ``jax.nn.dot_product_attention``; chunked callers shift by passing explicit windows.
* ``j < kv_len``: keys the kernels appended to reach a block multiple are never visible;
* equal segment ids (packed sequences), when segment ids are given.

Query rows the kernels append are *not* masked: they read real keys, produce finite junk
and are sliced away; their padded ``do`` is zero, so they add nothing to dk or dv.

A query row with no visible key has output 0 and log-sum-exp ``-inf`` in every
implementation (see ``kernels/attention.py``).

The block functions below take the block index either as a Python int or as a traced
int32 scalar (``pl.program_id``) and use only scalar ops that both the Triton and the
Mosaic lowerings accept (add, mul, min, max, non-negative division, select).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Int = Any  # a Python int or a traced int32 scalar


@dataclasses.dataclass(frozen=True)
class Band:
    """Index-based visibility: key j is visible from query i iff
    ``i - left <= j <= i + right`` and ``j < kv_len`` (None: that side is unbounded)."""

    left: int | None
    right: int | None
    q_len: int
    kv_len: int

    @property
    def kind(self) -> str:
        """The mask kind used to key the block-size table."""
        if self.left is None and self.right is None:
            return "full"
        if self.left is None and self.right == 0:
            return "causal"
        return "local"


def make_band(causal: bool, window: tuple[int | None, int | None] | None, q_len: int, kv_len: int) -> Band:
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return Band(left=left, right=right, q_len=q_len, kv_len=kv_len)


# ---------------------------------------------------------------- element masks


def band_mask(q_pos: jax.Array, kv_pos: jax.Array, band: Band, *, check_kv_len: bool = True) -> jax.Array | None:
    """Boolean visibility from positions (any broadcastable shapes); None when nothing is masked."""
    mask = None

    def both(m, new):
        return new if m is None else jnp.logical_and(m, new)

    if band.right is not None:
        mask = both(mask, kv_pos <= q_pos + band.right)
    if band.left is not None:
        mask = both(mask, kv_pos >= q_pos - band.left)
    if check_kv_len:
        mask = both(mask, kv_pos < band.kv_len)
    return mask


def segment_mask(q_seg: jax.Array, kv_seg: jax.Array) -> jax.Array:
    return q_seg == kv_seg


def dense_mask(band: Band, q_seg: jax.Array | None, kv_seg: jax.Array | None) -> jax.Array | None:
    """[B or 1, 1, Tq, Tkv] visibility for the dense (reference / XLA) paths; None: all visible."""
    q_pos = jnp.arange(band.q_len, dtype=jnp.int32)[:, None]
    kv_pos = jnp.arange(band.kv_len, dtype=jnp.int32)[None, :]
    mask = band_mask(q_pos, kv_pos, band, check_kv_len=False)  # no padding in the dense paths
    mask = None if mask is None else mask[None, None]
    if q_seg is not None:
        seg = segment_mask(q_seg[:, :, None], kv_seg[:, None, :])[:, None]
        mask = seg if mask is None else jnp.logical_and(mask, seg)
    return mask


# ---------------------------------------------------------------- block ranges


def _is_static(*xs: Int) -> bool:
    return all(isinstance(x, int) for x in xs)


def _div(a: Int, b: int) -> Int:
    """Floor division of a non-negative scalar (truncation equals floor there)."""
    if _is_static(a):
        return a // b
    return lax.div(a, jnp.int32(b))


def _max(a: Int, b: Int) -> Int:
    return max(a, b) if _is_static(a, b) else jnp.maximum(a, b)


def _min(a: Int, b: Int) -> Int:
    return min(a, b) if _is_static(a, b) else jnp.minimum(a, b)


def _cdiv_nonneg(a: Int, b: int) -> Int:
    return _div(a + (b - 1), b)


def _clamp_ranges(lo: Int, full_lo: Int, full_hi: Int, hi: Int, num: int) -> tuple[Int, Int, Int, Int]:
    """0 <= lo <= full_lo <= full_hi <= hi <= num (an empty range when nothing is visible)."""
    lo = _min(lo, num)
    hi = _min(_max(hi, lo), num)
    full_lo = _min(_max(full_lo, lo), hi)
    full_hi = _min(_max(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


def kv_block_range(q_block: Int, block_q: int, block_kv: int, band: Band) -> tuple[Int, Int, Int, Int]:
    """For one query block, the kv blocks to visit: ``[lo, hi)``, of which ``[full_lo, full_hi)``
    are entirely visible (no element mask needed); blocks outside ``[lo, hi)`` are skipped."""
    num_valid = -(-band.kv_len // block_kv)
    q_start = q_block * block_q
    q_end = q_start + (block_q - 1)
    lo = 0 if band.left is None else _div(_max(q_start - band.left, 0), block_kv)
    hi = num_valid if band.right is None else _min(num_valid, _div(q_end + band.right, block_kv) + 1)
    full_lo = 0 if band.left is None else _cdiv_nonneg(_max(q_end - band.left, 0), block_kv)
    full_hi = band.kv_len // block_kv  # blocks with no padded key
    if band.right is not None:
        full_hi = _min(full_hi, _div(q_start + band.right + 1, block_kv))
    return _clamp_ranges(lo, full_lo, full_hi, hi, num_valid)


def q_block_range(kv_block: Int, block_q: int, block_kv: int, band: Band) -> tuple[Int, Int, Int, Int]:
    """For one kv block, the query blocks that see any of its keys: ``[lo, hi)``, of which
    ``[full_lo, full_hi)`` see all of them. Appended query rows are left out (they add nothing)."""
    num_valid = -(-band.q_len // block_q)
    kv_start = kv_block * block_kv
    kv_end = kv_start + (block_kv - 1)
    lo = 0 if band.right is None else _div(_max(kv_start - band.right, 0), block_q)
    hi = num_valid if band.left is None else _min(num_valid, _div(kv_end + band.left, block_q) + 1)
    full_lo = 0 if band.right is None else _cdiv_nonneg(_max(kv_end - band.right, 0), block_q)
    full_hi = num_valid if band.left is None else _div(kv_start + band.left + 1, block_q)
    # A block holding appended keys is never "full"; one holding only appended keys is skipped.
    if _is_static(kv_start):
        if kv_end >= band.kv_len:
            full_hi = full_lo
        if kv_start >= band.kv_len:
            hi = lo
    else:
        # Strongly typed operands: see segment_block_kind about selects of weak literals.
        i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
        full_hi = jnp.where(kv_end >= band.kv_len, i32(full_lo), i32(full_hi))
        hi = jnp.where(kv_start >= band.kv_len, i32(lo), i32(hi))
    return _clamp_ranges(lo, full_lo, full_hi, hi, num_valid)


# ---------------------------------------------------------------- segment blocks

SKIP, MASKED, FULL = 0, 1, 2


def segment_block_bounds(seg: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per-block (min, max) of segment ids, [B, T // block] each (T a block multiple)."""
    b, t = seg.shape
    blocks = seg.reshape(b, t // block, block)
    return blocks.min(axis=-1), blocks.max(axis=-1)


def segment_block_kind(q_min: Int, q_max: Int, kv_min: Int, kv_max: Int) -> Int:
    """SKIP when the id ranges are disjoint (no pair can match), FULL when both blocks hold one
    and the same id, else MASKED. Conservative for any id layout (sorted or not)."""
    disjoint = jnp.logical_or(q_max < kv_min, kv_max < q_min)
    uniform = jnp.logical_and(jnp.logical_and(q_min == q_max, kv_min == kv_max), q_min == kv_min)
    # Arithmetic rather than jnp.where on Python ints: the Triton lowering of a select between
    # two weakly typed literals types them like the predicate (i1). uniform implies not disjoint.
    assert (SKIP, MASKED, FULL) == (0, 1, 2)
    return jnp.logical_not(disjoint).astype(jnp.int32) * (1 + uniform.astype(jnp.int32))


def pad_segments(seg: jax.Array, length: int) -> jax.Array:
    """Pad by repeating the last id, so block id ranges are not widened by the padding."""
    extra = length - seg.shape[1]
    return seg if extra == 0 else jnp.pad(seg, ((0, 0), (0, extra)), mode="edge")
