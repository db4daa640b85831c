"""Peak FLOP/s per device: vendor datasheet figures, or a measured matmul rate.

MFU divides achieved model FLOP/s by this number, so the figure must be the
*dense* peak (datasheets often headline 2x "with sparsity" numbers).
"""

from __future__ import annotations

import re
import time
from typing import Any

import jax
import jax.numpy as jnp

# Dense FLOP/s per chip from vendor datasheets.
# GPUs: "bfloat16" is the dense tensor-core figure; "float32" is the plain
# (non-tensor-core) FP32 figure. Caveat: XLA may run float32 dots on tensor
# cores as TF32 (see jax_default_matmul_precision), in which case MFU measured
# against this figure can exceed 1; set precision="highest" or pass an override.
# TPUs: the MXU has no fp32 datapath; float32 matmuls are run as bf16 passes
# (one pass at default precision, 3 or 6 at "high"/"highest"), so the bf16 peak
# is the ceiling for both dtypes and we use it for "float32" too.
PEAK_FLOPS_PER_DEVICE: dict[str, dict[str, float]] = {
    "NVIDIA H100 SXM": {"bfloat16": 989e12, "float32": 67e12},
    "NVIDIA H100 PCIe": {"bfloat16": 756e12, "float32": 51e12},
    "NVIDIA H100 NVL": {"bfloat16": 835e12, "float32": 60e12},
    "NVIDIA H200": {"bfloat16": 989e12, "float32": 67e12},  # H200 SXM: same GH100 chip as H100 SXM
    "NVIDIA H200 NVL": {"bfloat16": 835e12, "float32": 60e12},
    "NVIDIA A100": {"bfloat16": 312e12, "float32": 19.5e12},  # same for 40/80 GB, SXM/PCIe
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5e": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v6e": {"bfloat16": 918e12, "float32": 918e12},
}

# device_kind (lower-cased, whitespace collapsed) -> table key. First match wins,
# so the more specific variants come first. Patterns are anchored on word
# boundaries so e.g. "TPU v4 lite" (v4i, a different chip) is *not* taken for v4.
_KIND_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bh200\b.*\bnvl\b"), "NVIDIA H200 NVL"),
    (re.compile(r"\bh200\b"), "NVIDIA H200"),
    (re.compile(r"\bh100\b.*\bnvl\b"), "NVIDIA H100 NVL"),
    (re.compile(r"\bh100\b.*\bpcie\b"), "NVIDIA H100 PCIe"),
    (re.compile(r"\bh100\b"), "NVIDIA H100 SXM"),  # e.g. "NVIDIA H100 80GB HBM3"
    (re.compile(r"\ba100\b"), "NVIDIA A100"),  # e.g. "NVIDIA A100-SXM4-80GB"
    (re.compile(r"^tpu v4$"), "TPU v4"),
    (re.compile(r"^tpu v5 ?(lite|e)"), "TPU v5e"),  # jax reports v5e as "TPU v5 lite"
    (re.compile(r"^tpu v5 ?p?$"), "TPU v5p"),  # v5p reports "TPU v5" or "TPU v5p"
    (re.compile(r"^tpu v6 ?(lite|e)"), "TPU v6e"),  # Trillium: "TPU v6 lite"
]

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    # fp16 runs on the same tensor-core path at the same dense rate as bf16.
    "float16": "bfloat16", "fp16": "bfloat16", "half": "bfloat16",
    "float32": "float32", "fp32": "float32", "f32": "float32",
}

# (platform, device_kind, dtype) -> measured FLOP/s; the probe runs once per process.
_PROBE_CACHE: dict[tuple[str, str, str], float] = {}


def _table_key(device_kind: str) -> str | None:
    kind = " ".join(device_kind.lower().replace("-", " ").split())
    for pattern, key in _KIND_PATTERNS:
        if pattern.search(kind):
            return key
    return None


def _normalize_dtype(dtype: Any) -> str:
    name = str(jnp.dtype(dtype)) if not isinstance(dtype, str) else dtype.lower()
    try:
        return _DTYPE_ALIASES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype for peak FLOP/s: {dtype!r}; use one of {sorted(_DTYPE_ALIASES)}") from None


def measure_matmul_flops(
    n: int = 2048, dtype: Any = jnp.float32, repeats: int = 5, *, device: jax.Device | None = None
) -> float:
    """FLOP/s of a jitted n x n @ n x n `jnp.dot` (2 n^3 FLOPs) on `device` (default device if None).

    Compiles and runs once to warm up, then returns the best of `repeats` timed
    runs: the best run is the least disturbed by other processes on the host.
    """
    device = device or jax.devices()[0]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (n, n), dtype), device)
    b = jax.device_put(jax.random.normal(kb, (n, n), dtype), device)
    matmul = jax.jit(jnp.dot)
    matmul(a, b).block_until_ready()  # compile + first run (allocations, caches)
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def peak_flops_per_device(
    device: jax.Device, dtype: str, override: float | None = None
) -> tuple[float, str]:
    """Peak dense FLOP/s of one `device` for `dtype`, and where the figure came from.

    Returns (flops, source) with source one of:
      "config"                 `override` was given (it always wins);
      "table:<key>"            a datasheet entry of PEAK_FLOPS_PER_DEVICE (key = table key);
      "measured:matmul-probe"  CPU or an unknown device kind: measure_matmul_flops,
                               run once per process (per kind and dtype) and cached.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be positive, got {override}")
        return float(override), "config"
    dtype_key = _normalize_dtype(dtype)
    platform = getattr(device, "platform", "")
    kind = getattr(device, "device_kind", "")
    key = None if platform == "cpu" else _table_key(kind)
    if key is not None:
        return PEAK_FLOPS_PER_DEVICE[key][dtype_key], f"table:{key}"
    cache_key = (platform, kind, dtype_key)
    if cache_key not in _PROBE_CACHE:
        # Probe the device itself when it is a real one (tests pass look-alikes).
        target = device if isinstance(device, jax.Device) else None
        _PROBE_CACHE[cache_key] = measure_matmul_flops(dtype=jnp.dtype(dtype_key), device=target)
    return _PROBE_CACHE[cache_key], "measured:matmul-probe"
