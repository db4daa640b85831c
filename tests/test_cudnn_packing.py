"""cuDNN on packed batches (kernels/cudnn_packing.py), proved exact on CPU.

cuDNN does not run here, so the transformation is fed to a plain-jnp emulation of what cuDNN
computes on its packed layout: the emulation first applies jax's own conversion to cuDNN's
flat element offsets (`_fix_seqlen_offsets`, the code the real call runs), then attends within
each (offset, length) segment of the flattened token axis, reading keys at the key tensor's
real per-token stride, and leaves tokens outside every segment NaN (cuDNN does not write
them). Fed by `pack_segments`, it must equal kernels/reference.py with the segment ids,
forward and gradients. The real call is traced and lowered for CUDA as well.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import cudnn_packing
from kernels.reference import reference_attention

fused_attention = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
attention_module = importlib.import_module("kernels.attention")


def emulate_cudnn(q, k, v, packed, *, causal, scale, sliding_window):
    """What cuDNN's packed (THD) attention computes, from its inputs alone."""
    b, t, hq, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    q_len, kv_len, q_off, kv_off = fused_attention._fix_seqlen_offsets(
        packed.seq_lens, packed.seq_lens, packed.offsets, packed.offsets, q, k)
    q_len, kv_len = q_len.reshape(-1), kv_len.reshape(-1)  # one entry per flat segment
    q_start = q_off.reshape(-1)[:q_len.size] // (hq * d)  # element offsets -> token index in the flat axis
    kv_start = kv_off.reshape(-1)[:kv_len.size] // (hkv * d)  # the key tensor's real stride

    def member(start, length, n):  # [n tokens, segments]: token i lies in segment s
        i = jnp.arange(n)[:, None]
        return (i >= start[None]) & (i < start[None] + length[None]) & (length[None] > 0)

    mq, mk = member(q_start, q_len, b * t), member(kv_start, kv_len, b * s_len)
    q_local = jnp.arange(b * t) - jnp.sum(jnp.where(mq, q_start[None], 0), axis=1)
    kv_local = jnp.arange(b * s_len) - jnp.sum(jnp.where(mk, kv_start[None], 0), axis=1)
    visible = jnp.einsum("is,js->ij", mq.astype(jnp.int32), mk.astype(jnp.int32)) > 0
    if causal:
        visible &= kv_local[None, :] <= q_local[:, None]
    if sliding_window is not None:
        visible &= q_local[:, None] - kv_local[None, :] < sliding_window
    qf = q.reshape(b * t, hkv, hq // hkv, d).astype(jnp.float32)
    kf, vf = k.reshape(b * s_len, hkv, d).astype(jnp.float32), v.reshape(b * s_len, hkv, -1).astype(jnp.float32)
    logits = jnp.einsum("ikgd,jkd->kgij", qf, kf, precision="highest") * scale
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("kgij,jkd->ikgd", jnp.nan_to_num(probs), vf, precision="highest")
    covered = jnp.any(mq, axis=1)
    out = jnp.where(covered[:, None, None, None], out, jnp.nan)  # cuDNN leaves these unwritten
    return out.reshape(b, t, hq, -1).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class Case:
    hq: int = 4
    hkv: int = 2
    causal: bool = True
    window: int | None = None
    max_segments: int = 6
    repeat_kv: bool = True  # False: skip the wrapper's GQA workaround (for the probe test)
    with_grads: bool = False  # compare gradients too (one case: compiles dominate this file)


def _segment_rows(t: int = 24) -> np.ndarray:
    return np.stack([
        np.r_[[1] * 5, [2] * 9, [3] * 2, [0] * (t - 16)],  # three documents, then a padding run
        np.r_[[1] * t],  # one document fills the row
        np.r_[[1] * 3, [2] * (t - 3)],  # no padding
    ]).astype(np.int32)


def _broken_rows() -> np.ndarray:
    seg = _segment_rows()
    seg[2, 20:] = 1  # row 2: id 1 in two runs (not a packed layout); row 0 has 4 runs
    return seg


CASES = {
    "causal-window-gqa2": Case(window=3, with_grads=True),
    "full-mha": Case(hq=2, hkv=2, causal=False),
    "causal-mqa-no-repeat": Case(hq=4, hkv=1, repeat_kv=False),  # jax's own GQA offsets
    "bound-3-broken-rows": Case(max_segments=3),
}


def _packed(case: Case, q, k, v, seg):
    if case.repeat_kv:
        return cudnn_packing.packed_attention(q, k, v, seg, causal=case.causal, scale=16 ** -0.5,
                                              left_window=case.window, max_segments=case.max_segments,
                                              fused=emulate_cudnn)
    packed = cudnn_packing.pack_segments(seg, case.max_segments)
    return emulate_cudnn(q, k, v, packed, causal=case.causal, scale=16 ** -0.5, sliding_window=None)


def _reference(case: Case, q, k, v, seg):
    window = None if case.window is None else (case.window, 0 if case.causal else None)
    return reference_attention(q, k, v, causal=case.causal, segment_ids=seg, window=window)


@functools.cache
def _results():
    """Everything the tests below compare, in one compiled program (compiles dominate here)."""
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.standard_normal((3, 24, h, 16)), jnp.float32) for h in (4, 2, 2, 4))

    @jax.jit
    def run(q, k, v, w, seg, broken):
        out = {"tables": cudnn_packing.pack_segments(seg, 5)}
        for name, case in CASES.items():
            s = broken if name.startswith("bound") else seg
            args = q[..., :case.hq, :], k[..., :case.hkv, :], v[..., :case.hkv, :]
            wc = w[..., :case.hq, :]
            for label, fn in (("packed", _packed), ("reference", _reference)):
                loss = lambda *a, f=fn, c=case: jnp.sum(f(c, *a, s) * wc)  # noqa: E731
                grads = jax.grad(loss, argnums=(0, 1, 2))(*args) if case.with_grads else None
                out[f"{name}/{label}"] = fn(case, *args, s), grads
        return out

    return jax.device_get(run(q, k, v, w, jnp.asarray(_segment_rows()), jnp.asarray(_broken_rows())))


@pytest.mark.parametrize("name", ["causal-window-gqa2", "full-mha"])
def test_packed_layout_equals_reference_forward_and_gradients(name):
    (out, grads), (ref, ref_grads) = _results()[f"{name}/packed"], _results()[f"{name}/reference"]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg="out")
    assert (grads is None) == (not CASES[name].with_grads)
    for g, r, n in zip(grads or (), ref_grads or (), "qkv"):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=f"d{n}")


def test_pack_segments_tables(monkeypatch):
    packed = _results()["tables"]
    np.testing.assert_array_equal(packed.seq_lens, [[5, 9, 2, 8, -1], [24, -1, -1, -1, -1], [3, 21, -1, -1, -1]])
    np.testing.assert_array_equal(packed.offsets, [[0, 5, 14, 16, -1, -1], [0, -1, -1, -1, -1, -1],
                                                   [0, 3, -1, -1, -1, -1]])
    assert packed.row_ok.all()
    monkeypatch.setattr(cudnn_packing, "MAX_SEGMENTS", 3)  # the bound is read at the call
    small = cudnn_packing.pack_segments(jnp.asarray(_segment_rows()))
    assert small.seq_lens.shape == (3, 3) and np.asarray(small.row_ok).tolist() == [False, True, True]


def test_rows_breaking_the_bound_or_contiguity_are_nan_never_silently_wrong():
    (out, _), (ref, _) = _results()["bound-3-broken-rows/packed"], _results()["bound-3-broken-rows/reference"]
    assert np.isnan(out[0]).all()  # 4 runs > 3
    assert np.isnan(out[2]).all()  # id 1 in two runs
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5, atol=1e-5)


def test_gqa_probe_matches_what_the_installed_conversion_does():
    """Without the kv-head repeat, GQA through the emulation (jax's real offset conversion)
    is right exactly when the probe says kv offsets follow the key's stride."""
    (raw, _), (ref, _) = _results()["causal-mqa-no-repeat/packed"], _results()["causal-mqa-no-repeat/reference"]
    raw_ok = bool(np.allclose(np.nan_to_num(raw, nan=1e9), ref, atol=1e-5))
    assert raw_ok == cudnn_packing.kv_offsets_follow_key_stride()


def test_cudnn_call_lowers_for_cuda_with_the_packed_tables(monkeypatch):
    """The real jax cuDNN call accepts our tables (dtypes, ranks, shapes) and lowers to the
    cuDNN custom call, with cuDNN's version and capability checks answered as on an H100."""

    class _Versions:
        @staticmethod
        def cudnn_get_version():
            return 91000

    monkeypatch.setattr(fused_attention, "cuda_versions", _Versions)
    monkeypatch.setattr(fused_attention, "check_compute_capability", lambda c: True)
    monkeypatch.setattr(fused_attention, "is_cuda_compute_capability_equal", lambda c: False)
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 128), jnp.int32)

    def f(q, k, v, seg):
        def loss(q, k, v):
            out = cudnn_packing.packed_attention(q, k, v, seg, causal=True, scale=0.125, left_window=None)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = jax.jit(f).trace(q, q, q, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text


def test_cudnn_impl_with_segment_ids_runs_per_shard_in_the_model_attention_path(monkeypatch):
    """kernels.attention(impl='cudnn', segment_ids=...) takes the packed path, and
    sharding/context.py runs it per (batch, heads) shard under shard_map like the Pallas
    kernels (each shard builds its own segment tables): on a data 2 x fsdp 2 x tensor 2 mesh
    the output equals the reference. What cuDNN cannot do stays a one-line ValueError."""
    from sharding import context
    from sharding.mesh import MeshConfig, make_mesh
    from sharding.plan import ParallelPlan
    from sharding.rules import rules_for

    monkeypatch.setattr(attention_module, "_platform", lambda: "gpu")
    monkeypatch.setattr(cudnn_packing, "cudnn_fused", emulate_cudnn)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
    rng = np.random.default_rng(3)
    seg = jnp.asarray(np.tile(_segment_rows(24), (2, 1))[:4])  # batch 4 = data x fsdp
    q, k, v = (jnp.asarray(rng.standard_normal((4, 24, h, 16)), jnp.bfloat16) for h in (4, 2, 2))

    plan = ParallelPlan(mesh, rules_for("fsdp"), platform="gpu")  # the emulated GPU's plan

    def sharded(q, k, v):
        return context.attention(q, k, v, segment_ids=seg, impl="cudnn", plan=plan)

    def reference(q, k, v):
        return reference_attention(q, k, v, causal=True, segment_ids=seg, out_dtype=jnp.float32)

    with jax.set_mesh(mesh):
        step = jax.jit(sharded)
        out = step(q, k, v)
        text = step.lower(q, k, v).as_text()
    assert "manual_computation" in text or "shard_map" in text
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(jax.jit(reference)(q, k, v)), atol=2e-2)
    with pytest.raises(ValueError, match=r"cudnn.*one shared segment_ids") as info:
        kernels.attention(q, k, v, segment_ids=(seg, seg + 0), impl="cudnn")
    assert "\n" not in str(info.value)
