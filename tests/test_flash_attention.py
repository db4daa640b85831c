"""Tests for the Pallas flash-attention kernels (kernels/flash_*.py) behind kernels.attention.

On CPU both Pallas implementations run in interpret mode: `pallas_triton` (the Triton-style
GPU kernel) and `pallas_mosaic_tpu` (the Mosaic TPU kernel, HLO interpreter; two cases also
under the full TPU simulator). Every case checks the output, the log-sum-exp and the
gradients of q, k and v (through both the output and the lse) against the float32 jnp
reference at Precision.HIGHEST, and against jax.nn.dot_product_attention where it has the
feature. Lengths are deliberately not block multiples, and the small blocks (16) give every
case several blocks, so block skipping, boundary masks and padding are all exercised.

The default run keeps one case of each behaviour; the exhaustive grid is marked slow.
Device-independent checks that the same kernels lower for real GPUs (Triton IR) and TPUs
(Mosaic) are at the end: interpret mode alone would not catch an op or a block shape the
real compilers reject.
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
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

import kernels
from kernels import BlockSizes, attention_with_lse, masks
from kernels import block_sizes as block_table
from kernels.attention import reference_attention

PALLAS = ("pallas_triton", "pallas_mosaic_tpu")
SMALL = BlockSizes(16, 16, 16, 16, 16, 16)
# Different tile shapes per kernel: lengths are padded to the largest, so the dq and dk/dv
# kernels see more (and partly empty) blocks than the forward.
MIXED = BlockSizes(block_q=32, block_kv=16, block_q_dq=16, block_kv_dq=32, block_q_dkv=16, block_kv_dkv=32)
EMPTY_ID = 7  # a query segment id with no key (in "pair" segment cases)
attention_module = importlib.import_module("kernels.attention")  # the package re-exports a function of that name


@dataclasses.dataclass(frozen=True)
class Case:
    b: int = 2
    tq: int = 40
    tkv: int = 40
    hq: int = 4
    hkv: int = 2
    dqk: int = 32
    dv: int | None = None  # None: dqk
    dtype: str = "float32"
    causal: bool = True
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    segments: str = "none"  # none | shared (one array) | pair (q ids, kv ids; some q rows see no key)
    blocks: BlockSizes = SMALL
    sinks: bool = False  # gpt-oss attention sinks, one float32 logit per query head (dsinks compared too)

    @property
    def d_v(self) -> int:
        return self.dqk if self.dv is None else self.dv

    @property
    def jax_nn_has_it(self) -> bool:
        """Whether jax.nn.dot_product_attention computes this case under our conventions."""
        late_rows_see_nothing = (self.window is not None and self.window[0] is not None
                                 and self.tq - 1 - self.window[0] >= self.tkv)  # jax.nn averages those
        return (self.softcap is None and self.d_v == self.dqk and self.segments != "pair"
                and not late_rows_see_nothing and not self.sinks)

    @property
    def lse_in_loss(self) -> bool:
        """Differentiate through the lse too, except where gradients are compared with jax.nn
        (which has no lse): one compiled backward serves both comparisons."""
        return not self.jax_nn_has_it


def _segments(case: Case):
    rng = np.random.default_rng(5)
    if case.segments == "none":
        return None

    def packed(length, lengths):
        row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[:length]
        return np.pad(row, (0, length - len(row)))  # trailing 0 = padding id

    if case.segments == "shared":
        t = case.tq
        rows = [packed(t, [t // 4, t // 3, t // 5]), packed(t, [t])]
        return jnp.asarray(np.stack(rows[:case.b]), jnp.int32)
    q_rows = [packed(case.tq, [case.tq // 3, case.tq // 2]), packed(case.tq, [case.tq])]
    kv_rows = [packed(case.tkv, [case.tkv // 4, case.tkv // 2]), packed(case.tkv, [case.tkv])]
    q_seg, kv_seg = np.stack(q_rows[:case.b]), np.stack(kv_rows[:case.b])
    # Query rows whose id appears in no key: they must come out 0 with finite gradients.
    q_seg[0, 3:5] = EMPTY_ID
    q_seg[-1, rng.integers(0, case.tq)] = EMPTY_ID
    return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def _inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(case.dtype)
    q = jnp.asarray(rng.standard_normal((case.b, case.tq, case.hq, case.dqk)), dt)
    k = jnp.asarray(rng.standard_normal((case.b, case.tkv, case.hkv, case.dqk)), dt)
    v = jnp.asarray(rng.standard_normal((case.b, case.tkv, case.hkv, case.d_v)), dt)
    w_out = jnp.asarray(rng.standard_normal((case.b, case.tq, case.hq, case.d_v)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((case.b, case.hq, case.tq)), jnp.float32)
    # Sinks near a row's lse (log of ~T visible keys) take a real share of the softmax; the last
    # head's is large (its rows are mostly sink: outputs ~0, the sigmoid saturates).
    sinks = jnp.asarray(np.r_[2.0 + 1.5 * rng.standard_normal(case.hq - 1), 12.0], jnp.float32) if case.sinks else None
    return q, k, v, _segments(case), w_out, w_lse, sinks


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(case: Case, impl: str, q, k, v, seg, w_out, w_lse, sinks=None):
    """(out, lse, (dq, dk, dv[, dsinks])) of one implementation; the loss reads both out and lse."""
    kw = dict(causal=case.causal, segment_ids=seg, window=case.window, softcap=case.softcap)

    def forward(q, k, v, sinks):
        if impl == "reference":
            return reference_attention(q, k, v, return_lse=True, out_dtype=jnp.float32, sinks=sinks, **kw)
        return attention_with_lse(q, k, v, impl=impl, block_sizes=case.blocks, sinks=sinks, **kw)

    def loss(q, k, v, sinks):
        out, lse = forward(q, k, v, sinks)
        total = jnp.sum(out.astype(jnp.float32) * w_out)
        if case.lse_in_loss:
            total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
        return total

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    (out, lse), grads = forward(q, k, v, sinks), jax.grad(loss, argnums=argnums)(q, k, v, sinks)
    return out, lse, grads


@functools.partial(jax.jit, static_argnums=0)
def _jax_nn(case: Case, q, k, v, seg, w_out):
    """jax.nn.dot_product_attention (XLA) in float32 at HIGHEST precision, and its gradients."""
    mask = None
    if seg is not None:
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]

    window = None
    if case.window is not None:  # jax.nn takes ints only: an unbounded side is any length
        window = tuple(case.tq + case.tkv if w is None else w for w in case.window)

    def f(q, k, v):
        up = [x.astype(jnp.float32) for x in (q, k, v)]
        with jax.default_matmul_precision("highest"):
            return jax.nn.dot_product_attention(*up, mask=mask, is_causal=case.causal,
                                                local_window_size=window, implementation="xla")

    return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * w_out), argnums=(0, 1, 2))(q, k, v)


def _tolerances(case: Case) -> tuple[dict, dict]:
    if case.dtype == "float32":
        return dict(rtol=1e-5, atol=5e-6), dict(rtol=1e-5, atol=1e-5)
    # bfloat16 inputs, outputs and gradients (8 mantissa bits) against a float32 reference.
    return dict(rtol=1e-2, atol=1e-2), dict(rtol=2e-2, atol=2e-2)


def _visible_rows(case: Case, seg) -> np.ndarray:
    """[B, Tq] whether each query row sees any key, from first principles."""
    i = np.arange(case.tq)[:, None]
    j = np.arange(case.tkv)[None, :]
    vis = np.ones((case.tq, case.tkv), bool)
    left, right = (None, None) if case.window is None else case.window
    if case.causal:
        vis &= j <= i
    if left is not None:
        vis &= j >= i - left
    if right is not None:
        vis &= j <= i + right
    vis = np.broadcast_to(vis, (case.b, case.tq, case.tkv))
    if seg is not None:
        q_seg, kv_seg = seg if isinstance(seg, tuple) else (seg, seg)
        vis = vis & (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])
    return vis.any(-1)


def check(case: Case, impl: str) -> None:
    q, k, v, seg, w_out, w_lse, sinks = args = _inputs(case)
    out, lse, grads = jax.device_get(_run(case, impl, *args))
    ref_out, ref_lse, ref_grads = jax.device_get(_run(case, "reference", *args))
    fwd_tol, grad_tol = _tolerances(case)

    assert out.shape == (case.b, case.tq, case.hq, case.d_v) and out.dtype == jnp.dtype(case.dtype)
    assert lse.shape == (case.b, case.hq, case.tq) and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float32), ref_out, **fwd_tol, err_msg="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="lse -inf rows")
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], **fwd_tol, err_msg="lse")
    for name, g, r in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        assert g.dtype == (jnp.float32 if name == "sinks" else jnp.dtype(case.dtype)), name
        assert np.all(np.isfinite(g.astype(np.float32))), f"d{name} not finite"
        np.testing.assert_allclose(g.astype(np.float32), r, **grad_tol, err_msg=f"d{name}")

    # Rows with no visible key: exactly 0 out, lse -inf (the documented convention), or the sink.
    empty = ~_visible_rows(case, seg)
    empty_lse = np.broadcast_to(-np.inf if sinks is None else np.asarray(sinks), lse.transpose(0, 2, 1).shape)
    assert np.all(out[empty] == 0) and np.array_equal(lse.transpose(0, 2, 1)[empty], empty_lse[empty])
    if case.segments == "pair":
        assert empty.any(), "the pair case must contain a query row with no visible key"

    if case.jax_nn_has_it:
        nn_seg = seg if case.segments == "shared" else None
        nn_out, nn_grads = jax.device_get(_jax_nn(case, q, k, v, nn_seg, w_out))
        np.testing.assert_allclose(out.astype(np.float32), nn_out, **fwd_tol, err_msg="out vs jax.nn")
        for name, g, r in zip("qkv", grads, nn_grads):
            np.testing.assert_allclose(g.astype(np.float32), r, **grad_tol, err_msg=f"d{name} vs jax.nn")


# ---------------------------------------------------------------- default run: one case per behaviour

FAST = {
    # vs jax.nn too: causal, one head per kv head, length not a block multiple.
    "causal-mha-f32-T40": Case(hq=2, hkv=2),
    # GQA 2, not causal, length_q != length_kv, head dim 96 (two column chunks), per-kernel blocks.
    "full-gqa2-d96-tq24-tkv40-mixed-blocks": Case(tq=24, tkv=40, dqk=96, causal=False, blocks=MIXED),
    # MLA head dims, MQA, (q, kv) segment ids with query rows that see no key; lse in the loss.
    "mla-mqa-pair-segments-empty-rows": Case(b=2, tq=24, tkv=40, hq=4, hkv=1, dqk=192, dv=128, segments="pair"),
    # Sliding window (both sides), soft-cap, one shared segment-id array; lse in the loss.
    "window-softcap-shared-segments": Case(tq=48, tkv=48, hq=2, hkv=2, causal=False, window=(6, 3),
                                           softcap=5.0, segments="shared"),
    # bfloat16, GQA 4.
    "bf16-causal-gqa4": Case(b=1, hq=8, hkv=2, dtype="bfloat16"),
    # Attention sinks (applied to the kernel's out and lse, kernels.apply_sinks): GQA 2, causal left
    # window, (q, kv) segment ids with rows that see no key (out 0, lse = the sink); dsinks too.
    "sinks-gqa2-window-pair-segments-empty-rows": Case(tq=24, tkv=40, window=(9, 0), segments="pair", sinks=True),
}
XLA_FAST = ("mla-mqa-pair-segments-empty-rows", "window-softcap-shared-segments")  # its fallback paths


@pytest.mark.parametrize("impl", [*PALLAS, "xla"])
@pytest.mark.parametrize("name", list(FAST))
def test_matches_reference(name, impl):
    if impl == "xla" and name not in XLA_FAST:
        pytest.skip("xla runs the cases that need its jnp path and the empty-row convention")
    check(FAST[name], impl)


@pytest.mark.parametrize("impl", PALLAS)
def test_bitwise_deterministic(impl):
    case = FAST["mla-mqa-pair-segments-empty-rows"]
    args = _inputs(case, seed=3)
    first = jax.device_get(_run(case, impl, *args))
    second = jax.device_get(_run(case, impl, *args))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", PALLAS)
def test_gqa_groups_consecutive_query_heads(impl):
    """Query head h reads kv head h // (Hq / Hkv), shown without the reference: keys are
    identical (uniform attention) and kv head i holds the constant value i + 1."""
    b, t, hq, hkv, d = 1, 24, 8, 2, 16
    q = jnp.asarray(np.random.default_rng(0).standard_normal((b, t, hq, d)), jnp.float32)
    k = jnp.ones((b, t, hkv, d), jnp.float32)
    v = jnp.broadcast_to((jnp.arange(hkv, dtype=jnp.float32) + 1)[None, None, :, None], (b, t, hkv, d))
    out = kernels.attention(q, k, v, causal=True, impl=impl, block_sizes=SMALL)
    expected = (np.arange(hq) // (hq // hkv) + 1).astype(np.float32)
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(expected[None, None, :, None], out.shape),
                               rtol=1e-6)


def test_mosaic_kernel_under_the_full_tpu_interpreter():
    """The TPU kernels under pltpu.InterpretParams (simulated VMEM, DMAs and semaphores; reads
    out of bounds raise, scratch starts as NaN, races are detected): two tiny unbatched cases."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    cases = [Case(b=1, tq=32, tkv=32, hq=2, hkv=1, dqk=16),
             Case(b=1, tq=24, tkv=40, hq=2, hkv=2, dqk=16, causal=False, window=(5, 3), segments="pair")]
    for case in cases:
        args = _inputs(case)
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True)):
            got = jax.device_get(_run(case, "pallas_mosaic_tpu", *args))
        assert not tpu_interpreter.races.races_found
        ref = jax.device_get(_run(case, "reference", *args))
        fwd_tol, grad_tol = _tolerances(case)
        np.testing.assert_allclose(got[0], ref[0], **fwd_tol)
        for g, r in zip(got[2], ref[2]):
            np.testing.assert_allclose(g, r, **grad_tol)


# ---------------------------------------------------------------- exhaustive grid (slow)

GQA = {"gqa1": (4, 4), "gqa2": (4, 2), "gqa4": (8, 2), "mqa": (4, 1)}
HEAD_DIMS = {"d64": (64, None), "d128": (128, None), "d96": (96, None), "mla192-128": (192, 128)}
MASKS = {
    "causal-window-left": dict(causal=True, window=(7, None)),
    "window-both": dict(causal=False, window=(4, 9)),
    "window-right-only": dict(causal=False, window=(None, 2)),
    "causal-shared-segments": dict(causal=True, segments="shared"),
    "full-pair-segments": dict(causal=False, segments="pair", tkv=56),
    "causal-window-pair-segments": dict(causal=True, window=(9, 0), segments="pair", tkv=33),
    "tq-gt-tkv-causal": dict(tq=56, tkv=24),
    "tq-gt-tkv-window-empty-rows": dict(tq=56, tkv=24, window=(8, None)),  # late rows see no key
    "one-block": dict(tq=9, tkv=9),
    "single-query": dict(tq=1, tkv=37, causal=False),
    "softcap-causal-bf16": dict(softcap=3.0, dtype="bfloat16"),
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", PALLAS)
@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_dtype_causal_gqa(impl, gqa, causal, dtype):
    hq, hkv = GQA[gqa]
    check(Case(b=1, tq=40, tkv=40, hq=hq, hkv=hkv, dtype=dtype, causal=causal), impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", PALLAS)
@pytest.mark.parametrize("dims", list(HEAD_DIMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_head_dims(impl, dims, dtype):
    dqk, dv = HEAD_DIMS[dims]
    check(Case(b=1, tq=24, tkv=24, hq=2, hkv=1, dqk=dqk, dv=dv, dtype=dtype), impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", [*PALLAS, "xla"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_grid_masks(impl, mask):
    check(Case(b=2, hq=4, hkv=2, **MASKS[mask]), impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", PALLAS)
@pytest.mark.parametrize("mask", list(MASKS))
def test_grid_masks_with_sinks(impl, mask):
    """Every mask of the grid with attention sinks (the default run keeps one such case per kernel)."""
    check(Case(b=2, hq=4, hkv=2, sinks=True, **MASKS[mask]), impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", PALLAS)
@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_grid_gqa_with_sinks(impl, gqa, causal):
    hq, hkv = GQA[gqa]
    check(Case(b=1, tq=40, tkv=40, hq=hq, hkv=hkv, causal=causal, sinks=True), impl)


# ---------------------------------------------------------------- the model on every implementation


def _tiny_model_losses(with_grads: bool):
    from jaxinfra.step import loss_fn
    from models import ModelConfig, Transformer

    base = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       mlp_dim=64, dtype="float32", param_dtype="float32", attention_impl="xla")
    b, t = 2, 24
    rng = np.random.default_rng(1)
    batch = {
        "inputs": rng.integers(0, 64, (b, t)), "targets": rng.integers(0, 64, (b, t)),
        "segment_ids": np.array([[1] * 9 + [2] * 11 + [0] * 4, [1] * t]),
        "positions": np.array([list(range(9)) + list(range(11)) + [0] * 4, list(range(t))]),
    }
    batch = {k: jnp.asarray(x, jnp.int32) for k, x in batch.items()}
    results = {}
    for impl in ("xla", *PALLAS):
        cfg = dataclasses.replace(base, attention_impl=impl)
        graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)  # same seed: same params
        fn = loss_fn(graphdef, cfg)
        fn = jax.value_and_grad(fn) if with_grads else fn
        results[impl] = jax.device_get(jax.jit(fn)(params, batch))
    return results


def test_tiny_model_loss_equal_across_impls():
    """A 2-layer model on a packed GQA batch gives xla's loss to 1e-5 with either Pallas kernel."""
    losses = _tiny_model_losses(with_grads=False)
    for impl in PALLAS:
        assert abs(float(losses[impl]) - float(losses["xla"])) <= 1e-5, (impl, losses)


@pytest.mark.slow
def test_tiny_model_grads_equal_across_impls():
    results = _tiny_model_losses(with_grads=True)
    loss_xla, grads_xla = results["xla"]
    for impl in PALLAS:
        loss, grads = results[impl]
        assert abs(float(loss) - float(loss_xla)) <= 1e-5, (impl, loss, loss_xla)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_xla)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- validation and dispatch


def _z(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        ((_z(2, 8, 4, 16), _z(2, 8, 3, 16), _z(2, 8, 3, 16)), {}, r"q heads 4 .*k/v heads 3"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 1, 16)), {}, r"k and v"),
        ((_z(8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), {}, r"\bq\b must be \[batch"),
        ((_z(2, 8, 4, 16), _z(2, 8, 32), _z(2, 8, 2, 16)), {}, r"\bk\b must be \[batch"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(1, 2, 8, 2, 16)), {}, r"\bv\b must be \[batch"),
        ((_z(2, 8, 4, 16), _z(3, 8, 2, 16), _z(3, 8, 2, 16)), {}, r"batch differs"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 8), _z(2, 8, 2, 8)), {}, r"q and k head_dim"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16, dtype=jnp.bfloat16), _z(2, 8, 2, 16)), {}, r"dtype"),
        ((_z(2, 8, 4, 16, dtype=jnp.int32),) * 3, {}, r"\bq\b dtype must be floating"),
        ((_z(2, 8, 4, 16), _z(2, 6, 2, 16), _z(2, 6, 2, 16)), dict(segment_ids=_z(2, 8, dtype=jnp.int32)),
         r"segment_ids.*length_q == length_kv"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(segment_ids=_z(2, 9, dtype=jnp.int32)),
         r"segment_ids \(q\)"),
        ((_z(2, 8, 4, 16), _z(2, 6, 2, 16), _z(2, 6, 2, 16)),
         dict(segment_ids=(_z(2, 8, dtype=jnp.int32), _z(2, 8, dtype=jnp.int32))), r"segment_ids \(kv\)"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(segment_ids=_z(2, 8)), r"segment_ids.*integer"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(window=(3, -1)), r"window"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(window=5), r"window"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(softcap=0.0), r"softcap"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(scale=float("nan")), r"scale"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(impl="flash9000"), r"impl"),
        ((_z(2, 8, 4, 16), _z(2, 8, 2, 16), _z(2, 8, 2, 16)), dict(impl="cudnn"), r"cudnn.*GPU"),
    ],
    ids=["heads", "kv-heads", "rank-q", "rank-k", "rank-v", "batch", "head-dim", "dtype-mismatch", "int-dtype",
         "one-segment-array-lengths", "segment-shape-q", "segment-shape-kv", "segment-dtype", "window-negative",
         "window-int", "softcap", "scale", "impl", "cudnn-on-cpu"],
)
@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_mosaic_tpu", "pallas_mosaic_gpu", "xla"])
def test_bad_arguments_raise_before_any_kernel(args, kwargs, pattern, impl, monkeypatch):
    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(attention_module, "flash_attention", no_kernel)
    kwargs = {"impl": impl, **kwargs}
    with pytest.raises(ValueError, match=pattern) as info:
        kernels.attention(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_auto_dispatch_and_one_time_fallback_log(monkeypatch, caplog):
    q, v = _z(1, 8, 2, 64), _z(1, 8, 2, 64)
    assert kernels.resolve_impl("auto", q, v) == "xla"  # CPU
    monkeypatch.setattr(attention_module, "_platform", lambda: "gpu")
    monkeypatch.setattr(attention_module, "_logged", set())
    assert kernels.resolve_impl("auto", q, v) == "pallas_triton"
    monkeypatch.setattr(attention_module, "_platform", lambda: "tpu")
    assert kernels.resolve_impl("auto", q, v) == "pallas_mosaic_tpu"
    big_q, big_v = _z(1, 8, 2, 512), _z(1, 8, 2, 512)
    with caplog.at_level(logging.WARNING, logger="kernels.attention"):
        assert kernels.resolve_impl("auto", big_q, big_v) == "xla"
        assert kernels.resolve_impl("auto", big_q, big_v) == "xla"
    fallbacks = [r for r in caplog.records if "using xla" in r.getMessage()]
    assert len(fallbacks) == 1 and "head dim 512" in fallbacks[0].getMessage()


def test_pallas_impl_on_the_wrong_accelerator_raises(monkeypatch):
    monkeypatch.setattr(attention_module, "_platform", lambda: "tpu")
    q = _z(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"pallas_triton.*gpu"):
        kernels.attention(q, q, q, impl="pallas_triton")


def test_block_size_table():
    bs = block_table.lookup("NVIDIA H100 80GB HBM3", "bfloat16", 128, 128, "causal")
    assert bs.num_warps == 8 and bs.block_q == 128
    assert bs.warps_stages("fwd", 128) == (8, 3) and bs.warps_stages("dkv", 128) == (8, 2)
    assert BlockSizes().warps_stages("dq", 64) == (4, 2)  # unset: 4 warps up to D64, 2 stages
    assert BlockSizes(num_warps=8, num_stages_dq=4).warps_stages("dq", 64) == (8, 4)
    assert block_table.lookup("NVIDIA H100", "float32", 128, 128, "causal").block_q == 64  # dtype row wins
    assert block_table.lookup("TPU v5 lite", "bfloat16", 128, 128, "causal").block_kv == 512
    assert block_table.lookup("TPU v4", "bfloat16", 64, 64, "full") == block_table.TABLE[("TPU", "*", "*", "*")]
    assert block_table.lookup("some new chip", "float32", 64, 64, "full") == block_table.DEFAULT
    assert BlockSizes(128, 128, 128, 128, 128, 128).clamped(20, 300).block_q == 32
    with pytest.raises(ValueError, match="block_kv"):
        BlockSizes(block_kv=48)


# ---------------------------------------------------------------- the shared block logic, brute force


def _random_bands(seed: int, n: int = 300):
    """(band, bq, bk, tq_p, tkv_p, visibility over the padded lengths) for random bands, lengths
    and blocks (lengths padded to 64, the largest block)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        tq, tkv = (int(x) for x in rng.integers(1, 90, 2))
        bq, bk = (int(x) for x in rng.choice([16, 32, 64], 2))
        left = None if rng.random() < 0.4 else int(rng.integers(0, 40))
        right = None if rng.random() < 0.4 else int(rng.integers(0, 40))
        band = masks.make_band(bool(rng.random() < 0.5), (left, right), tq, tkv)
        tq_p, tkv_p = -(-tq // 64) * 64, -(-tkv // 64) * 64
        yield band, bq, bk, tq_p, tkv_p, _dense_visibility(band, tq_p, tkv_p)


def _dense_visibility(band: masks.Band, tq_p: int, tkv_p: int) -> np.ndarray:
    i = np.arange(tq_p)[:, None]
    j = np.arange(tkv_p)[None, :]
    vis = j < band.kv_len
    if band.left is not None:
        vis = vis & (j >= i - band.left)
    if band.right is not None:
        vis = vis & (j <= i + band.right)
    return vis


def test_block_ranges_are_sound_and_full_blocks_are_full():
    """For random bands, lengths and blocks: every visible (query, key) pair lies in a visited
    block, and blocks visited without an element mask are entirely visible."""
    for band, bq, bk, tq_p, tkv_p, vis in _random_bands(seed=0):
        tq = band.q_len
        for qi in range(tq_p // bq):
            lo, flo, fhi, hi = masks.kv_block_range(qi, bq, bk, band)
            assert 0 <= lo <= flo <= fhi <= hi <= tkv_p // bk
            rows = vis[qi * bq:(qi + 1) * bq]
            for j in range(tkv_p // bk):
                tile = rows[:, j * bk:(j + 1) * bk]
                if not lo <= j < hi:
                    assert not tile.any(), (band, bq, bk, qi, j)
                if flo <= j < fhi:
                    assert tile.all(), (band, bq, bk, qi, j)
        valid_rows = np.arange(tq_p)[:, None] < tq  # the dk/dv walk leaves appended rows out
        for kj in range(tkv_p // bk):
            lo, flo, fhi, hi = masks.q_block_range(kj, bq, bk, band)
            assert 0 <= lo <= flo <= fhi <= hi <= tq_p // bq
            cols = (vis & valid_rows)[:, kj * bk:(kj + 1) * bk]
            for i in range(tq_p // bq):
                if not lo <= i < hi:
                    assert not cols[i * bq:(i + 1) * bq].any(), (band, bq, bk, kj, i)
                if flo <= i < fhi:
                    assert vis[i * bq:(i + 1) * bq, kj * bk:(kj + 1) * bk].all(), (band, bq, bk, kj, i)


def test_every_fully_visible_block_is_in_the_unmasked_range():
    """The converse of the test above: a block whose tile is entirely visible (and holds no
    appended key) is never visited with an element mask, so the unmasked fast path covers
    every block strictly inside the band."""
    for band, bq, bk, tq_p, tkv_p, vis in _random_bands(seed=2):
        tq, tkv = band.q_len, band.kv_len
        tile = lambda i, j: vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]  # noqa: E731
        for qi in range(tq_p // bq):
            _, flo, fhi, _ = masks.kv_block_range(qi, bq, bk, band)
            full = [j for j in range(tkv_p // bk) if (j + 1) * bk <= tkv and tile(qi, j).all()]
            assert full == list(range(flo, fhi)), (band, bq, bk, qi)
        for kj in range(tkv_p // bk):
            _, flo, fhi, _ = masks.q_block_range(kj, bq, bk, band)
            full = [i for i in range(-(-tq // bq)) if (kj + 1) * bk <= tkv and tile(i, kj).all()]
            assert full == list(range(flo, fhi)), (band, bq, bk, kj)


def test_triton_kernels_mask_only_the_blocks_on_the_band_edge(monkeypatch):
    """Counted at run time (interpret mode): causal T=64 in 16-blocks visits 10 blocks per
    kernel (forward, dq, dk/dv) and applies the element mask on the 4 diagonal blocks only."""
    from kernels import flash_triton

    counts = {"visits": 0, "masked": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            jax.debug.callback(lambda: counts.__setitem__(name, counts[name] + 1))
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(flash_triton, "_scores", counting("visits", flash_triton._scores))
    monkeypatch.setattr(flash_triton, "_mask", counting("masked", flash_triton._mask))
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 1, 16)), jnp.float32)

    def loss(q):
        return jnp.sum(kernels.attention(q, q, q, causal=True, impl="pallas_triton", block_sizes=SMALL))

    jax.block_until_ready(jax.jit(jax.grad(loss))(q))
    assert counts == {"visits": 3 * 10, "masked": 3 * 4}


def test_float32_inputs_use_ieee_dots_in_the_triton_kernel():
    """Triton's default for float32 dots is TF32 (~1e-3 relative error, measured on an H200):
    float32 operands must ask for HIGHEST (IEEE), 16-bit ones keep the default."""
    from kernels import flash_triton

    def precision(dtype):
        x = jnp.zeros((16, 16), dtype)
        eqn = jax.make_jaxpr(lambda a, b: flash_triton._dot(a, b, flash_triton._NT))(x, x).eqns[0]
        return eqn.params["precision"]

    assert precision(jnp.float32) == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert precision(jnp.bfloat16) is None


def test_block_ranges_traced_equal_static():
    band = masks.make_band(True, (21, None), 70, 50)
    for qi in range(5):
        static = masks.kv_block_range(qi, 16, 32, band)
        traced = jax.jit(lambda i: masks.kv_block_range(i, 16, 32, band))(jnp.int32(qi))
        assert tuple(int(x) for x in traced) == static
    for kj in range(4):
        static = masks.q_block_range(kj, 16, 16, band)
        traced = jax.jit(lambda j: masks.q_block_range(j, 16, 16, band))(jnp.int32(kj))
        assert tuple(int(x) for x in traced) == static


def test_segment_block_kind_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(500):
        qs, ks = rng.integers(0, 4, rng.integers(1, 6)), rng.integers(0, 4, rng.integers(1, 6))
        kind = int(masks.segment_block_kind(qs.min(), qs.max(), ks.min(), ks.max()))
        equal = qs[:, None] == ks[None, :]
        if kind == masks.SKIP:
            assert not equal.any()  # skipping is safe
        assert (kind == masks.FULL) == equal.all()  # unmasked exactly when every pair matches


# ---------------------------------------------------------------- the real compilers' lowering


def _lower(backend: str, device_kind: str, *, t=256, hq=4, hkv=2, dqk=128, dv=128, dtype=jnp.bfloat16,
           causal=True, window=None, softcap=None, segments=False, blocks=None) -> str:
    """Forward + backward of one backend ("triton", "tpu", "mosaic_gpu") lowered for its real
    compiler (CUDA or TPU) on this CPU machine; `blocks` overrides the device's table row."""
    from kernels import flash_mosaic_gpu
    from kernels.flash import FlashParams, flash_attention
    from kernels.flash_tpu import tpu_blocks

    band = masks.make_band(causal, window, t, t)
    table = block_table.MOSAIC_GPU_TABLE if backend == "mosaic_gpu" else block_table.TABLE
    if blocks is None:
        blocks = block_table.lookup(device_kind, jnp.dtype(dtype).name, dqk, dv, band.kind, table=table)
    blocks = flash_mosaic_gpu.clamped(blocks, band) if backend == "mosaic_gpu" else blocks.clamped(t, t)
    if backend == "tpu":
        blocks = tpu_blocks(blocks, band, interpret=False)
    params = FlashParams(backend, band, dqk ** -0.5, softcap, blocks, interpret=False)
    q = jax.ShapeDtypeStruct((2, t, hq, dqk), dtype)
    k = jax.ShapeDtypeStruct((2, t, hkv, dqk), dtype)
    v = jax.ShapeDtypeStruct((2, t, hkv, dv), dtype)
    seg = jax.ShapeDtypeStruct((2, t), jnp.int32) if segments else None

    def fwd_bwd(q, k, v, seg):
        def loss(q, k, v):
            out, lse = flash_attention(params, q, k, v, seg, seg)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    platform = {"triton": "cuda", "tpu": "tpu", "mosaic_gpu": "cuda"}[backend]
    return jax.jit(fwd_bwd).trace(q, k, v, seg).lower(lowering_platforms=(platform,)).as_text()


LOWERING = {
    "causal-d128": {},
    "gqa4-d64-full": dict(hq=8, hkv=2, dqk=64, dv=64, causal=False),
    "mla-mqa-segments-window-softcap": dict(dqk=192, dv=128, hkv=1, segments=True, window=(64, 0), softcap=30.0),
    "d96-f32-len200": dict(dqk=96, dv=96, dtype=jnp.float32, t=200),
}


@pytest.mark.parametrize("name", list(LOWERING))
def test_lowers_to_triton_for_gpu(name):
    text = _lower("triton", "NVIDIA H100 80GB HBM3", **LOWERING[name])
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv


@pytest.mark.parametrize("name", list(LOWERING))
def test_lowers_to_mosaic_for_tpu(name):
    text = _lower("tpu", "TPU v5 lite", **LOWERING[name])
    assert text.count("custom_call @tpu_custom_call") == 3


# The Hopper kernel (kernels/flash_mosaic_gpu.py): Mosaic GPU's lowering checks layouts, wgmma
# operand shapes and the 227 KB shared-memory limit on CPU too.
MOSAIC_GPU_LOWERING = {
    "causal-d128-gqa2": {},
    "len200-window-both-d64-gqa4-f16": dict(t=200, hq=8, hkv=2, dqk=64, dv=64, causal=False, window=(40, 17),
                                            dtype=jnp.float16),
    "mla192-128-mqa-segments-window-softcap": dict(dqk=192, dv=128, hkv=1, segments=True, window=(64, 0),
                                                  softcap=30.0),
}


@pytest.mark.parametrize("name", list(MOSAIC_GPU_LOWERING))
def test_lowers_to_mosaic_gpu_for_cuda(name):
    text = _lower("mosaic_gpu", "NVIDIA H100 80GB HBM3", **MOSAIC_GPU_LOWERING[name])
    assert text.count("custom_call @mosaic_gpu") == 3  # forward, dq, dk/dv


def test_mosaic_gpu_head_dim_256_is_refused_because_it_does_not_fit_shared_memory():
    """The stated limit is real: at 256 the backward's tiles exceed Hopper's 227 KB."""
    from kernels import flash_mosaic_gpu

    assert "up to 192" in flash_mosaic_gpu.unsupported(jnp.bfloat16, 256, 256, "gpu", "9.0")
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        _lower("mosaic_gpu", "NVIDIA H100", dqk=256, dv=256, blocks=BlockSizes(64, 64, 64, 64, 64, 64, num_stages=2))
