"""Block sizes for the flash-attention kernels, and which implementation `auto` prefers: small
tables keyed by device kind, dtype, head dim and mask kind, with sane defaults.
`benchmarks/attention.py --sweep` measures candidates on the current device and prints rows
to paste into `TABLE`; `benchmarks/attention.py` (or `scripts/device_check.py`) gives the
per-implementation TFLOP/s that justify an `IMPL_TABLE` row.

Blocks are powers of two and >= 16 (Triton needs every matmul dim >= 16 and every loaded
tile a power of two). On real TPUs the Mosaic wrapper raises kv blocks to multiples of 128
(the lane width); in interpret mode any of these sizes runs. The Mosaic GPU kernel has its
own table (`MOSAIC_GPU_TABLE`): there block_q is the rows of one compute warpgroup (64: one
wgmma M tile), kv blocks are multiples of 64, and num_stages is the depth of the TMA ring.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the forward, dq and dk/dv kernels (rows of q by rows of k/v)."""

    block_q: int = 128
    block_kv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_warps: int | None = None  # Triton forward; None: 4 for head dims <= 64, else 8
    num_stages: int | None = None  # Triton forward (Mosaic GPU: TMA ring depth); None: 2
    num_warps_dq: int | None = None  # Triton dq kernel; None: as the forward
    num_stages_dq: int | None = None
    num_warps_dkv: int | None = None  # Triton dk/dv kernel; None: as the forward
    num_stages_dkv: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("block_") and (value < 16 or value & (value - 1)):
                raise ValueError(f"BlockSizes.{f.name}={value}: must be a power of two >= 16")

    @property
    def q_multiple(self) -> int:
        """Query lengths are padded to a multiple of this (all q blocks divide it)."""
        return max(self.block_q, self.block_q_dq, self.block_q_dkv)

    @property
    def kv_multiple(self) -> int:
        return max(self.block_kv, self.block_kv_dq, self.block_kv_dkv)

    def warps_stages(self, kernel: str, head_dim: int) -> tuple[int, int]:
        """(num_warps, num_stages) of one Triton kernel: "fwd", "dq" or "dkv"."""
        warps = {"dq": self.num_warps_dq, "dkv": self.num_warps_dkv}.get(kernel) or self.num_warps
        stages = {"dq": self.num_stages_dq, "dkv": self.num_stages_dkv}.get(kernel) or self.num_stages
        return warps or (4 if head_dim <= 64 else 8), stages or 2

    def clamped(self, q_len: int, kv_len: int) -> BlockSizes:
        """Shrink blocks that exceed the (power-of-two rounded) sequence lengths, so a short
        sequence is not padded to a long block."""
        qcap = max(16, _next_pow2(q_len))
        kcap = max(16, _next_pow2(kv_len))
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, qcap), block_q_dq=min(self.block_q_dq, qcap),
            block_q_dkv=min(self.block_q_dkv, qcap), block_kv=min(self.block_kv, kcap),
            block_kv_dq=min(self.block_kv_dq, kcap), block_kv_dkv=min(self.block_kv_dkv, kcap))


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# Starting points, not yet measured (the 2026-11-29 H200 run used 128x64 / 64x64 at 8 warps,
# 2 stages: 203 / 137 TFLOP/s forward / backward on bf16 D128 causal): larger tiles and one
# more pipeline stage for the forward (FlashAttention-2's Hopper setting), and the backward
# kernels tiled along the dimension they accumulate over (dq: long q tile, dk/dv: long kv tile).
_GPU_BF16_D128 = BlockSizes(128, 64, 128, 64, 64, 128, num_warps=8, num_stages=3,
                            num_warps_dq=8, num_stages_dq=2, num_warps_dkv=8, num_stages_dkv=2)
_GPU_BF16_D64 = BlockSizes(128, 64, 128, 64, 64, 128, num_warps=4, num_stages=3,
                           num_warps_dq=4, num_stages_dq=2, num_warps_dkv=4, num_stages_dkv=2)
_GPU_LARGE_D = BlockSizes(64, 32, 32, 32, 32, 32, num_warps=8, num_stages=2)
_GPU_F32_D128 = BlockSizes(64, 32, 32, 32, 32, 32, num_warps=8, num_stages=2)  # f32 tiles: twice the bytes
_TPU = BlockSizes(128, 128, 128, 128, 128, 128)
_TPU_LARGE = BlockSizes(256, 512, 256, 256, 256, 256)
# Interpret mode on CPU: fewer, larger blocks interpret faster.
_CPU = BlockSizes(128, 128, 128, 128, 128, 128)

# (device kind prefix, dtype, head-dim bucket, mask kind) -> BlockSizes. "*" matches any.
# Head-dim bucket: the larger of d_qk and d_v rounded up to 64, 128 or 256.
# Rows for a device are starting points until `benchmarks/attention.py --sweep` has been run
# on it; measured rows say so in their comment.
TABLE: dict[tuple[str, str, int | str, str], BlockSizes] = {
    ("NVIDIA", "*", 64, "*"): _GPU_BF16_D64,  # unmeasured starting point
    ("NVIDIA", "*", 128, "*"): _GPU_BF16_D128,  # unmeasured starting point
    ("NVIDIA", "*", 256, "*"): _GPU_LARGE_D,
    ("NVIDIA", "float32", 128, "*"): _GPU_F32_D128,
    ("TPU", "*", "*", "*"): _TPU,
    ("TPU v5", "bfloat16", 128, "causal"): _TPU_LARGE,
    ("TPU v6", "bfloat16", 128, "causal"): _TPU_LARGE,
    ("cpu", "*", "*", "*"): _CPU,
}
DEFAULT = BlockSizes()

# The Mosaic GPU kernel (kernels/flash_mosaic_gpu.py): block_q = rows per compute warpgroup
# (two compute warpgroups per program), kv blocks multiples of 64, num_stages = TMA ring depth.
# Unmeasured starting points (FlashAttention-3's Hopper tiles at 64 rows per warpgroup; the dq
# kernel keeps two [64, block_kv_dq] float32 tiles (s, dP) live beside dq, so 64 there).
_MOSAIC_D128 = BlockSizes(64, 128, 64, 64, 64, 64, num_stages=2)
_MOSAIC_D192 = BlockSizes(64, 64, 64, 64, 64, 64, num_stages=2)  # bucket 256: the kernel takes up to 192
MOSAIC_GPU_TABLE: dict[tuple[str, str, int | str, str], BlockSizes] = {
    ("NVIDIA", "*", 64, "*"): _MOSAIC_D128,  # unmeasured starting point
    ("NVIDIA", "*", 128, "*"): _MOSAIC_D128,  # unmeasured starting point
    ("NVIDIA", "*", 256, "*"): _MOSAIC_D192,  # unmeasured starting point (MLA 192/128)
    ("cpu", "*", "*", "*"): BlockSizes(64, 64, 64, 64, 64, 64, num_stages=2),  # GPU interpret mode
}
MOSAIC_GPU_DEFAULT = _MOSAIC_D128

# What `impl="auto"` prefers where it was measured faster than the Pallas kernel of the
# platform, same keys; no row = keep that kernel. A preferred implementation is used only
# where it supports the call (else the Pallas kernel runs), and never for packed segment
# ids through cuDNN (its packed layout holds a bounded number of segments per row).
IMPL_TABLE: dict[tuple[str, str, int | str, str], str] = {
    # Measured 2026-11-29, one H200, B4 T4096 bf16 (benchmarks/RESULTS.md): cuDNN vs our Triton kernel,
    # forward / backward TFLOP/s. D128 causal: 368 / 429 vs 203 / 137 (GQA 32/8: 428 / 435 vs 254 / 135);
    # D128 full: 488 / 528 vs 262 / 136; D64 causal: 307 / 349 vs 204 / 219.
    ("NVIDIA H200", "bfloat16", 128, "causal"): "cudnn",
    ("NVIDIA H200", "bfloat16", 128, "full"): "cudnn",
    ("NVIDIA H200", "bfloat16", 64, "causal"): "cudnn",
    # pallas_mosaic_gpu: no measured row yet (scripts/device_all.sh numerics attention fills it).
}


def head_dim_bucket(d_qk: int, d_v: int) -> int:
    d = max(d_qk, d_v)
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _best_row(table: dict, device_kind: str, dtype: str, d_qk: int, d_v: int, mask_kind: str):
    """The value of the most specific row matching the key (longest device prefix first), or None."""
    bucket = head_dim_bucket(d_qk, d_v)
    best = None
    for (dev, dt, hd, mk), value in table.items():
        if not device_kind.lower().startswith(dev.lower()):
            continue
        if dt not in ("*", dtype) or hd not in ("*", bucket) or mk not in ("*", mask_kind):
            continue
        score = (len(dev), dt != "*", hd != "*", mk != "*")
        if best is None or score > best[0]:
            best = (score, value)
    return None if best is None else best[1]


def lookup(device_kind: str, dtype: str, d_qk: int, d_v: int, mask_kind: str, *,
           table: dict | None = None, default: BlockSizes = DEFAULT) -> BlockSizes:
    """Block sizes for a call: the most specific row of `table` (default `TABLE`)."""
    found = _best_row(TABLE if table is None else table, device_kind, dtype, d_qk, d_v, mask_kind)
    return default if found is None else found


def preferred_impl(device_kind: str, dtype: str, d_qk: int, d_v: int, mask_kind: str) -> str | None:
    """The implementation `auto` should try first here (an `IMPL_TABLE` row), or None."""
    return _best_row(IMPL_TABLE, device_kind, dtype, d_qk, d_v, mask_kind)
