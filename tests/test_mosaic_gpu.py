"""The Hopper kernel in Pallas Mosaic GPU (kernels/flash_mosaic_gpu.py) behind kernels.attention.

No GPU here, so (besides the lowering for CUDA of every supported feature, with the other
kernels' lowering tests in tests/test_flash_attention.py):

* The wrapper: dispatch (`auto` and the table), every fallback to pallas_triton with its one
  log line, padding, block-size rules.
* Numerics (slow): jax's GPU interpreter runs the same program on CPU, simulating the
  warpgroups, shared memory, TMA copies and barriers, against the float32 reference, forward
  and gradients, and bitwise across two runs. About 10-20 s per kernel and grid point here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import BlockSizes, attention_with_lse, flash_mosaic_gpu, masks
from kernels import block_sizes as block_table
from kernels.flash import FlashParams
from kernels.reference import reference_attention

attention_module = importlib.import_module("kernels.attention")


# ---------------------------------------------------------------- the wrapper


def _z(*shape, dtype=jnp.bfloat16):
    return jnp.zeros(shape, dtype)


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(attention_module, "_logged", set())


@pytest.mark.parametrize("dtype, d_qk, d_v, cc, reason", [
    (jnp.float32, 128, 128, "9.0", "it takes bfloat16/float16 (wgmma), got float32"),
    (jnp.bfloat16, 96, 96, "9.0", "head dims must be multiples of 64 up to 192, got 96/96"),
    (jnp.bfloat16, 256, 256, "9.0", "head dims must be multiples of 64 up to 192, got 256/256"),
    (jnp.bfloat16, 128, 128, "8.0", "it needs a Hopper GPU (compute capability 9.0), got 8.0"),
    (jnp.bfloat16, 128, 128, "10.0", "it needs a Hopper GPU (compute capability 9.0), got 10.0"),
], ids=["float32", "d96", "d256", "ampere", "blackwell"])
def test_every_fallback_runs_pallas_triton_and_logs_one_line(monkeypatch, caplog, fresh_log, dtype, d_qk, d_v, cc,
                                                             reason):
    monkeypatch.setattr(attention_module, "_platform", lambda: "gpu")
    monkeypatch.setattr(attention_module, "_compute_capability", lambda: cc)
    q, v = _z(1, 8, 2, d_qk, dtype=dtype), _z(1, 8, 2, d_v, dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="kernels.attention"):
        assert kernels.resolve_impl("pallas_mosaic_gpu", q, v) == "pallas_triton"
        assert kernels.resolve_impl("pallas_mosaic_gpu", q, v) == "pallas_triton"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"attention(impl='pallas_mosaic_gpu'): {reason}; using pallas_triton"]


def test_fallback_is_what_runs(monkeypatch, caplog, fresh_log):
    """A float32 call with impl='pallas_mosaic_gpu' reaches the Triton kernel, with Triton's
    block table; a bfloat16 one the Mosaic GPU kernel with its own (recorded, not run)."""
    called = []

    def record(params, q, k, v, q_seg, kv_seg):
        called.append((params.backend, params.blocks.block_kv))
        return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1]))

    monkeypatch.setattr(attention_module, "flash_attention", record)
    with caplog.at_level(logging.WARNING, logger="kernels.attention"):
        kernels.attention(_z(1, 16, 2, 64, dtype=jnp.float32), _z(1, 16, 2, 64, dtype=jnp.float32),
                          _z(1, 16, 2, 64, dtype=jnp.float32), impl="pallas_mosaic_gpu")
        kernels.attention(_z(1, 300, 2, 64), _z(1, 300, 2, 64), _z(1, 300, 2, 64), impl="pallas_mosaic_gpu")
    cpu_triton = block_table.TABLE[("cpu", "*", "*", "*")].clamped(16, 16).block_kv
    cpu_mosaic = block_table.MOSAIC_GPU_TABLE[("cpu", "*", "*", "*")].block_kv
    assert called == [("triton", cpu_triton), ("mosaic_gpu", cpu_mosaic)]
    assert caplog.text.count("using pallas_triton") == 1


def test_mosaic_gpu_needs_its_tile_rules():
    q = _z(1, 128, 2, 64)
    for bad, name in ((BlockSizes(128, 64, 64, 64, 64, 64), "block_q"), (BlockSizes(64, 32, 64, 64, 64, 64),
                                                                        "block_kv")):
        with pytest.raises(ValueError, match=f"pallas_mosaic_gpu needs BlockSizes.{name}") as info:
            kernels.attention(q, q, q, impl="pallas_mosaic_gpu", block_sizes=bad)
        assert "\n" not in str(info.value)


def test_padding_to_the_kernel_blocks():
    """Query lengths pad to 2 warpgroups x 64 rows, kv lengths to 2 x the largest kv block;
    segment ids pad by repeating the last id; head dims are never padded."""
    band = masks.make_band(True, None, 200, 70)
    blocks = flash_mosaic_gpu.clamped(BlockSizes(64, 128, 64, 128, 64, 64, num_stages=2), band)
    assert (blocks.block_kv, blocks.block_kv_dq, blocks.block_kv_dkv) == (128, 128, 64)
    params = FlashParams("mosaic_gpu", band, 0.1, None, blocks, interpret=True)
    q, k = _z(2, 200, 4, 192), _z(2, 70, 2, 192)
    seg_q, seg_kv = jnp.ones((2, 200), jnp.int32), jnp.full((2, 70), 3, jnp.int32)
    x = flash_mosaic_gpu._Prepared(params, q, k, _z(2, 70, 2, 128), seg_q, seg_kv)
    assert (x.q.shape, x.k.shape, x.v.shape) == ((2, 256, 4, 192), (2, 256, 2, 192), (2, 256, 2, 128))
    assert int(x.segs[1][0, -1]) == 3 and x.segs[0].shape == (2, 256)


def test_auto_dispatch_follows_the_measured_table(monkeypatch, fresh_log):
    """H200 bf16 D128/D64: the measured cuDNN rows (when cuDNN supports the call; never for
    segment ids); elsewhere pallas_triton, or pallas_mosaic_gpu where a row says so."""
    monkeypatch.setattr(attention_module, "_platform", lambda: "gpu")
    monkeypatch.setattr(attention_module, "_compute_capability", lambda: "9.0")
    kind = {"value": "NVIDIA H200"}
    monkeypatch.setattr(attention_module, "_device_kind", lambda: kind["value"])
    q = _z(2, 64, 4, 128)
    seg = jnp.ones((2, 64), jnp.int32)
    assert kernels.resolve_impl("auto", q, q) == "cudnn"
    assert kernels.resolve_impl("auto", q, q, causal=False) == "cudnn"
    assert kernels.resolve_impl("auto", _z(2, 64, 4, 64), _z(2, 64, 4, 64)) == "cudnn"
    assert kernels.resolve_impl("auto", q, q, segment_ids=seg) == "pallas_triton"  # bounded packed layout
    assert kernels.resolve_impl("auto", q, q, need_lse=True) == "pallas_triton"
    assert kernels.resolve_impl("auto", q, q, softcap=5.0) == "pallas_triton"
    assert kernels.resolve_impl("auto", q, q, causal=False, window=(8, 8)) == "pallas_triton"
    assert kernels.resolve_impl("auto", q.astype(jnp.float32), q.astype(jnp.float32)) == "pallas_triton"
    assert kernels.resolve_impl("auto", _z(2, 64, 4, 192), q) == "pallas_triton"  # MLA: no cuDNN row
    kind["value"] = "NVIDIA H100 80GB HBM3"  # not measured: keep the Triton kernel
    assert kernels.resolve_impl("auto", q, q) == "pallas_triton"
    row = ("NVIDIA H100", "bfloat16", 128, "causal")
    monkeypatch.setitem(block_table.IMPL_TABLE, row, "pallas_mosaic_gpu")
    assert kernels.resolve_impl("auto", q, q) == "pallas_mosaic_gpu"
    assert kernels.resolve_impl("auto", _z(2, 64, 4, 96), _z(2, 64, 4, 96)) == "pallas_triton"  # it cannot: d96
    monkeypatch.setattr(attention_module, "_compute_capability", lambda: "8.0")
    assert kernels.resolve_impl("auto", q, q) == "pallas_triton"


def test_sinks_are_applied_to_the_kernels_out_and_lse(monkeypatch):
    """With sinks the Mosaic GPU kernel runs as without them and `kernels.apply_sinks` rescales its
    (out, lse) (recorded, not run; the interpreted numerics with sinks are in the slow grid below)."""
    out = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, 64)), jnp.bfloat16)
    lse = jnp.asarray(np.r_[np.linspace(-2.0, 6.0, 127), -np.inf], jnp.float32)[None, None].repeat(2, axis=1)
    monkeypatch.setattr(attention_module, "flash_attention", lambda params, *a: (out, lse))
    sinks = jnp.asarray([1.0, -3.0], jnp.float32)
    got, got_lse = attention_with_lse(out, out, out, impl="pallas_mosaic_gpu", sinks=sinks)
    keep = 1 / (1 + np.exp(np.asarray(sinks)[:, None] - np.asarray(lse[0])))  # [H, T]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(out, np.float32) * keep.T[None, :, :, None],
                               rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(got_lse[0], np.logaddexp(np.asarray(lse[0]), np.asarray(sinks)[:, None]), rtol=1e-6)
    assert np.all(np.asarray(got)[:, -1] == 0) and np.array_equal(got_lse[0, :, -1], sinks)  # a row with no key


def test_bad_shapes_raise_before_any_kernel(monkeypatch):
    monkeypatch.setattr(attention_module, "flash_attention", lambda *a: pytest.fail("a kernel ran"))
    with pytest.raises(ValueError, match=r"q heads 4 .*k/v heads 3"):
        kernels.attention(_z(1, 128, 4, 64), _z(1, 128, 3, 64), _z(1, 128, 3, 64), impl="pallas_mosaic_gpu")


# ---------------------------------------------------------------- numerics under the GPU interpreter (slow)


@dataclasses.dataclass(frozen=True)
class Case:
    t: int = 128
    tkv: int | None = None
    hq: int = 2
    hkv: int = 1
    dqk: int = 64
    dv: int = 64
    causal: bool = True
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    segments: bool = False
    sinks: bool = False  # gpt-oss attention sinks (kernels.apply_sinks on the kernel's out and lse)


NUMERICS = {
    "causal-gqa2-d64": Case(),
    "full-mha-d128-len200-pad": Case(t=200, hq=1, dqk=128, dv=128, causal=False),
    "mla192-128-segments-window": Case(hq=2, dqk=192, dv=128, window=(40, 0), segments=True),
    "softcap-window-both-tq-ne-tkv": Case(t=128, tkv=192, hq=1, causal=False, window=(30, 20), softcap=5.0),
    "sinks-gqa2-segments-window": Case(hq=4, hkv=2, window=(40, 0), segments=True, sinks=True),
    "sinks-mla192-128-full-window-tq-ne-tkv": Case(t=128, tkv=192, dqk=192, dv=128, causal=False, window=(30, 20),
                                                   sinks=True),
}


def _inputs(case: Case):
    rng = np.random.default_rng(1)
    tkv = case.tkv or case.t
    q = jnp.asarray(rng.standard_normal((1, case.t, case.hq, case.dqk)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, tkv, case.hkv, case.dqk)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, tkv, case.hkv, case.dv)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, case.t, case.hq, case.dv)), jnp.float32)
    seg = None
    if case.segments:  # three documents and a padding run; query 5 is alone in its id
        ids = np.r_[[1] * 40, [2] * 50, [3] * 20, [0] * (case.t - 110)]
        ids[5] = 9
        seg = (jnp.asarray(ids[None], jnp.int32), jnp.asarray(np.where(ids == 9, 1, ids)[None], jnp.int32))
    sinks = jnp.asarray(np.r_[2.0 + rng.standard_normal(case.hq - 1), 10.0], jnp.float32) if case.sinks else None
    return q, k, v, w, seg, sinks


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(case: Case, impl: str, q, k, v, w, seg, sinks=None):
    kw = dict(causal=case.causal, window=case.window, softcap=case.softcap, segment_ids=seg)

    def fwd(q, k, v, sinks):
        if impl == "reference":
            return reference_attention(q, k, v, return_lse=True, out_dtype=jnp.float32, sinks=sinks, **kw)
        return attention_with_lse(q, k, v, impl=impl, sinks=sinks, **kw)

    def loss(q, k, v, sinks):
        out, lse = fwd(q, k, v, sinks)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    out, lse = fwd(q, k, v, sinks)
    return out, lse, jax.grad(loss, argnums=(0, 1, 2) if sinks is None else (0, 1, 2, 3))(q, k, v, sinks)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NUMERICS))
def test_interpreted_kernel_matches_the_reference_and_is_deterministic(name):
    case = NUMERICS[name]
    args = _inputs(case)
    got = jax.device_get(_run(case, "pallas_mosaic_gpu", *args))
    again = jax.device_get(_run(case, "pallas_mosaic_gpu", *args))
    ref = jax.device_get(_run(case, "reference", *args))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)  # bitwise deterministic
    out, lse, grads = got
    np.testing.assert_allclose(np.asarray(out, np.float32), ref[0], rtol=1e-2, atol=1e-2, err_msg="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref[1]))
    finite = np.isfinite(ref[1])
    np.testing.assert_allclose(lse[finite], ref[1][finite], rtol=1e-3, atol=1e-3, err_msg="lse")
    if case.segments:  # a row that sees no key: out 0, lse -inf (or the sink)
        empty_lse = lse[0, :, 5] if case.sinks else np.isneginf(lse[0, :, 5])
        want = np.asarray(args[5]) if case.sinks else True
        assert np.array_equal(empty_lse, np.broadcast_to(want, empty_lse.shape)) and np.all(np.asarray(out)[0, 5] == 0)
    for n, g, r in zip(("q", "k", "v", "sinks"), grads, ref[2]):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all(), n
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(r).max())), err_msg=f"d{n}")
