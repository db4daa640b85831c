"""Quantized matmuls for training: int8 (AQT-style) and fp8, as custom VJPs over einsum and ragged_dot.

int8: both operands symmetric int8 with dynamic scales reduced over the contracted dims
(activations per token, weights per output channel), an int32-accumulating dot, and the
scales applied to its result. The backward quantizes too, reusing the forward's int8
operands (AQT's "use forward quantization"): for dx the weight's per-channel scale is
folded into the gradient, which is requantized over the weight's output dims; for dw the
activation's per-token scale is folded in and the gradient is requantized over the token
dims. Rounding has no gradient: the VJP is the float einsum's (straight-through).

fp8: per-tensor scales; float8_e4m3fn forward operands (max 448), float8_e5m2 gradients
(max 57344). Scales come from this step's absmax ("current"), or from the max over an amax
history ("delayed", Transformer Engine's recipe). A delayed projection takes its history
[3, H] (rows: input, weight, gradient; newest first) as an extra argument, and its VJP
returns, as the history's "gradient", this step's absmax of each in column 0 (zeros
elsewhere); the train step turns that into the rolled history (models/project.py
`roll_histories`). A history that is still all zero (the first step) means current scaling.

Inside the expert shard_maps a plan carries, per operand dim, the manual axes splitting it
(resolved from logical names when the projection is traced), and scale reductions are
`complete_max`ed over them, so they span every shard as on one device (sharding/reductions.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from kernels.mixed import WEIGHT_GRAD, labels, like_primal
from models.quant import INT8_MAX, absmax, fp8_scale, int8_scale, quantize_fp8
from sharding.reductions import Split, complete_max


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operands:
    """What a quantized matmul knows of its operands beyond their values (static)."""

    x_split: Split = None  # per dim of x: the manual axes splitting it inside a shard_map (or None)
    w_split: Split = None  # per dim of w, alike
    out_dtype: Any = jnp.float32
    x_dtype: Any = jnp.float32  # the cotangents' dtypes
    w_dtype: Any = jnp.float32
    name: str = ""  # the projection (a named_scope on its dots)


@dataclasses.dataclass(frozen=True)
class EinsumPlan(Operands):
    """A two-operand einsum with every label spelled out."""

    xl: str
    wl: str
    ol: str

    @property
    def contracted(self) -> str:
        return "".join(c for c in self.xl if c in self.wl and c not in self.ol)

    @property
    def o_split(self) -> Split:
        if self.x_split is None and self.w_split is None:
            return None
        known = {**dict(zip(self.wl, self.w_split or ((),) * len(self.wl))),
                 **dict(zip(self.xl, self.x_split or ((),) * len(self.xl)))}
        return tuple(known.get(c, ()) for c in self.ol)


def parse_einsum(spec: str, x_ndim: int, w_ndim: int) -> tuple[str, str, str]:
    """'...ecd,edf->...ecf' -> explicit labels (the ellipsis as fresh capital letters)."""
    return labels(spec, x_ndim, w_ndim)


def broadcast_to(s: jax.Array, labels: str, out: str) -> jax.Array:
    """A keepdims scale over `labels` (size 1 on labels absent from `out`) laid out for `out`."""
    kept = "".join(c for c in labels if c in out)
    s = s.reshape([d for c, d in zip(labels, s.shape) if c in out])
    ordered = "".join(sorted(kept, key=out.index))
    if ordered != kept:
        s = jnp.einsum(f"{kept}->{ordered}", s)
    sizes = dict(zip(ordered, s.shape))
    return s.reshape([sizes.get(c, 1) for c in out])


def quantize_int8_over(x: jax.Array, labels: str, over: str, split: Split) -> tuple[jax.Array, jax.Array]:
    """int8 values and float32 keepdims scale, one scale per slice reduced over the labels `over`."""
    axes = tuple(i for i, c in enumerate(labels) if c in over)
    scale = int8_scale(complete_max(absmax(x, axes), split, axes))
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX)
    return q.astype(jnp.int8), scale


def tensor_amax(x: jax.Array, split: Split) -> jax.Array:
    """Per-tensor absmax (a float32 scalar), completed over every manual axis splitting x."""
    return complete_max(jnp.max(jnp.abs(x.astype(jnp.float32))), split, range(x.ndim))


def _dot(p: EinsumPlan, a_labels: str, b_labels: str, out: str, a: jax.Array, b: jax.Array, acc) -> jax.Array:
    with jax.named_scope(p.name):
        return jnp.einsum(f"{a_labels},{b_labels}->{out}", a, b, preferred_element_type=acc)


# ---------------------------------------------------------------- int8


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def int8_einsum(p: EinsumPlan, x: jax.Array, w: jax.Array) -> jax.Array:
    return _int8_fwd(p, x, w)[0]


def _int8_fwd(p: EinsumPlan, x: jax.Array, w: jax.Array):
    xq, sx = quantize_int8_over(x, p.xl, p.contracted, p.x_split)
    wq, sw = quantize_int8_over(w, p.wl, p.contracted, p.w_split)
    acc = _dot(p, p.xl, p.wl, p.ol, xq, wq, jnp.int32).astype(jnp.float32)
    out = acc * broadcast_to(sx, p.xl, p.ol) * broadcast_to(sw, p.wl, p.ol)
    return out.astype(p.out_dtype), (xq, sx, wq, sw)


def _int8_bwd(p: EinsumPlan, res, g: jax.Array):
    xq, sx, wq, sw = res
    g = g.astype(jnp.float32)
    w_out = "".join(c for c in p.ol if c in p.wl and c not in p.xl)  # the weight's output dims
    tokens = "".join(c for c in p.ol if c in p.xl and c not in p.wl)  # the activation's token dims
    gq, sg = quantize_int8_over(g * broadcast_to(sw, p.wl, p.ol), p.ol, w_out, p.o_split)
    dx = _dot(p, p.ol, p.wl, p.xl, gq, wq, jnp.int32).astype(jnp.float32) * broadcast_to(sg, p.ol, p.xl)
    gq, sg = quantize_int8_over(g * broadcast_to(sx, p.xl, p.ol), p.ol, tokens, p.o_split)
    dw = _dot(p, p.xl, p.ol, p.wl, xq, gq, jnp.int32).astype(jnp.float32) * broadcast_to(sg, p.ol, p.wl)
    return like_primal(dx, xq).astype(p.x_dtype), like_primal(dw, wq).astype(p.w_dtype)


int8_einsum.defvjp(_int8_fwd, _int8_bwd)


# ---------------------------------------------------------------- fp8


def delayed_scale(history: jax.Array, amax_now: jax.Array, fmt: str) -> jax.Array:
    """The scale from an amax history [H] (its max); the current amax while the history is empty."""
    past = jnp.max(history)
    return fp8_scale(jnp.where(past > 0, past, amax_now), fmt)


def _fp8_scales(history: jax.Array | None, amaxes: Sequence[jax.Array], fmts: Sequence[str]) -> list[jax.Array]:
    if history is None:
        return [fp8_scale(a, f) for a, f in zip(amaxes, fmts)]
    return [delayed_scale(history[i], a, f) for i, (a, f) in enumerate(zip(amaxes, fmts))]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(p: EinsumPlan, x: jax.Array, w: jax.Array, history: jax.Array | None) -> jax.Array:
    return _fp8_fwd(p, x, w, history)[0]


def _fp8_fwd(p: EinsumPlan, x: jax.Array, w: jax.Array, history: jax.Array | None):
    ax, aw = tensor_amax(x, p.x_split), tensor_amax(w, p.w_split)
    sx, sw = _fp8_scales(history, (ax, aw), ("e4m3", "e4m3"))
    xq, wq = quantize_fp8(x, sx, "e4m3"), quantize_fp8(w, sw, "e4m3")
    out = _dot(p, p.xl, p.wl, p.ol, xq, wq, jnp.float32) * (sx * sw)
    return out.astype(p.out_dtype), (xq, sx, wq, sw, ax, aw, history)


def observation(history: jax.Array, amaxes: Sequence[jax.Array]) -> jax.Array:
    """What a delayed projection's VJP returns for its history: this step's absmaxes in column 0."""
    return jnp.zeros_like(history).at[:, 0].set(jnp.stack(amaxes).astype(history.dtype))


def _fp8_bwd(p: EinsumPlan, res, g: jax.Array):
    xq, sx, wq, sw, ax, aw, history = res
    ag = tensor_amax(g, p.o_split)
    (sg,) = _fp8_scales(None if history is None else history[2:], (ag,), ("e5m2",))
    gq = quantize_fp8(g, sg, "e5m2")
    dx = _dot(p, p.ol, p.wl, p.xl, gq, wq, jnp.float32) * (sg * sw)
    dw = _dot(p, p.xl, p.ol, p.wl, xq, gq, jnp.float32) * (sx * sg)
    seen = None if history is None else observation(history, (ax, aw, ag))
    return like_primal(dx, xq).astype(p.x_dtype), like_primal(dw, wq).astype(p.w_dtype), seen


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)


# ---------------------------------------------------------------- ragged (grouped) matmuls


@dataclasses.dataclass(frozen=True)
class RaggedPlan(Operands):
    """rows x [M, K] times weights w [E, K, N] -> [M, N], rows grouped by expert (group sizes [E])."""

    @property
    def o_split(self) -> Split:
        if self.x_split is None:
            return None
        return (self.x_split[0], self.w_split[2] if self.w_split else ())


def group_ids(sizes: jax.Array, rows: int) -> jax.Array:
    """The group (expert) of each of `rows` sorted rows; rows past the groups get the last one."""
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right"), sizes.shape[0] - 1)


def _ragged(p: RaggedPlan, a, b, sizes, acc, weight_grad: bool = False) -> jax.Array:
    with jax.named_scope(p.name):
        if weight_grad:
            return jax.lax.ragged_dot_general(a, b, sizes, WEIGHT_GRAD, preferred_element_type=acc)
        return jax.lax.ragged_dot(a, b, sizes, preferred_element_type=acc)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def int8_ragged_dot(p: RaggedPlan, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return _int8_ragged_fwd(p, x, w, sizes)[0]


def _int8_ragged_fwd(p: RaggedPlan, x, w, sizes):
    xq, sx = quantize_int8_over(x, "mk", "k", p.x_split)  # [M, 1]
    wq, sw = quantize_int8_over(w, "ekn", "k", p.w_split)  # [E, 1, N]
    gid = group_ids(sizes, x.shape[0])
    out = _ragged(p, xq, wq, sizes, jnp.int32).astype(jnp.float32) * sx * sw[gid, 0]
    return out.astype(p.out_dtype), (xq, sx, wq, sw, sizes, gid)


def _int8_ragged_bwd(p: RaggedPlan, res, g):
    xq, sx, wq, sw, sizes, gid = res
    g = g.astype(jnp.float32)
    gq, sg = quantize_int8_over(g * sw[gid, 0], "mn", "n", p.o_split)  # per row
    dx = _ragged(p, gq, jnp.swapaxes(wq, 1, 2), sizes, jnp.int32).astype(jnp.float32) * sg
    gq, sg = quantize_int8_over(g * sx, "mn", "m", p.o_split)  # per output column, over every row
    dw = _ragged(p, xq, gq, sizes, jnp.int32, weight_grad=True).astype(jnp.float32) * sg[None]
    return like_primal(dx, xq).astype(p.x_dtype), like_primal(dw, wq).astype(p.w_dtype), None


int8_ragged_dot.defvjp(_int8_ragged_fwd, _int8_ragged_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_ragged_dot(p: RaggedPlan, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return _fp8_ragged_fwd(p, x, w, sizes)[0]


def _fp8_ragged_fwd(p: RaggedPlan, x, w, sizes):
    sx, sw = fp8_scale(tensor_amax(x, p.x_split), "e4m3"), fp8_scale(tensor_amax(w, p.w_split), "e4m3")
    xq, wq = quantize_fp8(x, sx, "e4m3"), quantize_fp8(w, sw, "e4m3")
    out = _ragged(p, xq, wq, sizes, jnp.float32) * (sx * sw)
    return out.astype(p.out_dtype), (xq, sx, wq, sw, sizes)


def _fp8_ragged_bwd(p: RaggedPlan, res, g):
    xq, sx, wq, sw, sizes = res
    sg = fp8_scale(tensor_amax(g, p.o_split), "e5m2")
    gq = quantize_fp8(g, sg, "e5m2")
    dx = _ragged(p, gq, jnp.swapaxes(wq, 1, 2), sizes, jnp.float32) * (sg * sw)
    dw = _ragged(p, xq, gq, sizes, jnp.float32, weight_grad=True) * (sx * sg)
    return like_primal(dx, xq).astype(p.x_dtype), like_primal(dw, wq).astype(p.w_dtype), None


fp8_ragged_dot.defvjp(_fp8_ragged_fwd, _fp8_ragged_bwd)
