"""Ring attention's per-device body: one flash-kernel call per ring step, merged by log-sum-exp.

Runs inside `shard_map` over the `context` axis (see `sharding/context.py: attention`). Each
device holds a local block of Tl queries and, at ring step t, the K/V block of device
``source = (me - t) % n``; K/V (and their segment ids) move one device along the ring with
`ppermute` between steps, so K/V memory stays at one block.

Which local queries see which visiting keys is known per *chunk pair*, not per token, so each
step is one call of `kernels.attention_with_lse` (any `impl`: xla, Pallas, auto) on a
contiguous (q rows, kv rows) rectangle with a static mask, never a [Tl, Tl] mask:

- step 0 (source == me): the local block against itself, causal. With load balancing (device
  i holds chunks i and 2n-1-i of 2n) this is exact too: the local tokens are in increasing
  original order, chunk 2n-1-i sees all of chunk i, chunk i sees nothing of 2n-1-i.
- later steps, unbalanced: ``source < me`` sees the whole block (full), ``source > me`` nothing.
- later steps, balanced (chunk c = Tl / 2): ``source < me`` -> all Tl queries see the first
  chunk of the block (full, Tl x c); ``source > me`` -> only the second local chunk sees
  anything, and it sees the whole block (full, c x Tl). Both are Tl x c of work: balanced.

The device index is traced, so the choice is a `lax.cond` between kernel calls of static
shapes (rows a branch does not compute get output 0 and lse -inf: they merge as nothing).
Segment ids go to the kernel as a (q, kv) pair, so packed sequences and GQA work unchanged.

Merging: with lse_t the natural log-sum-exp of each piece, ``out = sum_t w_t out_t / sum_t
w_t`` with ``w_t = exp(lse_t - m)`` for any m; m = the running max of the lse, held under
`stop_gradient` (the result does not depend on m, so its gradient is exact without it) and
0 where still -inf, so the weights are <= 1, pieces with lse -inf weigh exactly 0 and a row
with nothing visible anywhere ends as 0 / 1 = 0 with finite gradients. The gradient reaches
each kernel through both outputs: d/d out_t is w_t / sum w, d/d lse_t is w_t (out_t - out) .
dO / sum w; `attention_with_lse`'s custom VJP takes the lse cotangent (it enters the
backward kernels through delta = rowsum(O dO) - dlse, `kernels/flash.py`).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

import kernels
from kernels.logs import log_once

logger = logging.getLogger(__name__)
_logged: set[str] = set()

Piece = tuple[jax.Array, jax.Array]  # (out [B, T, H, Dv] in q.dtype, lse [B, H, T] float32)
State = tuple[jax.Array, jax.Array, jax.Array]  # (weighted sum, weight total, running max lse)


def ring_impl(impl: str) -> str:
    """The attention impl each ring step runs: cuDNN returns no log-sum-exp, so it becomes `auto`
    (which never picks cuDNN when the lse is needed: Pallas on a GPU)."""
    if impl == "cudnn":
        log_once(logger, _logged, "ring attention: cudnn returns no log-sum-exp; each ring step runs impl='auto'")
        return "auto"
    return impl


def _piece(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, *, causal: bool,
           scale: float, impl: str) -> Piece:
    return kernels.attention_with_lse(q, k, v, causal=causal, segment_ids=(q_seg, kv_seg), scale=scale, impl=impl)


def _nothing(q: jax.Array, v: jax.Array, rows: int, axis: str) -> Piece:
    """`rows` query rows that see no key: output 0, lse -inf (they merge as nothing). Cast to
    varying over `axis` so both `cond` branches have the type of a kernel's output."""
    b, _, h, _ = q.shape
    piece = (jnp.zeros((b, rows, h, v.shape[-1]), q.dtype), jnp.full((b, h, rows), -jnp.inf, jnp.float32))
    return jax.lax.pcast(piece, axis, to="varying")


def _visiting_block(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array,
                    earlier: jax.Array, *, axis: str, balanced: bool, scale: float, impl: str) -> Piece:
    """The local queries against another device's K/V block; `earlier`: traced source < me."""
    call = dict(causal=False, scale=scale, impl=impl)
    if not balanced:  # the block lies wholly before (all visible) or after (none) the local one
        return jax.lax.cond(earlier, lambda: _piece(q, k, v, q_seg, kv_seg, **call),
                            lambda: _nothing(q, v, q.shape[1], axis))
    c = q.shape[1] // 2

    def first_chunk_only() -> Piece:  # source < me: chunk `source` precedes both local chunks
        return _piece(q, k[:, :c], v[:, :c], q_seg, kv_seg[:, :c], **call)

    def second_half_sees_all() -> Piece:  # source > me: both chunks precede only local chunk 2n-1-me
        out, lse = _piece(q[:, c:], k, v, q_seg[:, c:], kv_seg, **call)
        none_out, none_lse = _nothing(q, v, c, axis)
        return jnp.concatenate([none_out, out], axis=1), jnp.concatenate([none_lse, lse], axis=2)

    return jax.lax.cond(earlier, first_chunk_only, second_half_sees_all)


def _merge(state: State, piece: Piece) -> State:
    """Add one piece to the running log-sum-exp merge (see the module docstring)."""
    acc, total, top = state
    out, lse = piece
    lse = jnp.swapaxes(lse, 1, 2)  # [B, T, H], the layout of out's leading axes
    new_top = jnp.maximum(top, jax.lax.stop_gradient(lse))
    base = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # -inf only while nothing was visible
    rescale = jnp.exp(top - base)  # constant (no gradient): top and base are stopped
    weight = jnp.exp(lse - base)  # 0 (and gradient 0) for lse = -inf
    acc = acc * rescale[..., None] + weight[..., None] * out.astype(jnp.float32)
    return acc, total * rescale + weight, new_top


def ring_attention_local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, axis: str, ring: int,
                         balanced: bool, scale: float, impl: str) -> jax.Array:
    """Per-device body: local q [B, Tl, H, D] against every K/V block of the ring -> [B, Tl, H, Dv]."""
    b, tl, h, _ = q.shape
    if balanced and tl % 2:
        raise ValueError(f"ring attention: balanced local length {tl} must be even (two chunks)")
    impl = ring_impl(impl)
    me = jax.lax.axis_index(axis)
    state = (jnp.zeros((b, tl, h, v.shape[-1]), jnp.float32), jnp.zeros((b, tl, h), jnp.float32),
             jnp.full((b, tl, h), -jnp.inf, jnp.float32))
    state = _merge(state, _piece(q, k, v, seg, seg, causal=True, scale=scale, impl=impl))
    kv_seg = seg
    shift = [(j, (j + 1) % ring) for j in range(ring)]
    for step in range(1, ring):
        k, v, kv_seg = (jax.lax.ppermute(x, axis, shift) for x in (k, v, kv_seg))
        earlier = (me - step) % ring < me  # whose block this is: device (me - step) % ring
        state = _merge(state, _visiting_block(q, k, v, seg, kv_seg, earlier, axis=axis, balanced=balanced,
                                              scale=scale, impl=impl))
    acc, total, _ = state
    return (acc / jnp.where(total > 0, total, 1.0)[..., None]).astype(q.dtype)
