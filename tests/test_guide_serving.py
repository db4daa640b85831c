"""Page 20 (serving): its formulas against the stack and against a simulation.

The concurrency formula rows = floor((memory - weights) / cache bytes per row) against the cache
bytes of models/cache.py, `jaxinfra info --inference` and `jaxinfra plan --inference`; the batch at
which the plan's decode step turns compute-bound; speculative decoding's expected tokens per target
pass against a Monte-Carlo draw. Abstract shapes only: nothing is compiled.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import re

import pytest

from jaxinfra.config import load_config
from jaxinfra.info import inference_lines
from jaxinfra.metrics import param_counts
from jaxinfra.plan.devices import DEVICES
from models import cache

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "guide" / "20-serving.md"


def _load_script(path: pathlib.Path):
    """scripts/ is not an installed package: load the page's script from its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sc = _load_script(REPO / "scripts" / "guide" / "serving_capacity.py")
BF16 = ["model.param_dtype=bfloat16"]


def info_row_bytes(cfg, seq_len: int) -> int:
    """The bytes `jaxinfra info --inference --max-len seq_len` prints for one row."""
    line = inference_lines(cfg, seq_len)[0]
    return int(re.search(r"positions: ([\d,]+) bytes", line).group(1).replace(",", ""))


@pytest.mark.parametrize("spec", ["llama3-8b", "llama3-8b:quant.kv_cache=int8", "gemma3-27b", "deepseek-v3"])
def test_rows_per_device_from_the_cache_bytes(spec):
    assert "floor((device memory - weight bytes) / cache bytes of one row)" in PAGE.read_text()
    preset, _, rest = spec.partition(":")
    overrides = [*BF16, *(o for o in rest.split(",") if o)]
    cfg = load_config(preset, [*overrides, "mesh.data=1"])
    seq_len = 8192
    per_row = sc.row_bytes(cfg, seq_len)
    assert per_row == info_row_bytes(cfg, seq_len)
    quantized = cfg.quant.kv_cache == "int8"
    if not cache.has_sliding(cfg.model):  # a global cache holds every position: bytes/token x T
        assert per_row == cache.bytes_per_token(cfg.model, quantized) * seq_len
    else:  # sliding layers keep their window only
        assert per_row < cache.bytes_per_token(cfg.model, quantized) * seq_len
    spec_h200 = DEVICES["h200"]
    plan = sc.decode_plan(preset, overrides, spec_h200, 1, seq_len)
    weights = sc.weight_bytes(plan)
    # bfloat16 weights on one device (MoE router biases stay float32: a few KiB)
    assert weights == pytest.approx(2 * param_counts(cfg.model)["total"], rel=1e-6)
    rows = sc.max_rows(spec_h200.memory_bytes, weights, per_row)
    if weights > spec_h200.memory_bytes:
        assert rows == 0
        return
    assert rows * per_row <= spec_h200.memory_bytes - weights < (rows + 1) * per_row
    # The plan's cache component for that many rows is the same bytes (models/cache.py through the plan).
    at_rows = sc.decode_plan(preset, overrides, spec_h200, rows, seq_len)
    assert next(c.bytes for c in at_rows.memory.components if c.name == "kv cache") == rows * per_row


def test_compute_bound_batch_is_where_the_plan_switches():
    spec, seq_len = DEVICES["h100"], 512
    cfg = load_config("llama3-8b", [*BF16, "mesh.data=1"])
    per_row = sc.row_bytes(cfg, seq_len)
    weights = sc.weight_bytes(sc.decode_plan("llama3-8b", BF16, spec, 1, seq_len))
    crossover = sc.compute_bound_from(weights, per_row, param_counts(cfg.model)["matmul"], spec, cfg.model.dtype)
    assert 1 < crossover < math.inf
    below = sc.decode_plan("llama3-8b", BF16, spec, math.floor(crossover), seq_len)
    above = sc.decode_plan("llama3-8b", BF16, spec, math.ceil(crossover) + 1, seq_len)
    assert below.time.bottleneck.startswith("memory")
    assert above.time.bottleneck == "compute"
    # At long context the cache read per row outgrows the compute per row: never compute-bound.
    long_row = sc.row_bytes(cfg, 8192)
    assert sc.compute_bound_from(weights, long_row, param_counts(cfg.model)["matmul"], spec, "bfloat16") == math.inf


@pytest.mark.parametrize(("a", "k"), [(0.6, 1), (0.8, 4), (0.9, 8), (0.5, 3)])
def test_speculative_expected_tokens_matches_a_simulation(a, k):
    assert "(1 - a^(k+1)) / (1 - a)" in PAGE.read_text()
    trials = 100_000
    simulated = sc.simulated_tokens(a, k, trials, seed=1)
    # tokens per pass lie in [1, k + 1]: the mean's standard error is at most k / (2 sqrt(trials))
    tolerance = 5 * k / (2 * math.sqrt(trials))
    assert abs(sc.expected_tokens(a, k) - simulated) < tolerance
    off_by_one = (1 - a**k) / (1 - a)  # the accepted prefix without the target's own token
    assert abs(off_by_one - simulated) > tolerance


def test_speculative_limits_and_speedup():
    assert sc.expected_tokens(1.0, 4) == 5
    assert sc.expected_tokens(0.0, 4) == 1  # every proposal rejected: the target's own token
    assert sc.expected_tokens(0.7, 0) == 1  # no draft: plain decoding
    assert sc.speedup(0.8, 4, 0.0) == pytest.approx(sc.expected_tokens(0.8, 4))
    assert sc.speedup(0.8, 4, 0.05) == pytest.approx(sc.expected_tokens(0.8, 4) / 1.2)
