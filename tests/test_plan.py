"""`jaxinfra plan`: the analytic memory against JAX's saved residuals and XLA's memory analysis,
the FLOP pieces against flops_per_token, collectives and links, the search, the CLI contract and
`jaxinfra train`'s pre-flight refusal.

The compiled comparisons use shapes where params and activations dominate XLA's small buffers
(vocab 2048, d_model 256, seq 256) and compile once each; the full table of layouts is the slow
test (benchmarks/plan.py prints the same table into benchmarks/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import io
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jaxinfra import cli
from jaxinfra.config import ConfigError, load_config, validate
from jaxinfra.metrics.flops import flops_per_token
from jaxinfra.plan import activations as act
from jaxinfra.plan import devices as plan_devices
from jaxinfra.plan.cli import preflight
from jaxinfra.plan.compiled import analyse, compiled_figures
from jaxinfra.plan.devices import device_spec
from jaxinfra.plan.estimate import make_plan
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.links import LINKS, axis_link, collective_seconds, read_measured
from jaxinfra.plan.memory import StateBytes, estimate
from jaxinfra.plan.search import overrides, search
from jaxinfra.plan.time import accumulate_bytes, collectives, layer_flops, pipeline_ticks
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_params
from kernels import facts as kernel_facts
from models import ModelConfig
from models import cache as kv_cache
from models.layers import rope_frequencies
from models.remat import remat_policy
from models.transformer import Block, MoEBlock

attention_module = importlib.import_module("kernels.attention")  # the module (kernels.attention is the function)

# Shapes for the compiled comparisons (benchmarks/plan.py LAYOUTS uses the same).
BASE = ["model.vocab_size=2048", "model.d_model=256", "model.mlp_dim=1024", "model.num_heads=4",
        "data.source=synthetic", "train.seq_len=256", "train.batch_size=16"]
GQA = ["model.num_kv_heads=2"]
# (name, preset, overrides): dense GQA / MLA / MoE over the strategies, axes and remat policies.
LAYOUTS = [
    ("GQA dp none", "tiny", GQA + ["mesh.data=8", "parallelism.strategy=dp"]),
    ("GQA zero1 full", "tiny", GQA + ["mesh.data=8", "parallelism.strategy=zero1", "model.remat_policy=full"]),
    ("GQA fsdp full", "tiny", GQA + ["mesh.data=1", "mesh.fsdp=8", "model.remat_policy=full"]),
    ("GQA fsdp none accum 2", "tiny", GQA + ["mesh.data=1", "mesh.fsdp=8", "train.grad_accum_steps=2",
                                             "train.batch_size=32"]),
    ("GQA data x tensor none", "tiny", GQA + ["mesh.data=2", "mesh.tensor=4"]),
    ("MHA tensor + SP full", "tiny", ["model.num_kv_heads=4", "mesh.data=2", "mesh.tensor=4",
                                      "parallelism.sequence_parallel=true", "model.remat_policy=full"]),
    ("GQA fsdp x context full", "tiny", GQA + ["mesh.data=1", "mesh.fsdp=4", "mesh.context=2",
                                               "model.remat_policy=full"]),
    ("GQA pipeline gpipe save_dots", "tiny", GQA + ["mesh.data=4", "mesh.stage=2", "parallelism.microbatches=4",
                                                    "model.remat_policy=save_dots"]),
    ("GQA pipeline 1f1b full", "tiny", GQA + ["mesh.data=4", "mesh.stage=2", "parallelism.microbatches=4",
                                              "parallelism.pipeline_schedule=1f1b", "model.remat_policy=full"]),
    # save_dots_no_batch under the stage vmap saves no weight matmul (activations.effective_policy);
    # `small` (6 untied layers, save_dots_no_batch) in gpipe, 1f1b and circular.
    ("GQA pipeline gpipe save_dots_no_batch", "tiny", GQA + ["mesh.data=4", "mesh.stage=2",
                                                             "parallelism.microbatches=4",
                                                             "model.remat_policy=save_dots_no_batch"]),
    ("small pipeline gpipe", "small", ["mesh.data=4", "mesh.stage=2", "parallelism.microbatches=4"]),
    ("small pipeline 1f1b", "small", ["mesh.data=4", "mesh.stage=2", "parallelism.microbatches=4",
                                      "parallelism.pipeline_schedule=1f1b"]),
    ("small pipeline circular", "small", ["mesh.data=4", "mesh.stage=2", "parallelism.microbatches=4",
                                          "parallelism.pipeline_schedule=circular", "parallelism.pipeline_repeats=3"]),
    ("MLA dp full", "deepseek-tiny", ["mesh.data=8", "model.remat_policy=full"]),
    ("MLA dp none", "deepseek-tiny", ["mesh.data=8"]),
    ("MoE expert none", "mixtral-tiny", GQA + ["mesh.data=4", "mesh.expert=2"]),
    ("MoE expert 8 full", "mixtral-tiny", GQA + ["mesh.data=1", "mesh.expert=8", "model.remat_policy=full"]),
    ("MoE fsdp x expert full", "mixtral-tiny", GQA + ["mesh.data=1", "mesh.fsdp=4", "mesh.expert=2",
                                                      "model.remat_policy=full"]),
    ("GQA dp save_dots", "tiny", GQA + ["mesh.data=8", "parallelism.strategy=dp", "model.remat_policy=save_dots"]),
]
# Known gap (docs/plan.md): MoE capacity dispatch under save_dots is underestimated by 16-21%.
# The default run's share of the table; the collective counts below reuse the same compiles.
FAST = ("GQA fsdp full", "GQA pipeline gpipe save_dots", "MoE expert none", "GQA pipeline gpipe save_dots_no_batch")


def layout_config(preset: str, extra: list[str]):
    return load_config(preset, [*BASE, *extra])


@functools.cache
def _compiled(name: str) -> tuple[Layout, dict]:
    """A LAYOUTS row's layout and XLA's figures of its compiled step (compiled once per test session)."""
    _, preset, extra = next(row for row in LAYOUTS if row[0] == name)
    cfg = layout_config(preset, extra)
    return Layout.of(cfg, 8, "cpu"), analyse(cfg, jax.devices()[:8])


def _compare(name: str) -> tuple[float, float]:
    lay, figures = _compiled(name)
    return estimate(lay).total, figures["total_bytes"]


@pytest.mark.parametrize("name", FAST)
def test_analytic_memory_within_15_percent_of_compiled(name):
    analytic, compiled = _compare(name)
    assert abs(analytic / compiled - 1) < 0.15, (name, analytic, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("name", [row[0] for row in LAYOUTS if row[0] not in FAST])
def test_analytic_memory_table_within_15_percent_of_compiled(name):
    analytic, compiled = _compare(name)
    assert abs(analytic / compiled - 1) < 0.15, (name, analytic, compiled)



# (layout, plan collective, compiled (opcode, devices per group)): the bytes each moves per step
# must agree within 10% (jaxinfra/plan/compiled.py counts the compiled ones through loop trips).
COLLECTIVE_CHECKS = [
    ("GQA fsdp full", "FSDP weight all-gather on fsdp", ("all-gather", 8)),
    ("GQA pipeline gpipe save_dots", "gradient all-reduce on data", ("all-reduce", 4)),  # per backward tick
    ("GQA pipeline gpipe save_dots", "pipeline send on stage", ("collective-permute", None)),
    ("GQA pipeline gpipe save_dots", "pipeline output all-reduce on stage", ("all-reduce", 2)),
    ("MoE expert none", "expert all-to-all on expert", ("all-to-all", 2)),
]


@pytest.mark.parametrize("name, label, compiled", COLLECTIVE_CHECKS)
def test_collective_bytes_match_the_compiled_step(name, label, compiled):
    lay, figures = _compiled(name)
    planned = sum(c.calls * c.size for c in collectives(lay, StateBytes.of(lay)) if c.label == label)
    op, group = compiled
    moved = sum(size for key, (_, size) in figures["collectives"].items()
                if key.split(" x")[0] == op and (group is None or key == f"{op} x{group}"))
    assert planned == pytest.approx(moved, rel=0.10), (name, label, planned, moved)


def test_expert_slots_are_not_gathered_over_data():
    """Capacity dispatch with data x expert: each device exchanges only its own slots (the batch's
    other axes are manual in sharding/expert.py; GSPMD alone all-gathered them over `data`)."""
    _, figures = _compiled("MoE expert none")
    gathered = sum(size for key, (_, size) in figures["collectives"].items() if key.startswith("all-gather"))
    exchanged = figures["collectives"]["all-to-all x2"][1]
    assert gathered < 0.05 * exchanged, figures["collectives"]


def test_capacity_groups_are_whole_sequences_under_context_parallelism():
    """models/moe.py groups whole sequences; under `mesh.context` the compiled step gathers the
    sequence for the dispatch (its [rows, E, C, d] buffers carry the full-sequence C), so every
    context shard computes all of a row's slots: twice the expert rows per local token at cp=2."""
    from models.moe import expert_capacity

    cfg = load_config("mixtral-tiny", ["mesh.data=4", "mesh.context=2"])
    m, seq = cfg.model, cfg.train.seq_len
    cp, flat = Layout.of(cfg, 8, "cpu"), Layout.of(load_config("mixtral-tiny", ["mesh.data=8"]), 8, "cpu")
    slots = m.moe_num_experts * expert_capacity(seq, m.moe_top_k, m.moe_num_experts, m.moe_capacity_factor)
    assert act.capacity_slots(cp) == act.capacity_slots(flat) == slots
    assert layer_flops(cp, True)["ffn_up"] == pytest.approx(2 * layer_flops(flat, True)["ffn_up"])


# ---------------------------------------------------------------- quantization and distillation
TEACHER = ModelConfig(vocab_size=2048, d_model=384, num_layers=2, num_heads=4, mlp_dim=1536, tie_embeddings=False)
# (name, a layout of LAYOUTS, the feature's overrides; "{teacher}" is the teacher run dir)
FEATURES = [
    ("int8 train", "GQA fsdp full", ["quant.train=int8"]),
    ("fp8 delayed train", "MoE expert none", ["quant.train=fp8", "quant.fp8_emulation=true",
                                              "quant.scaling=delayed"]),
    ("int8 train, MLA", "MLA dp full", ["quant.train=int8"]),
    ("online distill, full vocabulary", "GQA fsdp full", ["distill.teacher={teacher}"]),
    ("online distill, top-k, float32 teacher", "MoE expert none", ["distill.teacher={teacher}", "distill.top_k=16",
                                                                   "distill.teacher_dtype=float32"]),
    ("online distill, chunked loss", "GQA dp none", ["distill.teacher={teacher}", "model.loss_chunk_size=64"]),
    ("LoRA", "GQA dp none", ["lora.rank=8", "lora.targets=[q,k,v,o,gate,up,down]"]),
    ("QLoRA, int8 base", "GQA fsdp full", ["lora.rank=8", "lora.targets=[q,k,v,o,gate,up,down]",
                                          "quant.weights=int8"]),
]
# Default run: int8 training and QLoRA (the teacher components' shardings and the float LoRA base's
# accounting are checked without a compile below).
FAST_FEATURES = ("int8 train", "QLoRA, int8 base")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    from jaxinfra.checkpoint import save_params_only
    from jaxinfra.config import Config
    from jaxinfra.state import init_params

    out = tmp_path_factory.mktemp("teacher")
    params = jax.jit(lambda key: init_params(TEACHER, key))(jax.random.key(0))
    save_params_only(out, Config(model=TEACHER), params, {"params_only": True, "step": 0})
    return str(out)


def _compare_feature(name: str, teacher: str) -> tuple[float, float]:
    _, layout, extra = next(row for row in FEATURES if row[0] == name)
    _, preset, base = next(row for row in LAYOUTS if row[0] == layout)
    cfg = layout_config(preset, [*base, *(e.format(teacher=teacher) for e in extra)])
    return estimate(Layout.of(cfg, 8, "cpu")).total, analyse(cfg, jax.devices()[:8])["total_bytes"]


@pytest.mark.parametrize("name", FAST_FEATURES)
def test_quant_and_distill_memory_within_15_percent_of_compiled(name, teacher_dir):
    analytic, compiled = _compare_feature(name, teacher_dir)
    assert abs(analytic / compiled - 1) < 0.15, (name, analytic, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("name", [row[0] for row in FEATURES if row[0] not in FAST_FEATURES])
def test_quant_and_distill_memory_table_within_15_percent_of_compiled(name, teacher_dir):
    analytic, compiled = _compare_feature(name, teacher_dir)
    assert abs(analytic / compiled - 1) < 0.15, (name, analytic, compiled)


def test_teacher_params_are_resident_without_gradients_or_optimizer_state(teacher_dir):
    """The teacher adds exactly its params (in teacher_dtype, by the parameter rules) to the
    step's arguments; the student's gradients and optimizer state are unchanged."""
    _, preset, base = next(row for row in LAYOUTS if row[0] == "GQA fsdp full")
    cfg = layout_config(preset, [*base, f"distill.teacher={teacher_dir}", "distill.teacher_dtype=float32"])
    mem = estimate(Layout.of(cfg, 8, "cpu")).as_dict()
    plain = estimate(Layout.of(layout_config(preset, base), 8, "cpu")).as_dict()
    rt = build_runtime(cfg, jax.devices()[:8])  # the shardings the run gives the teacher's params
    teacher = abstract_params(dataclasses.replace(TEACHER, param_dtype="float32"))
    shards = jax.tree.leaves(jax.tree.map(lambda x, sh: math.prod(sh.shard_shape(x.shape)) * 4, teacher,
                                          rt.extension("distill").input_shardings()[0]))
    assert mem["teacher_params"] == sum(shards)
    assert (mem["gradients"], mem["optimizer_state"]) == (plain["gradients"], plain["optimizer_state"])


def _lora_plan(layout: str, extra: list[str]) -> dict[str, int]:
    _, preset, base = next(row for row in LAYOUTS if row[0] == layout)
    return estimate(Layout.of(layout_config(preset, [*base, *extra]), 8, "cpu")).as_dict()


def test_lora_prices_a_frozen_base_and_trained_adapters():
    """The base keeps its params' bytes but gets no gradients, no optimizer state and no update copy;
    the adapters (float32, replicated under dp) get all three: rank * (d_in + d_out) per target matrix
    (models/lora_config.py adapter_param_count). An int8 base is <= 0.3 of the float32 one."""
    from models.lora_config import adapter_param_count

    lora = ["lora.rank=8", "lora.targets=[q,k,v,o,gate,up,down]"]
    plain, mem = _lora_plan("GQA dp none", []), _lora_plan("GQA dp none", lora)
    _, preset, base = next(row for row in LAYOUTS if row[0] == "GQA dp none")
    cfg = layout_config(preset, [*base, *lora])
    adapters = 4 * adapter_param_count(cfg.model, cfg.lora)
    assert mem["frozen_params"] == plain["params"]
    assert mem["params"] == adapters
    # the optimizer state's scalars (AdamW's step counts) add a few bytes to the moments
    assert (mem["gradients"], mem["optimizer_state"]) == pytest.approx((adapters, 2 * adapters), abs=64)
    assert mem["optimizer_update"] == pytest.approx(2 * adapters, abs=64)  # new adapters + moments - gradients
    for layout in ("GQA dp none", "GQA fsdp full"):
        int8, float32 = _lora_plan(layout, [*lora, "quant.weights=int8"]), _lora_plan(layout, lora)
        assert int8["frozen_params"] <= 0.3 * float32["frozen_params"], layout
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli.main(["plan", "tiny", *lora, "quant.weights=int8", "--devices", "8", "--device-kind", "h100"]) == 0
    assert re.search(r"params: frozen base .* \(no gradients, no optimizer state\) \+ trained adapters", text.getvalue())


def test_info_marks_frozen_and_trainable_params():
    from jaxinfra.info import describe

    cfg = load_config("tiny", ["lora.rank=4", "lora.targets=[q,down]", "quant.weights=int8"])
    rows = {line.split()[0]: line.split()[-1] for line in describe(cfg).splitlines() if line.startswith("layers/")}
    assert rows["layers/attn/wq_lora_a"] == rows["layers/mlp/w_down_lora_b"] == "trainable"
    assert rows["layers/attn/wq"] == rows["layers/attn/wq_scale"] == rows["layers/attn/wk"] == "frozen"
    assert "layers/attn/wk_lora_a" not in rows
    text = describe(cfg)
    assert "frozen params:" in text and "trained params:" in text and "over a frozen int8" in text
    assert "training" not in describe(load_config("tiny")).splitlines()[-5]  # no column without a frozen base


def test_quantized_inference_params_and_kv_cache_match_the_compiled_decode():
    """--inference on a `jaxinfra quantize`d config with an int8 KV cache: int8 weights + scales and
    the int8 cache + scales are what the compiled decode takes as arguments."""
    from jaxinfra.infer.generation import Generator
    from jaxinfra.state import init_params

    cfg = load_config("tiny", [*BASE, *GQA, "train.batch_size=4", "quant.weights=int8", "quant.kv_cache=int8"])
    params = jax.jit(lambda key: init_params(cfg.model, key, cfg.quant))(jax.random.key(0))
    _, decode = Generator(cfg, params, devices=jax.devices()[:1])._compile(4, cfg.train.seq_len - 1, 1, 1)
    mem = make_plan(cfg, 1, device_spec("h100"), inference=True).memory.as_dict()
    state = decode.memory_analysis().argument_size_in_bytes  # params + cache + the loop's small state
    assert mem["params"] + mem["kv_cache"] == pytest.approx(state, rel=0.01)
    assert mem["params"] < 0.3 * estimate(Layout.of(load_config("tiny", [*BASE, *GQA]), 1, "cpu")).as_dict()["params"]

# ---------------------------------------------------------------- saved activations vs JAX

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "i32": 4, "bool": 1}


def jax_saved_bytes(cfg, moe: bool, policy: str) -> int:
    """Bytes of the residuals jax.ad_checkpoint reports for one real layer (inputs excluded, and
    reshapes of the weights, which XLA keeps as views of the params)."""
    model = dataclasses.replace(cfg.model, remat_policy=policy)
    graphdef, params = nnx.split((MoEBlock if moe else Block)(model, nnx.Rngs(0)))
    views = set()
    for w in jax.tree.leaves(params):
        views |= {(w.shape[0], math.prod(w.shape[1:])), (math.prod(w.shape[:-1]), w.shape[-1])}
    b, t = cfg.train.batch_size, cfg.train.seq_len
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    extra = (jnp.ones((b, t), bool), pos) if moe else ()

    def layer(p, h):
        out = nnx.merge(graphdef, p)(h, pos, jnp.ones((b, t), jnp.int32), rope_frequencies(model), *extra)
        return out[0] if moe else out

    if policy != "none":
        layer = jax.checkpoint(layer, policy=remat_policy(policy))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(layer, params, jnp.ones((b, t, model.d_model)))
    total = 0
    for line in text.getvalue().splitlines():
        found = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
        if not found or "from the argument" in found.group(3):
            continue
        shape = tuple(int(x) for x in found.group(2).split(",") if x)
        if "reshape" in found.group(3) and shape in views:
            continue
        total += math.prod(shape) * _DTYPE_BYTES[found.group(1)]
    return total


@pytest.mark.parametrize("preset, extra, moe", [
    ("tiny", [], False),  # GQA 4/2 heads
    ("tiny", ["model.norm_placement=sandwich", "model.mlp_activation=gelu_tanh"], False),  # Gemma's block
    ("deepseek-tiny", [], False),  # MLA
    ("mixtral-tiny", [], True),  # MoE, capacity dispatch
    ("mixtral-tiny", ["model.moe_dispatch=dropless"], True),
])
def test_saved_activation_formulas_match_jax_residuals(preset, extra, moe):
    # batch x seq = 48 differs from every weight dimension, so weight views are told apart.
    cfg = load_config(preset, [*extra, "train.batch_size=2", "train.seq_len=24", "mesh.data=1"])
    lay = Layout.of(cfg, 1, "cpu")
    for policy in ("none", "save_dots", "save_dots_no_batch", "save_qkv_attn_mlp"):
        formula = act.saved(act.layer_tensors(lay, moe), policy)
        reference = jax_saved_bytes(cfg, moe, policy)
        assert abs(formula - reference) <= 0.06 * reference, (policy, formula, reference)


# ---------------------------------------------------------------- FLOPs, links, time


@pytest.mark.parametrize("preset", ["tiny", "deepseek-tiny", "qwen3-moe-tiny"])
def test_flop_pieces_add_up_to_flops_per_token(preset):
    """The time model's per-piece forward FLOPs (top-k experts, dense attention) x 3 for the
    backward, plus the head, equal the independent PaLM-style count."""
    cfg = load_config(preset, ["model.moe_dispatch=dropless", "mesh.data=1"])
    lay = Layout.of(cfg, 1, "gpu")
    flags = cfg.model.moe_layer_flags()
    pieces = sum(sum(layer_flops(lay, moe).values()) for moe in flags)
    head = 2 * cfg.model.vocab_size * cfg.model.d_model
    assert 3 * (pieces + head) == pytest.approx(flops_per_token(cfg.model, cfg.train.seq_len), rel=1e-9)


def test_links_follow_the_device_order_and_measured_tables_replace_them(tmp_path):
    sizes = {"data": 1, "stage": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 8}
    assert axis_link("tensor", sizes, {}, 8, "nvlink4", "ib-ndr") == "nvlink4"  # 8 neighbours: one node
    assert axis_link("fsdp", sizes, {}, 8, "nvlink4", "ib-ndr") == "ib-ndr"  # stride 8: across nodes
    assert axis_link("fsdp", {**sizes, "tensor": 1}, {"fsdp": 2}, 8, "nvlink4", "ib-ndr") == "ib-ndr"  # DCN
    # nccl-tests' busbw inverted: all-reduce of S bytes moves 2(n-1)/n S per device.
    assert collective_seconds("all_reduce", 1e9, 8, LINKS["nvlink4"]) == pytest.approx(10e-6 + 1.75e9 / 450e9)
    bench = tmp_path / "bench.txt"
    bench.write_text("1 process(es), 8 x cpu, mesh {...}\naxis       n op                     bytes     time us "
                     "algbw GB/s  busbw GB/s\nfsdp       8 all_gather             1,024       300.0       0.003"
                     "       0.003\nfsdp       8 all_gather        16,777,216     11211.4       1.496       1.309\n")
    link = read_measured(str(bench))[("fsdp", "all_gather")]
    assert (link.bandwidth, link.latency) == (pytest.approx(1.309e9), pytest.approx(300e-6))
    bench.write_text("nothing here\n")
    with pytest.raises(ConfigError, match="no `jaxinfra bench collectives` rows"):
        read_measured(str(bench))


def test_step_time_names_the_bottleneck():
    h100 = device_spec("h100")
    fsdp = make_plan(load_config("llama3-8b", ["train.grad_accum_steps=8"]), 64, h100)
    assert fsdp.bottleneck == "FSDP weight all-gather on fsdp"  # 64-way FSDP over InfiniBand
    t = fsdp.time
    assert t.step_s == pytest.approx(max(t.compute_s, t.overlapped_s) + t.exposed_s + t.update_s + t.accumulate_s)
    # The update moves 10 bytes per byte of the optimizer-sharded params at 3.35 TB/s; each of the 8
    # accumulation microbatches adds its gradients into the sum (3 bytes per byte).
    assert t.update_s == pytest.approx(10 * 8.03e9 * 4 / 64 / 3.35e12, rel=0.01)
    assert t.accumulate_s == pytest.approx(8 * 3 / 10 * t.update_s)
    piped = make_plan(load_config("llama3-8b", ["mesh.fsdp=8", "mesh.stage=8", "mesh.data=1",
                                                "train.grad_accum_steps=8", "parallelism.microbatches=8"]), 64, h100)
    assert piped.time.flops.bubble == pytest.approx(piped.time.flops.layers * 7 / 8)  # (S-1)/M of the layers' work
    # Every backward tick (M + S - 1 = 15) adds the stage's layer gradients into its accumulator, and
    # each of the 8 accumulation microbatches its gradients into the optimizer-sharded sum.
    lay, state = piped.layout, StateBytes.of(piped.layout)
    assert pipeline_ticks(lay) == (15, 15) and 0 < state.layer_params < state.params
    assert accumulate_bytes(lay, state) == pytest.approx(8 * 3 * (15 * state.layer_params + state.opt_params))
    one_f = piped.layout.with_config(dataclasses.replace(
        lay.cfg, parallelism=dataclasses.replace(lay.cfg.parallelism, pipeline_schedule="1f1b")))
    assert pipeline_ticks(one_f) == (8 + 8 - 1, 8 + 16 - 2)
    too_big = make_plan(load_config("llama3-8b"), 8, h100)
    assert not too_big.fits and too_big.bottleneck == "memory"
    assert too_big.tokens_per_s == pytest.approx(512 * 8192 / too_big.time.step_s)


# ---------------------------------------------------------------- search


def test_search_ranks_layouts_that_fit_and_config_validation_accepts():
    cfg = load_config("mixtral-tiny", ["train.batch_size=8"])
    spec = device_spec("h100", memory_gib=0.2)
    ranked = search(cfg, 2, spec)
    assert ranked and all(p.fits for p in ranked)
    times = [p.time.step_s for p in ranked]
    assert times == sorted(times)
    for p in ranked[:10]:  # each printed command reproduces the ranked layout exactly
        again = load_config("mixtral-tiny", ["train.batch_size=8", *overrides(p)])
        validate(again, 2)
        assert make_plan(again, 2, spec).time.step_s == pytest.approx(p.time.step_s)
    assert {p.layout.cfg.parallelism.strategy for p in ranked} >= {"dp", "zero1", "fsdp"}
    assert any(p.layout.ep > 1 for p in ranked) and any(p.layout.pp > 1 for p in ranked)


# ---------------------------------------------------------------- CLI


def test_plan_json_has_the_contract_fields(capsys):
    assert cli.main(["plan", "tiny", "--devices", "8", "--device-kind", "h100", "mesh.fsdp=8", "mesh.data=1",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mem = out["memory_bytes_per_device"]
    assert mem["total"] > mem["params"] > 0 and {"gradients", "optimizer_state", "activations"} <= set(mem)
    assert out["tokens_per_s"] == pytest.approx(16 * 128 / out["step_time_s"])
    assert 0 < out["mfu"] < 1 and isinstance(out["bottleneck"], str) and out["fits"]


@pytest.mark.parametrize("argv, message", [
    (["--devices", "0"], "--devices=0 is invalid"),
    (["--devices", "-4"], "--devices=-4 is invalid"),
    (["--devices", "8", "--device-kind", "h100", "--hbm-gib", "0"], "--hbm-gib=0.0 is invalid"),
    (["--devices", "6", "--device-kind", "h100", "mesh.fsdp=4"], None),  # 6 devices do not take fsdp=4
    (["--devices", "8", "--device-kind", "h100", "mesh.tensor=8"], None),  # 4 heads over tensor=8
])
def test_plan_bad_input_is_one_line_exit_2(capsys, argv, message):
    assert cli.main(["plan", "tiny", *argv]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    if message is None:  # a layout the trainer refuses: the same message as the config validation
        overrides_ = [a for a in argv if "=" in a]
        with pytest.raises(ConfigError) as refused:
            validate(load_config("tiny", overrides_), int(argv[1]))
        message = str(refused.value)
    assert err[0] == f"jaxinfra: error: {message}" or message in err[0]


def test_search_prints_train_commands_and_nothing_that_fits_is_one_line_exit_2(capsys):
    assert cli.main(["plan", "tiny", "--devices", "2", "--device-kind", "h100", "--search", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line.strip() for line in lines if line.strip().startswith("jaxinfra train tiny ")]
    assert len(commands) == 3 and "mesh.data=" in commands[0] and "model.remat_policy=" in commands[0]
    assert cli.main(["plan", "tiny", "--devices", "2", "--device-kind", "h100", "--hbm-gib", "0.001",
                     "--search"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no layout of 2 h100 devices fits" in err[0]


def test_inference_plan_counts_the_kv_cache_as_models_cache_does():
    cfg = load_config("llama3-8b", ["train.batch_size=8", "train.seq_len=4096", "mesh.tensor=8", "mesh.fsdp=1"])
    plan = make_plan(cfg, 8, device_spec("h100"), inference=True)
    cache = plan.memory.as_dict()["kv_cache"]
    assert cache == kv_cache.bytes_per_token(cfg.model) * 8 * 4096 // 8  # KV heads split over tensor=8
    assert "gradients" not in plan.memory.as_dict() and plan.tokens_per_s == pytest.approx(8 / plan.time.step_s)


def test_compile_on_more_devices_than_this_process_has_runs_a_child():
    """16 fake CPU devices in a child process (this one has 8); its figures match the analytic ones."""
    cfg = load_config("tiny", ["mesh.data=16", "data.source=synthetic", "train.batch_size=16", "train.seq_len=32",
                               "model.num_layers=1"])
    figures = compiled_figures(cfg, 16)
    assert figures["platform"] == "cpu" and figures["total_bytes"] > figures["argument_bytes"] > 0
    analytic = estimate(Layout.of(cfg, 16, "cpu")).total
    assert analytic / figures["total_bytes"] == pytest.approx(1.0, abs=0.3)  # tiny shapes: XLA's small buffers


# ---------------------------------------------------------------- jaxinfra train's pre-flight


def test_train_prints_the_plan_line_and_refuses_a_config_far_over_memory(tmp_path, capsys):
    run = tmp_path / "run"
    huge = ["train.batch_size=2048", "train.seq_len=2048", "data.source=synthetic", "--run-dir", str(run)]
    assert cli.main(["train", "tiny", *huge]) == cli.EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out.startswith("jaxinfra: plan: ") and "per device analytic" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "exceeds the cpu device's" in err[0] and "--force" in err[0]
    assert not run.exists()  # refused before anything was written or compiled


# ---------------------------------------------------------------- attention as the kernels keep it


def _attention_plan(impl: str, kind: str = "h100"):
    """tiny's GQA layers in bfloat16 (head dim 64: every flash kernel takes it) on 8 devices of `kind`."""
    cfg = load_config("tiny", [*BASE, *GQA, "mesh.data=8", "model.dtype=bfloat16", f"model.attention_impl={impl}"])
    return make_plan(cfg, 8, device_spec(kind))


def _kernels_run(monkeypatch, impl: str, kind: str, lay: Layout, segments: bool = True) -> str:
    """What kernels.attention itself dispatches `impl` to for the model's call on that device."""
    spec = device_spec(kind)
    monkeypatch.setattr(attention_module, "_platform", lambda: spec.platform)
    monkeypatch.setattr(attention_module, "_device_kind", lambda: spec.name)
    monkeypatch.setattr(attention_module, "_compute_capability", lambda: spec.compute_capability)
    m = lay.model
    q = jax.ShapeDtypeStruct((lay.rows, lay.seq, lay.heads, m.resolved_head_dim), jnp.dtype(m.dtype))
    seg = jax.ShapeDtypeStruct((lay.rows, lay.seq), jnp.int32) if segments else None
    return attention_module.resolve_impl(impl, q, q, segment_ids=seg)


def test_attention_sinks_are_priced_as_the_kernels_run_them(monkeypatch):
    """gpt-oss sinks: `auto` on an H100 plans (and dispatches) Triton as without sinks; on an H200 in bf16
    D64 (cuDNN's measured row) Triton too, since cuDNN returns no log-sum-exp for the sinks."""
    cfg = load_config("tiny", [*BASE, *GQA, "mesh.data=8", "model.dtype=bfloat16", "model.attention_sinks=true",
                                "model.attention_impl=auto"])
    lay = make_plan(cfg, 8, device_spec("h100")).layout
    sinks = jax.ShapeDtypeStruct((lay.heads,), jnp.float32)
    spec = device_spec("h100")
    monkeypatch.setattr(attention_module, "_platform", lambda: spec.platform)
    q = jax.ShapeDtypeStruct((lay.rows, lay.seq, lay.heads, lay.model.resolved_head_dim), jnp.bfloat16)
    assert lay.attention_impl == attention_module.resolve_impl("auto", q, q, sinks=sinks) == "pallas_triton"
    call = kernel_facts.Call("bfloat16", 64, 64, kernels_band(lay))
    h200 = device_spec("h200").kernel_target
    assert kernel_facts.resolve("auto", h200, call)[0] == "cudnn"
    assert kernel_facts.resolve("auto", h200, dataclasses.replace(call, sinks=True))[0] == "pallas_triton"


def test_attention_memory_is_priced_as_the_kernels_keep_it(monkeypatch):
    """Mosaic GPU (and every flash kernel) keeps its output and log-sum-exp, not the [rows, heads,
    seq, seq] float32 scores; `auto` is priced as the implementation the kernels pick on that device
    (training passes segment ids, so never cuDNN's bounded packed layout: Triton on H100 and H200)."""
    plans = {impl: _attention_plan(impl) for impl in ("xla", "pallas_triton", "pallas_mosaic_gpu")}
    act = {impl: p.memory.as_dict()["activations"] for impl, p in plans.items()}
    lay = plans["xla"].layout
    scores = lay.model.num_layers * lay.tokens * lay.heads * lay.kv_seq * 4
    assert plans["pallas_mosaic_gpu"].layout.attention_impl == "pallas_mosaic_gpu"
    assert act["pallas_mosaic_gpu"] == act["pallas_triton"]
    assert scores < act["xla"] - act["pallas_mosaic_gpu"] < 5 * scores  # scores and their softmax pieces
    for kind in ("h100", "h200"):
        auto = _attention_plan("auto", kind)
        assert auto.layout.attention_impl == _kernels_run(monkeypatch, "auto", kind, auto.layout) == "pallas_triton"
        assert auto.memory.as_dict()["activations"] == act["pallas_triton"]
    # Without segment ids the H200's measured IMPL_TABLE row picks cuDNN, in the kernels and in facts alike.
    call = kernel_facts.Call("bfloat16", 64, 64, kernels_band(lay))
    assert kernel_facts.resolve("auto", device_spec("h200").kernel_target, call)[0] == "cudnn"
    assert _kernels_run(monkeypatch, "auto", "h200", lay, segments=False) == "cudnn"
    assert set(kernel_facts.KEEPS) == set(kernel_facts.IMPLEMENTATIONS) - {"auto"}


def kernels_band(lay: Layout):
    from kernels.masks import make_band

    return make_band(True, None, lay.seq, lay.kv_seq)


def test_preflight_accepts_a_flash_run_that_compiles_within_the_device_memory(monkeypatch):
    """A Mosaic GPU config whose compiled step fits the device exactly: the pre-flight used to price
    float32 scores per layer for it (the xla figure, > 110% of the device) and refused it."""
    extra = [*BASE, *GQA, "mesh.data=8", "train.seq_len=1024", "model.num_layers=2"]
    flash = load_config("tiny", [*extra, "model.attention_impl=pallas_mosaic_gpu"])
    dense = load_config("tiny", [*extra, "model.attention_impl=xla"])
    compiled = analyse(flash, jax.devices()[:8])["total_bytes"]  # float32 on CPU: Triton, interpreted
    capacity = compiled  # the device holds exactly what XLA allocates
    assert estimate(Layout.of(dense, 8, "cpu")).total > 1.1 * capacity  # what it was priced at
    assert estimate(Layout.of(flash, 8, "cpu")).total <= 1.1 * capacity
    monkeypatch.setattr(plan_devices, "host_memory_bytes", lambda: capacity * jax.local_device_count())
    preflight(flash, force=False)  # accepted
    with pytest.raises(ConfigError, match="exceeds the cpu device's"):
        preflight(dense, force=False)
