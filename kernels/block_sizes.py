"""Block sizes for the flash-attention kernels: a small table keyed by device kind, dtype,
head dim and mask kind, with sane defaults. `benchmarks/attention.py --sweep` measures
candidates on the current device and prints rows to paste into `TABLE`.

Blocks are powers of two and >= 16 (Triton needs every matmul dim >= 16 and every loaded
tile a power of two). On real TPUs the Mosaic wrapper raises kv blocks to multiples of 128
(the lane width); in interpret mode any of these sizes runs.
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
    num_warps: int | None = None  # Triton only; None: 4 for head dims <= 64, else 8
    num_stages: int | None = None  # Triton only; None: 2

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


_GPU_BF16_D128 = BlockSizes(128, 64, 64, 64, 64, 64, num_warps=8, num_stages=2)
_GPU_BF16_D64 = BlockSizes(128, 64, 64, 64, 64, 64, num_warps=4, num_stages=2)
_GPU_LARGE_D = BlockSizes(64, 32, 32, 32, 32, 32, num_warps=8, num_stages=2)
_TPU = BlockSizes(128, 128, 128, 128, 128, 128)
_TPU_LARGE = BlockSizes(256, 512, 256, 256, 256, 256)
# Interpret mode on CPU: fewer, larger blocks interpret faster.
_CPU = BlockSizes(128, 128, 128, 128, 128, 128)

# (device kind prefix, dtype, head-dim bucket, mask kind) -> BlockSizes. "*" matches any.
# Head-dim bucket: the larger of d_qk and d_v rounded up to 64, 128 or 256.
# Rows for a device are starting points until `benchmarks/attention.py --sweep` has been run
# on it; measured rows say so in their comment.
TABLE: dict[tuple[str, str, int | str, str], BlockSizes] = {
    ("NVIDIA", "*", 64, "*"): _GPU_BF16_D64,
    ("NVIDIA", "*", 128, "*"): _GPU_BF16_D128,
    ("NVIDIA", "*", 256, "*"): _GPU_LARGE_D,
    ("NVIDIA", "float32", 128, "*"): _GPU_LARGE_D,  # f32 tiles are twice the shared memory
    ("TPU", "*", "*", "*"): _TPU,
    ("TPU v5", "bfloat16", 128, "causal"): _TPU_LARGE,
    ("TPU v6", "bfloat16", 128, "causal"): _TPU_LARGE,
    ("cpu", "*", "*", "*"): _CPU,
}
DEFAULT = BlockSizes()


def head_dim_bucket(d_qk: int, d_v: int) -> int:
    d = max(d_qk, d_v)
    return 64 if d <= 64 else 128 if d <= 128 else 256


def lookup(device_kind: str, dtype: str, d_qk: int, d_v: int, mask_kind: str) -> BlockSizes:
    """The most specific table row matching the key (longest device prefix first)."""
    bucket = head_dim_bucket(d_qk, d_v)
    best: tuple[tuple[int, ...], BlockSizes] | None = None
    for (dev, dt, hd, mk), sizes in TABLE.items():
        if not device_kind.lower().startswith(dev.lower()):
            continue
        if dt not in ("*", dtype) or hd not in ("*", bucket) or mk not in ("*", mask_kind):
            continue
        score = (len(dev), dt != "*", hd != "*", mk != "*")
        if best is None or score > best[0]:
            best = (score, sizes)
    return DEFAULT if best is None else best[1]
