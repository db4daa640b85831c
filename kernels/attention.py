"""`attention(q, k, v, ...)`: one entry point for every attention implementation.

Layout [batch, length, heads, head_dim]: q [B, Tq, Hq, d_qk], k [B, Tkv, Hkv, d_qk],
v [B, Tkv, Hkv, d_v]. GQA/MQA when Hq is a multiple of Hkv (query head h reads kv head
h // (Hq / Hkv)); d_v may differ from d_qk (MLA, e.g. 192 / 128).

Masking (all optional, combined by AND; see `kernels/masks.py`):
* ``causal``: key j visible from query i iff j <= i (top-left aligned, as jax.nn);
* ``window=(left, right)``: i - left <= j <= i + right; either side None = unbounded;
  with causal, right is clipped to 0;
* ``segment_ids``: one [B, T] array for both sides (Tq == Tkv) or a
  (q_segment_ids [B, Tq], kv_segment_ids [B, Tkv]) pair; a key is visible only to queries
  of the same id (packed sequences).

Convention for a query row with no visible key (e.g. a padding id with no matching key):
output 0, log-sum-exp -inf, and zero (finite) gradients through that row, in every
implementation. (jax.nn.dot_product_attention alone would average all values there.)

Implementations (`impl`):
* ``xla``: our dense jnp path (kernels/reference.py `dense_attention`, input dtype, float32
  accumulation): every feature (softcap, d_qk != d_v, sinks, the log-sum-exp output).
* ``pallas_triton``: Pallas flash attention, Triton lowering (GPU). Interpret mode on CPU.
* ``pallas_mosaic_tpu``: Pallas flash attention, Mosaic lowering (TPU). Interpret mode on CPU.
* ``pallas_mosaic_gpu``: Pallas flash attention, Mosaic GPU lowering (Hopper: wgmma, TMA,
  warp specialisation; `kernels/flash_mosaic_gpu.py`). On CPU jax's GPU interpreter runs it.
  Where it cannot run a call (float32, head dims not multiples of 64 or above 192, a
  non-Hopper GPU) it logs the reason once and runs ``pallas_triton``.
* ``cudnn``: cuDNN's fused attention, GPU only, for the cases cuDNN supports (bf16/fp16,
  d_qk == d_v, no softcap, causal or full, left windows); others raise. Segment ids (one
  shared array) go through cuDNN's packed layout (`kernels/cudnn_packing.py`: at most
  `MAX_SEGMENTS` runs per row, each id one contiguous run; rows that break that are NaN).
* ``auto``: GPU -> the implementation `block_sizes.IMPL_TABLE` measured fastest for the
  device, dtype, head dim and mask (cuDNN on the H200's bf16 D64/D128 rows) where it supports
  the call, else pallas_triton; TPU -> pallas_mosaic_tpu; else xla. Falls back to xla
  (logging once per reason) where the chosen kernel does not support the problem. `auto`
  never picks cuDNN's packed layout (bounded segments per row).

Attention sinks (``sinks``, [Hq] float logits, gpt-oss): one learned logit per query head
joins the softmax denominator with no value, so a row's weights may sum to < 1; the lse
includes it. ``xla`` runs them in its dense jnp path; the Pallas kernels run without them and
`apply_sinks` folds them into their (out, lse) afterwards, in float32 (differentiable through the
kernels' custom VJP, which takes an lse cotangent); ``cudnn`` returns no lse and refuses them
(``auto`` then chooses as without sinks, never cuDNN). A row with no visible key: output 0, lse =
its sink, finite gradients.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kernels import block_sizes as block_table
from kernels import cudnn_packing, facts
from kernels import flash_mosaic_gpu as mosaic_gpu
from kernels.block_sizes import BlockSizes
from kernels.config import IMPLEMENTATIONS, AttentionImpl  # jax-free: the run config names them
from kernels.flash import FlashParams, flash_attention
from kernels.logs import log_once
from kernels.masks import Band, make_band
from kernels.reference import dense_attention, reference_attention

__all__ = ["IMPLEMENTATIONS", "AttentionImpl", "apply_sinks", "attention", "attention_with_lse", "reference_attention",
           "resolve_impl", "validate_attention_args"]


logger = logging.getLogger(__name__)
_logged: set[str] = set()  # messages already logged (kernels.logs.log_once)

SegmentIds = jax.Array | tuple[jax.Array, jax.Array] | None
Window = tuple[int | None, int | None] | None


# ---------------------------------------------------------------- validation


def _shape_of(x, name: str) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise ValueError(f"attention: {name} must be an array, got {type(x).__name__}")
    return tuple(shape)


def validate_attention_args(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: SegmentIds = None,
                            window: Window = None, scale: float | None = None, softcap: float | None = None,
                            causal: bool = True,
                            sinks: jax.Array | None = None) -> tuple[jax.Array | None, jax.Array | None]:
    """Checks in Python, before any kernel runs (a wrong head count must not run silently:
    interpret mode clamps out-of-range block indices). Returns (q_segment_ids, kv_segment_ids)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(_shape_of(x, name)) != 4:
            raise ValueError(f"attention: {name} must be [batch, length, heads, head_dim], got shape {x.shape}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"attention: batch differs: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"attention: k and v must agree in batch, length and heads: k {k.shape}, v {v.shape}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q and k head_dim differ: {q.shape[3]} vs {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: q heads {q.shape[2]} not a multiple of k/v heads {k.shape[2]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if 0 in x.shape:
            raise ValueError(f"attention: {name} has an empty dimension: shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"attention: {name} dtype must be floating, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"attention: q, k, v dtype differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(causal, (bool, jnp.bool_)):
        raise ValueError(f"attention: causal must be a Python bool, got {causal!r}")
    if window is not None:
        if not isinstance(window, Sequence) or len(window) != 2 or not all(
                w is None or (isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 0)
                for w in window):
            raise ValueError(f"attention: window must be (left, right) with ints >= 0 or None, got {window!r}")
    if scale is not None and not (isinstance(scale, numbers.Real) and math.isfinite(scale) and scale != 0):
        raise ValueError(f"attention: scale must be a finite nonzero Python float, got {scale!r}")
    if softcap is not None and not (isinstance(softcap, numbers.Real) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"attention: softcap must be a Python float > 0, got {softcap!r}")
    if sinks is not None:
        if _shape_of(sinks, "sinks") != (q.shape[2],):
            raise ValueError(f"attention: sinks must be [q heads] = ({q.shape[2]},), got shape {tuple(sinks.shape)}")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"attention: sinks dtype must be floating, got {sinks.dtype}")
    return _split_segment_ids(segment_ids, q.shape[:2], k.shape[:2])


def _split_segment_ids(segment_ids: SegmentIds, q_bt: tuple[int, int], kv_bt: tuple[int, int]):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("attention: segment_ids must be one [batch, length] array or a "
                             f"(q_segment_ids, kv_segment_ids) pair, got {len(segment_ids)} items")
        q_seg, kv_seg = segment_ids
    else:
        if q_bt[1] != kv_bt[1]:
            raise ValueError(f"attention: one segment_ids array needs length_q == length_kv ({q_bt[1]} vs "
                             f"{kv_bt[1]}); pass a (q_segment_ids, kv_segment_ids) pair")
        q_seg = kv_seg = segment_ids
    for name, s, want in (("segment_ids (q)", q_seg, q_bt), ("segment_ids (kv)", kv_seg, kv_bt)):
        if _shape_of(s, name) != tuple(want):
            raise ValueError(f"attention: {name} must be [batch, length] = {tuple(want)}, got {tuple(s.shape)}")
        if not jnp.issubdtype(s.dtype, jnp.integer):
            raise ValueError(f"attention: {name} dtype must be integer, got {s.dtype}")
    return q_seg, kv_seg


# ---------------------------------------------------------------- dispatch


def _platform() -> str:
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def _device_kind() -> str:
    return "cpu" if _platform() == "cpu" else jax.devices()[0].device_kind


def _compute_capability() -> str | None:
    return getattr(jax.devices()[0], "compute_capability", None)


def _target(platform: str) -> facts.Target:
    """The devices of `platform` (the caller's plan's, else this process's default backend), as
    kernels/facts.py's dispatch reads them (kind and capability on GPUs)."""
    if platform != "gpu":
        return facts.Target(platform)
    return facts.Target(platform, _device_kind(), _compute_capability())


def _call(q, v, band: Band, q_seg, kv_seg, softcap, need_lse: bool, has_sinks: bool = False) -> facts.Call:
    segments = "none" if q_seg is None and kv_seg is None else "shared" if q_seg is kv_seg else "pair"
    return facts.Call(jnp.dtype(q.dtype).name, q.shape[-1], v.shape[-1], band, segments, softcap, need_lse,
                      has_sinks)


def _pallas_unsupported(q: jax.Array, v: jax.Array) -> str | None:
    return facts.pallas_unsupported(q.shape[-1], v.shape[-1])


def _cudnn_unsupported(q, v, band: Band, q_seg, kv_seg, softcap, need_lse: bool, platform: str,
                       has_sinks: bool = False) -> str | None:
    return facts.cudnn_unsupported(_target(platform), _call(q, v, band, q_seg, kv_seg, softcap, need_lse, has_sinks))


def _resolve(impl: str, q, v, band: Band, q_seg, kv_seg, softcap, need_lse: bool, platform: str,
             has_sinks: bool = False) -> str:
    """kernels/facts.py decides (the planner asks it the same question); fallbacks log once here."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention: impl={impl!r}; choose one of {IMPLEMENTATIONS}")
    call = _call(q, v, band, q_seg, kv_seg, softcap, need_lse, has_sinks)
    chosen, note = facts.resolve(impl, _target(platform), call)
    if note is not None:
        log_once(logger, _logged, note)
    return chosen


def resolve_impl(impl: str, q: jax.Array, v: jax.Array, *, causal: bool = True, segment_ids: SegmentIds = None,
                 window: Window = None, softcap: float | None = None, need_lse: bool = False,
                 platform: str | None = None, sinks: jax.Array | None = None) -> str:
    """The implementation `impl` runs as for this call on this platform (auto resolved,
    fallbacks logged). The keyword arguments are those of `attention` (unvalidated here)."""
    q_seg, kv_seg = (segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids))
    band = make_band(bool(causal), None if window is None else tuple(window), q.shape[1], v.shape[1])
    return _resolve(impl, q, v, band, q_seg, kv_seg, softcap, need_lse, platform or _platform(), sinks is not None)


def _flash_params(impl: str, q, v, band: Band, scale: float, softcap, block_sizes: BlockSizes | None,
                  platform: str) -> FlashParams:
    native = {"pallas_triton": "gpu", "pallas_mosaic_tpu": "tpu", "pallas_mosaic_gpu": "gpu"}[impl]
    if platform not in (native, "cpu"):
        raise ValueError(f"attention: impl={impl!r} runs on {native} (or CPU, interpreted), not on {platform}")
    reason = _pallas_unsupported(q, v)
    if reason is not None:
        raise ValueError(f"attention: impl={impl!r} does not support this call: {reason}")
    interpret = platform == "cpu"
    key = (_device_kind(), jnp.dtype(q.dtype).name, q.shape[-1], v.shape[-1], band.kind)
    if impl == "pallas_mosaic_gpu":
        if block_sizes is None:
            block_sizes = block_table.lookup(*key, table=block_table.MOSAIC_GPU_TABLE,
                                             default=block_table.MOSAIC_GPU_DEFAULT)
        mosaic_gpu.check_blocks(block_sizes)
        return FlashParams(backend="mosaic_gpu", band=band, scale=scale, softcap=softcap,
                           blocks=mosaic_gpu.clamped(block_sizes, band), interpret=interpret)
    if block_sizes is None:
        block_sizes = block_table.lookup(*key)
    blocks = block_sizes.clamped(band.q_len, band.kv_len)
    if impl == "pallas_mosaic_tpu":
        from kernels.flash_tpu import tpu_blocks
        blocks = tpu_blocks(blocks, band, interpret)
    backend = "triton" if impl == "pallas_triton" else "tpu"
    return FlashParams(backend=backend, band=band, scale=scale, softcap=softcap, blocks=blocks, interpret=interpret)


def _xla(q, k, v, band: Band, q_seg, kv_seg, scale: float, softcap, need_lse: bool, sinks=None):
    """Our dense jnp path for every call: in the input dtype with float32 accumulation, 4-D batched dots
    in the heads-major layout (kernels/reference.py). It replaced jax.nn.dot_product_attention's xla
    implementation here, whose 5-D grouped einsums and mask passes made the `small` step's attention
    ~20% slower on XLA:CPU (benchmarks/RESULTS.md, 2026-12-03); rows with no visible key give 0 as it is."""
    out, lse = dense_attention(q, k, v, band, q_seg, kv_seg, scale, softcap, upcast=False, precision=None,
                               sinks=sinks)
    return out.astype(q.dtype), (lse if need_lse else None)


def _cudnn(q, k, v, band: Band, scale: float, segment_ids):
    causal = band.right == 0
    if segment_ids is not None:
        return cudnn_packing.packed_attention(q, k, v, segment_ids, causal=causal, scale=scale,
                                              left_window=band.left, fused=cudnn_packing.cudnn_fused)
    local = None if band.left is None else (band.left, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=local,
                                        implementation="cudnn")


def _attention(q, k, v, *, causal, segment_ids, window, scale, softcap, impl, block_sizes, need_lse, platform,
               sinks=None):
    q_seg, kv_seg = validate_attention_args(q, k, v, segment_ids, window, scale, softcap, causal, sinks)
    band = make_band(bool(causal), None if window is None else tuple(window), q.shape[1], k.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    platform = platform or _platform()
    impl = _resolve(impl, q, v, band, q_seg, kv_seg, softcap, need_lse, platform, sinks is not None)
    if impl == "xla":
        return _xla(q, k, v, band, q_seg, kv_seg, scale, softcap, need_lse, sinks)
    if impl == "cudnn":
        reason = _cudnn_unsupported(q, v, band, q_seg, kv_seg, softcap, need_lse, platform, sinks is not None)
        if reason is not None:
            raise ValueError(f"attention: impl='cudnn' does not support this call: {reason}")
        return _cudnn(q, k, v, band, scale, q_seg), None
    params = _flash_params(impl, q, v, band, scale, softcap, block_sizes, platform)
    out, lse = flash_attention(params, q, k, v, q_seg, kv_seg)
    return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)


def apply_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of attention without sinks -> with them: out [B, Tq, Hq, d_v], lse [B, Hq, Tq] float32
    (-inf for rows with no visible key), sinks [Hq]. Returns out in its dtype and the float32 lse.

    With the sink the denominator grows from exp(lse) to exp(lse) + exp(sink), so every weight, hence
    out, shrinks by sigmoid(lse - sink) = exp(lse - logaddexp(lse, sink)), and the lse becomes
    logaddexp(lse, sink). Done in float32 outside the kernels, so one place serves every Pallas kernel
    and the ring's merged blocks; the gradients of q, k, v flow through out and lse (the kernels'
    custom VJP takes an lse cotangent), the sink's through this formula. A row that sees no key
    (lse -inf) gets weight sigmoid(-inf) = 0 and lse = sink, with zero, finite gradients."""
    sink = sinks.astype(jnp.float32)[None, :, None]  # [1, Hq, 1] against lse [B, Hq, Tq]
    keep = jax.nn.sigmoid(lse - sink)  # logistic: its derivative s (1 - s) is 0 at -inf, not NaN
    scaled = out.astype(jnp.float32) * jnp.swapaxes(keep, 1, 2)[..., None]
    return scaled.astype(out.dtype), jnp.logaddexp(lse, sink)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, segment_ids: SegmentIds = None,
              window: Window = None, scale: float | None = None, softcap: float | None = None,
              impl: str = "auto", block_sizes: BlockSizes | None = None, platform: str | None = None,
              sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention -> [B, Tq, Hq, d_v] in q.dtype. See the module docstring.

    scale: multiplies q.k (default d_qk ** -0.5); softcap: logits -> softcap * tanh(logits / softcap)
    after scaling (Gemma-2); block_sizes: override the table in `kernels/block_sizes.py`
    (Pallas impls only; for sweeps); platform: "cpu" / "gpu" / "tpu" of the devices it runs on
    (a parallel plan's; default: jax's default backend); sinks: [Hq] attention-sink logits (every
    implementation but cudnn)."""
    out, _ = _attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window, scale=scale,
                        softcap=softcap, impl=impl, block_sizes=block_sizes, need_lse=False, platform=platform,
                        sinks=sinks)
    return out


def attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                       segment_ids: SegmentIds = None, window: Window = None, scale: float | None = None,
                       softcap: float | None = None, impl: str = "auto",
                       block_sizes: BlockSizes | None = None,
                       platform: str | None = None, sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(out, lse): lse [B, Hq, Tq] float32 is the natural log-sum-exp of the scaled (capped)
    logits over visible keys, -inf for rows with none, for merging chunks:
    ``out = sum_c exp(lse_c - lse) out_c`` with ``lse = logsumexp_c lse_c`` (sharding/context.py's
    ring attention calls this per K/V block and merges the blocks so). Differentiable in both
    outputs. `impl="cudnn"` is not available here. With `sinks` the lse includes the sink term
    (so chunks of one row cannot be merged this way: the sink would count once per chunk; merge
    them without sinks, then `apply_sinks` once, as the ring does)."""
    return _attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window, scale=scale,
                      softcap=softcap, impl=impl, block_sizes=block_sizes, need_lse=True, platform=platform,
                      sinks=sinks)
