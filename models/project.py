"""The one place where weight matmuls happen: `project` (an einsum) and `project_ragged` (grouped).

Every projection of the model (attention q/k/v/o, MLA's, the dense MLP, routed and shared
experts on both MoE paths, the unembedding, the router) calls one of these with its name
(models/quant_config.py PROJECTIONS), so a quantization mode changes this file only:

    weight is an Int8Weight (a `jaxinfra quantize` checkpoint)  -> weight-only int8: the int8
        values enter the dot converted, and the per-channel scale multiplies the result (or
        the input, when the scaled dims are the input's); group-wise scales multiply per-group
        partial sums. No dequantized (value x scale) copy of the weight is formed.
    MatmulQuant.mode int8 / fp8 (quant.train)                  -> models/qdot.py custom VJPs
    otherwise                                                  -> the plain einsum in the compute dtype

Modules keep, beside each quantizable weight `w`: `w_scale` (a WeightScale, stored-int8
checkpoints) and `w_amax` (an AmaxHistory, fp8 delayed scaling); `prepare_weights` makes them.
With `lora.rank > 0` a targeted weight also has `w_lora_a` (LoraA [*batch, *contracted, r]) and
`w_lora_b` (LoraB [*batch, r, *output]); its value is then an `Adapted` (base, A, B * alpha/r) and
every projection adds dropout(x) A B to the base's output (the base unchanged: float or int8).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kernels import mixed
from models import qdot
from models.lora_config import NO_LORA, LoraConfig, fan_in_bound, lora_targets
from models.quant import dequantize, dequantize_grouped
from models.quant_config import MatmulQuant, QuantConfig
from models.stat import Stat
from sharding.reductions import manual_split


class WeightScale(nnx.Param):
    """float32 scales of an int8-stored weight, keepdims: per output channel, 1 on its contracted dims;
    group-wise, the last contracted dim divided by the group size (groups of consecutive inputs).
    Metadata `contract`: the contracted dims as negative axes (stable under layer stacking)."""


class AmaxHistory(Stat):
    """fp8 delayed scaling: [3, H] absmax of input, weight and gradient over the last H steps (newest
    first). A Stat (models/stat.py): stacked, sharded and checkpointed with the layer, outside the
    optimizer; its "cotangent" is this step's observation, which the train step rolls into the history."""


class LoraA(nnx.Param):
    """LoRA's down-projection [*batch dims, *contracted dims, rank] (float32): trained over a frozen base."""


class LoraB(nnx.Param):
    """LoRA's up-projection [*batch dims, rank, *output dims] (float32, zeros at init)."""


class Int8Weight(NamedTuple):
    values: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32 keepdims scale (see WeightScale)


class Adapted(NamedTuple):
    """A weight with low-rank adapters: x W + x A B (`b` already times alpha / rank)."""

    base: jax.Array | Int8Weight
    a: jax.Array
    b: jax.Array


Weight = jax.Array | Int8Weight | Adapted
ADAPTERS = nnx.Any(LoraA, LoraB)  # the nnx filter of every LoRA adapter (what a LoRA run trains)
Projections = Mapping[str, tuple[str, tuple[int, ...]]]  # weight attr -> (projection name, contracted dims)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


# ---------------------------------------------------------------- module side


def prepare_weights(module: nnx.Module, quant: QuantConfig, table: Projections, dtype: Any,
                    lora: LoraConfig = NO_LORA, rngs: nnx.Rngs | None = None) -> None:
    """For each weight attr -> (projection name, contracted dims as negative axes): store it as int8 +
    WeightScale when `quant.weights=int8`, add an AmaxHistory when the projection scales fp8 delayed,
    add LoRA adapters when `lora` targets it (initialised from `rngs`), and record the projection's
    MatmulQuant (static, hashable: part of the graph definition)."""
    module.dtype = dtype
    module.matmuls = tuple((attr, quant.matmul(name)) for attr, (name, _) in table.items())
    targets = lora_targets(lora)
    module.lora_scale, module.lora_dropout = lora.scale, lora.dropout
    for attr, (name, contract) in table.items():
        if not hasattr(module, attr):
            continue
        w = getattr(module, attr)
        names = tuple(w.get_metadata().get("out_sharding"))
        if name in targets:
            _add_adapters(module, attr, w.shape, names, contract, lora, rngs)
        if quant.stores_int8(name):
            setattr(module, attr, nnx.Param(jnp.zeros(w.shape, jnp.int8), out_sharding=names, eager_sharding=False))
            setattr(module, f"{attr}_scale", _scale_param(w.shape, names, contract, quant.group_size))
        if matmul_of(module, attr).delayed:
            history = jnp.zeros((3, quant.amax_history), jnp.float32)
            setattr(module, f"{attr}_amax", AmaxHistory(history, out_sharding=(None, None), eager_sharding=False))


def adapter_layout(shape: Sequence[int], names: Sequence[str | None],
                   contract: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """(batch, contracted, output) axes of a weight: batch = the dims before the first contracted one
    (a routed expert's `experts`), output = the rest."""
    n = len(shape)
    axes = sorted(a % n for a in contract)
    batch = list(range(axes[0]))
    return batch, axes, [i for i in range(n) if i not in axes and i not in batch]


def _add_adapters(module: nnx.Module, attr: str, shape: Sequence[int], names: Sequence[str | None],
                  contract: tuple[int, ...], lora: LoraConfig, rngs: nnx.Rngs | None) -> None:
    """`attr`_lora_a / _lora_b as PEFT initialises them (B zeros, so the adapted model starts as the base);
    A takes the contracted dims' logical names (sharded over the input axis), B the output dims'."""
    batch, axes, out = adapter_layout(shape, names, contract)
    r = lora.rank
    a_shape = [shape[i] for i in batch + axes] + [r]
    b_shape = [shape[i] for i in batch] + [r] + [shape[i] for i in out]
    d_in = math.prod(shape[i] for i in axes)
    key = _lora_key(rngs)
    if lora.init == "kaiming":
        bound = fan_in_bound(d_in)
        a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
    else:  # PEFT's "gaussian": std 1/r
        a = jax.random.normal(key, a_shape, jnp.float32) / r
    a_names = tuple(names[i] for i in batch + axes) + (None,)
    b_names = tuple(names[i] for i in batch) + (None,) + tuple(names[i] for i in out)
    setattr(module, f"{attr}_lora_a", LoraA(a, out_sharding=a_names, eager_sharding=False))
    setattr(module, f"{attr}_lora_b", LoraB(jnp.zeros(b_shape, jnp.float32), out_sharding=b_names,
                                            eager_sharding=False))


def _lora_key(rngs: nnx.Rngs | None) -> jax.Array:
    """The adapters' init key: a `lora` stream when the Rngs have one (jaxinfra/state.py gives it, so the
    base weights draw the same keys with or without adapters), else `params`."""
    if rngs is None:
        return jax.random.key(0)
    return rngs.lora() if hasattr(rngs, "lora") else rngs.params()


def _scale_param(shape: Sequence[int], names: Sequence[str | None], contract: tuple[int, ...],
                 group_size: int) -> WeightScale:
    n = len(shape)
    axes = sorted(a % n for a in contract)
    scale_shape, scale_names = list(shape), list(names)
    if group_size:  # groups of group_size consecutive inputs along the last contracted dim (validated to divide)
        scale_shape[axes[-1]] = shape[axes[-1]] // group_size
    else:  # one scale per output channel
        for a in axes:
            scale_shape[a], scale_names[a] = 1, None
    return WeightScale(jnp.ones(scale_shape, jnp.float32), out_sharding=tuple(scale_names), eager_sharding=False,
                       contract=tuple(contract))


def matmul_of(module: nnx.Module, attr: str) -> MatmulQuant:
    return dict(module.matmuls)[attr]


def weight(module: nnx.Module, attr: str) -> Weight:
    """The value of weight `attr`: its array, or an Int8Weight when it is stored quantized; Adapted
    around either when it has LoRA adapters."""
    w = getattr(module, attr)[...]
    scale = getattr(module, f"{attr}_scale", None)
    w = Int8Weight(w, scale[...]) if scale is not None else w
    a = getattr(module, f"{attr}_lora_a", None)
    if a is None:
        return w
    return Adapted(w, a[...], getattr(module, f"{attr}_lora_b")[...] * module.lora_scale)


def history(module: nnx.Module, attr: str) -> jax.Array | None:
    h = getattr(module, f"{attr}_amax", None)
    return None if h is None else h[...]


def project_attr(module: nnx.Module, spec: str, x: jax.Array, attr: str, *, out_dtype: Any = None,
                 names: tuple | None = None, w: Weight | None = None) -> jax.Array:
    """`project` with module `module`'s weight `attr` (or `w`, e.g. a slice of it), its projection
    settings and amax history, in the module's compute dtype."""
    w = weight(module, attr) if w is None else w
    lora_x = _dropout(module, attr, x) if isinstance(w, Adapted) else None
    return project(spec, x, w, matmul_of(module, attr), dtype=module.dtype, out_dtype=out_dtype,
                   history=history(module, attr), names=names, lora_x=lora_x)


def _dropout(module: nnx.Module, attr: str, x: jax.Array) -> jax.Array | None:
    """LoRA's dropout of the adapters' input, in training only: the layer runner sets `lora_key` (this
    step's key for the layer) on the modules of a model with lora.dropout > 0; None: no dropout."""
    key = getattr(module, "lora_key", None)
    rate = module.lora_dropout
    if key is None or not rate:
        return None
    keep = jax.random.bernoulli(jax.random.fold_in(key, zlib.crc32(attr.encode()) & 0x7FFFFFFF), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def merged(w: Adapted, dtype: Any = jnp.float32) -> jax.Array:
    """W + A B * alpha/r as one float array (an int8 base dequantized first): inference's sliced uses
    (MLA's absorbed decode) and `jaxinfra lora merge`."""
    base = _dequantized(w.base, jnp.float32) if isinstance(w.base, Int8Weight) else w.base.astype(jnp.float32)
    a, b = w.a.astype(jnp.float32), w.b.astype(jnp.float32)
    # base [*batch, *contracted, *output], a [*batch, *contracted, r], b [*batch, r, *output]; a leading
    # stacked `layers` axis is one more batch dim.
    nb = a.ndim + b.ndim - 2 - base.ndim
    batch = a.shape[:nb]
    delta = jnp.einsum("...ir,...ro->...io", a.reshape(*batch, -1, a.shape[-1]), b.reshape(*batch, b.shape[nb], -1),
                       precision=jax.lax.Precision.HIGHEST)
    return (base + delta.reshape(base.shape)).astype(dtype)


def float_weight(w: Weight, dtype: Any) -> jax.Array:
    """Any weight as one float array: an int8 one dequantized, an adapted one merged."""
    if isinstance(w, Adapted):
        return merged(w, dtype)
    return _dequantized(w, dtype) if isinstance(w, Int8Weight) else w.astype(dtype)


def slice_weight(w: Weight, index: Any) -> Weight:
    """w[index] for an index over the weight's free (output) dims: its scale is sliced alike (an
    adapted weight is merged first)."""
    if isinstance(w, Adapted):
        w = merged(w, w.b.dtype)
    if isinstance(w, Int8Weight):
        return Int8Weight(w.values[index], w.scale[index])
    return w[index]


# ---------------------------------------------------------------- the projections


def project(spec: str, x: jax.Array, w: Weight, matmul: MatmulQuant, *, dtype: Any, out_dtype: Any = None,
            history: jax.Array | None = None, names: tuple | None = None,
            lora_x: jax.Array | None = None) -> jax.Array:
    """einsum(spec, x, w) for a weight matmul, quantized as `matmul` (or `w`'s storage) says.

    x is in the compute dtype `dtype`; the result is in `out_dtype` (default: dtype). `names`: the
    logical names of x's and w's dims, needed only inside a shard_map (sharding/reductions.py).
    An Adapted `w` adds (lora_x or x) A B in the compute dtype to the base's projection."""
    out_dtype = dtype if out_dtype is None else out_dtype
    if isinstance(w, Adapted):
        out = project(spec, x, w.base, matmul, dtype=dtype, out_dtype=out_dtype, history=history, names=names)
        with jax.named_scope(f"{matmul.name}.lora"):
            return out + _lora_einsum(spec, x if lora_x is None else lora_x, w, dtype, out_dtype)
    with jax.named_scope(matmul.name):
        if isinstance(w, Int8Weight):
            return _stored_int8_einsum(spec, x.astype(dtype), w, dtype, out_dtype)
        if matmul.mode == "none":  # bf16 compute: bf16 x bf16 -> float32 dots, backward too (kernels/mixed.py)
            return mixed.einsum(spec, x, w, dtype=dtype, out_dtype=out_dtype)
        xl, wl, ol = qdot.parse_einsum(spec, x.ndim, w.ndim)
        plan = qdot.EinsumPlan(xl, wl, ol, **_operands(names, out_dtype, x, w, matmul))
        if matmul.mode == "int8":
            return qdot.int8_einsum(plan, x, w)
        return qdot.fp8_einsum(plan, x, w, history)


def project_ragged(rows: jax.Array, w: Weight, group_sizes: jax.Array, matmul: MatmulQuant, *, dtype: Any,
                   names: tuple | None = None) -> jax.Array:
    """ragged_dot(rows [M, K], w [E, K, N], group_sizes [E]) -> [M, N] in `dtype`: rows sorted by group,
    group e multiplied by w[e] (rows past the groups give 0)."""
    if isinstance(w, Adapted):  # per group: rows @ A[e] @ B[e]
        out = project_ragged(rows, w.base, group_sizes, matmul, dtype=dtype, names=names)
        with jax.named_scope(f"{matmul.name}.lora"):
            mid = mixed.ragged_dot(rows, w.a, group_sizes, dtype=dtype)
            return out + mixed.ragged_dot(mid, w.b, group_sizes, dtype=dtype)
    with jax.named_scope(matmul.name):
        if isinstance(w, Int8Weight):
            if w.scale.shape[1] != 1:  # group-wise: per-group partial sums do not fit ragged_dot
                return jax.lax.ragged_dot(rows.astype(dtype), _dequantized(w, dtype), group_sizes)
            out = jax.lax.ragged_dot(rows.astype(dtype), w.values.astype(dtype), group_sizes)
            gid = qdot.group_ids(group_sizes, rows.shape[0])
            return (out * w.scale[gid, 0]).astype(dtype)
        if matmul.mode == "none":
            return mixed.ragged_dot(rows, w, group_sizes, dtype=dtype)
        plan = qdot.RaggedPlan(**_operands(names, dtype, rows, w, matmul))
        fn = qdot.int8_ragged_dot if matmul.mode == "int8" else qdot.fp8_ragged_dot
        return fn(plan, rows, w, group_sizes)


def _lora_einsum(spec: str, x: jax.Array, w: Adapted, dtype: Any, out_dtype: Any) -> jax.Array:
    """(x A) B for einsum(spec, x, W): A [*batch, *contracted, r], B [*batch, r, *output] (labels from the
    spec: batch dims are in x, W and the output; contracted in x and W; output in W and the output)."""
    base_ndim = w.base.values.ndim if isinstance(w.base, Int8Weight) else w.base.ndim
    xl, wl, ol = qdot.parse_einsum(spec, x.ndim, base_ndim)
    batch = "".join(c for c in wl if c in xl and c in ol)
    contracted = "".join(c for c in wl if c in xl and c not in ol)
    outs = "".join(c for c in wl if c not in xl)
    r = next(c for c in "rstuvwxyzabcdefghijklmnopq" if c not in xl + wl + ol)
    ml = "".join(c for c in xl if c not in contracted) + r
    mid = mixed.einsum(f"{xl},{batch}{contracted}{r}->{ml}", x.astype(dtype), w.a, dtype=dtype)
    return mixed.einsum(f"{ml},{batch}{r}{outs}->{ol}", mid, w.b, dtype=dtype, out_dtype=out_dtype)


def _operands(names: tuple | None, out_dtype: Any, x: jax.Array, w: jax.Array, matmul: MatmulQuant) -> dict:
    """qdot.Operands fields; the manual axes splitting each dim of x and w resolved now from their
    logical names (inside a shard_map body, while it is traced)."""
    x_split, w_split = (None, None) if names is None else (manual_split(names[0]), manual_split(names[1]))
    return dict(x_split=x_split, w_split=w_split, out_dtype=out_dtype, x_dtype=x.dtype, w_dtype=w.dtype,
                name=matmul.name)


def lookup(table: Weight, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Embedding rows table[tokens] in `dtype` (an int8 table: its rows times their per-row, or
    per-row-per-group, scales; only the gathered rows are dequantized)."""
    if isinstance(table, Int8Weight):
        rows = Int8Weight(jnp.take(table.values, tokens, axis=0), jnp.take(table.scale, tokens, axis=0))
        return _dequantized(rows, dtype)
    return jnp.take(table, tokens, axis=0).astype(dtype)


# ---------------------------------------------------------------- weight-only int8


def _grouped_axis(w: Int8Weight) -> int | None:
    axes = [i for i, (n, s) in enumerate(zip(w.values.shape, w.scale.shape)) if 1 < s < n]
    return axes[0] if axes else None


def _dequantized(w: Int8Weight, dtype: Any) -> jax.Array:
    axis = _grouped_axis(w)
    if axis is None:
        return dequantize(w.values, w.scale, dtype)
    return dequantize_grouped(w.values, w.scale, axis, dtype)


def _stored_int8_einsum(spec: str, x: jax.Array, w: Int8Weight, dtype: Any, out_dtype: Any) -> jax.Array:
    xl, wl, ol = qdot.parse_einsum(spec, x.ndim, w.values.ndim)
    q, s = w.values, w.scale
    axis = _grouped_axis(w)
    if axis is not None:
        if wl[axis] in ol:  # grouped along a dim this einsum keeps (MLA's absorbed decode): dequantize
            return jnp.einsum(spec, x, _dequantized(w, dtype), preferred_element_type=out_dtype)
        return _grouped_einsum(xl, wl, ol, x, w, axis, out_dtype)
    scaled = "".join(c for c, n in zip(wl, s.shape) if n > 1)
    if all(c in ol for c in scaled):  # per output channel: scale the result
        out = jnp.einsum(f"{xl},{wl}->{ol}", x, q.astype(dtype), preferred_element_type=jnp.float32)
        return (out * qdot.broadcast_to(s, wl, ol)).astype(out_dtype)
    if all(c in xl for c in scaled):  # the scaled dims are the input's (MLA's absorbed W_uk): scale x
        xs = (x.astype(jnp.float32) * qdot.broadcast_to(s, wl, xl)).astype(dtype)
        return jnp.einsum(f"{xl},{wl}->{ol}", xs, q.astype(dtype), preferred_element_type=out_dtype)
    return jnp.einsum(spec, x, _dequantized(w, dtype), preferred_element_type=out_dtype)


def _grouped_einsum(xl: str, wl: str, ol: str, x: jax.Array, w: Int8Weight, axis: int, out_dtype: Any) -> jax.Array:
    """Group-wise scales on contracted dim wl[axis]: split it into (groups, group size), keep the groups
    (and any other scaled contracted dim) in the dot's output, scale, then sum them."""
    c = wl[axis]
    g = next(ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in xl + wl + ol)
    groups = w.scale.shape[axis]
    split = lambda a, labels: a.reshape(  # noqa: E731
        *a.shape[:labels.index(c)], groups, -1, *a.shape[labels.index(c) + 1:])
    xs, qs = split(x, xl), split(w.values.astype(x.dtype), wl)
    xl2, wl2 = xl.replace(c, g + c), wl.replace(c, g + c)
    sl = wl.replace(c, g)  # the scale's labels
    extra = g + "".join(ch for ch, n in zip(wl, w.scale.shape) if n > 1 and ch not in ol and ch != c)
    out = jnp.einsum(f"{xl2},{wl2}->{ol + extra}", xs, qs, preferred_element_type=jnp.float32)
    out = out * qdot.broadcast_to(w.scale, sl, ol + extra)
    return jnp.sum(out, axis=tuple(range(len(ol), len(ol) + len(extra)))).astype(out_dtype)


# ---------------------------------------------------------------- delayed scaling in the train step


def merge_observations(a: nnx.State, b: nnx.State) -> nnx.State:
    """Gradient accumulation of Stats' cotangents: an AmaxHistory's observation over microbatches is
    their max, the rest adds."""
    return jax.tree.map(lambda x, y: x.replace(jnp.maximum(x[...], y[...])) if isinstance(x, AmaxHistory)
                        else jax.tree.map(jnp.add, x, y), a, b, is_leaf=_is_var)


def roll_histories(stats: nnx.State, observed: nnx.State) -> nnx.State:
    """`stats` with each AmaxHistory [..., 3, H] shifted one step older, this step's observation
    (column 0 of its cotangent in `observed`) in front."""

    def one(old, g):
        if not isinstance(old, AmaxHistory):
            return old
        return old.replace(jnp.concatenate([g[...][..., :1], old[...][..., :-1]], axis=-1))

    return jax.tree.map(one, stats, observed, is_leaf=_is_var)
