"""Context parallelism: attention over a sequence split on the `context` mesh axis.

Two exact variants, chosen by `parallelism.context_impl`:

- `allgather`: queries stay split; K/V (and their segment ids) are all-gathered by
  GSPMD through a sharding constraint, then ordinary attention runs per device.
  Simple, and the all-gather overlaps with the Q projection; K/V memory is the
  full sequence per device.
- `ring`: K/V blocks travel around the context ring with `ppermute` inside
  `shard_map`; each step attends the local queries to one K/V block with the
  configured kernel (`kernels.attention_with_lse`: xla, Pallas, auto; cuDNN, which
  returns no log-sum-exp, runs as auto) and merges the partial results with the
  log-sum-exp trick (Liu et al. 2023, "Ring Attention"). Per step the visibility
  between the local and the visiting chunks is full, causal-diagonal or none, so
  each step is one kernel call on a static rectangle, chosen by a `lax.cond` on the
  device index (`sharding/ring.py`). Its custom VJP sends K/V around the ring again
  with their gradients, recomputing each step's piece, so a device holds one block's
  residuals at a time: with a flash kernel no scores at all and memory O(T / n) per
  device (the all-gather's is O(T); `benchmarks/ring_memory.py`), with `xla` one
  chunk pair's scores. The shard_map is manual over the
  (batch, heads) axes too, so a custom kernel runs on its shard.

Causal load balancing (ring): the sequence is cut into 2n chunks and device i
holds chunks i and 2n-1-i, so every device has the same amount of visible
(causal) work. `balanced_order` gives that token order; the training loop
applies it to the batch, and `sharding/ring.py` picks each step's visible chunk
pair from the two devices' indices (`_token_index` maps a device's tokens back to
their original positions, for the guide and its tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import kernels
from kernels.facts import CUSTOM_KERNELS
from sharding.plan import ParallelPlan, single_device
from sharding.ring import ring_attention_local
from sharding.rules import logical_to_mesh

CONTEXT = "context"


def balanced_order(length: int, ring: int) -> np.ndarray:
    """Token order that gives ring device i the chunks i and 2n-1-i (n = ring size)."""
    if length % (2 * ring):
        raise ValueError(f"sequence length {length} must be divisible by 2 x context size = {2 * ring}")
    chunk = length // (2 * ring)
    order = []
    for i in range(ring):
        order += [np.arange(i * chunk, (i + 1) * chunk), np.arange((2 * ring - 1 - i) * chunk, (2 * ring - i) * chunk)]
    return np.concatenate(order)


def _token_index(device: jax.Array, local_len: int, ring: int, balanced: bool) -> jax.Array:
    """Original (pre-reordering) sequence index of each token held by `device`."""
    if not balanced:
        return device * local_len + jnp.arange(local_len)
    chunk = local_len // 2
    first = device * chunk + jnp.arange(chunk)
    second = (2 * ring - 1 - device) * chunk + jnp.arange(chunk)
    return jnp.concatenate([first, second])


def _ring_attention_local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, ring: int,
                          balanced: bool, scale: float, impl: str = "auto", platform: str | None = None,
                          softcap: float | None = None) -> jax.Array:
    """Per-device body: local q [B, Tl, H, D] against every K/V block of the ring, one
    `kernels.attention_with_lse` call per ring step (`sharding/ring.py`)."""
    return ring_attention_local(q, k, v, seg, axis=CONTEXT, ring=ring, balanced=balanced, scale=scale, impl=impl,
                                platform=platform, softcap=softcap)


# Custom kernels XLA cannot partition (cuDNN's packed layout: its per-row segment tables are
# built from the local batch, so each shard must build its own): the kernels' own list.
PER_SHARD_IMPLS = CUSTOM_KERNELS


def _kernel_axes(q: jax.Array, k: jax.Array, plan: ParallelPlan) -> tuple[object, object, set[str]]:
    """Mesh axes of the batch and heads dimensions a custom kernel runs split over, and their set.

    Heads are split only when the K/V heads split the same way, so each shard keeps whole GQA groups."""
    mesh, table = plan.mesh, plan.rules.activations
    batch = logical_to_mesh(("batch",), table, mesh, q.shape[:1])[0]
    heads = logical_to_mesh(("heads",), table, mesh, q.shape[2:3])[0]
    kv_heads = logical_to_mesh(("kv_heads",), table, mesh, k.shape[2:3])[0]
    if heads != kv_heads:
        heads = None
    used = {a for axes in (batch, heads) if axes for a in (axes if isinstance(axes, tuple) else (axes,))}
    return batch, heads, used


def _per_shard_kernel(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, impl: str,
                      plan: ParallelPlan, softcap: float | None = None,
                      window: tuple[int, int] | None = None) -> jax.Array:
    """Run a custom kernel (Pallas, cuDNN) on each device's (batch, heads) shard.

    XLA cannot partition a custom kernel, so without this it would gather the full batch
    onto every device. Heads are split as `_kernel_axes` says.
    """
    mesh, platform = plan.mesh, plan.platform
    batch, heads, used = _kernel_axes(q, k, plan)
    spec = P(batch, None, heads, None)
    seg_spec = P(batch, None)
    if not used:
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform,
                                 softcap=softcap, window=window)
    args, specs = (q, k, v), (spec, spec, spec)
    if segment_ids is not None:
        args, specs = (*args, segment_ids), (*specs, seg_spec)
    body = jax.shard_map(
        lambda q, k, v, *s: kernels.attention(q, k, v, causal=True, segment_ids=s[0] if s else None, impl=impl,
                                              platform=platform, softcap=softcap, window=window),
        mesh=mesh, axis_names=used, in_specs=specs, out_specs=spec,
        check_vma=False)  # custom-call outputs carry no varying-axes annotation
    return body(*args)


def _ring(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, impl: str,
          plan: ParallelPlan, softcap: float | None = None) -> jax.Array:
    """Ring attention (`sharding/ring.py`) in a shard_map manual over `context` and over the
    (batch, heads) axes a custom kernel must run split over (`_kernel_axes`, as `_per_shard_kernel`)."""
    kernels.validate_attention_args(q, k, v, segment_ids)
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    batch, heads, used = _kernel_axes(q, k, plan)
    spec, seg_spec = P(batch, CONTEXT, heads, None), P(batch, CONTEXT)
    body = jax.shard_map(
        lambda q, k, v, s: _ring_attention_local(q, k, v, s, ring=plan.context_size, balanced=plan.load_balance,
                                                 scale=q.shape[-1] ** -0.5, impl=impl, platform=plan.platform,
                                                 softcap=softcap),
        mesh=plan.mesh, axis_names={CONTEXT, *used}, in_specs=(spec, spec, spec, seg_spec), out_specs=spec,
        check_vma=False)  # custom-call outputs carry no varying-axes annotation
    return body(q, k, v, segment_ids)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None,
              impl: str = "auto", plan: ParallelPlan | None = None, softcap: float | None = None,
              sinks: jax.Array | None = None, window: int | None = None) -> jax.Array:
    """Causal attention for [batch, length, heads, head_dim] inputs, context-parallel when the plan's
    mesh splits the sequence (`plan`: default single device); `softcap`: tanh soft-cap of the scores;
    `sinks`: [heads] attention-sink logits (XLA partitions them with the heads; not yet the ring);
    `window`: a sliding window, query i sees keys i - window < j <= i (the kernels' (window - 1, 0);
    GSPMD's global computation under allgather; not the ring)."""
    plan = plan or single_device()
    platform = plan.platform
    band = None if window is None else (window - 1, 0)
    if plan.mesh is None:
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform,
                                 softcap=softcap, sinks=sinks, window=band)
    if plan.context_size == 1:
        resolved = kernels.resolve_impl(impl, q, v, segment_ids=segment_ids, softcap=softcap, platform=platform,
                                        sinks=sinks, window=band)
        if resolved in PER_SHARD_IMPLS and plan.size > 1:
            return _per_shard_kernel(q, k, v, segment_ids, impl, plan, softcap, band)
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform,
                                 softcap=softcap, sinks=sinks, window=band)
    if plan.context_impl == "allgather":
        k = plan.constrain(k, ("batch", "kv_length", "kv_heads", "head_dim"))
        v = plan.constrain(v, ("batch", "kv_length", "kv_heads", "head_dim"))
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform,
                                 softcap=softcap, sinks=sinks, window=band)
    if sinks is not None:  # the ring merges per-block lse's: the sink must join once, not per block
        raise ValueError("attention sinks are not supported by context_impl=ring yet; use context_impl=allgather")
    if window is not None:  # each ring step's visible band would depend on the (traced) device pair
        raise ValueError("sliding windows are not supported by context_impl=ring; use context_impl=allgather")
    return _ring(q, k, v, segment_ids, impl, plan, softcap)
