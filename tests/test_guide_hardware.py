"""Page 16 (hardware and clusters): the checkpoint-interval formulas against a brute-force minimum of
the lost time, and the device table the page prints against jaxinfra/plan/devices.py."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import pathlib

import numpy as np
import pytest

from jaxinfra.metrics.peak import PEAK_FLOPS_PER_DEVICE
from jaxinfra.plan.devices import DEVICES, GiB
from jaxinfra.plan.links import LINKS
from jaxinfra.plan.reliability import (
    checkpoint_every,
    daly_interval,
    device_mtbf_s,
    exact_wall_factor,
    job_mtbf_s,
    lost_fraction,
    young_interval,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "guide" / "16-hardware-clusters.md"


def _argmin(f, lo: float, hi: float) -> float:
    """The minimiser of f on a log grid of [lo, hi], refined once around the best point."""
    grid = np.geomspace(lo, hi, 20001)
    best = grid[int(np.argmin([f(t) for t in grid]))]
    fine = np.linspace(best * 0.999, best * 1.001, 2001)
    return float(fine[int(np.argmin([f(t) for t in fine]))])


@pytest.mark.parametrize("c, m", [(0.05, 11_000.0), (10.0, 11_000.0), (60.0, 1_800.0), (600.0, 180_000.0)])
def test_young_is_the_minimum_of_the_first_order_lost_time(c: float, m: float) -> None:
    brute = _argmin(lambda t: lost_fraction(t, c, m, restart_s=300.0), c / 10, 10 * m)
    assert young_interval(c, m) == pytest.approx(brute, rel=2e-4)
    assert young_interval(c, m) == pytest.approx(math.sqrt(2 * c * m))


@pytest.mark.parametrize("c, m", [(10.0, 11_000.0), (60.0, 1_800.0), (300.0, 1_800.0)])
def test_daly_is_nearer_the_exact_optimum_than_young(c: float, m: float) -> None:
    exact = _argmin(lambda t: exact_wall_factor(t, c, m, restart_s=120.0), c / 10, 10 * m)
    assert daly_interval(c, m) == pytest.approx(exact, rel=2e-3)
    assert abs(daly_interval(c, m) - exact) < abs(young_interval(c, m) - exact)
    assert daly_interval(3 * m, m) == m  # C >= 2M: checkpointing costs more than it saves


def test_mtbf_from_reported_counts_and_scaling() -> None:
    dev = device_mtbf_s(419, 54, 16384)  # The Llama 3 Herd of Models: 419 unexpected in 54 days
    assert dev == pytest.approx(54 * 86400 * 16384 / 419)
    assert job_mtbf_s(dev, 16384) == pytest.approx(54 * 86400 / 419)
    assert job_mtbf_s(dev, 8) == pytest.approx(2048 * job_mtbf_s(dev, 16384))
    assert checkpoint_every(100.0, 1.41) == 71 and checkpoint_every(0.1, 1.0) == 1
    with pytest.raises(ValueError):
        job_mtbf_s(dev, 0)


def _device_table_output() -> str:
    spec = importlib.util.spec_from_file_location("device_table", REPO / "scripts" / "guide" / "device_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main()
    return out.getvalue().strip()


def test_device_table_prints_the_plans_numbers() -> None:
    lines = _device_table_output().splitlines()
    assert len(lines) == 1 + len(DEVICES)
    for line in lines[1:]:
        kind, *_ = line.split()
        spec = DEVICES[kind]
        nums = line.split()[-10:]  # memory, bf16, fp32, HBM, flop/byte, domain, link, GB/s, slow, efficiency
        peak = PEAK_FLOPS_PER_DEVICE[spec.name]
        assert float(nums[0]) == pytest.approx(spec.memory_bytes / GiB, abs=0.05)
        assert float(nums[1]) == pytest.approx(peak["bfloat16"] / 1e12, abs=0.5)
        assert float(nums[2]) == pytest.approx(peak["float32"] / 1e12, abs=0.05)
        assert float(nums[3]) == pytest.approx(spec.memory_bandwidth / 1e12, abs=5e-4)
        assert int(nums[5]) == spec.domain and nums[6] == spec.fast_link and nums[8] == spec.slow_link
        assert float(nums[7]) == pytest.approx(LINKS[spec.fast_link].bandwidth / 1e9, abs=0.5)


def test_the_page_shows_the_current_device_table() -> None:
    text = PAGE.read_text()
    command = "python scripts/guide/device_table.py"
    assert command in text, "the page runs the device table script"
    shown = text.split(command, 1)[1].split("```text\n", 1)[1].split("```", 1)[0].strip()
    assert shown == _device_table_output()
