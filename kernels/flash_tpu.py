"""Flash attention in Pallas with the Mosaic lowering (TPU; interpret mode on CPU).

Layout [batch, heads, length, head_dim] inside (one transpose each way in XLA): Mosaic
tiles the last two dims of every block by (8, 128), so a head cannot be a squeezed
middle dim as in the Triton kernel.

* Forward: grid (batch, q heads, q blocks, kv blocks), the kv axis "arbitrary" (sequential)
  with the online-softmax state (m, l, acc) in VMEM scratch. Row statistics are kept
  replicated across the 128 lanes ([block_q, 128]) so they broadcast against score tiles
  without relayouts. A kv step outside the visible block range (`masks.kv_block_range`)
  does nothing, and the kv index map clamps into that range, so the pipeline re-uses the
  block it already holds instead of fetching a skipped one (blocks skipped only because of
  segment ids are still fetched, then not computed). Steps inside the fully visible range
  run without an element mask. Segment ids come in twice: per element
  (q ids lane-replicated, kv ids sublane-replicated, the layouts Mosaic tiles cheaply),
  and as per-block (min, max) bounds prefetched into SMEM, to skip or unmask blocks.
* Backward: a dq kernel (grid like the forward) and a dk/dv kernel with grid
  (batch, kv heads, kv blocks, group x q blocks): its sequential axis walks every query
  head of the GQA group and every query block, accumulating dk/dv of the shared kv head
  in VMEM. Each output block has one writer: deterministic, no atomics.
* log-sum-exp leaves the forward lane-replicated ([.., Tq, 128]); callers get [..., 0].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.block_sizes import BlockSizes, _next_pow2
from kernels.flash_common import FlashParams, pad_axis, round_up
from kernels.masks import (
    FULL,
    SKIP,
    Band,
    band_mask,
    kv_block_range,
    pad_segments,
    q_block_range,
    segment_block_bounds,
    segment_block_kind,
)

LANES = 128
SUBLANES = 8
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def tpu_blocks(blocks: BlockSizes, band: Band, interpret) -> BlockSizes:
    """On a real TPU every block is a multiple of 128 or spans the whole (padded) length
    (Mosaic's (8, 128) tiling, with lengths in the lane dim of score tiles); interpret
    mode takes any power of two, so tests can use small blocks."""
    if interpret:
        return blocks
    qcap, kcap = _next_pow2(band.q_len), _next_pow2(band.kv_len)
    fix = lambda b, cap: max(b, min(LANES, cap))  # noqa: E731
    return dataclasses.replace(
        blocks, block_q=fix(blocks.block_q, qcap), block_q_dq=fix(blocks.block_q_dq, qcap),
        block_q_dkv=fix(blocks.block_q_dkv, qcap), block_kv=fix(blocks.block_kv, kcap),
        block_kv_dq=fix(blocks.block_kv_dq, kcap), block_kv_dkv=fix(blocks.block_kv_dkv, kcap))


def _lanes(x: jax.Array, n: int) -> jax.Array:
    """A [rows, 128] lane-replicated array as [rows, n]."""
    if n == LANES:
        return x
    return jnp.tile(x, (1, pl.cdiv(n, LANES)))[:, :n]


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _clamp(i, lo, hi, n: int):
    """Block index i clamped into [lo, hi) (and [0, n)): skipped steps re-use a fetched block."""
    return jnp.minimum(jnp.maximum(jnp.minimum(i, hi - 1), lo), n - 1)


def _scores(params: FlashParams, q, k):
    s = _dot(q, k, _NT) * params.scale
    if params.softcap is None:
        return s, None
    t = jnp.tanh(s / params.softcap)
    return params.softcap * t, t


def _mask(params: FlashParams, s, q_block, kv_block, bq: int, bk: int, qseg_ref, kvseg_ref):
    q_pos = q_block * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    kv_pos = kv_block * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = band_mask(q_pos, kv_pos, params.band)
    if qseg_ref is not None:
        seg = _lanes(qseg_ref[...], bk) == kvseg_ref[:1, :]  # [bq, bk]
        mask = seg if mask is None else jnp.logical_and(mask, seg)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _run_flags(block, lo, full_lo, full_hi, hi, seg_kind):
    """(run without mask, run with mask) for this grid step."""
    in_range = jnp.logical_and(block >= lo, block < hi)
    index_full = jnp.logical_and(block >= full_lo, block < full_hi)
    if seg_kind is None:
        return jnp.logical_and(in_range, index_full), jnp.logical_and(in_range, jnp.logical_not(index_full))
    full = jnp.logical_and(index_full, seg_kind == FULL)
    run = jnp.logical_and(in_range, seg_kind != SKIP)
    return jnp.logical_and(run, full), jnp.logical_and(run, jnp.logical_not(full))


def _bounds(ref, b, i, n: int):
    """(min, max) segment id of block i of batch row b from a flattened SMEM table."""
    base = (b * n + i) * 2
    return ref[base], ref[base + 1]


class _Prepared:
    def __init__(self, params: FlashParams, q, k, v, q_seg, kv_seg):
        self.b, self.tq, self.hq, self.dqk = q.shape
        _, self.tkv, self.hkv, self.dv = v.shape
        self.group = self.hq // self.hkv
        self.tq_p = round_up(self.tq, params.blocks.q_multiple)
        self.tkv_p = round_up(self.tkv, params.blocks.kv_multiple)
        to_bhtd = lambda x, t: jnp.swapaxes(pad_axis(x, 1, t), 1, 2)  # noqa: E731
        self.q, self.k, self.v = to_bhtd(q, self.tq_p), to_bhtd(k, self.tkv_p), to_bhtd(v, self.tkv_p)
        self.has_seg = q_seg is not None
        if self.has_seg:
            self.q_seg = pad_segments(q_seg.astype(jnp.int32), self.tq_p)
            self.kv_seg = pad_segments(kv_seg.astype(jnp.int32), self.tkv_p)
            self.q_seg_lanes = jnp.broadcast_to(self.q_seg[:, :, None], (self.b, self.tq_p, LANES))
            self.kv_seg_sublanes = jnp.broadcast_to(self.kv_seg[:, None, :], (self.b, SUBLANES, self.tkv_p))

    def prefetch(self, bq: int, bk: int) -> list[jax.Array]:
        """Flattened per-block (min, max) segment ids: [B * nq * 2] and [B * nk * 2] int32."""
        if not self.has_seg:
            return []
        flat = lambda lo_hi: jnp.stack(lo_hi, axis=-1).reshape(-1)  # noqa: E731
        return [flat(segment_block_bounds(self.q_seg, bq)), flat(segment_block_bounds(self.kv_seg, bk))]


def _compiler_params() -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


# ---------------------------------------------------------------- forward


def _fwd_kernel(*refs, params: FlashParams, has_seg: bool, nq: int, nk: int):
    if has_seg:
        (qb_ref, kb_ref, q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref,
         m_ref, l_ref, acc_ref) = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
        qseg_ref = kvseg_ref = None
    bq, bk = params.blocks.block_q, params.blocks.block_kv
    b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    dv = acc_ref.shape[-1]

    @pl.when(kj == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    seg_kind = None
    if has_seg:
        seg_kind = segment_block_kind(*_bounds(qb_ref, b, qi, nq), *_bounds(kb_ref, b, kj, nk))
    run_full, run_masked = _run_flags(kj, *kv_block_range(qi, bq, bk, params.band), seg_kind)

    def step(masked: bool):
        s, _ = _scores(params, q_ref[...], k_ref[...])
        if masked:
            s = _mask(params, s, qi, kj, bq, bk, qseg_ref, kvseg_ref)
        m_prev, l_prev = m_ref[...], l_ref[...]  # [bq, 128], lane-replicated
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
        m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next  # all masked: no NaN
        p = jnp.exp(s - _lanes(m_use, bk))
        alpha = jnp.exp(m_prev - m_use)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1)[:, None]
        pv = _dot(p.astype(v_ref.dtype), v_ref[...], _NN)
        acc_ref[...] = acc_ref[...] * _lanes(alpha, dv) + pv

    pl.when(run_full)(lambda: step(False))
    pl.when(run_masked)(lambda: step(True))

    @pl.when(kj == nk - 1)
    def _finish():
        l = l_ref[...]
        empty = l == 0.0  # no visible key: output 0, lse -inf
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = (acc_ref[...] * _lanes(1.0 / l_safe, dv)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, -jnp.inf, m_ref[...] + jnp.log(l_safe))


def _grid_spec(num_prefetch, grid, in_specs, out_specs, scratch):
    return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=num_prefetch, grid=grid, in_specs=in_specs,
                                        out_specs=out_specs, scratch_shapes=scratch)


def _q_major_specs(x: _Prepared, params: FlashParams, bq: int, bk: int):
    """Index maps for grids (batch, q head, q block, kv block) with kv steps clamped to the
    visible range. Index maps get the scalar-prefetch refs as trailing arguments."""
    nk = x.tkv_p // bk
    g = x.group

    def kv_block(qi, kj):
        lo, _, _, hi = kv_block_range(qi, bq, bk, params.band)
        return _clamp(kj, lo, hi, nk)

    def kv_head(h):
        return lax.div(h, jnp.int32(g)) if g > 1 else h

    q_tile = lambda d: pl.BlockSpec((None, None, bq, d), lambda b, h, i, j, *_: (b, h, i, 0))  # noqa: E731
    kv_tile = lambda d: pl.BlockSpec((None, None, bk, d),  # noqa: E731
                                     lambda b, h, i, j, *_: (b, kv_head(h), kv_block(i, j), 0))
    rows = pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, j, *_: (b, h, i, 0))
    seg = [pl.BlockSpec((None, bq, LANES), lambda b, h, i, j, *_: (b, i, 0)),
           pl.BlockSpec((None, SUBLANES, bk), lambda b, h, i, j, *_: (b, 0, kv_block(i, j)))]
    return q_tile, kv_tile, rows, seg


def forward(params: FlashParams, q, k, v, q_seg, kv_seg) -> tuple[jax.Array, jax.Array]:
    x = _Prepared(params, q, k, v, q_seg, kv_seg)
    bq, bk = params.blocks.block_q, params.blocks.block_kv
    nq, nk = x.tq_p // bq, x.tkv_p // bk
    q_tile, kv_tile, rows, seg_specs = _q_major_specs(x, params, bq, bk)
    prefetch = x.prefetch(bq, bk)
    seg_arrays = [x.q_seg_lanes, x.kv_seg_sublanes] if x.has_seg else []
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, params=params, has_seg=x.has_seg, nq=nq, nk=nk),
        grid_spec=_grid_spec(
            len(prefetch), (x.b, x.hq, nq, nk),
            [q_tile(x.dqk), kv_tile(x.dqk), kv_tile(x.dv), *(seg_specs if x.has_seg else [])],
            [q_tile(x.dv), rows],
            [pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
             pltpu.VMEM((bq, x.dv), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((x.b, x.hq, x.tq_p, x.dv), q.dtype),
                   jax.ShapeDtypeStruct((x.b, x.hq, x.tq_p, LANES), jnp.float32)],
        compiler_params=_compiler_params(),
        interpret=params.interpret,
        name="flash_attention_fwd",
    )(*prefetch, x.q, x.k, x.v, *seg_arrays)
    return jnp.swapaxes(out[:, :, :x.tq], 1, 2), lse[:, :, :x.tq, 0]


# ---------------------------------------------------------------- backward: dq


def _dq_kernel(*refs, params: FlashParams, has_seg: bool, nq: int, nk: int):
    if has_seg:
        (qb_ref, kb_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref,
         dq_ref, acc_ref) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref = refs
        qseg_ref = kvseg_ref = None
    bq, bk = params.blocks.block_q_dq, params.blocks.block_kv_dq
    b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    seg_kind = None
    if has_seg:
        seg_kind = segment_block_kind(*_bounds(qb_ref, b, qi, nq), *_bounds(kb_ref, b, kj, nk))
    run_full, run_masked = _run_flags(kj, *kv_block_range(qi, bq, bk, params.band), seg_kind)

    def step(masked: bool):
        k = k_ref[...]
        s, t = _scores(params, q_ref[...], k)
        if masked:
            s = _mask(params, s, qi, kj, bq, bk, qseg_ref, kvseg_ref)
        p = jnp.exp(s - _lanes(lse_ref[...], bk))
        dp = _dot(do_ref[...], v_ref[...], _NT)
        ds = p * (dp - _lanes(delta_ref[...], bk))
        if t is not None:
            ds = ds * (1.0 - t * t)
        acc_ref[...] += _dot((ds * params.scale).astype(k.dtype), k, _NN)

    pl.when(run_full)(lambda: step(False))
    pl.when(run_masked)(lambda: step(True))

    @pl.when(kj == nk - 1)
    def _finish():
        dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


# ---------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(*refs, params: FlashParams, has_seg: bool, nq: int, nk: int, group: int):
    if has_seg:
        (qb_ref, kb_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref,
         dk_ref, dv_ref, dk_acc, dv_acc) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs
        qseg_ref = kvseg_ref = None
    bq, bk = params.blocks.block_q_dkv, params.blocks.block_kv_dkv
    b, kj, step_id = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    qi = lax.rem(step_id, jnp.int32(nq))  # the sequential axis walks (group head, q block)

    @pl.when(step_id == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    seg_kind = None
    if has_seg:
        seg_kind = segment_block_kind(*_bounds(qb_ref, b, qi, nq), *_bounds(kb_ref, b, kj, nk))
    run_full, run_masked = _run_flags(qi, *q_block_range(kj, bq, bk, params.band), seg_kind)

    def step(masked: bool):
        q, do = q_ref[...], do_ref[...]
        s, t = _scores(params, q, k_ref[...])
        if masked:
            s = _mask(params, s, qi, kj, bq, bk, qseg_ref, kvseg_ref)
        p = jnp.exp(s - _lanes(lse_ref[...], bk))  # [bq, bk]
        dv_acc[...] += _dot(p.T.astype(do.dtype), do, _NN)
        dp = _dot(do, v_ref[...], _NT)
        ds = p * (dp - _lanes(delta_ref[...], bk))
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk_acc[...] += _dot((ds * params.scale).T.astype(q.dtype), q, _NN)

    pl.when(run_full)(lambda: step(False))
    pl.when(run_masked)(lambda: step(True))

    @pl.when(step_id == group * nq - 1)
    def _finish():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def backward(params: FlashParams, q, k, v, q_seg, kv_seg, do, lse, delta):
    x = _Prepared(params, q, k, v, q_seg, kv_seg)
    blocks, g = params.blocks, x.group
    do_t = jnp.swapaxes(pad_axis(do, 1, x.tq_p), 1, 2)
    # Appended query rows: lse +inf makes their p exactly 0. Lane-replicated for the kernels.
    lanes = lambda r: jnp.broadcast_to(r[..., None], (*r.shape, LANES))  # noqa: E731
    lse_l = lanes(pad_axis(lse, 2, x.tq_p, jnp.inf))
    delta_l = lanes(pad_axis(delta, 2, x.tq_p))
    seg_arrays = [x.q_seg_lanes, x.kv_seg_sublanes] if x.has_seg else []

    bq, bk = blocks.block_q_dq, blocks.block_kv_dq
    nq, nk = x.tq_p // bq, x.tkv_p // bk
    q_tile, kv_tile, rows, seg_specs = _q_major_specs(x, params, bq, bk)
    prefetch = x.prefetch(bq, bk)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, params=params, has_seg=x.has_seg, nq=nq, nk=nk),
        grid_spec=_grid_spec(
            len(prefetch), (x.b, x.hq, nq, nk),
            [q_tile(x.dqk), kv_tile(x.dqk), kv_tile(x.dv), q_tile(x.dv), rows, rows,
             *(seg_specs if x.has_seg else [])],
            q_tile(x.dqk), [pltpu.VMEM((bq, x.dqk), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(x.q.shape, q.dtype),
        compiler_params=_compiler_params(),
        interpret=params.interpret,
        name="flash_attention_dq",
    )(*prefetch, x.q, x.k, x.v, do_t, lse_l, delta_l, *seg_arrays)

    bq, bk = blocks.block_q_dkv, blocks.block_kv_dkv
    nq, nk = x.tq_p // bq, x.tkv_p // bk

    def q_step(j, t):
        """(q head, q block) of sequential step t for kv block j, clamped to the visible range."""
        lo, _, _, hi = q_block_range(j, bq, bk, params.band)
        return lax.div(t, jnp.int32(nq)), _clamp(lax.rem(t, jnp.int32(nq)), lo, hi, nq)

    def q_map(b, h, j, t, *_):
        gi, i = q_step(j, t)
        return b, h * g + gi, i, 0

    def qseg_map(b, h, j, t, *_):
        return b, q_step(j, t)[1], 0

    q_tile = lambda d: pl.BlockSpec((None, None, bq, d), q_map)  # noqa: E731
    kv_tile = lambda d: pl.BlockSpec((None, None, bk, d), lambda b, h, j, t, *_: (b, h, j, 0))  # noqa: E731
    rows = pl.BlockSpec((None, None, bq, LANES), q_map)
    seg_specs = [pl.BlockSpec((None, bq, LANES), qseg_map),
                 pl.BlockSpec((None, SUBLANES, bk), lambda b, h, j, t, *_: (b, 0, j))]
    prefetch = x.prefetch(bq, bk)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, params=params, has_seg=x.has_seg, nq=nq, nk=nk, group=g),
        grid_spec=_grid_spec(
            len(prefetch), (x.b, x.hkv, nk, g * nq),
            [q_tile(x.dqk), kv_tile(x.dqk), kv_tile(x.dv), q_tile(x.dv), rows, rows,
             *(seg_specs if x.has_seg else [])],
            [kv_tile(x.dqk), kv_tile(x.dv)],
            [pltpu.VMEM((bk, x.dqk), jnp.float32), pltpu.VMEM((bk, x.dv), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(x.k.shape, k.dtype), jax.ShapeDtypeStruct(x.v.shape, v.dtype)],
        compiler_params=_compiler_params(),
        interpret=params.interpret,
        name="flash_attention_dkv",
    )(*prefetch, x.q, x.k, x.v, do_t, lse_l, delta_l, *seg_arrays)
    unpad = lambda a, t: jnp.swapaxes(a[:, :, :t], 1, 2)  # noqa: E731
    return unpad(dq, x.tq), unpad(dk, x.tkv), unpad(dv, x.tkv)
