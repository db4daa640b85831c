"""Matmuls in a low-precision compute dtype with float32 accumulation, forward and backward.

`jnp.einsum(a_bf16, b_bf16, preferred_element_type=float32)` is the dot GPU tensor cores, TPU MXUs
and CPUs with AVX512-BF16 / AMX run natively. Autodiff alone does not keep it: the transpose of a
dot whose output is float32 multiplies the float32 cotangent by the other bfloat16 operand, and XLA
then converts that operand up to float32 (on CPU it also up-converts the operands of any dot that
outputs bfloat16). So the VJPs here are written out: the incoming cotangent is rounded to the compute
dtype once, and both gradient dots are again compute-dtype x compute-dtype -> float32, each result
rounded to its operand's dtype (a float32 operand, e.g. a float32 master weight cast inside, gets its
gradient straight from the float32 accumulator).

A float32 compute dtype is the plain einsum (the same program as before these existed).
"""

from __future__ import annotations

import string
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# What a remat policy that keeps dots keeps of these (models/remat.py): the rounded result, by name,
# not the dot's float32 output (which would double the saved bytes).
SAVED, SAVED_BATCHED = "mixed_dot", "mixed_batched_dot"

WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(  # ragged_dot's weight gradient: rows x cotangent per group
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
# The same with the rows transposed to [K, M] first (contracted dim last, as XLA:CPU's bf16 kernels want).
WEIGHT_GRAD_T = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1], rhs_group_dimensions=[])


def is_mixed_dot(prim: Any, *avals: Any, **params: Any) -> bool:
    """Whether a traced primitive (as a remat policy sees it) is one of these dots: low-precision operands,
    float32 result."""
    if prim.name not in ("dot_general", "ragged_dot_general"):
        return False
    return params.get("preferred_element_type") == jnp.float32 and all(is_low_precision(a.dtype) for a in avals[:2])


def is_low_precision(dtype: Any) -> bool:
    """A compute dtype narrower than float32 (bfloat16, float16): its matmuls go through this module."""
    return jnp.dtype(dtype).itemsize < 4 and jnp.issubdtype(dtype, jnp.floating)


def labels(spec: str, a_ndim: int, b_ndim: int) -> tuple[str, str, str]:
    """'...ecd,edf->...ecf' -> explicit labels (the ellipsis as fresh capital letters). Every label must
    appear in two of the three terms (a label summed within one operand has no dot transpose)."""
    inputs, out = spec.replace(" ", "").split("->")
    al, bl = inputs.split(",")
    if "..." in spec:
        n = a_ndim - (len(al) - 3) if "..." in al else b_ndim - (len(bl) - 3)
        fill = "".join([c for c in string.ascii_uppercase if c not in spec][:n])
        al, bl, out = (s.replace("...", fill) for s in (al, bl, out))
    for x, others in ((al, bl + out), (bl, al + out)):
        if any(c not in others for c in x):
            raise ValueError(f"einsum {spec!r}: a label summed in one operand alone is not a matmul")
    return al, bl, out


def _varying(x: jax.Array) -> frozenset:
    """The manual mesh axes `x` varies over inside a shard_map (empty outside one)."""
    return frozenset(getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ()))


def like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent summed over the manual axes it varies over and its primal does not: inside a
    shard_map a VJP must return the primal's type, and a contraction split over a manual axis
    leaves partial sums (the psum the float einsum's own transpose would insert)."""
    extra = _varying(ct) - _varying(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


def einsum(spec: str, a: jax.Array, b: jax.Array, *, dtype: Any, out_dtype: Any = None) -> jax.Array:
    """einsum(spec, a, b) with both operands in compute dtype `dtype`, float32 accumulation, the result
    in `out_dtype` (default `dtype`). Operands may come in another dtype (a float32 master weight):
    they are cast inside, and their gradients come back in their own dtype."""
    out_dtype = dtype if out_dtype is None else out_dtype
    if not is_low_precision(dtype):
        return jnp.einsum(spec, a, b.astype(dtype), preferred_element_type=out_dtype)
    al, bl, ol = labels(spec, a.ndim, b.ndim)
    y = _mixed_einsum((al, bl, ol, jnp.dtype(dtype), jnp.dtype(out_dtype), a.dtype, b.dtype), a, b)
    batched = any(c in bl and c in ol for c in al)
    return checkpoint_name(y, SAVED_BATCHED if batched else SAVED)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixed_einsum(p: tuple, a: jax.Array, b: jax.Array) -> jax.Array:
    return _einsum_fwd(p, a, b)[0]


def _dot(a_labels: str, b_labels: str, out: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A bf16 x bf16 -> float32 dot. A batched one (MoE experts, attention) is written out in the form
    matmul libraries read, (batch, free, contracted) x (batch, contracted, free) -> (batch, free, free),
    each of the three pinned row-major (`row_major`): left free, XLA:CPU picks layouts (or swaps the
    operands) into a form that it then hands to a kernel with no bf16, which fails at run time."""
    batch = "".join(c for c in a_labels if c in b_labels and c in out)
    if not batch:
        return jnp.einsum(f"{a_labels},{b_labels}->{out}", a, b, preferred_element_type=jnp.float32)
    contracted = "".join(c for c in a_labels if c in b_labels and c not in out)
    a_free = "".join(c for c in a_labels if c not in batch + contracted)
    b_free = "".join(c for c in b_labels if c not in batch + contracted)
    a_order = batch + a_free + contracted
    a, a_labels = materialized(a, a_labels, a_order), a_order
    if b_labels not in (batch + contracted + b_free, batch + b_free + contracted):  # either is a library form
        b, b_labels = materialized(b, b_labels, batch + contracted + b_free), batch + contracted + b_free
    else:  # no transpose needed, but the layout still pinned
        b = row_major(b)
    natural = batch + a_free + b_free
    y = jnp.einsum(f"{a_labels},{b_labels}->{natural}", a, b, preferred_element_type=jnp.float32)
    return jnp.transpose(row_major(y), [natural.index(c) for c in out])


def grad_dot(a_labels: str, b_labels: str, out: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A gradient dot, laid out as the fast kernels want it: a weight gradient sums over the tokens,
    the leading dim of both operands (a "TN" matmul). XLA:CPU's bf16 kernels (YNNPACK) take only a
    left operand whose contracted dims come last, and XLA folds a plain transpose back into the dot;
    so the left operand is transposed into a real copy (`materialized`). Batched dots (attention's)
    are left to XLA, which lays those out itself."""
    contracted = [c for c in a_labels if c in b_labels and c not in out]
    if any(c in b_labels and c in out for c in a_labels):
        return _dot(a_labels, b_labels, out, a, b)
    if out[0] in b_labels:  # the left operand is the one whose free dims lead the result (XLA orders it so)
        a_labels, b_labels, a, b = b_labels, a_labels, b, a
    if not _ends_with(a_labels, contracted):
        order = "".join(c for c in a_labels if c not in contracted) + "".join(contracted)
        a, a_labels = materialized(a, a_labels, order), order
    return _dot(a_labels, b_labels, out, a, b)


def _ends_with(labels: str, tail: list[str]) -> bool:
    return set(labels[len(labels) - len(tail):]) == set(tail)


def materialized(x: jax.Array, labels: str, order: str) -> jax.Array:
    """x with its dims permuted from `labels` to `order`, as a real row-major copy (`row_major`): a bare
    transpose is folded into its consumer by XLA, or laid out column-major (a free bitcast)."""
    return row_major(jnp.transpose(x, [labels.index(c) for c in order]))


def row_major(x: jax.Array) -> jax.Array:
    """x pinned to a row-major layout: XLA:CPU otherwise lays a producer's output out as its consumer dot
    likes and may then hand that dot to a kernel with no bf16 (it fails at run time). An optimization
    barrier on x reshaped with a unit dim after its first does it (found by reading XLA:CPU's compiled HLO;
    a reshape that merges dims would also do, but gathers sharded ones)."""
    return jax.lax.optimization_barrier(x.reshape(x.shape[0], 1, *x.shape[1:])).reshape(x.shape)


def _einsum_fwd(p: tuple, a: jax.Array, b: jax.Array):
    al, bl, ol, dtype, out_dtype = p[:5]
    a_c, b_c = a.astype(dtype), b.astype(dtype)
    return _dot(al, bl, ol, a_c, b_c).astype(out_dtype), (a_c, b_c)


def _einsum_bwd(p: tuple, res, g: jax.Array):
    al, bl, ol, dtype, _, a_dtype, b_dtype = p
    a_c, b_c = res
    g = g.astype(dtype)
    da = like_primal(grad_dot(ol, bl, al, g, b_c), a_c).astype(a_dtype)
    db = like_primal(grad_dot(al, ol, bl, a_c, g), b_c).astype(b_dtype)
    return da, db


_mixed_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def ragged_dot(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *, dtype: Any,
               out_dtype: Any = None) -> jax.Array:
    """ragged_dot(rows [M, K], w [E, K, N], group_sizes [E]) -> [M, N] as `einsum` does it: operands in
    `dtype`, float32 accumulation, the result in `out_dtype` (default `dtype`)."""
    out_dtype = dtype if out_dtype is None else out_dtype
    if not is_low_precision(dtype):
        return jax.lax.ragged_dot(rows, w.astype(dtype), group_sizes, preferred_element_type=out_dtype)
    y = _mixed_ragged((jnp.dtype(dtype), jnp.dtype(out_dtype), rows.dtype, w.dtype), rows, w, group_sizes)
    return checkpoint_name(y, SAVED)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixed_ragged(p: tuple, rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return _ragged_fwd(p, rows, w, sizes)[0]


def _ragged_fwd(p: tuple, rows: jax.Array, w: jax.Array, sizes: jax.Array):
    dtype, out_dtype = p[:2]
    r_c, w_c = rows.astype(dtype), w.astype(dtype)
    out = jax.lax.ragged_dot(r_c, w_c, sizes, preferred_element_type=jnp.float32).astype(out_dtype)
    return out, (r_c, w_c, sizes)


def _ragged_bwd(p: tuple, res, g: jax.Array):
    dtype, _, r_dtype, w_dtype = p
    r_c, w_c, sizes = res
    g = g.astype(dtype)
    dr = jax.lax.ragged_dot(g, jnp.swapaxes(w_c, 1, 2), sizes, preferred_element_type=jnp.float32)
    r_t = materialized(r_c, "mk", "km")
    dw = jax.lax.ragged_dot_general(r_t, g, sizes, WEIGHT_GRAD_T, preferred_element_type=jnp.float32)
    return like_primal(dr, r_c).astype(r_dtype), like_primal(dw, w_c).astype(w_dtype), None


_mixed_ragged.defvjp(_ragged_fwd, _ragged_bwd)
