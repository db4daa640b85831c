"""The parallel plan is explicit (issue 27): what a model traces is a function of its arguments
and the plan it is given, never of an ambient context; the layer schedule says which stacks
exist and in what order the layers run."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models import ModelConfig
from models.stack import layer_schedule
from models.transformer import Transformer
from sharding.mesh import MeshConfig, make_mesh
from sharding.pipeline import PipelineSettings
from sharding.plan import ParallelPlan, plan_for, single_device
from sharding.rules import rules_for

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, head_dim=8, mlp_dim=64,
                   param_dtype="float32", dtype="float32")


def _program(model: Transformer, tokens: jax.Array, plan: ParallelPlan) -> str:
    graphdef, params = nnx.split(model)
    text = str(jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p).forward(t, plan=plan)[0])(params, tokens))
    # jax records its own ambient mesh on some equations (`ctx_mesh`): metadata, not ours. Its printer also
    # wraps an equation's params differently with it, so whitespace is dropped before comparing.
    text = re.sub(r"ctx_mesh=\w*Mesh\((?:[^()]|\([^()]*\))*\)", "", text)
    return "".join(text.split())


def test_plan_decides_the_program_without_any_context():
    model = Transformer(TINY, nnx.Rngs(0))
    tokens = jnp.zeros((8, 16), jnp.int32)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
    sharded = plan_for(mesh, rules_for("fsdp"))
    single = _program(model, tokens, single_device())
    assert "sharding_constraint" not in single
    got = _program(model, tokens, sharded)
    assert got.count("sharding_constraint") >= 2 * TINY.num_layers  # the residual pins, at least
    assert _program(model, tokens, sharded) == got  # a function of (arguments, plan) alone
    # An ambient mesh changes nothing: the single-device plan still traces the single-device program.
    with jax.set_mesh(mesh):
        assert _program(model, tokens, single_device()) == single
    assert model(tokens).shape == (8, 16, TINY.vocab_size)  # bare calls: the single-device default


def test_plan_fields():
    single = single_device()
    assert single.mesh is None and single.pipeline is None and single.platform is None
    assert (single.stages, single.pipelined, single.context_size, single.expert_size) == (1, False, 1, 1)
    x = jnp.ones((4, 4))
    assert single.constrain(x, ("batch", "embed")) is x
    mesh = make_mesh(MeshConfig(stage=2, context=2, expert=2), jax.devices())
    plan = plan_for(mesh, rules_for("fsdp", context_impl="ring"), PipelineSettings("1f1b", 4))
    assert (plan.stages, plan.pipelined, plan.context_size, plan.expert_size) == (2, True, 2, 2)
    assert plan.platform == "cpu" and plan.pipeline == PipelineSettings("1f1b", 4)
    assert plan.context_impl == "ring" and plan.load_balance
    # Pipeline settings exist iff the mesh has stages (defaults when none were given).
    flat = make_mesh(MeshConfig(data=8), jax.devices())
    assert plan_for(flat, rules_for(), PipelineSettings("1f1b", 4)).pipeline is None
    assert ParallelPlan(mesh, rules_for()).pipeline == PipelineSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mesh = None


def test_no_ambient_sharding_state():
    """No module of ours keeps a ContextVar for sharding; the only one left is the manual-axes
    scope inside shard_map bodies (sharding/reductions.py)."""
    holders = []
    for package in ("jaxinfra", "models", "sharding", "kernels"):
        for path in sorted((REPO / package).rglob("*.py")):
            if "ContextVar" in path.read_text():
                holders.append(str(path.relative_to(REPO)))
    assert holders == ["sharding/reductions.py"]
    import sharding

    for info in pkgutil.iter_modules(sharding.__path__):
        module = importlib.import_module(f"sharding.{info.name}")
        for gone in ("activation_sharding", "active", "is_pipelined", "stage_count"):
            assert not hasattr(module, gone), f"sharding.{info.name}.{gone}"


def test_layer_schedule():
    moe = dataclasses.replace(TINY, num_layers=7, moe_num_experts=4, moe_top_k=2, moe_every=2,
                              moe_first_dense_layers=1)
    s = layer_schedule(moe)
    assert [(x.kind, x.index) for x in s.layers] == [
        ("dense", 0), ("dense", 1), ("moe", 0), ("dense", 2), ("moe", 1), ("dense", 3), ("moe", 2)]
    assert (s.prefix, s.period, s.periods, s.dense_per_period, s.stacks) == (1, 2, 3, 1, ("layers", "moe_layers"))
    dense = layer_schedule(TINY)
    assert (dense.prefix, dense.period, dense.periods, dense.stacks) == (0, 1, 2, ("layers",))
    every = layer_schedule(dataclasses.replace(moe, num_layers=3, moe_every=1, moe_first_dense_layers=0))
    assert every.stacks == ("moe_layers",) and every.dense_per_period == 0
    params = nnx.state(Transformer(moe, nnx.Rngs(0)), nnx.Param)
    assert {k for k in params if k.endswith("layers")} == set(s.stacks)
