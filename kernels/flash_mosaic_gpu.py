"""Flash attention for Hopper in Pallas Mosaic GPU: wgmma, TMA copies, warp specialisation.

Same conventions as the Triton kernel (`flash_triton.py`): [batch, length, heads, head_dim],
GQA by kv head h // group, the visibility of `masks.py`, log-sum-exp in natural log at the
API, output 0 and lse -inf for a row that sees no key, and a backward split into a dq and a
dk/dv kernel so every output has one writer (bitwise deterministic, no atomics).

* Every program runs three warpgroups: two compute warpgroups, each owning `block_q` query
  rows (one 64-row wgmma tile), and one memory warpgroup that streams k/v blocks with TMA
  into a ring of `num_stages` shared-memory slots. Per slot a "loaded" barrier (TMA
  completion) and a "free" barrier (both compute warpgroups done) let the copy of block
  j + stages overlap the math on block j: the software pipeline over kv blocks.
* Forward: S = Q Kᵀ and O += P V on the tensor cores (wgmma, operands in swizzled shared
  memory, accumulators in registers), softmax in base 2 with log2(e) folded into the scale.
  A schedule barrier makes the two compute warpgroups take turns (one in its matmuls while
  the other is in its softmax: FlashAttention-3's ping-pong).
* The memory warpgroup fetches the kv blocks the program's 2 x block_q rows may see
  (`masks.kv_block_range`); each compute warpgroup computes on its own range, unmasked in
  its fully visible middle, and passes over (waits on, frees) the blocks only the other
  warpgroup needs, so every barrier phase is seen by every thread.
* dq kernel: like the forward, streaming k and v. dk/dv kernel: each compute warpgroup owns
  `block_kv_dkv` kv rows; the memory warpgroup streams q, dO, lse and delta blocks of every
  query head of the GQA group in turn, so dk/dv of a shared kv head sum in registers.
* Segment ids are applied per element on every visited block; lengths are padded to block
  multiples in XLA (appended keys masked, appended query rows sliced away).

Limits (`unsupported` names them; `kernels.attention` then logs once and runs
`pallas_triton`): bfloat16/float16 only (wgmma; float32 inputs mean IEEE float32 dots, which
the tensor cores do not do), head dims multiples of 64 (128-byte swizzled tiles) up to 192
(the backward's shared memory at 256 exceeds 227 KB; MLA's 192/128 fits),
and a Hopper GPU (compute capability 9.0) or CPU, where the GPU interpreter runs it.

On CPU (`interpret`), jax's GPU interpreter runs the same program, simulating the warpgroups,
shared memory, TMA copies and barriers (a protocol error hangs or fails there too). Its wgmma
takes neither register operands nor transposed tiles, so there each matmul is a dot of the
same shared-memory tiles (`_mm`), and layouts are not pinned (`_cast`, `_load`): the
difference from the hardware program is the matmul instruction alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.flash_common import FlashParams, pad_axis, round_up
from kernels.masks import Band, band_mask, kv_block_range, pad_segments, q_block_range

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
COMPUTE_WGS = 2
# 256 would need 258 KB of shared memory in the dq and dk/dv kernels (two warpgroups' q and
# dO tiles plus a 2-slot k/v ring) > Hopper's 227 KB; the CPU lowering test checks the rest fit.
MAX_HEAD_DIM = 192
MEMORY_WG = COMPUTE_WGS  # the last warpgroup
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [rows, cols] wgmma tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def unsupported(dtype, d_qk: int, d_v: int, platform: str, compute_capability: str | None) -> str | None:
    """Why the Mosaic GPU kernel cannot run a call (None: it can)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it takes bfloat16/float16 (wgmma), got {jnp.dtype(dtype).name}"
    if d_qk % 64 or d_v % 64 or max(d_qk, d_v) > MAX_HEAD_DIM:
        return f"head dims must be multiples of 64 up to {MAX_HEAD_DIM}, got {d_qk}/{d_v}"
    if platform == "gpu" and compute_capability != "9.0":
        return f"it needs a Hopper GPU (compute capability 9.0), got {compute_capability}"
    if platform not in ("gpu", "cpu"):
        return f"it runs on NVIDIA GPUs, not {platform}"
    return None


def interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


@dataclasses.dataclass(frozen=True)
class _Geom:
    """Static shapes of one call after padding."""

    b: int
    tq: int
    tkv: int
    hq: int
    hkv: int
    dqk: int
    dv: int
    has_seg: bool

    @property
    def group(self) -> int:
        return self.hq // self.hkv


def _tiles(shape, dtype):
    """A shared-memory tile that wgmma and TMA read: (8, 64) tiling, 128-byte swizzle."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def _cast(x: jax.Array, layout, hw: bool) -> jax.Array:
    """Pin a register layout (hardware program only: the interpreter has no layouts, and a
    layout changes where values live, not what they are)."""
    return plgpu.layout_cast(x, layout) if hw else x


def _load(ref, layout, hw: bool) -> jax.Array:
    """A whole shared-memory vector as registers in `layout`."""
    return plgpu.load(ref, (), layout=layout) if hw else ref[...]


def _mm(a, b, *, hw: bool, trans_b: bool = False, acc: jax.Array | None = None, sync=None) -> jax.Array:
    """a @ b (b transposed with trans_b) in float32, added to `acc` when given.

    Hardware: one wgmma; b is a shared-memory tile, a a tile or registers; a fresh product
    fills a scoped accumulator (`sync` runs while it computes), a sum accumulates in place
    (pl.run_state). Interpreter (whose wgmma takes neither register operands nor transposed
    tiles, and which lacks run_state): the same product as a dot of the tiles' values."""
    if not hw:
        a_val = a if isinstance(a, jax.Array) else a[...]
        b_val = b[...]
        out = lax.dot_general(a_val, b_val, (((1,), (1 if trans_b else 0,)), ((), ())),
                              preferred_element_type=jnp.float32)
        if sync is not None:
            sync()
        return out if acc is None else acc + out
    b_op = plgpu.transpose_ref(b, (1, 0)) if trans_b else b
    if acc is not None:
        return pl.run_state(lambda ref: plgpu.wgmma(ref, a, b_op))(plgpu.ACC.init(acc))

    def fresh(ref):
        plgpu.wgmma(ref, a, b_op)
        if sync is not None:
            sync()  # while this wgmma runs
        return ref[...]

    m = a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    return pl.run_scoped(fresh, plgpu.ACC((m, n), jnp.float32))


def _scores(params: FlashParams, s: jax.Array):
    """Raw q.k -> scores in log2 units (natural x log2(e)), and tanh(s / cap) for the backward."""
    if params.softcap is None:
        return s * (params.scale * LOG2E), None
    t = jnp.tanh(s * (params.scale / params.softcap))
    return t * (params.softcap * LOG2E), t


def _mask(params: FlashParams, s, q_start, kv_start, q_axis: int, hw: bool, q_seg=None, kv_seg=None):
    """-inf outside the band / segment; q_axis says which axis of the tile holds queries."""
    iota = lambda dim: _cast(lax.broadcasted_iota(jnp.int32, s.shape, dim), plgpu.Layout.WGMMA, hw)  # noqa: E731
    q_pos, kv_pos = q_start + iota(q_axis), kv_start + iota(1 - q_axis)
    mask = band_mask(q_pos, kv_pos, params.band)
    if q_seg is not None:
        same = (lax.broadcast_in_dim(q_seg, s.shape, [q_axis])
                == lax.broadcast_in_dim(kv_seg, s.shape, [1 - q_axis]))
        mask = same if mask is None else jnp.logical_and(mask, same)
    return jnp.where(mask, s, -jnp.inf)


def _clamped(lo, own, hi):
    """A compute warpgroup's (lo, full_lo, full_hi, hi) inside the program's [lo, hi)."""
    clamp = lambda x, a, b: jnp.minimum(jnp.maximum(x, a), b)  # noqa: E731
    o_lo, o_flo, o_fhi, o_hi = own
    o_lo = clamp(o_lo, lo, hi)
    o_hi = clamp(o_hi, o_lo, hi)
    o_flo = clamp(o_flo, o_lo, o_hi)
    return o_lo, o_flo, clamp(o_fhi, o_flo, o_hi), o_hi


def _walk(lo, own, hi, step, skip, carry, always_masked: bool):
    """Visit blocks [lo, hi): `skip` outside this warpgroup's own range, masked `step` at its
    edges (everywhere with segment ids), unmasked `step` in its fully visible middle."""
    o_lo, o_flo, o_fhi, o_hi = _clamped(lo, own, hi)
    run = lambda a, b, f, c: lax.fori_loop(a, b, f, c)  # noqa: E731
    carry = run(lo, o_lo, skip, carry)
    if always_masked:
        carry = run(o_lo, o_hi, functools.partial(step, masked=True), carry)
    else:
        carry = run(o_lo, o_flo, functools.partial(step, masked=True), carry)
        carry = run(o_flo, o_fhi, functools.partial(step, masked=False), carry)
        carry = run(o_fhi, o_hi, functools.partial(step, masked=True), carry)
    return run(o_hi, hi, skip, carry)


def _drain(lo, hi, stages: int, *free_barriers) -> None:
    """The memory warpgroup waits for the last `stages` uses of the ring to be freed too, so
    it sees every phase of the barriers it waits on (and leaves no copy in flight)."""
    @pl.loop(jnp.maximum(lo, hi - stages), hi)
    def _(j):
        for bar in free_barriers:
            plgpu.barrier_wait(bar.at[lax.rem(j - lo, stages)])


@dataclasses.dataclass(frozen=True)
class _KvRing:
    """The k/v (and kv segment id) ring of the forward and dq kernels: per slot a tile, a
    "loaded" barrier each, and "free" barriers for k and v (both compute warpgroups arrive)."""

    k: object
    v: object
    seg: object | None
    k_loaded: object
    v_loaded: object
    seg_loaded: object | None
    k_free: object
    v_free: object
    stages: int

    def slot(self, j, lo):
        return lax.rem(j - lo, self.stages)


def _stream_kv(ring: _KvRing, k_ref, v_ref, kvseg_ref, b, kv_head, lo, hi, bk: int) -> None:
    """The memory warpgroup: kv blocks [lo, hi) into the ring, each slot refilled once both
    compute warpgroups freed it (k and v separately, so v's copy can start while k is in use)."""
    plgpu.set_max_registers(40, action="decrease")

    def fetch_k(j, slot):
        rows = pl.ds(j * bk, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], ring.k.at[slot], ring.k_loaded.at[slot])
        if ring.seg is not None:
            plgpu.copy_gmem_to_smem(kvseg_ref.at[b, rows], ring.seg.at[slot], ring.seg_loaded.at[slot])

    def fetch_v(j, slot):
        plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * bk, bk), kv_head], ring.v.at[slot], ring.v_loaded.at[slot])

    for i in range(ring.stages):
        @pl.when(lo + i < hi)
        def _prologue():
            fetch_k(lo + i, i)
            fetch_v(lo + i, i)

    @pl.loop(lo + ring.stages, hi)
    def _steady(j):
        slot = ring.slot(j, lo)
        plgpu.barrier_wait(ring.k_free.at[slot])
        fetch_k(j, slot)
        plgpu.barrier_wait(ring.v_free.at[slot])
        fetch_v(j, slot)

    _drain(lo, hi, ring.stages, ring.k_free, ring.v_free)


def _kv_program(params: FlashParams, geo: _Geom, ring: _KvRing, bq: int, bk: int, k_ref, v_ref, kvseg_ref):
    """A forward / dq program: its indices and kv block range [lo, hi), with the memory
    warpgroup started on that range."""
    b, h, qi, wg = (lax.axis_index(n) for n in ("batch", "heads", "q_seq", "wg"))
    lo, _, _, hi = kv_block_range(qi, COMPUTE_WGS * bq, bk, params.band)
    pl.when(wg == MEMORY_WG)(lambda: _stream_kv(ring, k_ref, v_ref, kvseg_ref, b, _kv_head(h, geo.group), lo, hi, bk))
    return b, h, qi, wg, lo, hi


def _pass_block(ring: _KvRing, slot, take_turn=None) -> None:
    """A compute warpgroup passing over a block only the other one needs: the same waits,
    arrivals (and turns of the ping-pong) as computing on it, so every phase stays in step."""
    plgpu.barrier_wait(ring.k_loaded.at[slot])
    if ring.seg is not None:
        plgpu.barrier_wait(ring.seg_loaded.at[slot])
    plgpu.barrier_arrive(ring.k_free.at[slot])
    if take_turn is not None:
        take_turn()
    plgpu.barrier_wait(ring.v_loaded.at[slot])
    if take_turn is not None:
        take_turn()
    plgpu.barrier_arrive(ring.v_free.at[slot])


def _ring_scratch(stages: int, bk: int, geo: _Geom, dtype):
    """(tiles, barriers) of a _KvRing."""
    tiles = (_tiles((stages, bk, geo.dqk), dtype), _tiles((stages, bk, geo.dv), dtype),
             plgpu.SMEM((stages, bk), jnp.int32) if geo.has_seg else None)
    bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages) if geo.has_seg else None,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages))
    return tiles, bars


def _kv_head(h, group: int):
    return lax.div(h, jnp.int32(group)) if group > 1 else h


# ---------------------------------------------------------------- forward


def _fwd_kernel(*refs, params: FlashParams, geo: _Geom, hw: bool):
    if geo.has_seg:
        q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, out_ref, lse_ref, (smem, ring_tiles), (bars, ring_bars) = refs
    else:
        (q_ref, k_ref, v_ref, out_ref, lse_ref, (smem, ring_tiles), (bars, ring_bars)), qseg_ref, kvseg_ref = \
            refs, None, None
    q_smem, o_smem, lse_smem, qseg_smem = smem
    q_bar, turn = bars
    bq, bk, stages = params.blocks.block_q, params.blocks.block_kv, params.blocks.num_stages or 2
    ring = _KvRing(*ring_tiles, *ring_bars, stages=stages)
    b, h, qi, wg, lo, hi = _kv_program(params, geo, ring, bq, bk, k_ref, v_ref, kvseg_ref)

    def take_turn():  # the ping-pong between the two compute warpgroups
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_block = COMPUTE_WGS * qi + wg
        q_start = q_block * bq
        q_tile, q_rows = q_smem.at[wg], pl.ds(q_start, bq)
        plgpu.copy_gmem_to_smem(q_ref.at[b, q_rows, h], q_tile, q_bar.at[wg])
        q_seg = None
        if geo.has_seg:
            plgpu.copy_gmem_to_smem(qseg_ref.at[b, q_rows], qseg_smem.at[wg], q_bar.at[COMPUTE_WGS + wg])
            plgpu.barrier_wait(q_bar.at[COMPUTE_WGS + wg])
            q_seg = _load(qseg_smem.at[wg], _ROW, hw)
        plgpu.barrier_wait(q_bar.at[wg])

        def step(j, carry, masked):
            acc, m_prev, l_prev = carry
            slot = ring.slot(j, lo)
            plgpu.barrier_wait(ring.k_loaded.at[slot])
            s = _mm(q_tile, ring.k.at[slot], hw=hw, trans_b=True, sync=take_turn)
            kv_seg = None
            if geo.has_seg:
                plgpu.barrier_wait(ring.seg_loaded.at[slot])
                kv_seg = _load(ring.seg.at[slot], _COL, hw)
            plgpu.barrier_arrive(ring.k_free.at[slot])
            s, _ = _scores(params, s)
            if masked:
                s = _mask(params, s, q_start, j * bk, 0, hw, q_seg, kv_seg)
            m_next = jnp.maximum(m_prev, s.max(axis=1))
            # All keys so far masked: shift by 0, so exp2(-inf) = 0 rather than NaN.
            m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
            alpha = jnp.exp2(m_prev - m_use)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l_next = l_prev * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(q_ref.dtype)
            plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may issue its matmuls
            plgpu.barrier_wait(ring.v_loaded.at[slot])
            plgpu.barrier_wait(turn)
            acc = _mm(p, ring.v.at[slot], hw=hw, acc=acc)
            plgpu.barrier_arrive(ring.v_free.at[slot])
            return acc, m_next, l_next

        def skip(j, carry):
            _pass_block(ring, ring.slot(j, lo), take_turn)
            return carry

        carry = (_cast(jnp.zeros((bq, geo.dv), jnp.float32), plgpu.Layout.WGMMA, hw),
                 _cast(jnp.full((bq,), -jnp.inf, jnp.float32), _ROW, hw),
                 _cast(jnp.zeros((bq,), jnp.float32), _ROW, hw))
        own = kv_block_range(q_block, bq, bk, params.band)
        pl.when(wg == 1)(take_turn)
        acc, m, l = _walk(lo, own, hi, step, skip, carry, geo.has_seg)
        pl.when(wg == 0)(take_turn)

        empty = l == 0.0  # no visible key: output 0, lse -inf (the convention of every impl)
        l_safe = jnp.where(empty, 1.0, l)
        o_tile = q_tile if o_smem is None else o_smem.at[wg]
        o_tile[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(out_ref.dtype)
        lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(l_safe))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_tile, out_ref.at[b, q_rows, h])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, q_rows])
        plgpu.wait_smem_to_gmem(0)


def _fwd_scratch(params: FlashParams, geo: _Geom, dtype):
    bq, bk, stages = params.blocks.block_q, params.blocks.block_kv, params.blocks.num_stages or 2
    smem = (_tiles((COMPUTE_WGS, bq, geo.dqk), dtype),
            None if geo.dv == geo.dqk else _tiles((COMPUTE_WGS, bq, geo.dv), dtype),
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32) if geo.has_seg else None)
    bars = (plgpu.Barrier(num_barriers=2 * COMPUTE_WGS), plgpu.Barrier(num_arrivals=COMPUTE_WGS))
    ring_tiles, ring_bars = _ring_scratch(stages, bk, geo, dtype)
    return [(smem, ring_tiles), (bars, ring_bars)]


# ---------------------------------------------------------------- backward: dq


def _dq_kernel(*refs, params: FlashParams, geo: _Geom, hw: bool):
    if geo.has_seg:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dq_ref, (smem, ring_tiles),
         (row_bars, ring_bars)) = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, (smem, ring_tiles), (row_bars, ring_bars)), \
            qseg_ref, kvseg_ref = refs, None, None
    q_smem, do_smem, lse_smem, delta_smem, qseg_smem = smem
    bq, bk = params.blocks.block_q_dq, params.blocks.block_kv_dq
    ring = _KvRing(*ring_tiles, *ring_bars, stages=params.blocks.num_stages or 2)
    b, h, qi, wg, lo, hi = _kv_program(params, geo, ring, bq, bk, k_ref, v_ref, kvseg_ref)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_block = COMPUTE_WGS * qi + wg
        q_start = q_block * bq
        rows = pl.ds(q_start, bq)
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        loads = [(q_ref.at[b, rows, h], q_tile), (do_ref.at[b, rows, h], do_tile),
                 (lse_ref.at[b, h, rows], lse_smem.at[wg]), (delta_ref.at[b, h, rows], delta_smem.at[wg])]
        if geo.has_seg:
            loads.append((qseg_ref.at[b, rows], qseg_smem.at[wg]))
        for n, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src, dst, row_bars.at[wg * 5 + n])
        for n in range(len(loads)):
            plgpu.barrier_wait(row_bars.at[wg * 5 + n])
        lse = _load(lse_smem.at[wg], _ROW, hw)
        delta = _load(delta_smem.at[wg], _ROW, hw)
        q_seg = _load(qseg_smem.at[wg], _ROW, hw) if geo.has_seg else None

        def step(j, dq, masked):
            slot = ring.slot(j, lo)
            plgpu.barrier_wait(ring.k_loaded.at[slot])
            k_tile = ring.k.at[slot]
            s = _mm(q_tile, k_tile, hw=hw, trans_b=True)
            kv_seg = None
            if geo.has_seg:
                plgpu.barrier_wait(ring.seg_loaded.at[slot])
                kv_seg = _load(ring.seg.at[slot], _COL, hw)
            plgpu.barrier_wait(ring.v_loaded.at[slot])
            dp = _mm(do_tile, ring.v.at[slot], hw=hw, trans_b=True)
            plgpu.barrier_arrive(ring.v_free.at[slot])
            s, t = _scores(params, s)
            if masked:
                s = _mask(params, s, q_start, j * bk, 0, hw, q_seg, kv_seg)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
            if t is not None:
                ds = ds * (1.0 - t * t)  # d(cap * tanh(s / cap)) / ds
            ds = (ds * params.scale).astype(k_ref.dtype)
            dq = _mm(ds, k_tile, hw=hw, acc=dq)
            plgpu.barrier_arrive(ring.k_free.at[slot])
            return dq

        def skip(j, dq):
            _pass_block(ring, ring.slot(j, lo))
            return dq

        dq = _cast(jnp.zeros((bq, geo.dqk), jnp.float32), plgpu.Layout.WGMMA, hw)
        own = kv_block_range(q_block, bq, bk, params.band)
        dq = _walk(lo, own, hi, step, skip, dq, geo.has_seg)
        q_tile[...] = dq.astype(dq_ref.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[b, rows, h])
        plgpu.wait_smem_to_gmem(0)


def _dq_scratch(params: FlashParams, geo: _Geom, dtype):
    bq, bk, stages = params.blocks.block_q_dq, params.blocks.block_kv_dq, params.blocks.num_stages or 2
    smem = (_tiles((COMPUTE_WGS, bq, geo.dqk), dtype), _tiles((COMPUTE_WGS, bq, geo.dv), dtype),
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32), plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32) if geo.has_seg else None)
    ring_tiles, ring_bars = _ring_scratch(stages, bk, geo, dtype)
    return [(smem, ring_tiles), (plgpu.Barrier(num_barriers=5 * COMPUTE_WGS), ring_bars)]


# ---------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(*refs, params: FlashParams, geo: _Geom, hw: bool):
    if geo.has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kvseg_ref, dk_ref, dv_ref, smem, bars = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, smem, bars), qseg_ref, kvseg_ref = \
            refs, None, None
    k_smem, v_smem, kvseg_smem, q_smem, do_smem, lse_smem, delta_smem, qseg_smem = smem
    tile_bars, loaded, free = bars
    bq, bk = params.blocks.block_q_dkv, params.blocks.block_kv_dkv
    stages, group = params.blocks.num_stages or 2, geo.group
    b, h, kj, wg = (lax.axis_index(n) for n in ("batch", "heads", "kv_seq", "wg"))
    lo, _, _, hi = q_block_range(kj, bq, COMPUTE_WGS * bk, params.band)
    n_blocks = hi - lo
    buffers = [(q_ref, q_smem), (do_ref, do_smem), (lse_ref, lse_smem), (delta_ref, delta_smem)]
    if geo.has_seg:
        buffers.append((qseg_ref, qseg_smem))

    def block_of(t):  # pipeline step t -> (query head, query block): every head of the group in turn
        g = lax.div(t, n_blocks) if group > 1 else 0
        return h * group + g, lo + (lax.rem(t, n_blocks) if group > 1 else t)

    @pl.when(wg == MEMORY_WG)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(t, slot):
            head, i = block_of(t)
            rows = pl.ds(i * bq, bq)
            for n, (src, dst) in enumerate(buffers):
                ref = src.at[b, rows, head] if n < 2 else (src.at[b, head, rows] if n < 4 else src.at[b, rows])
                plgpu.copy_gmem_to_smem(ref, dst.at[slot], loaded.at[slot * 5 + n])

        for i in range(stages):
            pl.when(i < n_blocks * group)(functools.partial(fetch, i, i))

        @pl.loop(stages, n_blocks * group)
        def _steady(t):
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(free.at[slot])
            fetch(t, slot)

        _drain(0, n_blocks * group, stages, free)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        kv_block = COMPUTE_WGS * kj + wg
        kv_start = kv_block * bk
        rows = pl.ds(kv_start, bk)
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_tile, tile_bars.at[3 * wg])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], v_tile, tile_bars.at[3 * wg + 1])
        kv_seg = None
        if geo.has_seg:
            plgpu.copy_gmem_to_smem(kvseg_ref.at[b, rows], kvseg_smem.at[wg], tile_bars.at[3 * wg + 2])
            plgpu.barrier_wait(tile_bars.at[3 * wg + 2])
            kv_seg = _load(kvseg_smem.at[wg], _ROW, hw)
        plgpu.barrier_wait(tile_bars.at[3 * wg])
        plgpu.barrier_wait(tile_bars.at[3 * wg + 1])

        def wait_all(slot):
            for n in range(len(buffers)):
                plgpu.barrier_wait(loaded.at[slot * 5 + n])

        def step(t, carry, masked):
            dk, dv = carry
            slot = lax.rem(t, stages)
            _, i = block_of(t)
            wait_all(slot)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            s = _mm(k_tile, q_tile, hw=hw, trans_b=True)
            s, tanh = _scores(params, s)
            if masked:
                q_seg = _load(qseg_smem.at[slot], _COL, hw) if geo.has_seg else None
                s = _mask(params, s, i * bq, kv_start, 1, hw, q_seg, kv_seg)
            lse = _load(lse_smem.at[slot], _COL, hw)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [1]))
            dv = _mm(p.astype(do_ref.dtype), do_tile, hw=hw, acc=dv)
            dp = _mm(v_tile, do_tile, hw=hw, trans_b=True)
            delta = _load(delta_smem.at[slot], _COL, hw)
            ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [1]))
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            ds = (ds * params.scale).astype(q_ref.dtype)
            dk = _mm(ds, q_tile, hw=hw, acc=dk)
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv

        def skip(t, carry):
            slot = lax.rem(t, stages)
            wait_all(slot)
            plgpu.barrier_arrive(free.at[slot])
            return carry

        carry = (_cast(jnp.zeros((bk, geo.dqk), jnp.float32), plgpu.Layout.WGMMA, hw),
                 _cast(jnp.zeros((bk, geo.dv), jnp.float32), plgpu.Layout.WGMMA, hw))
        own = q_block_range(kv_block, bq, bk, params.band)

        def head(g, carry):  # one query head of the group: the block walk shifted by g * n_blocks
            shift = lambda f: lambda i, c, **kw: f(i - lo + g * n_blocks, c, **kw)  # noqa: E731
            return _walk(lo, own, hi, shift(step), shift(skip), carry, geo.has_seg)

        dk, dv = lax.fori_loop(0, group, head, carry) if group > 1 else head(0, carry)
        k_tile[...] = dk.astype(dk_ref.dtype)
        v_tile[...] = dv.astype(dv_ref.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[b, rows, h])
        plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[b, rows, h])
        plgpu.wait_smem_to_gmem(0)


def _dkv_scratch(params: FlashParams, geo: _Geom, dtype):
    bq, bk, stages = params.blocks.block_q_dkv, params.blocks.block_kv_dkv, params.blocks.num_stages or 2
    seg = geo.has_seg
    smem = (_tiles((COMPUTE_WGS, bk, geo.dqk), dtype), _tiles((COMPUTE_WGS, bk, geo.dv), dtype),
            plgpu.SMEM((COMPUTE_WGS, bk), jnp.int32) if seg else None,
            _tiles((stages, bq, geo.dqk), dtype), _tiles((stages, bq, geo.dv), dtype),
            plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.int32) if seg else None)
    bars = (plgpu.Barrier(num_barriers=3 * COMPUTE_WGS), plgpu.Barrier(num_barriers=5 * stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages))
    return [smem, bars]


# ---------------------------------------------------------------- wrappers


class _Prepared:
    """Inputs padded to the kernels' block multiples (head dims need none: multiples of 64)."""

    def __init__(self, params: FlashParams, q, k, v, q_seg, kv_seg):
        blocks = params.blocks
        b, tq, hq, dqk = q.shape
        _, tkv, hkv, dv = v.shape
        self.tq, self.tkv = tq, tkv
        tq_p = round_up(tq, COMPUTE_WGS * max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv))
        tkv_p = round_up(tkv, COMPUTE_WGS * max(blocks.block_kv, blocks.block_kv_dq, blocks.block_kv_dkv))
        self.geo = _Geom(b, tq_p, tkv_p, hq, hkv, dqk, dv, q_seg is not None)
        self.q, self.k, self.v = pad_axis(q, 1, tq_p), pad_axis(k, 1, tkv_p), pad_axis(v, 1, tkv_p)
        self.segs = [] if q_seg is None else [pad_segments(q_seg.astype(jnp.int32), tq_p),
                                              pad_segments(kv_seg.astype(jnp.int32), tkv_p)]

    def call(self, params: FlashParams, body, scratch, grid_rows: int, row_axis: str, heads: int, out_type):
        interpret = params.interpret
        return plgpu.kernel(
            functools.partial(body, params=params, geo=self.geo, hw=not interpret),
            out_type=out_type, scratch_types=scratch(params, self.geo, self.q.dtype),
            grid=(heads, grid_rows, self.geo.b), grid_names=("heads", row_axis, "batch"),
            num_threads=COMPUTE_WGS + 1, thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
            interpret=interpret_params() if interpret else None,
        )


def forward(params: FlashParams, q, k, v, q_seg, kv_seg) -> tuple[jax.Array, jax.Array]:
    x = _Prepared(params, q, k, v, q_seg, kv_seg)
    g = x.geo
    out, lse = x.call(params, _fwd_kernel, _fwd_scratch, g.tq // (COMPUTE_WGS * params.blocks.block_q), "q_seq",
                      g.hq, [jax.ShapeDtypeStruct((g.b, g.tq, g.hq, g.dv), q.dtype),
                             jax.ShapeDtypeStruct((g.b, g.hq, g.tq), jnp.float32)])(x.q, x.k, x.v, *x.segs)
    return out[:, :x.tq], lse[:, :, :x.tq]


def backward(params: FlashParams, q, k, v, q_seg, kv_seg, do, lse, delta):
    x = _Prepared(params, q, k, v, q_seg, kv_seg)
    g, blocks = x.geo, params.blocks
    do_p = pad_axis(do.astype(q.dtype), 1, g.tq)
    # Appended query rows: lse +inf makes their p exactly 0; the kernels take it in log2 units.
    lse_p = pad_axis(lse * LOG2E, 2, g.tq, jnp.inf)
    delta_p = pad_axis(delta, 2, g.tq)
    args = (x.q, x.k, x.v, do_p, lse_p, delta_p, *x.segs)
    dq = x.call(params, _dq_kernel, _dq_scratch, g.tq // (COMPUTE_WGS * blocks.block_q_dq), "q_seq", g.hq,
                jax.ShapeDtypeStruct(x.q.shape, q.dtype))(*args)
    dk, dv = x.call(params, _dkv_kernel, _dkv_scratch, g.tkv // (COMPUTE_WGS * blocks.block_kv_dkv), "kv_seq",
                    g.hkv, [jax.ShapeDtypeStruct(x.k.shape, k.dtype), jax.ShapeDtypeStruct(x.v.shape, v.dtype)])(*args)
    return dq[:, :x.tq], dk[:, :x.tkv], dv[:, :x.tkv]


def check_blocks(blocks) -> None:
    """The tile rules of this kernel (a wgmma M tile per warpgroup, 64-multiples elsewhere)."""
    for name in ("block_q", "block_q_dq", "block_q_dkv"):
        if getattr(blocks, name) != 64:
            raise ValueError(f"attention: pallas_mosaic_gpu needs BlockSizes.{name}=64 (one wgmma tile per "
                             f"warpgroup), got {getattr(blocks, name)}")
    for name in ("block_kv", "block_kv_dq", "block_kv_dkv"):
        if getattr(blocks, name) % 64:
            raise ValueError(f"attention: pallas_mosaic_gpu needs BlockSizes.{name} a multiple of 64, "
                             f"got {getattr(blocks, name)}")


def clamped(blocks, band: Band):
    """Shrink kv blocks past the (power-of-two rounded) kv length, keeping them >= 64."""
    cap = max(64, 1 << max(0, band.kv_len - 1).bit_length())
    return dataclasses.replace(blocks, block_kv=min(blocks.block_kv, cap), block_kv_dq=min(blocks.block_kv_dq, cap),
                               block_kv_dkv=min(blocks.block_kv_dkv, cap))


__all__ = ["backward", "check_blocks", "clamped", "forward", "unsupported"]
