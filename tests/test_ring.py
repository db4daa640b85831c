"""Ring attention through the kernels (sharding/ring.py): each ring step is one
`kernels.attention_with_lse` call merged by log-sum-exp. Forward and gradients must equal the
1-device float32 reference for every chunk-pair visibility (balanced and not), packed segment
ids, GQA and pieces whose rows see nothing, with the xla path and with a Pallas kernel (interpreted)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from sharding import context
from sharding.mesh import MeshConfig, make_mesh
from sharding.plan import ParallelPlan, plan_for
from sharding.rules import rules_for

B, T, H, KV_HEADS, D = 2, 32, 4, 2, 8
RING = 4


def _inputs(seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, h, D)), jnp.float32) for h in (H, KV_HEADS, KV_HEADS))
    # Row 0: two documents and padding (id 0); row 1: a one-token document, then one long one.
    # Per ring step many rows see nothing of the visiting block (other documents, later chunks).
    seg = np.zeros((B, T), np.int32)
    seg[0, :13], seg[0, 13:27] = 1, 2
    seg[1, 0], seg[1, 1:] = 3, 1
    return q, k, v, jnp.asarray(seg)


def _loss_and_grads(fn, seg, cot, *args):
    """fn(seg, *args) and the gradients of sum(out * cot) with respect to every one of `args`."""
    def loss(*args):
        out = fn(seg, *args)
        return jnp.sum(out * cot), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return out, grads


@pytest.mark.parametrize("impl,balanced,mesh_sizes", [
    ("xla", True, dict(context=RING)), ("xla", False, dict(context=RING)), ("pallas_triton", True, dict(context=RING)),
    ("pallas_triton", False, dict(data=2, context=2)),
    ("cudnn", True, dict(context=RING))])  # no lse from cuDNN: the ring runs `auto` (xla on CPU)
def test_ring_matches_reference(impl: str, balanced: bool, mesh_sizes: dict):
    check_ring(impl, balanced, mesh_sizes)


@pytest.mark.parametrize("impl,balanced,mesh_sizes", [
    pytest.param("xla", True, dict(context=RING), marks=pytest.mark.slow),
    ("pallas_triton", False, dict(data=2, context=2))])
def test_ring_with_sinks_matches_reference(impl: str, balanced: bool, mesh_sizes: dict):
    """gpt-oss sinks join once, after the ring's merge (kernels.apply_sinks on the merged lse, whose
    cotangent the ring's VJP carries): out and the gradients of q, k, v and the sinks equal 1 device's.
    The default run keeps the Pallas, unbalanced context=2 case (a balanced context=2 ring with sinks trains
    in tests/test_parallel.py); the slow run adds xla on a balanced context=4 ring."""
    check_ring(impl, balanced, mesh_sizes, sinks=jnp.asarray([0.5, -1.0, 2.5, 8.0], jnp.float32))


def test_per_shard_kernel_with_sinks_matches_reference():
    """Without context parallelism a Pallas kernel runs per (batch, heads) shard (sharding/context.py), here
    heads split over tensor=2 and batch over data=2; the sinks join its (out, lse) outside the shard_map."""
    q, k, v, seg = _inputs()
    sinks = jnp.asarray([0.5, -1.0, 2.5, 8.0], jnp.float32)
    cot = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, D)), jnp.float32)
    want, want_grads = _loss_and_grads(
        lambda s, q, k, v, sk: kernels.reference_attention(q, k, v, causal=True, segment_ids=s, sinks=sk),
        seg, cot, q, k, v, sinks)
    plan = plan_for(make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4]), rules_for())

    def sharded(s, q, k, v, sk):
        return context.attention(q, k, v, segment_ids=s, impl="pallas_mosaic_tpu", plan=plan, sinks=sk)

    assert "shard_map" in str(jax.make_jaxpr(sharded)(seg, q, k, v, sinks))
    got, got_grads = _loss_and_grads(sharded, seg, cot, q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    for name, g, w in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


def check_ring(impl: str, balanced: bool, mesh_sizes: dict, sinks: jax.Array | None = None) -> None:
    q, k, v, seg = _inputs()
    cot = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, D)), jnp.float32)
    args = (q, k, v) if sinks is None else (q, k, v, sinks)  # the differentiated ones
    want, want_grads = _loss_and_grads(
        lambda s, q, k, v, *sk: kernels.reference_attention(q, k, v, causal=True, segment_ids=s,
                                                            sinks=sk[0] if sk else None), seg, cot, *args)
    order = context.balanced_order(T, mesh_sizes["context"]) if balanced else np.arange(T)
    back = np.argsort(order)
    mesh = make_mesh(MeshConfig(**{"data": 1, **mesh_sizes}), jax.devices()[:RING])
    rules = rules_for(context_impl="ring", load_balance=balanced)

    def ring(s, q, k, v, *sk):
        return context.attention(q, k, v, segment_ids=s, impl=impl, plan=plan_for(mesh, rules),
                                 sinks=sk[0] if sk else None)

    got, got_grads = _loss_and_grads(ring, seg[:, order], cot[:, order], q[:, order], k[:, order], v[:, order],
                                     *args[3:])
    np.testing.assert_allclose(np.asarray(got)[:, back], np.asarray(want), rtol=2e-5, atol=2e-5)
    for name, g, w in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        g = np.asarray(g) if name == "sinks" else np.asarray(g)[:, back]
        np.testing.assert_allclose(g, np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


def test_ring_bfloat16_close_to_float32_reference():
    """bfloat16 inputs: pieces come back in bfloat16, the merge and the travelling dK/dV stay float32."""
    q, k, v, seg = _inputs()
    cot = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, D)), jnp.float32)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    want, want_grads = _loss_and_grads(
        lambda s, q, k, v: kernels.reference_attention(q, k, v, causal=True, segment_ids=s, out_dtype=jnp.float32),
        seg, cot, *(x.astype(jnp.float32) for x in (q16, k16, v16)))
    mesh = make_mesh(MeshConfig(data=1, context=RING), jax.devices()[:RING])

    def ring(s, q, k, v):
        plan = plan_for(mesh, rules_for(context_impl="ring", load_balance=False))
        return context.attention(q, k, v, segment_ids=s, impl="xla", plan=plan)

    got, got_grads = _loss_and_grads(ring, seg, cot, q16, k16, v16)
    assert got.dtype == jnp.bfloat16 and got_grads[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=6e-2, err_msg=name)


def test_ring_steps_call_the_kernel():
    """The Pallas kernel runs per ring step: once for the diagonal step, then one per branch of
    each later step's `cond` (which chunk pair the visiting block meets); the shard_map is manual
    over the batch axes too, so the custom kernel is never given the gathered batch."""
    q, k, v, seg = _inputs()
    mesh = make_mesh(MeshConfig(data=2, context=RING), jax.devices()[:2 * RING])

    def ring(q, k, v, s):
        plan = plan_for(mesh, rules_for(context_impl="ring"))
        return context.attention(q, k, v, segment_ids=s, impl="pallas_triton", plan=plan)

    text = str(jax.make_jaxpr(ring)(q, k, v, seg))
    assert text.count("pallas_call") == 1 + 2 * (RING - 1)
    assert "newly_manual_axes=frozenset({'context', 'data'})" in text or "frozenset({'data', 'context'})" in text


def _temp_mib(seq: int, impls: list[str]) -> dict[tuple[str, str], float]:
    from benchmarks import ring_memory
    rows = ring_memory.measure(seq=seq, ring=RING, impls=impls, batch=1, heads=4, kv_heads=2, head_dim=64,
                               dtype="float32")
    return {(name, impl): b / 2**20 for name, impl, b in rows}


def test_ring_memory_below_allgather_and_dense_ring():
    """Compiled temp bytes of forward + backward (benchmarks/ring_memory.py, its RESULTS row at seq
    8192): the kernel ring holds one block's residuals per step, not [Tl, Tl] scores per step."""
    mib = _temp_mib(1024, ["xla"])
    ring = mib[("ring (kernels)", "xla")]
    assert ring < 0.5 * mib[("allgather", "xla")] and ring < 0.5 * mib[("ring (dense, before)", "-")], mib


@pytest.mark.slow
def test_ring_memory_with_a_pallas_kernel():
    """Also below the all-gather through the same (interpreted) Pallas kernel: O(Tl) per device, not O(T)."""
    mib = _temp_mib(2048, ["pallas_triton"])
    assert mib[("ring (kernels)", "pallas_triton")] < 0.75 * mib[("allgather", "pallas_triton")], mib


def test_ring_lowers_to_triton_for_gpu(monkeypatch):
    """The ring with the Triton kernel lowered for CUDA on this CPU machine (the kernel module told
    it runs on an H100): forward 1 + 2 (n-1) kernels (the diagonal, both branches of each
    later step's cond), backward 3 per branch (recomputed forward, dq, dk/dv); K/V and ids shift
    n-1 times forward, K/V and their gradients n-1 times backward, the gradients once more home."""
    import sys
    module = sys.modules["kernels.attention"]
    monkeypatch.setattr(module, "_platform", lambda: "gpu")
    monkeypatch.setattr(module, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(module, "_compute_capability", lambda: "9.0")
    mesh = make_mesh(MeshConfig(data=1, context=RING), jax.devices()[:RING])
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

    def grads(q, k, v, s):
        def loss(q, k, v):
            out = context.attention(q, k, v, segment_ids=s, impl="pallas_triton", plan=plan)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    # The plan's platform says where the kernels run (the mesh's devices are CPUs here).
    plan = ParallelPlan(mesh, rules_for(context_impl="ring"), platform="gpu")
    seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    text = jax.jit(grads).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    steps = 1 + 2 * (RING - 1)
    assert text.count("custom_call @__gpu$xla.gpu.triton") == steps + 3 * steps
    assert text.count("collective_permute") == 3 * (RING - 1) + 5 * (RING - 1) + 2
