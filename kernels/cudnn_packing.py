"""cuDNN attention on packed batches: our [B, T] segment ids -> cuDNN's packed (THD) layout.

cuDNN's fused attention (`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`,
the function behind `jax.nn.dot_product_attention(implementation="cudnn")`) takes a packed
batch as per-row segment tables, M = the most segments a row may hold (static):

* ``q_seqlen``, ``kv_seqlen`` [B, M]: tokens in segment m of row b, -1 where there is none;
* ``q_offsets``, ``kv_offsets`` [B, M + 1]: first token of segment m within row b, -1 where
  there is none (the extra column is always -1);

Query token t of segment m attends only to the keys of segment m (causal and windows are
applied inside the segment); tokens outside every segment are not written.

The transformation (`pack_segments`): every maximal run of equal ids in a row is one cuDNN
segment, padding runs of id 0 included, so padding tokens attend within their run exactly as
in `kernels/reference.py`. That equals our segment-id semantics (same id <=> visible) iff

1. each id occupies one contiguous run in its row (what packing produces: 1, 2, ..., 0), and
2. a row holds at most ``max_segments`` runs (`MAX_SEGMENTS` by default; the bound is static
   because cuDNN sizes its launch by it).

Both are checked on device; a row that breaks either gets NaN output, never a silently
different attention (a training step's NaN guard then skips the step and counts it).

GQA: jax's conversion to cuDNN's element offsets (`_fix_seqlen_offsets`) multiplies the kv
offsets by the *query's* per-token stride (q heads x head dim) in the jax releases we know
of, which points into the wrong keys when kv heads < q heads (jax-ml/jax#39521).
`kv_offsets_follow_key_stride()` probes the installed jax; where it is wrong, k and v are
repeated up to the query head count before the call (exact, at the cost of that memory).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_SEGMENTS = 32  # runs per row (documents + a padding run); rows with more get NaN output


class PackedSegments(NamedTuple):
    """cuDNN's packed-layout tables for one [B, T] segment-id array (same for q and kv)."""

    seq_lens: jax.Array  # [B, M] int32, -1 = no segment
    offsets: jax.Array  # [B, M + 1] int32, -1 = no segment
    row_ok: jax.Array  # [B] bool: the row satisfies both conditions (else its output is NaN)


def pack_segments(segment_ids: jax.Array, max_segments: int | None = None) -> PackedSegments:
    """Runs of equal ids -> (lengths, offsets) per row; see the module docstring.
    max_segments None: `MAX_SEGMENTS` as it is at the call (so a program may raise it)."""
    max_segments = MAX_SEGMENTS if max_segments is None else max_segments
    if max_segments < 2:  # with one, cuDNN takes the tables as plain padding lengths, not a packed layout
        raise ValueError(f"attention: cudnn max_segments must be >= 2, got {max_segments}")
    seg = segment_ids.astype(jnp.int32)
    b, t = seg.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # run index of every token
    runs = run[:, -1] + 1
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    # Runs past the bound are dropped here; row_ok marks those rows.
    lens = jnp.zeros((b, max_segments), jnp.int32).at[rows, run].add(1, mode="drop")
    offs = jnp.full((b, max_segments + 1), t, jnp.int32).at[rows, run].min(pos, mode="drop")
    present = jnp.arange(max_segments + 1, dtype=jnp.int32)[None, :] < jnp.minimum(runs, max_segments)[:, None]
    lens = jnp.where(present[:, :max_segments], lens, -1)
    offs = jnp.where(present, offs, -1)
    return PackedSegments(lens, offs, jnp.logical_and(runs <= max_segments, runs == _distinct_ids(seg)))


def _distinct_ids(seg: jax.Array) -> jax.Array:
    """[B] number of distinct ids per row (equals the run count iff every id is one run)."""
    s = jnp.sort(seg, axis=1)
    return 1 + jnp.sum(s[:, 1:] != s[:, :-1], axis=1, dtype=jnp.int32)


@functools.cache
def kv_offsets_follow_key_stride() -> bool:
    """Whether the installed jax converts kv offsets with the key's per-token stride (GQA-safe).

    Probes `_fix_seqlen_offsets` (pure jnp) on a 2-segment, 2-query-head / 1-kv-head example;
    anything unexpected counts as "no" (then the caller repeats kv heads, which is always exact)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import _fix_seqlen_offsets

        lens = np.asarray([[2, 2]], np.int32)
        offs = np.asarray([[0, 2, -1]], np.int32)
        q, k = np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 4, 1, 8), np.float32)
        with jax.ensure_compile_time_eval():  # concrete even when first asked inside a jit trace
            kv_offsets = jax.jit(_fix_seqlen_offsets)(lens, lens, offs, offs, q, k)[3]
        return int(np.asarray(kv_offsets).reshape(-1)[1]) == 2 * 1 * 8  # segment 2 starts at token 2 of k
    except Exception:  # noqa: BLE001 - a changed private API: take the safe path
        return False


def cudnn_fused(q, k, v, packed: PackedSegments, *, causal: bool, scale: float,
                sliding_window: int | None) -> jax.Array:
    """The cuDNN call on the packed layout (GPU only)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_sdpa

    return cudnn_sdpa(q, k, v, q_seqlen=packed.seq_lens, kv_seqlen=packed.seq_lens, q_offsets=packed.offsets,
                      kv_offsets=packed.offsets, scale=scale,
                      mask_type=MaskType.PADDING_CAUSAL if causal else MaskType.PADDING,
                      sliding_window_length=sliding_window, qkv_layout="BTNH")


FusedCall = Callable[..., jax.Array]


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool,
                     scale: float, left_window: int | None, max_segments: int | None = None,
                     fused: FusedCall = cudnn_fused) -> jax.Array:
    """Attention of a packed batch through cuDNN's packed layout; equals `kernels.attention`
    with `segment_ids` (one shared array) under the two conditions of the module docstring.

    `left_window` is the band's left side (keys i - left .. i visible; causal only).
    `fused` is the call on the packed layout (tests pass a jnp emulation of cuDNN)."""
    packed = pack_segments(segment_ids, max_segments)
    if k.shape[2] != q.shape[2] and not kv_offsets_follow_key_stride():
        group = q.shape[2] // k.shape[2]
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))  # query head h reads kv head h // group
    # cuDNN's window counts the query itself: (pos - length, pos].
    window = None if left_window is None else left_window + 1
    out = fused(q, k, v, packed, causal=causal, scale=scale, sliding_window=window)
    # Every token of an ok row lies in a segment; other rows are NaN, loudly.
    return jnp.where(packed.row_ok[:, None, None, None], out, jnp.asarray(jnp.nan, out.dtype))
