"""Pipeline parallelism (sharding/pipeline.py) is the same computation as the 1-device run.

The tests/test_parallel.py method: one 1-device baseline, then each pipelined layout on 8
fake CPU devices must reproduce its first 5 losses (rtol 1e-5) and its final parameters.
MoE models too: the MoE periods are the pipeline's layers, with expert parallelism inside
each stage, and the router statistics (counts, drops, aux and z-losses, which feed the
loss, the metrics and the aux-loss-free bias) must equal the 1-device run's.
Also: 1F1B's activation memory against GPipe's, the schedule tables, per-layer statistics
summed over microbatches without bubble slots, and bad pipeline configs failing before
compile with one line naming the keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import assert_matches, packed_batches, parity_config, run_steps

from jaxinfra.checkpoint import abstract_with_shardings
from jaxinfra.config import Config, ConfigError, OptimizerConfig, ParallelismConfig
from jaxinfra.runtime import build_runtime
from models import ModelConfig
from sharding import pipeline
from sharding.mesh import MeshConfig, make_mesh
from sharding.plan import ParallelPlan
from sharding.rules import rules_for

MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp_dim=64, tie_embeddings=False)
OPT = OptimizerConfig(lr=1e-2, eps=1e-5)  # eps: see tests/test_step.py
BATCH, SEQ, STEPS = 8, 16, 5


def make_cfg(mesh: dict, model: ModelConfig = MODEL, batch: int = BATCH, accum: int = 1, **parallelism) -> Config:
    return parity_config(model, OPT, mesh, batch=batch, seq=SEQ, accum=accum, **parallelism)


def batches(batch: int = BATCH) -> list[dict[str, np.ndarray]]:
    return packed_batches(batch, SEQ, MODEL.vocab_size, STEPS)


def run(cfg: Config, devices) -> dict:
    return run_steps(cfg, devices, batches(cfg.train.batch_size))


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


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_more_pipeline_layouts_match_single_device(baseline, name):
    mesh, parallelism, extra = SLOW_LAYOUTS[name]
    cfg = make_cfg(mesh, model=extra.get("model", MODEL), **parallelism)
    if "accum" in extra:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=extra["accum"]))
    assert_matches(run(cfg, jax.devices()), baseline, name, trains=False)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_single_device(baseline, name):
    mesh, parallelism = LAYOUTS[name]
    result = run(make_cfg(mesh, **parallelism), jax.devices())
    assert_matches(result, baseline, name)
    # The stacked layers really are split over `stage`.
    wq = result["state"].params["layers"]["attn"]["wq"][...]
    assert wq.sharding.spec[0] == "stage", wq.sharding


def _temp_bytes(schedule: str) -> int:
    cfg = make_cfg(dict(stage=4), batch=32, pipeline_schedule=schedule, microbatches=16)
    rt = build_runtime(cfg, jax.devices()[:4])
    # Abstract state and batch carrying their shardings: the same program, lowered without compiling and
    # running the init.
    state = abstract_with_shardings(rt.abstract_state(), rt.state_shardings)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rt.batch_sharding) for k, v in batches(32)[0].items()}
    return rt.lower_train_step(state, batch).compile().memory_analysis().temp_size_in_bytes


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


# ---------------------------------------------------------------- MoE on the pipeline

# deepseek-tiny scaled down (sigmoid router with group-limited top-2 of 8 experts, a shared
# expert, the first layer dense, aux-loss-free bias; GQA instead of MLA, which the pipeline
# does not see and which costs ~30% more compile) with an MoE block every 2nd layer, so that
# a period (the pipeline's layer) holds a dense block and an MoE block: 1 + 4 x 2 = 9 layers,
# 4 periods (2 stages x 2 circular repeats). Capacity 4 x the even share: nothing is dropped, so
# the dropless path computes the same function and is checked against the same baseline.
MOE_MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=9, num_heads=4, num_kv_heads=2, head_dim=8,
                        mlp_dim=64, tie_embeddings=False, moe_num_experts=8, moe_top_k=2, moe_mlp_dim=16,
                        moe_shared_experts=1, moe_first_dense_layers=1, moe_every=2, moe_router_score="sigmoid",
                        moe_num_groups=4, moe_top_k_groups=2, moe_dispatch="capacity", moe_capacity_factor=4.0,
                        moe_aux_loss_weight=0.1, moe_z_loss_weight=1e-3, moe_bias_update_rate=1e-3)
# 2 gradient-accumulation steps of 8 rows, each split into 2 pipeline microbatches: the router
# statistics are per accumulation step in the 1-device run, so the pipeline must merge its
# microbatches' sums back into exactly those.
MOE_BATCH, MOE_ACCUM = 16, 2
MOE_LAYOUTS = {
    "moe-dropless-gpipe-stage2-expert2-data2": (dict(stage=2, expert=2, data=2), dict(microbatches=2), "dropless"),
}
# The other layouts with MoE, slower. Covered by default: their statistics plumbing (the
# stats-sum test below runs circular and 1F1B's custom VJP), the experts inside a stage (the
# dropless gpipe case above) and capacity routing under expert parallelism
# (tests/test_expert_parallel.py capacity-expert4-fsdp2).
SLOW_MOE_LAYOUTS = {
    "moe-gpipe-stage2-expert2-fsdp2": (dict(stage=2, expert=2, fsdp=2), dict(microbatches=2), "capacity"),
    "moe-1f1b-stage2-expert2-data2": (dict(stage=2, expert=2, data=2),
                                      dict(pipeline_schedule="1f1b", microbatches=2), "capacity"),
    "moe-circular-stage2-expert2-fsdp2-repeats2": (
        dict(stage=2, expert=2, fsdp=2), dict(pipeline_schedule="circular", pipeline_repeats=2, microbatches=2),
        "capacity"),
}


def moe_cfg(mesh: dict, dispatch: str = "capacity", capacity_factor: float = 4.0, **parallelism) -> Config:
    model = dataclasses.replace(MOE_MODEL, moe_dispatch=dispatch, moe_capacity_factor=capacity_factor)
    return make_cfg(mesh, model=model, batch=MOE_BATCH, accum=MOE_ACCUM, **parallelism)


@pytest.fixture(scope="module")
def moe_baseline():
    return run(moe_cfg({}), jax.devices()[:1])


def _check_moe(moe_baseline: dict, name: str, layouts: dict, capacity_factor: float = 4.0) -> None:
    mesh, parallelism, dispatch = layouts[name]
    result = run(moe_cfg(mesh, dispatch, capacity_factor, **parallelism), jax.devices())
    assert_matches(result, moe_baseline, name, metric_atol=1e-7,
                   metric_keys=("moe_aux_loss", "moe_z_loss", "moe_load_cv", "moe_load_max", "moe_dropped_frac"))
    # The MoE periods are split over `stage`, their experts over `expert`; the bias moved.
    w_gate = result["state"].params["moe_layers"]["moe"]["w_gate"][...]
    assert tuple(w_gate.sharding.spec[:2]) == ("stage", "expert"), w_gate.sharding
    bias = result["params"]["moe_layers"]["moe"]["router"]["bias"][...]
    assert np.any(np.asarray(bias) != 0)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_pipeline_matches_single_device(moe_baseline, name):
    _check_moe(moe_baseline, name, MOE_LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_MOE_LAYOUTS))
def test_moe_pipeline_more_schedules(moe_baseline, name):
    _check_moe(moe_baseline, name, SLOW_MOE_LAYOUTS)


@pytest.mark.slow
def test_moe_pipeline_with_capacity_drops():
    """Capacity factor 1: ~20% of assignments dropped, and the drops match too (slow: its own
    baseline; drops are per sequence, so the pipeline's row microbatches cannot change them)."""
    base = run(moe_cfg({}, capacity_factor=1.0), jax.devices()[:1])
    assert base["metrics"][-1]["moe_dropped_frac"] > 0.05
    _check_moe(base, "moe-gpipe-stage2-expert2-fsdp2", SLOW_MOE_LAYOUTS, capacity_factor=1.0)


def test_moe_baseline_statistics_matter(moe_baseline):
    """The MoE terms are live in the baseline: router losses in the loss, uneven load, the bias moving."""
    last = moe_baseline["metrics"][-1]
    assert last["moe_dropped_frac"] == 0 and last["moe_load_cv"] > 0.05 and last["moe_aux_loss"] > 0.5
    assert last["moe_z_loss"] > 0


def _toy_layer(h, w, mask):
    h = jnp.tanh(h * w["a"] + w["b"])
    m = mask[..., None].astype(h.dtype)
    return h, {"sum": jnp.sum(h * m, axis=(0, 1)), "tokens": jnp.sum(m)}


@pytest.mark.parametrize("schedule, stages, micro, repeats, scan",
                         [("gpipe", 4, 8, 1, True), ("circular", 2, 2, 2, False), ("1f1b", 4, 2, 1, True)])
def test_layer_stats_are_microbatch_sums_without_bubbles(schedule, stages, micro, repeats, scan):
    """apply_layers(with_stats=True): per-layer stats summed over microbatches equal the unsplit
    sequential run's, bubble slots add nothing, and gradients flow through them (1F1B's custom VJP too)."""
    layers, rng = 8, np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=(layers, 2)), jnp.float32) for k in ("a", "b")}
    h0 = jnp.asarray(rng.normal(size=(8, 4, 2)), jnp.float32)
    mask = jnp.asarray(rng.random((8, 4)) > 0.3)

    def objective(h, stats):
        return jnp.sum(h ** 2) + jnp.sum(stats["sum"] ** 2), (h, stats)

    def sequential(params, h):
        outs = []
        for i in range(layers):
            h, st = _toy_layer(h, jax.tree.map(lambda x, i=i: x[i], params), mask)
            outs.append(st)
        return objective(h, jax.tree.map(lambda *x: jnp.stack(x), *outs))

    def piped(params, h):
        return objective(*pipeline.apply_layers(_toy_layer, h, params, mask, plan=plan, scan_layers=scan,
                                                with_stats=True))

    mesh = make_mesh(MeshConfig(stage=stages, data=8 // stages), jax.devices())
    plan = ParallelPlan(mesh, rules_for("fsdp"), pipeline.PipelineSettings(schedule, micro, repeats))
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(piped, argnums=(0, 1), has_aux=True))(params, h0)
    want = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1), has_aux=True))(params, h0)
    np.testing.assert_array_equal(got[0][1][1]["tokens"], np.full(layers, float(mask.sum())))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh, model, match", [
    (dict(stage=2, expert=2, fsdp=2), dict(num_layers=7),
     r"model.num_layers=7 gives 3 MoE periods \(after model.moe_first_dense_layers=1, model.moe_every=2\), "
     r"not divisible by mesh.stage=2 x parallelism.pipeline_repeats=1 = 2"),
    (dict(stage=2, expert=2, context=2), {}, r"mesh.stage=2 with mesh.context=2 is not supported yet"),
])
def test_bad_moe_pipeline_configs_fail_before_compile(mesh, model, match):
    cfg = moe_cfg(mesh, microbatches=2)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    with pytest.raises(ConfigError, match=match) as err:
        build_runtime(cfg, jax.devices())
    assert "\n" not in str(err.value)
