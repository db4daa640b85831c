"""Pipeline parallelism (sharding/pipeline.py) is the same computation as the 1-device run.

The tests/test_parallel.py method: one 1-device baseline, then each pipelined layout on 8
fake CPU devices must reproduce its first 5 losses (rtol 1e-5) and its final parameters.
Also: 1F1B's activation memory against GPipe's, the schedule tables, and bad pipeline
configs failing before compile with one line naming the keys.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfra.config import Config, ConfigError, OptimizerConfig, ParallelismConfig, ScheduleConfig, TrainConfig
from jaxinfra.data import DataConfig
from jaxinfra.runtime import build_runtime
from models import ModelConfig
from sharding import pipeline
from sharding.mesh import MeshConfig

MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp_dim=64, tie_embeddings=False)
OPT = OptimizerConfig(lr=1e-2, eps=1e-5)  # eps: see tests/test_step.py
BATCH, SEQ, STEPS = 8, 16, 5
PARAM_ATOL = 2e-5


def make_cfg(mesh: dict, model: ModelConfig = MODEL, batch: int = BATCH, **parallelism) -> Config:
    return Config(model=model, optimizer=OPT, schedule=ScheduleConfig(warmup_steps=0),
                  mesh=MeshConfig(**{"data": 1, **mesh}), parallelism=ParallelismConfig(**parallelism),
                  data=DataConfig(source="synthetic", synthetic_vocab=64),
                  train=TrainConfig(steps=20, batch_size=batch, seq_len=SEQ))


def batches(batch: int = BATCH) -> list[dict[str, np.ndarray]]:
    """Packed rows (2 documents and padding per row) so segment masks matter; the same batch each step."""
    rng = np.random.default_rng(1)
    seg = np.ones((batch, SEQ), np.int32)
    pos = np.tile(np.arange(SEQ, dtype=np.int32), (batch, 1))
    for r in range(batch):
        cut, end = sorted(rng.integers(4, SEQ - 2, size=2))
        seg[r, cut:], pos[r, cut:] = 2, np.arange(SEQ - cut)
        seg[r, end + 2:], pos[r, end + 2:] = 0, 0
    tokens = rng.integers(0, MODEL.vocab_size, size=(batch, SEQ + 1)).astype(np.int32)
    one = {"inputs": tokens[:, :-1] * (seg > 0), "targets": tokens[:, 1:] * (seg > 0),
           "segment_ids": seg, "positions": pos}
    return [one] * STEPS


def run(cfg: Config, devices) -> dict:
    rt = build_runtime(cfg, devices)
    state = rt.init_state()
    losses = []
    for batch in batches(cfg.train.batch_size):
        state, metrics = rt.train_step(state, rt.to_global(batch))
        losses.append(float(metrics["loss"]))
    return {"losses": np.array(losses), "params": jax.device_get(state.params), "state": state, "rt": rt}


@pytest.fixture(scope="module")
def baseline():
    return run(make_cfg({}), jax.devices()[:1])


LAYOUTS = {
    "gpipe-stage2-fsdp4": (dict(stage=2, fsdp=4), dict(pipeline_schedule="gpipe", microbatches=2)),
    "circular-stage4-data2-repeats2": (dict(stage=4, data=2),
                                       dict(pipeline_schedule="circular", pipeline_repeats=2, microbatches=4)),
    "1f1b-stage2-fsdp2-tensor2": (dict(stage=2, fsdp=2, tensor=2), dict(pipeline_schedule="1f1b", microbatches=4)),
}


# Further compositions, slower: accumulation x pipeline, 1F1B on 4 stages, unrolled layers, remat.
SLOW_LAYOUTS = {
    "gpipe-accum2-stage2-data2-tensor2": (dict(stage=2, data=2, tensor=2), dict(microbatches=2), dict(accum=2)),
    "1f1b-stage4-data2": (dict(stage=4, data=2), dict(pipeline_schedule="1f1b", microbatches=4), {}),
    "circular-stage2-fsdp4-unrolled-remat": (
        dict(stage=2, fsdp=4), dict(pipeline_schedule="circular", pipeline_repeats=2, microbatches=2),
        dict(model=dataclasses.replace(MODEL, scan_layers=False, remat_policy="full"))),
}


def _check(baseline: dict, result: dict, name: str) -> None:
    np.testing.assert_allclose(result["losses"], baseline["losses"], rtol=1e-5, err_msg=name)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(result["params"])[0],
                                 jax.tree.leaves(baseline["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=PARAM_ATOL,
                                   err_msg=f"{name} {jax.tree_util.keystr(path)}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_more_pipeline_layouts_match_single_device(baseline, name):
    mesh, parallelism, extra = SLOW_LAYOUTS[name]
    cfg = make_cfg(mesh, model=extra.get("model", MODEL), **parallelism)
    if "accum" in extra:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=extra["accum"]))
    _check(baseline, run(cfg, jax.devices()), name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_single_device(baseline, name):
    mesh, parallelism = LAYOUTS[name]
    result = run(make_cfg(mesh, **parallelism), jax.devices())
    np.testing.assert_allclose(result["losses"], baseline["losses"], rtol=1e-5, err_msg=name)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(result["params"])[0],
                                 jax.tree.leaves(baseline["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=PARAM_ATOL,
                                   err_msg=f"{name} {jax.tree_util.keystr(path)}")
    assert result["losses"][-1] < result["losses"][0]
    # The stacked layers really are split over `stage`.
    wq = result["state"].params["layers"]["attn"]["wq"][...]
    assert wq.sharding.spec[0] == "stage", wq.sharding


def _temp_bytes(schedule: str) -> int:
    cfg = make_cfg(dict(stage=4), batch=32, pipeline_schedule=schedule, microbatches=16)
    rt = build_runtime(cfg, jax.devices()[:4])
    state = rt.init_state()
    return rt.lower_train_step(state, rt.to_global(batches(32)[0])).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_activation_memory_below_gpipe():
    """4 stages, 16 microbatches: 1F1B keeps <= 2S-1 stage inputs per device, GPipe all M+S-1 ticks'."""
    gpipe, one_f_one_b = _temp_bytes("gpipe"), _temp_bytes("1f1b")
    assert one_f_one_b < 0.5 * gpipe, (one_f_one_b, gpipe)


def test_schedule_tables_and_bubble():
    for stages, micro, repeats in ((2, 2, 1), (4, 4, 2), (4, 8, 3), (3, 5, 1)):
        tab = pipeline.forward_tables(stages, micro, repeats)
        ticks = repeats * micro + stages - 1
        assert tab["valid"].shape == (ticks, stages)
        # every (microbatch, repeat) passes every stage exactly once, in chunk order
        for s in range(stages):
            seen = sorted(zip(tab["mb"][tab["valid"][:, s], s], tab["rep"][tab["valid"][:, s], s]))
            assert seen == sorted((m, r) for m in range(micro) for r in range(repeats))
        busy = tab["valid"].mean()
        assert np.isclose(1 - busy, pipeline.bubble_fraction(stages, micro, repeats))
    tab = pipeline.one_f_one_b_tables(4, 16)
    for s in range(4):  # stash occupancy never exceeds the 2S-1 slots
        live = np.cumsum(tab["f_valid"][:, s]) - np.cumsum(np.r_[0, tab["b_valid"][:-1, s]])
        assert live.max() <= pipeline.stash_slots(4) and live.max() == 2 * (4 - s) - 1
    assert pipeline.bubble_fraction(4, 16) == 3 / 19


@pytest.mark.parametrize("overrides, match", [
    (dict(model=dataclasses.replace(MODEL, num_layers=6)),
     r"model.num_layers=6 is not divisible by mesh.stage=4 x parallelism.pipeline_repeats=2 = 8"),
    (dict(parallelism=ParallelismConfig(pipeline_schedule="circular", pipeline_repeats=2, microbatches=2)),
     r"parallelism.microbatches=2 is not divisible by mesh.stage=4"),
    (dict(parallelism=ParallelismConfig(microbatches=3)),
     r"train.batch_size=8 .* is not divisible by parallelism.microbatches=3"),
    (dict(parallelism=ParallelismConfig(pipeline_schedule="1f1b", pipeline_repeats=2)),
     r"parallelism.pipeline_repeats=2 needs parallelism.pipeline_schedule=circular"),
    (dict(parallelism=ParallelismConfig(microbatches=8)),
     r"train.batch_size=8 \(microbatch 1\) is not divisible by the data-parallel size"),
])
def test_bad_pipeline_configs_fail_before_compile(overrides, match):
    cfg = dataclasses.replace(
        make_cfg(dict(stage=4, data=2), pipeline_schedule="circular", pipeline_repeats=2, microbatches=4),
        **overrides)
    with pytest.raises(ConfigError, match=match) as err:
        build_runtime(cfg, jax.devices())
    assert "\n" not in str(err.value)


def test_info_prints_bubble():
    from jaxinfra.info import describe

    text = describe(make_cfg(dict(stage=4, data=2), pipeline_schedule="circular", pipeline_repeats=2,
                             microbatches=4))
    assert "pipeline: circular" in text and f"bubble {pipeline.bubble_fraction(4, 4, 2):.3f}" in text
