"""state.abstract_params: the one abstract params tree (restore / import / export targets)."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfra.config import load_config
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_params, init_params
from sharding.mesh import MeshConfig, make_mesh

SMALL = ["model.vocab_size=64", "model.d_model=64", "model.num_layers=2", "model.num_heads=4",
         "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8", "data.source=synthetic",
         "data.synthetic_vocab=64"]


def _shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


def test_abstract_params_without_mesh_has_init_params_shapes():
    model = load_config("tiny", SMALL).model
    abstract = abstract_params(model)
    real = init_params(model, jax.random.key(0))
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    assert _shapes(abstract) == _shapes(real)
    assert all(getattr(x, "sharding", None) is None for x in jax.tree.leaves(abstract))


@pytest.mark.parametrize("mesh", [["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"], ["mesh.data=2", "mesh.fsdp=4"]])
def test_abstract_params_on_a_mesh_carry_the_runtime_shardings(mesh):
    cfg = load_config("tiny", [*SMALL, *mesh])
    rt = build_runtime(cfg, jax.devices())
    abstract = abstract_params(cfg.model, rt.mesh, rt.rules)
    assert _shapes(abstract) == _shapes(abstract_params(cfg.model))
    expected = jax.tree.leaves(rt.state_shardings.params)
    got = [x.sharding for x in jax.tree.leaves(abstract)]
    assert got == expected
    assert any(s.spec != PartitionSpec() for s in got)  # the rules really shard something here


def test_abstract_params_on_a_mesh_without_rules_are_replicated():
    model = load_config("tiny", SMALL).model
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    leaves = jax.tree.leaves(abstract_params(model, mesh))
    assert leaves and all(x.sharding == NamedSharding(mesh, PartitionSpec()) for x in leaves)
