"""Context-parallel attention memory: compiled temp bytes per device, forward + backward.

    python benchmarks/ring_memory.py [--seq 8192] [--context 4] [--heads 4] [--kv-heads 2]
                                     [--head-dim 64] [--batch 1] [--dtype float32]
                                     [--impls xla,pallas_triton] [--markdown]

Compiles (does not run) the gradient of sum(attention(q, k, v) * cotangent) with respect to
q, k, v on `--context` fake CPU devices (mesh context=n, causal, packed segment ids, the
balanced token order) and prints XLA's `memory_analysis().temp_size_in_bytes` for:

- `allgather`: K/V all-gathered, then one attention over the full keys per device;
- `ring (dense, before)`: the ring body before issue 27 (`dense_ring_local` below, verbatim):
  float32 scores [B, kv_heads, groups, Tl, Tl] at precision highest per ring step;
- `ring (kernels)`: the ring of `sharding/ring.py`, one `kernels.attention_with_lse` per step.

`--impls` picks the kernel for allgather and the kernel ring (on CPU, Pallas impls compile
their interpret-mode lowering: the same blocked algorithm, so its buffers, not a GPU's).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _n = int(sys.argv[sys.argv.index("--context") + 1]) if "--context" in sys.argv else 4
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_n}"
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfra.metrics.table import format_table
from sharding import context
from sharding.mesh import MeshConfig, make_mesh
from sharding.plan import plan_for
from sharding.rules import rules_for

CONTEXT = context.CONTEXT


def dense_ring_local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, ring: int,
                     balanced: bool, scale: float) -> jax.Array:
    """`sharding/context.py: _ring_attention_local` before issue 27, kept as the memory baseline."""
    b, tl, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    me = jax.lax.axis_index(CONTEXT)
    q_idx = context._token_index(me, tl, ring, balanced)
    qg = q.reshape(b, tl, kv_heads, groups, d).astype(jnp.float32)
    out = jnp.zeros((b, kv_heads, groups, tl, v.shape[-1]), jnp.float32)
    row_max = jnp.full((b, kv_heads, groups, tl), -jnp.inf, jnp.float32)
    row_sum = jnp.zeros((b, kv_heads, groups, tl), jnp.float32)
    kv_seg = seg
    shift = [(j, (j + 1) % ring) for j in range(ring)]
    for step in range(ring):
        source = (me - step) % ring  # whose K/V block this device holds now
        kv_idx = context._token_index(source, tl, ring, balanced)
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


def _dense_ring(mesh, ring: int) -> Callable:
    def attend(q, k, v, seg):
        return jax.shard_map(
            lambda q, k, v, s: dense_ring_local(q, k, v, s, ring=ring, balanced=True, scale=q.shape[-1] ** -0.5),
            mesh=mesh, axis_names={CONTEXT}, in_specs=(P(None, CONTEXT),) * 4, out_specs=P(None, CONTEXT))(
                q, k, v, seg)
    return attend


def _through_context(mesh, context_impl: str, impl: str) -> Callable:
    rules = rules_for(context_impl=context_impl, load_balance=True)

    def attend(q, k, v, seg):
        return context.attention(q, k, v, segment_ids=seg, impl=impl, plan=plan_for(mesh, rules))
    return attend


def temp_bytes(attend: Callable, mesh, *, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int,
               dtype: str) -> int:
    """Compiled temp bytes per device of d/d(q, k, v) sum(attend(q, k, v, seg) * cotangent)."""
    def loss(q, k, v, seg, cot):
        return jnp.sum(attend(q, k, v, seg).astype(jnp.float32) * cot)

    spec = jax.sharding.NamedSharding(mesh, P(None, CONTEXT))
    shape = lambda h, dt: jax.ShapeDtypeStruct((batch, seq, h, head_dim), dt, sharding=spec)  # noqa: E731
    args = (shape(heads, dtype), shape(kv_heads, dtype), shape(kv_heads, dtype),
            jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=spec), shape(heads, jnp.float32))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def measure(*, seq: int, ring: int, impls: list[str], **shape) -> list[tuple[str, str, int]]:
    """(variant, impl, temp bytes) for allgather and the kernel ring per impl, and the dense ring."""
    mesh = make_mesh(MeshConfig(data=1, context=ring), jax.devices()[:ring])
    rows = []
    for impl in impls:
        rows.append(("allgather", impl, temp_bytes(_through_context(mesh, "allgather", impl), mesh, seq=seq,
                                                   **shape)))
    rows.append(("ring (dense, before)", "-", temp_bytes(_dense_ring(mesh, ring), mesh, seq=seq, **shape)))
    for impl in impls:
        rows.append(("ring (kernels)", impl, temp_bytes(_through_context(mesh, "ring", impl), mesh, seq=seq,
                                                        **shape)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--context", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--impls", default="xla,pallas_triton")
    parser.add_argument("--markdown", action="store_true")
    a = parser.parse_args()
    rows = measure(seq=a.seq, ring=a.context, impls=a.impls.split(","), batch=a.batch, heads=a.heads,
                   kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype)
    ref = dict(((n, i), b) for n, i, b in rows)[("allgather", a.impls.split(",")[0])]
    print(f"seq {a.seq}, context {a.context}, B{a.batch} H{a.heads}/{a.kv_heads} D{a.head_dim} {a.dtype}, "
          f"{jax.devices()[0].platform}: temp bytes per device, forward + backward")
    print(format_table([(n, i, f"{b / 2**20:.1f}", f"{b / ref:.2f}") for n, i, b in rows],
                       ["variant", "impl", "temp MiB", "/ allgather"], style="markdown" if a.markdown else "plain"))


if __name__ == "__main__":
    main()
