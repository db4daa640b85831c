"""Ring attention's per-device body: one flash-kernel call per ring step, merged by log-sum-exp.

Runs inside `shard_map` over the `context` axis (see `sharding/context.py: attention`). Each
device holds a local block of Tl queries and, at ring step t, the K/V block of device
``source = (me - t) % n``; K/V (and their segment ids) move one device along the ring with
`ppermute` between steps, so K/V memory stays at one block.

**Visibility per chunk pair.** Which local queries see which visiting keys is known per chunk,
not per token, so each step is one call of `kernels.attention_with_lse` (any `impl`: xla,
Pallas, auto) on a contiguous (q rows, kv rows) rectangle with a static mask (a `Pair`):

- step 0 (source == me): the local block against itself, causal. With load balancing (device
  i holds chunks i and 2n-1-i of 2n) this is exact too: the local tokens are in increasing
  original order, chunk 2n-1-i sees all of chunk i, chunk i sees nothing of 2n-1-i.
- later steps, unbalanced: ``source < me`` sees the whole block (full), ``source > me`` nothing.
- later steps, balanced (chunk c = Tl / 2): ``source < me`` -> all Tl queries see the first
  chunk of the block (full, Tl x c); ``source > me`` -> only the second local chunk sees
  anything, and it sees the whole block (full, c x Tl). Both are Tl x c of work: balanced.

Sliding windows (window W, unbalanced rings only: with load balancing a local block's index
distance is not the token distance): step t's earlier block starts d = t Tl positions before the
local one, so its visible part is a static rectangle, keys [k0, Tl) with k0 = max(0, d - W + 1),
under the kernels' band (W - 1 - e, e), e = d - k0 (in the backward, step t holds block me + t, an
earlier one only when that wraps: d = (n - t) Tl); a step whose block is all outside the window
calls no kernel (K/V still travel). Windows balance the ring's work themselves (every query sees at
most W keys), though a model's global layers run unbalanced then.

The device index is traced, so a later step is a `lax.cond` between the two pairs' kernel calls
(static shapes each). Segment ids go to the kernel as a (q, kv) pair, so packed sequences
(and GQA, which the kernels take natively) work unchanged.

**Merge.** With lse_t the natural log-sum-exp of piece t, ``out = sum_t w_t out_t / sum_t w_t``
with ``w_t = exp(lse_t - m)`` for any m: m is the running max (0 while still -inf), so weights
are <= 1, a piece with lse -inf weighs exactly 0 and a row with nothing visible ends 0 / 1 = 0.

**Gradients** (`_ring` is a custom VJP; the forward keeps only q, k, v, the ids, the merged out
and its lse L): the backward sends K/V around the ring again, the other way round, with their
float32 gradients travelling beside them; each step recomputes its piece (out_t, lse_t) and
backpropagates through `attention_with_lse` with the cotangents of the merge, ``d out_t = w_t dO`` and
``d lse_t = w_t (out_t - out) . dO`` where ``w_t = exp(lse_t - L)``. The kernels' VJP takes
the lse cotangent (it enters through delta = rowsum(out_t d out_t) - d lse_t, here
w_t rowsum(out dO): the global softmax's delta, `kernels/flash.py`), so the result is the
exact gradient of the merged attention. Everything per step (the piece's residuals) lives
inside the step's `cond` branch, so the backward holds one block's worth at a time instead of
every step's residuals, the cost of one extra forward kernel per step. Each rotation is tied to
the previous step's result (`_after`), so XLA cannot send all blocks up front and hold them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

import kernels
from kernels.logs import log_once

logger = logging.getLogger(__name__)
_logged: set[str] = set()

State = tuple[jax.Array, jax.Array, jax.Array]  # (weighted sum, weight total, running max lse)
Grads = tuple[jax.Array, jax.Array, jax.Array]  # float32 (dq, dk, dv) accumulators
T = TypeVar("T")


def ring_impl(impl: str) -> str:
    """The attention impl each ring step runs: cuDNN returns no log-sum-exp, so it becomes `auto`
    (which never picks cuDNN when the lse is needed: Pallas on a GPU)."""
    if impl == "cudnn":
        log_once(logger, _logged, "ring attention: cudnn returns no log-sum-exp; each ring step runs impl='auto'")
        return "auto"
    return impl


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Everything static about one ring call (hashable: a nondiff custom_vjp argument)."""

    axis: str
    ring: int
    balanced: bool
    scale: float
    impl: str
    platform: str | None = None  # the plan's devices (None: the default backend), for kernel dispatch
    softcap: float | None = None  # tanh soft-cap of the scores (Gemma 2), in every ring step
    window: int | None = None  # sliding window (keys seen, itself included); unbalanced rings only


@dataclasses.dataclass(frozen=True)
class Pair:
    """Local query rows [q0, q1) attend to visiting key rows [k0, k1): all of them, or causally."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    window: tuple[int, int] | None = None  # the kernels' (left, right) band on the rectangle's own indices


def _pairs(cfg: RingConfig, step: int, tl: int, back: bool = False) -> tuple[Pair | None, ...]:
    """Step 0: (the causal diagonal,); later steps: (the pair if source < me, if source > me).
    `back`: the backward's order, where step t holds the block of device me + t (so an earlier one
    is (ring - t) blocks back)."""
    if step == 0:
        return (Pair(0, tl, 0, tl, causal=True, window=None if cfg.window is None else (cfg.window - 1, 0)),)
    if cfg.window is not None:
        return _window_pair(cfg.window, ((cfg.ring - step) if back else step) * tl, tl), None
    if not cfg.balanced:
        return Pair(0, tl, 0, tl), None
    c = tl // 2
    return Pair(0, tl, 0, c), Pair(c, tl, 0, tl)


def _window_pair(window: int, d: int, tl: int) -> Pair | None:
    """The visible rectangle of an earlier block whose tokens start `d` positions before the local ones
    (unbalanced ring): query x sees key y when 0 <= d + x - y <= window - 1. Keys before k0 are out of
    every query's window; on the rest the band is (left, right) = (window - 1 - e, e), e = d - k0.
    None when the whole block is out of the window (no kernel call)."""
    k0 = max(0, d - (window - 1))
    if k0 >= tl:
        return None
    e = d - k0
    return Pair(0, tl, k0, tl, window=(window - 1 - e, e))


def _choose(cfg: RingConfig, step: int, me: jax.Array, tl: int, branch: Callable[[Pair | None], T], *,
            back: bool = False) -> T:
    """`branch(pair)` for this step's pair, chosen by the traced device index where it varies."""
    options = _pairs(cfg, step, tl, back)
    if len(options) == 1 or all(pair is None for pair in options):
        return branch(options[0])
    source = (me + step if back else me - step) % cfg.ring  # whose block this device holds now
    return jax.lax.cond(source < me, lambda: branch(options[0]), lambda: branch(options[1]))


def _kernel(cfg: RingConfig, pair: Pair, q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array,
            kv_seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out [B, Tq, H, Dv], lse [B, Tq, H]) of already-sliced rows and keys."""
    out, lse = kernels.attention_with_lse(q, k, v, causal=pair.causal, segment_ids=(q_seg, kv_seg), scale=cfg.scale,
                                          impl=cfg.impl, platform=cfg.platform, softcap=cfg.softcap,
                                          window=pair.window)
    return out, jnp.swapaxes(lse, 1, 2)


def _piece(cfg: RingConfig, pair: Pair, q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array,
           kv_seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The pair's rectangle: rows [q0, q1) of the local block against keys [k0, k1) of the visiting one."""
    rows, cols = slice(pair.q0, pair.q1), slice(pair.k0, pair.k1)
    return _kernel(cfg, pair, q[:, rows], k[:, cols], v[:, cols], q_seg[:, rows], kv_seg[:, cols])


def _merge(state: State, pair: Pair, out: jax.Array, lse: jax.Array) -> State:
    """Add one piece to the running log-sum-exp merge of rows [q0, q1) (module docstring)."""
    rows = slice(pair.q0, pair.q1)
    acc, total, top = (x[:, rows] for x in state)
    new_top = jnp.maximum(top, lse)
    base = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # -inf only while nothing was visible
    rescale, weight = jnp.exp(top - base), jnp.exp(lse - base)  # 0 for -inf
    acc = acc * rescale[..., None] + weight[..., None] * out.astype(jnp.float32)
    return tuple(s.at[:, rows].set(x) for s, x in zip(state, (acc, total * rescale + weight, new_top)))


def _after(xs: tuple[jax.Array, ...], dep: jax.Array) -> tuple[jax.Array, ...]:
    """`xs` unchanged, but computed after `dep`: XLA would otherwise send every block of the ring
    as early as it likes (they depend on K/V alone) and keep them all alive at once. Adds
    0 x one element of `dep` to the floating arrays (exact; XLA does not fold x * 0 for floats;
    a non-finite `dep` makes the blocks NaN, where the gradients being built are non-finite anyway)."""
    tie = 0 * dep.reshape(-1)[0]
    return tuple(x + tie.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs)


def _rotate(cfg: RingConfig, xs: tuple[jax.Array, ...], *, back: bool = False) -> tuple[jax.Array, ...]:
    """Send every array one device along the ring: j -> j + 1, or j -> j - 1 with `back`."""
    shift = [(j, (j - 1 if back else j + 1) % cfg.ring) for j in range(cfg.ring)]
    return tuple(jax.lax.ppermute(x, cfg.axis, shift) for x in xs)


def _ring_forward(cfg: RingConfig, q: jax.Array, k: jax.Array, v: jax.Array,
                  seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out [B, Tl, H, Dv] float32, lse [B, Tl, H] float32, -inf where nothing is visible)."""
    b, tl, h, _ = q.shape
    me = jax.lax.axis_index(cfg.axis)
    state = (jnp.zeros((b, tl, h, v.shape[-1]), jnp.float32), jnp.zeros((b, tl, h), jnp.float32),
             jnp.full((b, tl, h), -jnp.inf, jnp.float32))
    kv = (k, v, seg)
    for step in range(cfg.ring):
        if step:
            kv = _rotate(cfg, _after(kv, state[1]))  # state[1], the weight total, is always finite

        def branch(pair: Pair | None, state=state, kv=kv) -> State:
            return state if pair is None else _merge(state, pair, *_piece(cfg, pair, q, kv[0], kv[1], seg, kv[2]))
        state = _choose(cfg, step, me, tl, branch)
    acc, total, top = state
    seen = total > 0
    lse = jnp.where(seen, jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return acc / jnp.where(seen, total, 1.0)[..., None], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
    return _ring_forward(cfg, q, k, v, seg)[0].astype(q.dtype)


def _ring_fwd(cfg: RingConfig, q: jax.Array, k: jax.Array, v: jax.Array,
              seg: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _ring_forward(cfg, q, k, v, seg)
    return out.astype(q.dtype), (q, k, v, seg, out, lse)


def _pair_grads(cfg: RingConfig, pair: Pair, grads: Grads, q: jax.Array, k: jax.Array, v: jax.Array,
                q_seg: jax.Array, kv_seg: jax.Array, out: jax.Array, norm: jax.Array, d_out: jax.Array) -> Grads:
    """Recompute one piece and add its gradients: cotangents d out_t = w dO, d lse_t = w (out_t - out) . dO."""
    rows, cols = slice(pair.q0, pair.q1), slice(pair.k0, pair.k1)
    (out_t, lse_t), piece_vjp = jax.vjp(
        lambda q_, k_, v_: _kernel(cfg, pair, q_, k_, v_, q_seg[:, rows], kv_seg[:, cols]),
        q[:, rows], k[:, cols], v[:, cols])
    weight = jnp.exp(lse_t - norm[:, rows])  # this piece's share of each row: 0 where it saw nothing
    d_o = d_out[:, rows]
    d_lse = weight * jnp.sum((out_t.astype(jnp.float32) - out[:, rows]) * d_o, axis=-1)
    dq, dk, dv = piece_vjp(((weight[..., None] * d_o).astype(out_t.dtype), d_lse))
    return (grads[0].at[:, rows].add(dq.astype(jnp.float32)), grads[1].at[:, cols].add(dk.astype(jnp.float32)),
            grads[2].at[:, cols].add(dv.astype(jnp.float32)))


def _ring_bwd(cfg: RingConfig, residuals: tuple[jax.Array, ...],
              d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """K/V go around the ring again, their float32 gradients travelling with them. The other way
    round: the same ppermutes as the forward's would be merged with them by XLA's CSE, which
    then keeps every visiting block alive from the forward to the backward (all-gather memory
    for K/V); an optimization barrier did not stop that on XLA:CPU."""
    q, k, v, seg, out, lse = residuals
    me = jax.lax.axis_index(cfg.axis)
    d_out = d_out.astype(jnp.float32)
    norm = jnp.where(jnp.isneginf(lse), jnp.inf, lse)  # rows that saw nothing: every weight 0
    grads = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    kv = (k, v, seg)
    for step in range(cfg.ring):
        if step:
            kv, (dk, dv) = _rotate(cfg, _after(kv, grads[1]), back=True), _rotate(cfg, grads[1:], back=True)
            grads = (grads[0], dk, dv)

        def branch(pair: Pair | None, grads=grads, kv=kv) -> Grads:
            return grads if pair is None else _pair_grads(cfg, pair, grads, q, kv[0], kv[1], seg, kv[2], out, norm,
                                                          d_out)
        grads = _choose(cfg, step, me, q.shape[1], branch, back=True)
    dk, dv = _rotate(cfg, grads[1:], back=True)  # the last holder of block j is device j + 1: one step home
    return grads[0].astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, axis: str, ring: int,
                         balanced: bool, scale: float, impl: str, platform: str | None = None,
                         softcap: float | None = None, window: int | None = None) -> jax.Array:
    """Per-device body: local q [B, Tl, H, D] against every K/V block of the ring -> [B, Tl, H, Dv]."""
    if balanced and q.shape[1] % 2:
        raise ValueError(f"ring attention: balanced local length {q.shape[1]} must be even (two chunks)")
    if balanced and window is not None:  # a local block of two far-apart chunks: index distance is not position
        raise ValueError("ring attention: sliding windows need parallelism.load_balance=false")
    cfg = RingConfig(axis, ring, balanced, float(scale), ring_impl(impl), platform, softcap, window)
    return _ring(cfg, q, k, v, seg)
