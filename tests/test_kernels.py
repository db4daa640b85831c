"""Tests for kernels.attention: against the float32 HIGHEST-precision jnp reference, the
GQA head grouping checked from first principles, and shape validation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels.attention import reference_attention

B, T, H, D = 2, 16, 4, 8
RTOL, ATOL = 1e-5, 1e-6


def _qkv(kv_heads, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D), np.float32)
    k = rng.standard_normal((B, T, kv_heads, D), np.float32)
    v = rng.standard_normal((B, T, kv_heads, D), np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _segments():
    # Row 0: three packed documents then padding; row 1: one document filling the row.
    row0 = [1] * 5 + [2] * 6 + [3] * 3 + [0] * 2
    row1 = [1] * T
    return jnp.asarray([row0, row1], jnp.int32)


@jax.jit
def _kernel_and_reference(q, k, v, seg):
    """Kernel and reference outputs for every (causal, segmented) combination: one compile per shape."""
    out = {}
    for causal in (True, False):
        for name, s in (("noseg", None), ("seg", seg)):
            out[f"{causal}-{name}"] = (kernels.attention(q, k, v, causal=causal, segment_ids=s, impl="xla"),
                                 reference_attention(q, k, v, causal=causal, segment_ids=s))
    out["scale"] = (kernels.attention(q, k, v, causal=True, scale=0.1, impl="auto"),
                    reference_attention(q, k, v, causal=True, scale=0.1))
    return out


@functools.cache
def _outputs(kv_heads):
    q, k, v = _qkv(kv_heads)
    return jax.device_get(_kernel_and_reference(q, k, v, _segments()))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("segmented", ["noseg", "seg"])
def test_attention_matches_reference(kv_heads, causal, segmented):
    out, ref = _outputs(kv_heads)[f"{causal}-{segmented}"]
    assert out.shape == (B, T, H, D)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_attention_gradients_match_reference(kv_heads):
    q, k, v = _qkv(kv_heads, seed=1)
    seg = _segments()
    w = jnp.asarray(np.random.default_rng(7).standard_normal((B, T, H, D), np.float32))

    def objective(fn):
        return lambda q, k, v: jnp.sum(w * fn(q, k, v, causal=True, segment_ids=seg))

    grads = jax.jit(lambda q, k, v: (
        jax.grad(objective(lambda *a, **kw: kernels.attention(*a, impl="xla", **kw)), argnums=(0, 1, 2))(q, k, v),
        jax.grad(objective(reference_attention), argnums=(0, 1, 2))(q, k, v)))
    got, ref = grads(q, k, v)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_attention_explicit_scale():
    out, ref = _outputs(2)["scale"]
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    default, _ = _outputs(2)["True-noseg"]
    assert not np.allclose(out, default)  # the scale really was used


_attention = jax.jit(lambda q, k, v, seg: kernels.attention(q, k, v, causal=True, segment_ids=seg, impl="xla"))


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gqa_groups_consecutive_query_heads(kv_heads):
    """q head h must read kv head h // (H / KV), independently of the jnp reference.

    Every key is identical (uniform attention), and each kv head's values are a
    constant equal to its index + 1, so each output head reveals which kv head it read.
    """
    q = _qkv(kv_heads)[0]
    k = jnp.ones((B, T, kv_heads, D), jnp.float32)
    v = jnp.broadcast_to((jnp.arange(kv_heads, dtype=jnp.float32) + 1)[None, None, :, None], (B, T, kv_heads, D))
    out = _attention(q, k, v, None)
    group = H // kv_heads
    expected = np.array([h // group + 1 for h in range(H)], np.float32)
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(expected[None, None, :, None], out.shape),
                               rtol=1e-6)


def test_causal_first_token_sees_only_itself():
    _, _, v = _qkv(4)
    out, _ = _outputs(4)["True-noseg"]
    np.testing.assert_allclose(out[:, 0], np.asarray(v[:, 0]), rtol=1e-6, atol=1e-7)


def test_segments_isolate_documents():
    """Changing one packed document's keys/values must not change another document's output."""
    q, k, v = _qkv(2)
    seg = _segments()
    out = _attention(q, k, v, seg)
    # Perturb document 2 of row 0 (positions 5..10) in k and v.
    k2 = k.at[0, 5:11].add(3.0)
    v2 = v.at[0, 5:11].add(3.0)
    out2 = _attention(q, k2, v2, seg)
    np.testing.assert_array_equal(np.asarray(out[0, :5]), np.asarray(out2[0, :5]))
    np.testing.assert_array_equal(np.asarray(out[0, 11:]), np.asarray(out2[0, 11:]))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(out2[1]))
    assert not np.allclose(np.asarray(out[0, 5:11]), np.asarray(out2[0, 5:11]))


# ---------------------------------------------------------------- bad shapes


def _bad(q_shape, k_shape, v_shape, seg_shape=None):
    z = lambda s: jnp.zeros(s, jnp.float32)  # noqa: E731
    seg = None if seg_shape is None else jnp.zeros(seg_shape, jnp.int32)
    return z(q_shape), z(k_shape), z(v_shape), seg


@pytest.mark.parametrize(
    "shapes, pattern",
    [
        (((B, T, H, D), (B + 1, T, 2, D), (B + 1, T, 2, D)), r"batch"),
        (((B, T, H * D), (B, T, 2, D), (B, T, 2, D)), r"\bq\b.*\[batch, length, heads, head_dim\]"),
        (((B, T, H, D), (B, T, 2 * D), (B, T, 2, D)), r"\bk\b.*\[batch, length, heads, head_dim\]"),
        (((B, T, H, D), (B, T, 2, D), (T, 2, D)), r"\bv\b.*\[batch, length, heads, head_dim\]"),
        (((B, T, H, D), (B, T, 3, D), (B, T, 3, D)), r"heads"),
        (((B, T, H, D), (B, T, 2, D), (B, T, 1, D)), r"k and v"),
        (((B, T, H, D), (B, T, 2, D + 2), (B, T, 2, D + 2)), r"head_dim"),
        (((B, T, H, D), (B, T, 2, D), (B, T, 2, D), (B, T + 1)), r"segment_ids"),
    ],
    ids=["batch", "rank-q", "rank-k", "rank-v", "heads-multiple", "k-v-mismatch", "head-dim", "segment-ids"],
)
def test_bad_shapes_raise_value_error(shapes, pattern):
    q, k, v, seg = _bad(*shapes)
    with pytest.raises(ValueError, match=pattern) as info:
        kernels.attention(q, k, v, causal=True, segment_ids=seg, impl="xla")
    assert "\n" not in str(info.value)


def test_heads_not_multiple_names_both_counts():
    q, k, v, _ = _bad((B, T, H, D), (B, T, 3, D), (B, T, 3, D))
    with pytest.raises(ValueError, match=r"q heads 4 .* k/v heads 3"):
        kernels.attention(q, k, v, impl="xla")


def test_unknown_impl_raises():
    q, k, v = _qkv(2)
    with pytest.raises(ValueError, match=r"impl"):
        kernels.attention(q, k, v, impl="flash9000")


def test_log_once_warns_once_per_message_on_the_callers_logger(caplog):
    import logging

    from kernels.logs import log_once

    logger, seen = logging.getLogger("kernels.test_log_once"), set()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for message in ("fallback a", "fallback b", "fallback a", "fallback b"):
            log_once(logger, seen, message)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (logger.name, logging.WARNING, "fallback a"), (logger.name, logging.WARNING, "fallback b")]
    assert seen == {"fallback a", "fallback b"}


# ---------------------------------------------------------------- the device script, dry run


def _device_check():
    import importlib.util
    import sys
    from pathlib import Path

    if "device_check" not in sys.modules:  # scripts/ is not a package
        path = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"
        spec = importlib.util.spec_from_file_location("device_check", path)
        sys.modules["device_check"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["device_check"])
    return sys.modules["device_check"]


def test_device_check_dry_run(tmp_path, capsys):
    """scripts/device_check.py on CPU: one numerics case (xla runs it, twice; cuDNN and Mosaic GPU
    say why not; the Triton kernel takes the same path and is left out to save its interpreted
    compiles), the timing table, the JSON rows under --out, and a spent budget skipping rows."""
    import json

    from benchmarks import attention as bench

    check = _device_check()
    impls = "xla,pallas_mosaic_gpu,cudnn"
    assert check.main(["--dry-run", "--cases", "packed causal GQA2", "--impls", impls, "--shapes", "h16d128",
                       "--causal", "yes", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    numerics = json.loads((tmp_path / "attention_numerics.json").read_text())["numerics"]
    verdicts = {r["impl"]: (r.get("ok"), r["note"]) for r in numerics}
    assert verdicts["xla"][0]
    assert verdicts["cudnn"][1] == "n/a (no GPU)" and verdicts["pallas_mosaic_gpu"][1].startswith("n/a (dry run")
    timing = json.loads((tmp_path / "attention_timing.json").read_text())["timing"]
    assert [r["impl"] for r in timing] == impls.split(",")
    assert timing[0]["fwd_ms"] > 0 and "numerics passed" in text
    assert check.main(["--dry-run", "--skip-numerics", "--budget-s", "0", "--shapes", "h32d64,mla192-128"]) == 0
    assert capsys.readouterr().out.count("skipped (time budget)") == 2 * 2 * 2  # shapes x masks x (triton, xla)
    bench.main(["--sweep", "--dry-run", "--budget-s", "0", "--shapes", "h16d128", "--causal", "yes"])
    assert "no candidate ran" in capsys.readouterr().out
