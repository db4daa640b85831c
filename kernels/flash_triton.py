"""Flash attention in Pallas with the Triton lowering (NVIDIA GPUs; interpret mode on CPU).

Layout stays [batch, length, heads, head_dim]: Triton loads strided tiles, so no transpose.

* Forward: grid (q blocks, batch, q heads). Each program keeps its q tile and walks the kv
  blocks its queries can see (`masks.kv_block_range`) with the online softmax, in three
  loops: boundary blocks with an element mask, the fully visible middle without one, and
  the far boundary with a mask. Segment ids narrow further per block: disjoint id ranges
  skip the block, one shared id drops the mask (`masks.segment_block_kind`).
* Backward: two kernels, both recomputing p from the saved log-sum-exp.
  - dq: grid (q blocks, batch, q heads), walking kv blocks like the forward.
  - dk/dv: grid (kv blocks, batch, kv heads), walking the query blocks that see the kv
    block (`masks.q_block_range`) for every query head of the GQA group, so dk/dv of a
    shared kv head are summed in registers: no [.., q_heads, ..] intermediate, no atomics.
  Two kernels rather than one fused kernel with atomic dq updates: each output is written
  by exactly one program, so results are bitwise deterministic, and each kernel keeps
  only its own accumulators live.
* Head dims: Triton tiles must be powers of two, so a head dim is padded (in XLA) to a
  multiple of 16 and then processed as power-of-two column chunks (192 = 128 + 64,
  96 = 64 + 32): no FLOPs are wasted on zero padding, unlike padding 96 to 128.
* Lengths are padded to a block multiple in XLA; appended keys are masked (`j < kv_len`),
  appended query rows are computed and sliced away.
* Softmax in base 2: log2(e) is folded into the score scale (one multiply per score fewer,
  and `exp2` is the GPU's native instruction); the running max and the backward's
  log-sum-exp are kept in log2 units inside, natural log at the API.
* Compiler settings per kernel: `BlockSizes.warps_stages("fwd" | "dq" | "dkv", head_dim)`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.flash_common import FlashParams, pad_axis, round_up
from kernels.masks import (
    FULL,
    MASKED,
    SKIP,
    band_mask,
    kv_block_range,
    pad_segments,
    q_block_range,
    segment_block_bounds,
    segment_block_kind,
)

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    # Triton's default for float32 operands is TF32 (10-bit mantissa: ~1e-3 relative error,
    # measured on an H200); float32 inputs mean float32 math here, as in the reference.
    f32 = jnp.float32 in (a.dtype, b.dtype)
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST if f32 else None,
                           preferred_element_type=jnp.float32)


def column_chunks(d: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) power-of-two chunks (each >= 16) that tile a head dim (a multiple of 16)."""
    assert d % 16 == 0, d
    out, off = [], 0
    for bit in reversed(range(d.bit_length())):
        if d & (1 << bit):
            out.append((off, 1 << bit))
            off += 1 << bit
    return tuple(out)


def _compiler_params(params: FlashParams, d: int, kernel: str) -> plgpu.CompilerParams:
    warps, stages = params.blocks.warps_stages(kernel, d)
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _scores(params: FlashParams, q_chunks, k_chunks):
    """Scaled (and soft-capped) scores in float32 and log2 units (natural scores x log2(e));
    also tanh(s / cap) for the backward."""
    dots = sum(_dot(qc, kc, _NT) for qc, kc in zip(q_chunks, k_chunks))
    if params.softcap is None:
        return dots * (params.scale * LOG2E), None
    t = jnp.tanh(dots * (params.scale / params.softcap))
    return t * (params.softcap * LOG2E), t


def _mask(params: FlashParams, s, q_pos, kv_pos, q_seg, kv_seg):
    mask = band_mask(q_pos[:, None], kv_pos[None, :], params.band)
    if q_seg is not None:
        seg = q_seg[:, None] == kv_seg[None, :]
        mask = seg if mask is None else jnp.logical_and(mask, seg)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _walk(lo, full_lo, full_hi, hi, step, carry, seg_kind=None):
    """Visit blocks [lo, hi): masked at the edges, unmasked in [full_lo, full_hi).

    `seg_kind(i)` (segment ids given) further skips a block or drops its mask."""
    def visit(masked):
        def body(i, c):
            if seg_kind is None:
                return step(i, c, masked)
            kind = seg_kind(i)
            if masked:
                return lax.cond(kind == SKIP, lambda c: c, lambda c: step(i, c, True), c)
            return lax.switch(kind, [lambda c: c, lambda c: step(i, c, True), lambda c: step(i, c, False)], c)
        return body

    assert (SKIP, MASKED, FULL) == (0, 1, 2)
    carry = lax.fori_loop(lo, full_lo, visit(True), carry)
    carry = lax.fori_loop(full_lo, full_hi, visit(False), carry)
    return lax.fori_loop(full_hi, hi, visit(True), carry)


# ---------------------------------------------------------------- forward


def _fwd_kernel(*refs, params: FlashParams, has_seg: bool, qk_chunks, v_chunks):
    if has_seg:
        (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, qmin_ref, qmax_ref, kvmin_ref, kvmax_ref,
         o_ref, lse_ref) = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    bq, bk = params.blocks.block_q, params.blocks.block_kv
    qi = pl.program_id(0)
    q_chunks = [q_ref[:, pl.ds(off, n)] for off, n in qk_chunks]
    q_pos = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    q_seg = qseg_ref[...] if has_seg else None

    def step(j, carry, masked):
        acc, m_prev, l_prev = carry
        rows = pl.ds(j * bk, bk)
        s, _ = _scores(params, q_chunks, [k_ref[rows, pl.ds(off, n)] for off, n in qk_chunks])
        if masked:
            kv_seg = kvseg_ref[rows] if has_seg else None
            s = _mask(params, s, q_pos, j * bk + jnp.arange(bk, dtype=jnp.int32), q_seg, kv_seg)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # All keys so far masked: shift by 0, so exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
        m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        alpha = jnp.exp2(m_prev - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        p = p.astype(v_ref.dtype)
        acc = tuple(a * alpha[:, None] + _dot(p, v_ref[rows, pl.ds(off, n)], _NN)
                    for a, (off, n) in zip(acc, v_chunks))
        return acc, m_next, l_next

    carry = (tuple(jnp.zeros((bq, n), jnp.float32) for _, n in v_chunks),
             jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    seg_kind = None
    if has_seg:
        q_min, q_max = qmin_ref[qi], qmax_ref[qi]
        seg_kind = lambda j: segment_block_kind(q_min, q_max, kvmin_ref[j], kvmax_ref[j])  # noqa: E731
    acc, m, l = _walk(*kv_block_range(qi, bq, bk, params.band), step, carry, seg_kind)
    empty = l == 0.0  # no visible key: output 0, lse -inf (the convention of every impl)
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    for a, (off, n) in zip(acc, v_chunks):
        o_ref[:, pl.ds(off, n)] = (a * inv_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(jnp.where(empty, 1.0, l)))


class _Prepared:
    """Inputs padded for the kernels: lengths to block multiples, head dims to multiples of 16."""

    def __init__(self, params: FlashParams, q, k, v, q_seg, kv_seg):
        self.b, self.tq, self.hq, self.dqk = q.shape
        _, self.tkv, self.hkv, self.dv = v.shape
        self.group = self.hq // self.hkv
        self.tq_p = round_up(self.tq, params.blocks.q_multiple)
        self.tkv_p = round_up(self.tkv, params.blocks.kv_multiple)
        self.dqk_p, self.dv_p = round_up(self.dqk, 16), round_up(self.dv, 16)
        self.q = pad_axis(pad_axis(q, 1, self.tq_p), 3, self.dqk_p)
        self.k = pad_axis(pad_axis(k, 1, self.tkv_p), 3, self.dqk_p)
        self.v = pad_axis(pad_axis(v, 1, self.tkv_p), 3, self.dv_p)
        self.has_seg = q_seg is not None
        if self.has_seg:
            self.q_seg = pad_segments(q_seg.astype(jnp.int32), self.tq_p)
            self.kv_seg = pad_segments(kv_seg.astype(jnp.int32), self.tkv_p)
        self.qk_chunks = column_chunks(self.dqk_p)
        self.v_chunks = column_chunks(self.dv_p)

    def seg_inputs(self, bq: int, bk: int, q_whole: bool, kv_whole: bool):
        """Segment ids (per block or whole rows) and per-block id bounds, with their specs.

        Grid axes are (block, batch, head) for both backward kernels and the forward."""
        if not self.has_seg:
            return [], []
        q_min, q_max = segment_block_bounds(self.q_seg, bq)
        kv_min, kv_max = segment_block_bounds(self.kv_seg, bk)
        whole = lambda n: pl.BlockSpec((None, n), lambda i, b, h: (b, 0))  # noqa: E731
        block = lambda n: pl.BlockSpec((None, n), lambda i, b, h: (b, i))  # noqa: E731
        arrays = [self.q_seg, self.kv_seg, q_min, q_max, kv_min, kv_max]
        specs = [whole(self.tq_p) if q_whole else block(bq), whole(self.tkv_p) if kv_whole else block(bk),
                 whole(q_min.shape[1]), whole(q_max.shape[1]), whole(kv_min.shape[1]), whole(kv_max.shape[1])]
        return arrays, specs


def _kv_head(h, group: int):
    return lax.div(h, jnp.int32(group)) if group > 1 else h


def forward(params: FlashParams, q, k, v, q_seg, kv_seg) -> tuple[jax.Array, jax.Array]:
    x = _Prepared(params, q, k, v, q_seg, kv_seg)
    bq = params.blocks.block_q
    g = x.group
    seg_arrays, seg_specs = x.seg_inputs(bq, params.blocks.block_kv, q_whole=False, kv_whole=True)
    kernel = functools.partial(_fwd_kernel, params=params, has_seg=x.has_seg,
                               qk_chunks=x.qk_chunks, v_chunks=x.v_chunks)
    out, lse = pl.pallas_call(
        kernel,
        grid=(x.tq_p // bq, x.b, x.hq),
        in_specs=[
            pl.BlockSpec((None, bq, None, x.dqk_p), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, x.tkv_p, None, x.dqk_p), lambda i, b, h: (b, 0, _kv_head(h, g), 0)),
            pl.BlockSpec((None, x.tkv_p, None, x.dv_p), lambda i, b, h: (b, 0, _kv_head(h, g), 0)),
            *seg_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, x.dv_p), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((x.b, x.tq_p, x.hq, x.dv_p), q.dtype),
                   jax.ShapeDtypeStruct((x.b, x.hq, x.tq_p), jnp.float32)],
        compiler_params=_compiler_params(params, max(x.dqk_p, x.dv_p), "fwd"),
        interpret=params.interpret,
        name="flash_attention_fwd",
    )(x.q, x.k, x.v, *seg_arrays)
    return out[:, :x.tq, :, :x.dv], lse[:, :, :x.tq]


# ---------------------------------------------------------------- backward: dq


def _dq_kernel(*refs, params: FlashParams, has_seg: bool, qk_chunks, v_chunks):
    if has_seg:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, qmin_ref, qmax_ref,
         kvmin_ref, kvmax_ref, dq_ref) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    bq, bk = params.blocks.block_q_dq, params.blocks.block_kv_dq
    qi = pl.program_id(0)
    q_chunks = [q_ref[:, pl.ds(off, n)] for off, n in qk_chunks]
    do_chunks = [do_ref[:, pl.ds(off, n)] for off, n in v_chunks]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    q_seg = qseg_ref[...] if has_seg else None

    def step(j, dq, masked):
        rows = pl.ds(j * bk, bk)
        k_chunks = [k_ref[rows, pl.ds(off, n)] for off, n in qk_chunks]
        s, t = _scores(params, q_chunks, k_chunks)
        if masked:
            kv_seg = kvseg_ref[rows] if has_seg else None
            s = _mask(params, s, q_pos, j * bk + jnp.arange(bk, dtype=jnp.int32), q_seg, kv_seg)
        p = jnp.exp2(s - lse[:, None])
        dp = sum(_dot(dc, v_ref[rows, pl.ds(off, n)], _NT) for dc, (off, n) in zip(do_chunks, v_chunks))
        ds = p * (dp - delta[:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)  # d(cap * tanh(s / cap)) / ds
        ds = (ds * params.scale).astype(k_ref.dtype)
        return tuple(a + _dot(ds, kc, _NN) for a, kc in zip(dq, k_chunks))

    dq = tuple(jnp.zeros((bq, n), jnp.float32) for _, n in qk_chunks)
    seg_kind = None
    if has_seg:
        q_min, q_max = qmin_ref[qi], qmax_ref[qi]
        seg_kind = lambda j: segment_block_kind(q_min, q_max, kvmin_ref[j], kvmax_ref[j])  # noqa: E731
    dq = _walk(*kv_block_range(qi, bq, bk, params.band), step, dq, seg_kind)
    for a, (off, n) in zip(dq, qk_chunks):
        dq_ref[:, pl.ds(off, n)] = a.astype(dq_ref.dtype)


# ---------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(*refs, params: FlashParams, has_seg: bool, group: int, qk_chunks, v_chunks):
    if has_seg:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, qmin_ref, qmax_ref,
         kvmin_ref, kvmax_ref, dk_ref, dv_ref) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    bq, bk = params.blocks.block_q_dkv, params.blocks.block_kv_dkv
    kj = pl.program_id(0)
    k_chunks = [k_ref[:, pl.ds(off, n)] for off, n in qk_chunks]
    v_chunks_val = [v_ref[:, pl.ds(off, n)] for off, n in v_chunks]
    kv_pos = kj * bk + jnp.arange(bk, dtype=jnp.int32)
    kv_seg = kvseg_ref[...] if has_seg else None
    seg_kind = None
    if has_seg:
        kv_min, kv_max = kvmin_ref[kj], kvmax_ref[kj]
        seg_kind = lambda i: segment_block_kind(qmin_ref[i], qmax_ref[i], kv_min, kv_max)  # noqa: E731
    ranges = q_block_range(kj, bq, bk, params.band)

    def head(gi, carry):
        def step(i, carry, masked):
            dk, dv = carry
            rows = pl.ds(i * bq, bq)
            q_chunks = [q_ref[rows, gi, pl.ds(off, n)] for off, n in qk_chunks]
            do_chunks = [do_ref[rows, gi, pl.ds(off, n)] for off, n in v_chunks]
            s, t = _scores(params, q_chunks, k_chunks)
            if masked:
                q_seg = qseg_ref[rows] if has_seg else None
                s = _mask(params, s, i * bq + jnp.arange(bq, dtype=jnp.int32), kv_pos, q_seg, kv_seg)
            p = jnp.exp2(s - lse_ref[gi, rows][:, None])
            pt = p.astype(do_ref.dtype)
            dv = tuple(a + _dot(pt, dc, _TN) for a, dc in zip(dv, do_chunks))
            dp = sum(_dot(dc, vc, _NT) for dc, vc in zip(do_chunks, v_chunks_val))
            ds = p * (dp - delta_ref[gi, rows][:, None])
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = (ds * params.scale).astype(q_ref.dtype)
            dk = tuple(a + _dot(ds, qc, _TN) for a, qc in zip(dk, q_chunks))
            return dk, dv

        return _walk(*ranges, step, carry, seg_kind)

    carry = (tuple(jnp.zeros((bk, n), jnp.float32) for _, n in qk_chunks),
             tuple(jnp.zeros((bk, n), jnp.float32) for _, n in v_chunks))
    dk, dv = lax.fori_loop(0, group, head, carry) if group > 1 else head(0, carry)
    for a, (off, n) in zip(dk, qk_chunks):
        dk_ref[:, pl.ds(off, n)] = a.astype(dk_ref.dtype)
    for a, (off, n) in zip(dv, v_chunks):
        dv_ref[:, pl.ds(off, n)] = a.astype(dv_ref.dtype)


def backward(params: FlashParams, q, k, v, q_seg, kv_seg, do, lse, delta):
    x = _Prepared(params, q, k, v, q_seg, kv_seg)
    blocks, g = params.blocks, x.group
    do_p = pad_axis(pad_axis(do, 1, x.tq_p), 3, x.dv_p)
    # Appended query rows: lse +inf makes their p exactly 0. The kernels take it in log2 units
    # (one multiply here, not one per score there).
    lse_p = pad_axis(lse * LOG2E, 2, x.tq_p, jnp.inf)
    delta_p = pad_axis(delta, 2, x.tq_p)
    d_max = max(x.dqk_p, x.dv_p)

    bq, bk = blocks.block_q_dq, blocks.block_kv_dq
    seg_arrays, seg_specs = x.seg_inputs(bq, bk, q_whole=False, kv_whole=True)
    q_tile = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))  # noqa: E731
    kv_whole = lambda d: pl.BlockSpec((None, x.tkv_p, None, d),  # noqa: E731
                                      lambda i, b, h: (b, 0, _kv_head(h, g), 0))
    row_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, params=params, has_seg=x.has_seg, qk_chunks=x.qk_chunks,
                          v_chunks=x.v_chunks),
        grid=(x.tq_p // bq, x.b, x.hq),
        in_specs=[q_tile(x.dqk_p), kv_whole(x.dqk_p), kv_whole(x.dv_p), q_tile(x.dv_p), row_tile, row_tile,
                  *seg_specs],
        out_specs=q_tile(x.dqk_p),
        out_shape=jax.ShapeDtypeStruct(x.q.shape, q.dtype),
        compiler_params=_compiler_params(params, d_max, "dq"),
        interpret=params.interpret,
        name="flash_attention_dq",
    )(x.q, x.k, x.v, do_p, lse_p, delta_p, *seg_arrays)

    bq, bk = blocks.block_q_dkv, blocks.block_kv_dkv
    seg_arrays, seg_specs = x.seg_inputs(bq, bk, q_whole=True, kv_whole=False)
    q_group = lambda d: pl.BlockSpec((None, x.tq_p, g, d), lambda j, b, h: (b, 0, h, 0))  # noqa: E731
    kv_tile = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, b, h: (b, j, h, 0))  # noqa: E731
    rows_group = pl.BlockSpec((None, g, x.tq_p), lambda j, b, h: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, params=params, has_seg=x.has_seg, group=g, qk_chunks=x.qk_chunks,
                          v_chunks=x.v_chunks),
        grid=(x.tkv_p // bk, x.b, x.hkv),
        in_specs=[q_group(x.dqk_p), kv_tile(x.dqk_p), kv_tile(x.dv_p), q_group(x.dv_p), rows_group, rows_group,
                  *seg_specs],
        out_specs=[kv_tile(x.dqk_p), kv_tile(x.dv_p)],
        out_shape=[jax.ShapeDtypeStruct(x.k.shape, k.dtype), jax.ShapeDtypeStruct(x.v.shape, v.dtype)],
        compiler_params=_compiler_params(params, d_max, "dkv"),
        interpret=params.interpret,
        name="flash_attention_dkv",
    )(x.q, x.k, x.v, do_p, lse_p, delta_p, *seg_arrays)
    return dq[:, :x.tq, :, :x.dqk], dk[:, :x.tkv, :, :x.dqk], dv[:, :x.tkv, :, :x.dv]
