"""Facts about the attention implementations, in one place for every package that needs them.

* `AttentionImpl` / `IMPLEMENTATIONS`: the names `kernels.attention(impl=...)` takes.
* `KEEPS[impl]`: what an implementation holds in device memory for its backward. The `xla` path
  materialises the [batch, heads, q, kv] float32 scores and its softmax pieces; the flash
  kernels (Pallas, cuDNN) stream k/v blocks through on-chip memory and keep only their output
  and the float32 log-sum-exp per query row, and skip fully masked blocks (half the score
  FLOPs of a causal mask). They are custom calls XLA cannot partition.
* `resolve(impl, target, call)`: the implementation `impl` runs as for a call described by
  shapes, on a device described by `Target`, with no device present: `auto` resolved through
  `block_sizes.IMPL_TABLE`, Mosaic GPU's fallback to Triton. `kernels.attention` dispatches
  through it for its own device; `jaxinfra plan` asks it for the device it plans for.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kernels import block_sizes as block_table
from kernels import flash_mosaic_gpu as mosaic_gpu
from kernels.config import IMPLEMENTATIONS
from kernels.masks import Band

MAX_PALLAS_HEAD_DIM = 256  # larger tiles do not fit GPU shared memory / TPU VMEM at useful blocks
Segments = Literal["none", "shared", "pair"]  # no segment ids, one array for q and kv, a (q, kv) pair


@dataclasses.dataclass(frozen=True)
class Keeps:
    """What one implementation holds for its backward, besides its q, k, v inputs."""

    scores: bool  # the [batch, heads, q, kv] float32 scores and softmax pieces (else O(block) on chip)
    saved: tuple[str, ...]  # the residuals its backward reads
    custom_call: bool  # an opaque kernel: XLA cannot partition it (sharding/context.py runs it per shard)
    skips_masked_blocks: bool  # fully masked blocks are not computed (causal: half the score FLOPs)


_FLASH = Keeps(scores=False, saved=("out", "lse"), custom_call=True, skips_masked_blocks=True)
KEEPS: dict[str, Keeps] = {
    "xla": Keeps(scores=True, saved=("scores", "softmax", "out"), custom_call=False, skips_masked_blocks=False),
    "pallas_triton": _FLASH,
    "pallas_mosaic_tpu": _FLASH,
    "pallas_mosaic_gpu": _FLASH,
    "cudnn": _FLASH,  # cuDNN's fused attention saves its output and softmax statistics (the lse)
}
assert set(KEEPS) == set(IMPLEMENTATIONS) - {"auto"}, "every implementation states what it keeps"
CUSTOM_KERNELS: tuple[str, ...] = tuple(impl for impl, keeps in KEEPS.items() if keeps.custom_call)


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a call runs on: platform ("cpu", "gpu", "tpu"), jax's `device_kind` (the
    `block_sizes` tables' key, e.g. "NVIDIA H200"; only read on GPUs) and, on GPUs, the CUDA
    compute capability ("9.0" for Hopper)."""

    platform: str
    device_kind: str = ""
    compute_capability: str | None = None


@dataclasses.dataclass(frozen=True)
class Call:
    """An attention call as dispatch sees it: dtype name, head dims, the mask band, segment ids."""

    dtype: str
    d_qk: int
    d_v: int
    band: Band
    segments: Segments = "none"
    softcap: float | None = None
    need_lse: bool = False
    sinks: bool = False  # attention sinks: applied to the kernel's (out, lse), so the lse is needed


def pallas_unsupported(d_qk: int, d_v: int) -> str | None:
    if max(d_qk, d_v) > MAX_PALLAS_HEAD_DIM:
        return f"head dim {max(d_qk, d_v)} > {MAX_PALLAS_HEAD_DIM}"
    return None


def mosaic_gpu_unsupported(target: Target, call: Call) -> str | None:
    cc = target.compute_capability if target.platform == "gpu" else None
    return mosaic_gpu.unsupported(call.dtype, call.d_qk, call.d_v, target.platform, cc)


def cudnn_unsupported(target: Target, call: Call) -> str | None:
    band = call.band
    if target.platform != "gpu":
        return f"cudnn needs a GPU (platform is {target.platform})"
    if call.need_lse:
        return "cudnn does not return the log-sum-exp here"
    if call.sinks:
        return "attention sinks need the log-sum-exp, which cudnn does not return"
    if call.softcap is not None:
        return "cudnn has no softcap"
    if call.segments == "pair":
        return "cudnn's packed layout takes one shared segment_ids array (the same ids for q and kv)"
    if call.d_qk != call.d_v:
        return "cudnn path needs d_qk == d_v"
    if call.dtype not in ("bfloat16", "float16"):
        return f"cudnn needs bfloat16/float16, got {call.dtype}"
    if band.right not in (None, 0) or (band.right is None and band.left is not None):
        return "cudnn supports only left windows (causal)"
    if band.right == 0 and band.q_len != band.kv_len:
        return "cudnn causal mask alignment for length_q != length_kv"
    return None


def resolve(impl: str, target: Target, call: Call) -> tuple[str, str | None]:
    """(the implementation `impl` runs as, the one-line note to log when it fell back, else None).
    `impl` must be one of IMPLEMENTATIONS (kernels.attention validates it)."""
    if impl == "auto":
        return _auto(target, call)
    if impl == "pallas_mosaic_gpu":
        reason = mosaic_gpu_unsupported(target, call)
        if reason is not None:
            return "pallas_triton", f"attention(impl='pallas_mosaic_gpu'): {reason}; using pallas_triton"
    return impl, None


def _auto(target: Target, call: Call) -> tuple[str, str | None]:
    """GPU: the IMPL_TABLE row's implementation where it supports the call (never cuDNN's bounded
    packed layout), else Triton; TPU: Mosaic TPU; else xla; xla where the Pallas kernel cannot."""
    if target.platform == "gpu":
        preferred = block_table.preferred_impl(target.device_kind, call.dtype, call.d_qk, call.d_v, call.band.kind)
        if preferred == "cudnn" and call.segments == "none" and cudnn_unsupported(target, call) is None:
            return "cudnn", None
        if preferred == "pallas_mosaic_gpu" and mosaic_gpu_unsupported(target, call) is None:
            return "pallas_mosaic_gpu", None
    chosen = {"gpu": "pallas_triton", "tpu": "pallas_mosaic_tpu"}.get(target.platform, "xla")
    if chosen != "xla":
        reason = pallas_unsupported(call.d_qk, call.d_v)
        if reason is not None:
            return "xla", f"attention(impl='auto'): {chosen} does not support this call ({reason}); using xla"
    return chosen, None
