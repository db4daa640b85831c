"""models/quant.py against independent references: numpy rounding and ml_dtypes casts."""

import ml_dtypes
import numpy as np
import pytest

from models import quant


def _weights(shape=(64, 48), seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 3.0, size=(1, shape[1])).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero channel keeps scale 1 and values 0
    return w


def test_int8_per_channel_error_bound_and_reference():
    w = _weights()
    q, scale = quant.quantize_int8(w, axis=0)
    assert q.dtype == np.int8 and scale.shape == (1, w.shape[1])
    ref_scale = np.where(np.abs(w).max(0, keepdims=True) > 0, np.abs(w).max(0, keepdims=True) / 127.0, 1.0)
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(w / ref_scale), -127, 127).astype(np.int8))
    err = np.abs(np.asarray(quant.dequantize(q, scale)) - w)
    assert np.all(err <= np.asarray(scale) / 2 * (1 + 1e-6))
    assert np.all(np.asarray(q)[:, 3] == 0) and float(scale[0, 3]) == 1.0


def test_int8_grouped_round_trip_and_bad_group():
    w = _weights((64, 8))
    q, scale = quant.quantize_int8_grouped(w, group_size=16, axis=0)
    assert q.shape == w.shape and scale.shape == (4, 8)
    back = np.asarray(quant.dequantize_grouped(q, scale, axis=0))
    per_elem_scale = np.repeat(np.asarray(scale), 16, axis=0)
    assert np.all(np.abs(back - w) <= per_elem_scale / 2 * (1 + 1e-6))
    with pytest.raises(ValueError, match="group size 24 does not divide the input dimension 64"):
        quant.quantize_int8_grouped(w, group_size=24)


@pytest.mark.parametrize("fmt,np_dtype", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)])
def test_fp8_matches_ml_dtypes_round_to_nearest_and_saturates(fmt, np_dtype):
    x = _weights((32, 16), seed=1) * 50
    scale = quant.fp8_scale(quant.absmax(x, (0, 1)), fmt)
    got = np.asarray(quant.quantize_fp8(x, scale, fmt)).astype(np.float32)
    ref = np.clip(x / np.asarray(scale), -quant.FP8_MAX[fmt], quant.FP8_MAX[fmt]).astype(np_dtype).astype(np.float32)
    np.testing.assert_array_equal(got, ref)
    over = np.asarray(quant.quantize_fp8(np.float32([1e9, -1e9]), np.float32(1.0), fmt)).astype(np.float32)
    np.testing.assert_array_equal(over, [quant.FP8_MAX[fmt], -quant.FP8_MAX[fmt]])
