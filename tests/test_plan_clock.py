"""The planner's clock: the step's work by kind against hand counts, the probe cache, the dtype's peak.

No timings are asserted (speed targets live in benchmarks/plan.py `time`); the probes are mocked
where the test is about the plumbing.
"""

from __future__ import annotations

import json

import pytest

from jaxinfra import cli
from jaxinfra.config import load_config
from jaxinfra.plan import probes
from jaxinfra.plan import time as plan_time
from jaxinfra.plan.activations import saved_per_layer
from jaxinfra.plan.devices import device_spec, with_rates
from jaxinfra.plan.estimate import make_plan
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.work import layer_dispatch, layer_elementwise, layer_softmax, loss_elements

# `small`'s shapes: 6 layers, d 512, 8 heads of 64, SwiGLU 2048, vocab 8192, seq 256, batch 8, float32.
SMALL = ["mesh.data=1", "data.source=synthetic"]


def small(extra: list[str] = (), devices: int = 1) -> Layout:
    return Layout.of(load_config("small", [*SMALL, *extra]), devices, "cpu")


def test_attention_batched_flops_follow_the_formula_and_the_kinds_add_up():
    for policy, passes in (("none", 3), ("full", 4), ("save_dots_no_batch", 4), ("save_dots", 3)):
        lay = small([f"model.remat_policy={policy}"])
        work = plan_time.step_work(lay)
        # scores and weighted values: 2 x heads x (qk + v) x keys FLOPs per token forward (XLA: all T keys)
        per_token = 2 * 8 * (64 + 64) * 256
        assert work["batched"][0] == pytest.approx(8 * 256 * 6 * per_token * passes)
        total = work["matmul"][0] + work["head"][0] + work["batched"][0]
        assert total == pytest.approx(plan_time.step_flops(lay).executed)
        assert work["head"][0] == pytest.approx(8 * 256 * 2 * 512 * 8192 * 3)  # the unembedding, x3


def test_elementwise_bytes_of_one_layer_match_a_hand_count():
    lay = small()
    # Two RMSNorms (read x, write y, float32), two residual adds (read 2, write 1), RoPE on q and k
    # (8 + 8 heads of 64, read + write), SwiGLU's silu(gate) x up (read 2 x 2048, write 2048).
    d = 512
    hand = 2 * 2 * d * 4 + 2 * 3 * d * 4 + 2 * (8 + 8) * 64 * 4 + 3 * 2048 * 4
    assert sum(layer_elementwise(lay, False).values()) == hand
    assert layer_softmax(lay) == 8 * 256  # heads x keys per query
    assert loss_elements(lay) == 8 * 256 * 8192
    # Tensor parallelism splits heads and the MLP, not the stream; the loss's vocabulary too.
    tp = small(["mesh.data=2", "mesh.tensor=4"], 8)
    assert sum(layer_elementwise(tp, False).values()) == 2 * 2 * d * 4 + 2 * 3 * d * 4 + 2 * 4 * 64 * 4 + 3 * 512 * 4
    assert loss_elements(tp) == 4 * 256 * 2048
    # Elementwise work runs again in the backward under any policy but none (x4 instead of x3).
    none, full = (plan_time.step_work(small([f"model.remat_policy={p}"]))["elementwise"][0]
                  for p in ("none", "full"))
    assert full / none == pytest.approx(4 / 3)


def test_capacity_routing_tensors_are_their_own_kind():
    lay = Layout.of(load_config("qwen3-moe-tiny", ["train.seq_len=256", "mesh.data=1"]), 1, "cpu")
    # 16 experts x capacity 1.5 x 256 x top-4 / 16 = 96 slots each: a [E x C] = 1,536 float32 row per
    # token, six passes forward (dispatch and combine written, each transposed: written and read).
    assert layer_dispatch(lay, True) == {"dispatch_masks": 6 * 16 * 96 * 4}
    assert layer_dispatch(lay, False) == {} and "dispatch_masks" not in layer_elementwise(lay, True)
    assert probes.probe_shapes(lay)["dispatch"] == (16 * 256, 16 * 96)


def test_a_flash_kernel_has_no_separate_softmax():
    lay = Layout.of(load_config("llama3-8b", ["model.attention_impl=auto"]), 8, "gpu",
                    target=device_spec("h100").kernel_target)
    assert lay.attention_impl != "xla" and layer_softmax(lay) == 0


def test_each_kind_is_priced_at_its_rate():
    lay = small()
    rates = {"matmul": 1e11, "head": 8e10, "batched": 5e10, "dispatch": 1e10, "elementwise": 2e10, "softmax": 1e9, "loss": 5e8}
    spec = with_rates(device_spec("cpu", 1, matmul_flops=2e11, bandwidth=1e10),
                      {f"{k}:float32": v for k, v in rates.items()})
    plan = make_plan(lay.cfg, 1, spec)
    work = plan_time.step_work(lay)
    by_kind = dict(plan.time.compute_by_kind)
    # The scan's stacked residuals (measured plans only): 4 passes over what each of the 6 layers keeps.
    assert by_kind.pop("residuals") == pytest.approx(4 * 6 * saved_per_layer(lay, False) / 1e10)
    assert by_kind == pytest.approx({k: work[k][0] / rates[k] for k in rates})
    assert plan.time.compute_s == pytest.approx(sum(plan.time.compute_by_kind.values()))
    assert "residuals" not in make_plan(lay.cfg, 1, device_spec("h100")).time.compute_by_kind  # datasheet path
    # --efficiency keeps the dots at peak x efficiency; the memory-bound kinds stay probed.
    stated = with_rates(device_spec("cpu", 1, matmul_flops=2e11, bandwidth=1e10, efficiency=0.5),
                        {f"{k}:float32": v for k, v in rates.items()}, efficiency=0.5)
    assert stated.rate("matmul", "float32") == 1e11 and stated.rate("softmax", "float32") == 1e9


def test_the_dtype_peak_prices_bfloat16_dots(cache_path):
    h100 = device_spec("h100")
    f32, bf16 = (make_plan(load_config("small", [*SMALL, f"model.dtype={dt}"]), 1, h100) for dt in
                 ("float32", "bfloat16"))
    assert f32.time.peak == 67e12 and bf16.time.peak == 989e12
    assert f32.time.compute_by_kind["matmul"] / bf16.time.compute_by_kind["matmul"] == pytest.approx(989 / 67)
    # On CPU a bf16 model's dots are probed as bf16 x bf16 -> float32, the rest in float32.
    asked = []
    probes.rates(small(["model.dtype=bfloat16"]), [_FakeDevice()], 1, use_cache=False,
                 measure_fn=lambda kind, shape, dtype, devs: asked.append((kind, dtype)) or 1.0)
    assert dict(asked) == {"matmul": "bfloat16", "head": "bfloat16", "batched": "bfloat16",  # dense: no dispatch
                           "elementwise": "float32", "softmax": "float32", "loss": "float32"}


class _FakeDevice:
    platform, device_kind = "cpu", "cpu"


@pytest.fixture
def cache_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "jaxinfra" / "plan-probes.json"


def _counting():
    calls = []
    return calls, lambda kind, shape, dtype, devs: calls.append(kind) or 1e9 + len(calls)


def test_probe_cache_is_read_back_and_remeasured_when_corrupt_or_keyed_elsewhere(cache_path, capsys, monkeypatch):
    lay, dev = small(), [_FakeDevice()]
    calls, fn = _counting()
    first = probes.rates(lay, dev, 1, measure_fn=fn)
    n = len(probes.probe_shapes(lay))
    assert len(calls) == n and cache_path.exists()
    assert probes.rates(lay, dev, 1, measure_fn=fn) == first and len(calls) == n  # read from the file
    assert probes.rates(lay, dev, 2, measure_fn=fn) == {k: v / 2 for k, v in first.items()}  # shared by 2
    probes.rates(lay, dev, 1, use_cache=False, measure_fn=fn)  # --no-probe-cache
    assert len(calls) == 2 * n
    cache_path.write_text("{not json")
    probes.rates(lay, dev, 1, measure_fn=fn)
    assert len(calls) == 3 * n and "probe cache" in capsys.readouterr().err
    assert isinstance(json.loads(cache_path.read_text()), dict)  # rewritten whole
    monkeypatch.setattr(probes, "machine", lambda: "another host")
    probes.rates(lay, dev, 1, measure_fn=fn)
    assert len(calls) == 4 * n
    probes.rates(small(["train.seq_len=128"]), dev, 1, measure_fn=fn)  # other shapes: measured (a capped one not)
    assert "matmul" in calls[4 * n:] and "batched" in calls[4 * n:]


def test_plan_json_splits_compute_by_kind_with_the_probe_rates(cache_path, capsys, monkeypatch):
    monkeypatch.setattr(probes, "build", lambda *args: None)  # nothing compiled or timed
    monkeypatch.setattr(probes, "measure", lambda probe, **kw: 2e9)
    monkeypatch.setattr(probes, "peak_flops", lambda device, dtype: 4e9)
    assert cli.main(["plan", "tiny", "--devices", "1", "mesh.data=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["compute_by_kind"]) == {*probes.KINDS, "residuals"}
    assert out["compute_s"] == pytest.approx(sum(out["compute_by_kind"].values()))
    assert out["probe_rates"] == {f"{k}:float32": 2e9 for k in probes.KINDS if k != "dispatch"}  # dense
    assert cache_path.exists()
