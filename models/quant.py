"""Quantization primitives in plain jnp: symmetric int8 and scaled fp8, with their scales.

Symmetric int8 (AQT, LLM.int8 style): `q = round(x / s)`, `s = amax / 127` over the reduced
axes, so every element's dequantization error is at most s / 2. fp8: `x / s` cast to
float8_e4m3fn (forward operands, max 448) or float8_e5m2 (gradients, max 57344) with
round-to-nearest-even, saturated to the format's range (a plain cast would give NaN / inf).

Scales are float32 and keep the reduced axes as size-1 dims, so `q * s` broadcasts back.
Everything here is elementwise or a reduction: it shards like its operand under GSPMD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp

INT8_MAX = 127.0
Fp8Format = Literal["e4m3", "e5m2"]
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
FP8_MAX = {"e4m3": float(jnp.finfo(jnp.float8_e4m3fn).max), "e5m2": float(jnp.finfo(jnp.float8_e5m2).max)}


def _axes(x: jax.Array, axis: int | Sequence[int]) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % x.ndim for a in axes)


def absmax(x: jax.Array, axis: int | Sequence[int]) -> jax.Array:
    """max |x| over `axis` in float32, reduced axes kept as size 1."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=_axes(x, axis), keepdims=True)


def int8_scale(amax: jax.Array) -> jax.Array:
    """The int8 scale for a given absmax; an all-zero slice gets scale 1 (its values stay 0)."""
    return jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)


def quantize_int8(x: jax.Array, axis: int | Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 scale) with one scale per slice reduced over `axis`.

    Per output channel of a weight [in, out]: axis=0; per token of activations [rows, d]: axis=-1.
    """
    scale = int8_scale(absmax(x, axis))
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX)
    return q.astype(jnp.int8), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """q * scale in `dtype` (the scale broadcasts over the axes it was reduced on)."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def quantize_int8_grouped(w: jax.Array, group_size: int, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Group-wise int8 along `axis` (the contracting dim of a weight): one scale per
    `group_size` consecutive inputs and per output. Returns values shaped like `w` and
    scales shaped like `w` with `axis` divided by `group_size`."""
    axis = axis % w.ndim
    n = w.shape[axis]
    if group_size <= 0 or n % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {n}")
    grouped = w.reshape(*w.shape[:axis], n // group_size, group_size, *w.shape[axis + 1:])
    q, scale = quantize_int8(grouped, axis + 1)
    return q.reshape(w.shape), jnp.squeeze(scale, axis + 1)


def dequantize_grouped(q: jax.Array, scale: jax.Array, axis: int = 0, dtype=jnp.float32) -> jax.Array:
    """Inverse of `quantize_int8_grouped` (scale has `axis` of size n // group_size)."""
    axis = axis % q.ndim
    groups = scale.shape[axis]
    grouped = q.reshape(*q.shape[:axis], groups, q.shape[axis] // groups, *q.shape[axis + 1:])
    return dequantize(grouped, jnp.expand_dims(scale, axis + 1), dtype).reshape(q.shape)


def fp8_scale(amax: jax.Array, fmt: Fp8Format) -> jax.Array:
    """The scale that maps `amax` onto the format's largest finite value (1 for amax 0)."""
    return jnp.where(amax > 0, amax / FP8_MAX[fmt], 1.0).astype(jnp.float32)


def quantize_fp8(x: jax.Array, scale: jax.Array, fmt: Fp8Format) -> jax.Array:
    """x / scale saturated to the format's range, cast with round-to-nearest-even."""
    limit = FP8_MAX[fmt]
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(FP8_DTYPES[fmt])
