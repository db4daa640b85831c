"""The guide's definitions and corrected statements (issue 33's fixes) checked against the code.

Page 2: FLOPs per token = 6 N + the attention term (12 L d T for plain attention), as
`flops_per_token` counts it, and MFU as metrics.jsonl and `jaxinfra plan` compute it. Page 4: each
pipeline stage idles S-1 slots per pass in total (s filling, S-1-s draining), in the code's
timetable. Page 13: the frontier's interval is the 95% t-interval of the fitted exponent.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from jaxinfra.config import load_config
from jaxinfra.metrics.flops import flops_per_token, param_counts
from jaxinfra.metrics.writers import mfu
from jaxinfra.plan.devices import device_spec
from jaxinfra.scaling.fit import fit_frontier
from scripts.guide.mfu import terms
from sharding.pipeline import forward_tables


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b"])
def test_flops_per_token_is_6n_plus_12_l_d_t(preset):
    model, seq = (cfg := load_config(preset, [])).model, cfg.train.seq_len
    t = terms(model, seq)
    assert t["N"] == param_counts(model)["matmul"]
    assert t["sum"] == pytest.approx(flops_per_token(model, seq), rel=1e-12)
    assert model.num_heads * model.resolved_head_dim == model.d_model  # plain attention: the PaLM form holds
    assert t["attention"] == pytest.approx(12 * model.num_layers * model.d_model * seq, rel=1e-12)


def test_mfu_is_model_flops_over_the_dense_peak():
    """The page's example: 67,651 tokens/s on 8 H100s for llama3-8b is MFU 0.495 (the plan's figure)."""
    cfg = load_config("llama3-8b", [])
    peak = device_spec("h100").peak(cfg.model.dtype)
    assert peak == 989e12  # the dense bf16 figure, not the sparsity one
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    assert mfu(67651 / 8, fpt, peak) == pytest.approx(67651 / 8 * fpt / 989e12)
    assert round(mfu(67651 / 8, fpt, peak), 3) == 0.495


@pytest.mark.parametrize("stages,micro", [(4, 8), (2, 3), (8, 4)])
def test_each_stage_idles_s_minus_1_slots_per_pass(stages, micro):
    valid = forward_tables(stages, micro, 1)["valid"]  # [ticks, stages]
    assert valid.shape[0] == micro + stages - 1
    for s in range(stages):
        busy = np.flatnonzero(valid[:, s])
        assert len(busy) == micro and np.all(np.diff(busy) == 1)  # one busy run of M slots
        assert busy[0] == s and valid.shape[0] - 1 - busy[-1] == stages - 1 - s  # s filling, S-1-s draining


def test_frontier_interval_is_the_t_interval_of_the_exponent():
    rng = np.random.default_rng(0)
    c = np.array([1e10, 3e10, 1e11, 3e11, 1e12])
    loss = 50 * c ** -0.1 * np.exp(rng.normal(0, 0.01, c.size))
    fit = fit_frontier(c, loss)
    x, y = np.log(c), np.log(loss)
    slope, intercept = np.polyfit(x, y, 1)
    r = y - (slope * x + intercept)
    se = math.sqrt(r @ r / (len(x) - 2) / np.sum((x - x.mean()) ** 2))
    half = stats.t.ppf(0.975, len(x) - 2) * se
    assert fit.gamma == pytest.approx(-slope)
    assert fit.gamma_ci == pytest.approx((-slope - half, -slope + half))
