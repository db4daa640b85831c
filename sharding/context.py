"""Context parallelism: attention over a sequence split on the `context` mesh axis.

Two exact variants, chosen by `parallelism.context_impl`:

- `allgather`: queries stay split; K/V (and their segment ids) are all-gathered by
  GSPMD through a sharding constraint, then ordinary attention runs per device.
  Simple, and the all-gather overlaps with the Q projection; K/V memory is the
  full sequence per device.
- `ring`: K/V blocks travel around the context ring with `ppermute` inside
  `shard_map`; each step attends the local queries to one K/V block and merges
  the partial results with the log-sum-exp trick (Liu et al. 2023, "Ring
  Attention"). K/V memory stays at one block per device.

Causal load balancing (ring): the sequence is cut into 2n chunks and device i
holds chunks i and 2n-1-i, so every device has the same amount of visible
(causal) work. `balanced_order` gives that token order; the training loop
applies it to the batch, and this module masks with the original indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import kernels
from sharding.plan import ParallelPlan, single_device
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
                          balanced: bool, scale: float) -> jax.Array:
    """Per-device body: local q [B, Tl, H, D] against every K/V block of the ring."""
    b, tl, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    me = jax.lax.axis_index(CONTEXT)
    q_idx = _token_index(me, tl, ring, balanced)
    qg = q.reshape(b, tl, kv_heads, groups, d).astype(jnp.float32)
    out = jnp.zeros((b, kv_heads, groups, tl, v.shape[-1]), jnp.float32)
    row_max = jnp.full((b, kv_heads, groups, tl), -jnp.inf, jnp.float32)
    row_sum = jnp.zeros((b, kv_heads, groups, tl), jnp.float32)
    kv_seg = seg
    shift = [(j, (j + 1) % ring) for j in range(ring)]
    for step in range(ring):
        source = (me - step) % ring  # whose K/V block this device holds now
        kv_idx = _token_index(source, tl, ring, balanced)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32), precision="highest") * scale
        visible = (kv_idx[None, :] <= q_idx[:, None])[None] & (seg[:, :, None] == kv_seg[:, None, :])
        visible = visible[:, None, None]  # [B, 1, 1, Tq, Tk]
        block_max = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1)
        new_max = jnp.maximum(row_max, block_max)
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
        probs = jnp.where(visible, jnp.exp(scores - safe_max[..., None]), 0.0)
        rescale = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max - safe_max, -jnp.inf))
        row_sum = row_sum * rescale + jnp.sum(probs, axis=-1)
        out = out * rescale[..., None] + jnp.einsum("bkgts,bskd->bkgtd", probs, v.astype(jnp.float32),
                                                    precision="highest")
        row_max = new_max
        if step + 1 < ring:
            k, v, kv_seg = (jax.lax.ppermute(x, CONTEXT, shift) for x in (k, v, kv_seg))
    out = out / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tl, h, v.shape[-1]).astype(q.dtype)


# Custom kernels XLA cannot partition (cuDNN's packed layout: its per-row segment tables are
# built from the local batch, so each shard must build its own).
PER_SHARD_IMPLS = ("pallas_triton", "pallas_mosaic_tpu", "pallas_mosaic_gpu", "cudnn")


def _per_shard_kernel(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, impl: str,
                      plan: ParallelPlan) -> jax.Array:
    """Run a custom kernel (Pallas, cuDNN) on each device's (batch, heads) shard.

    XLA cannot partition a custom kernel, so without this it would gather the full batch
    onto every device. Heads are split over their mesh axes only when the K/V heads split
    evenly too, so each shard keeps whole GQA groups.
    """
    mesh, table, platform = plan.mesh, plan.rules.activations, plan.platform
    batch = logical_to_mesh(("batch",), table, mesh, q.shape[:1])[0]
    heads = logical_to_mesh(("heads",), table, mesh, q.shape[2:3])[0]
    kv_heads = logical_to_mesh(("kv_heads",), table, mesh, k.shape[2:3])[0]
    if heads != kv_heads:
        heads = None
    spec = P(batch, None, heads, None)
    seg_spec = P(batch, None)
    used = {a for axes in (batch, heads) if axes for a in (axes if isinstance(axes, tuple) else (axes,))}
    if not used:
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform)
    args, specs = (q, k, v), (spec, spec, spec)
    if segment_ids is not None:
        args, specs = (*args, segment_ids), (*specs, seg_spec)
    body = jax.shard_map(
        lambda q, k, v, *s: kernels.attention(q, k, v, causal=True, segment_ids=s[0] if s else None, impl=impl,
                                              platform=platform),
        mesh=mesh, axis_names=used, in_specs=specs, out_specs=spec,
        check_vma=False)  # custom-call outputs carry no varying-axes annotation
    return body(*args)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None,
              impl: str = "auto", plan: ParallelPlan | None = None) -> jax.Array:
    """Causal attention for [batch, length, heads, head_dim] inputs, context-parallel when the plan's
    mesh splits the sequence (`plan`: default single device)."""
    plan = plan or single_device()
    platform = plan.platform
    if plan.mesh is None:
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform)
    if plan.context_size == 1:
        resolved = kernels.resolve_impl(impl, q, v, segment_ids=segment_ids, platform=platform)
        if resolved in PER_SHARD_IMPLS and plan.size > 1:
            return _per_shard_kernel(q, k, v, segment_ids, impl, plan)
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform)
    if plan.context_impl == "allgather":
        k = plan.constrain(k, ("batch", "kv_length", "kv_heads", "head_dim"))
        v = plan.constrain(v, ("batch", "kv_length", "kv_heads", "head_dim"))
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, platform=platform)
    kernels.validate_attention_args(q, k, v, segment_ids)
    ring, balanced = plan.context_size, plan.load_balance
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    body = jax.shard_map(
        lambda q, k, v, s: _ring_attention_local(q, k, v, s, ring=ring, balanced=balanced,
                                                 scale=q.shape[-1] ** -0.5),
        mesh=plan.mesh, axis_names={CONTEXT},
        in_specs=(P(None, CONTEXT), P(None, CONTEXT), P(None, CONTEXT), P(None, CONTEXT)),
        out_specs=P(None, CONTEXT))
    return body(q, k, v, segment_ids)
