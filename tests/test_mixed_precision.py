"""bfloat16 that runs in bfloat16: every weight, attention and expert matmul of a compiled bf16 train
step is a bf16 x bf16 -> float32 dot, forward and backward (kernels/mixed.py), with no operand up-converted
to float32 by the compiler; the gradients match float32 autodiff to bf16 rounding; a bf16 run's losses
track float32's.

The dots are read from the compiled HLO (jaxinfra/metrics/hlo.py `dots`): an operand XLA converted up
reads f32 there. By design float32: the MoE router and the capacity routing's one-hot bookkeeping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfra.config import load_config
from jaxinfra.metrics.hlo import dots, parse_hlo
from jaxinfra.runtime import build_runtime
from kernels import mixed

SMALL = ["model.dtype=bfloat16", "model.num_layers=2", "train.seq_len=32", "train.batch_size=8",
         "model.vocab_size=256"]
FLOAT32_BY_DESIGN = ("router/", "gske,gskc->gsec")  # routing decisions and their one-hot masks


def random_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, t = cfg.train.batch_size, cfg.train.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()}


def up_converted(hlo_text: str) -> tuple[list[str], list[str]]:
    """(op names of every dot that is not bf16 x bf16 -> f32, op names of the bf16 ones), skipping the
    float32-by-design scopes."""
    bad, good = [], []
    for inst, operand_types in dots(parse_hlo(hlo_text)):
        if any(s in inst.op_name for s in FLOAT32_BY_DESIGN):
            continue
        ok = operand_types == ("bf16", "bf16") and inst.dtype == "f32"
        (good if ok else bad).append(inst.op_name or inst.name)
    return bad, good


@functools.cache
def runtime(preset: str, overrides: tuple[str, ...], devices: int):
    """One runtime per config for the whole file: its jitted step compiles once."""
    cfg = load_config(preset, [*SMALL, *overrides])
    return cfg, build_runtime(cfg, jax.devices()[:devices])


def compiled_step(preset: str, overrides: list[str], devices: int):
    cfg, rt = runtime(preset, tuple(overrides), devices)
    state, batch = rt.init_state(), rt.to_global(random_batch(cfg))
    text = rt.lower_train_step(state, batch).compile().as_text()
    _, metrics = rt.train_step(state, batch)  # the same program (jit reuses the compile)
    return text, float(jax.device_get(metrics["loss"]))


CASES = {  # name: (preset, overrides, devices, projections that must appear among the bf16 dots)
    "dense 1 device": ("tiny", ["mesh.data=1"], 1, ("attention.q", "attention.o", "mlp.down", "unembed")),
    "dense fsdp2 x tensor2": ("tiny", ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], 4,
                              ("attention.k", "mlp.gate", "unembed")),
    "MoE capacity 1 device": ("qwen3-moe-tiny", ["mesh.data=1"], 1, ("experts.gate", "experts.down")),
    "MoE dropless expert2 x fsdp2": ("qwen3-moe-tiny", ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=2",
                                                        "model.moe_dispatch=dropless"], 4,
                                     ("experts.up", "experts.down")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_step_has_only_bf16_dots(name):
    preset, overrides, devices, projections = CASES[name]
    text, loss = compiled_step(preset, overrides, devices)
    bad, good = up_converted(text)
    assert not bad, f"{name}: dots not bf16 x bf16 -> f32: {bad}"
    assert len(good) >= 12, good  # forward, input and weight gradients of every matmul
    for p in projections:
        assert any(f"{p}/" in n for n in good), (p, good)
    assert np.isfinite(loss)  # it runs: XLA:CPU refuses some bf16 dot layouts at run time


def test_the_check_sees_an_up_converted_dot():
    """Plain autodiff of a bf16 einsum with a float32 result: its weight gradient multiplies the float32
    cotangent by a bf16 operand, which XLA converts up. The checker must report it; mixed.einsum not."""
    x = jnp.ones((64, 32), jnp.bfloat16)
    w = jnp.ones((32, 48), jnp.float32)

    def plain(x, w):
        return jnp.sum(jnp.einsum("nd,df->nf", x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32))

    def ours(x, w):
        return jnp.sum(mixed.einsum("nd,df->nf", x, w, dtype=jnp.bfloat16, out_dtype=jnp.float32))

    for fn, expect_bad in ((plain, True), (ours, False)):
        text = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(x, w).compile().as_text()
        bad, good = up_converted(text)
        assert bool(bad) == expect_bad, (fn.__name__, bad, good)


EINSUMS = [  # spec, a shape, b shape: projections, a weight gradient over tokens, attention's batched dots
    ("nd,df->nf", (64, 32), (32, 48)),
    ("nd,dhk->nhk", (64, 32), (32, 2, 16)),
    ("nhk,hkd->nd", (64, 2, 16), (2, 16, 32)),
    ("btkgd,bskd->bkgts", (2, 16, 2, 2, 8), (2, 16, 2, 8)),
]


@pytest.mark.parametrize("spec,a_shape,b_shape", EINSUMS)
def test_mixed_einsum_gradients_match_float32(spec, a_shape, b_shape):
    """Value and both gradients of the bf16 einsum against float32 autodiff on the same (bf16-rounded)
    inputs: equal to bf16 rounding of the result and the cotangent (relative 2^-7 of the scale)."""
    ka, kb, kg = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(ka, a_shape).astype(jnp.bfloat16)
    b = jax.random.normal(kb, b_shape)  # a float32 master weight, cast inside
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), a, b).shape
    g = jax.random.normal(kg, out_shape)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b).astype(jnp.float32) * g)

    ours = lambda a, b: mixed.einsum(spec, a, b, dtype=jnp.bfloat16, out_dtype=jnp.float32)  # noqa: E731
    ref = lambda a, b: jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.bfloat16).astype(jnp.float32),  # noqa: E731
                                  precision=jax.lax.Precision.HIGHEST)
    (v, (da, db)), (v_ref, (da_ref, db_ref)) = (jax.value_and_grad(partial_loss, argnums=(0, 1))(a, b)
                                               for partial_loss in (lambda a, b: loss(ours, a, b),
                                                                    lambda a, b: loss(ref, a, b)))
    assert da.dtype == jnp.bfloat16 and db.dtype == jnp.float32  # each gradient in its operand's dtype
    for got, want in ((v, v_ref), (da, da_ref), (db, db_ref)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, atol=2 ** -6 * np.abs(want).max(), rtol=0)


def test_mixed_ragged_dot_matches_float32():
    """The grouped matmul (dropless MoE) and its gradients against float32 autodiff."""
    ka, kb, kg = jax.random.split(jax.random.key(1), 3)
    rows = jax.random.normal(ka, (24, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(kb, (3, 16, 8))
    sizes = jnp.array([10, 6, 8], jnp.int32)
    g = jax.random.normal(kg, (24, 8))

    def loss(fn, r, w):
        return jnp.sum(fn(r, w).astype(jnp.float32) * g)

    ours = lambda r, w: mixed.ragged_dot(r, w, sizes, dtype=jnp.bfloat16, out_dtype=jnp.float32)  # noqa: E731
    ref = lambda r, w: jax.lax.ragged_dot(r.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32),  # noqa: E731
                                          sizes, precision=jax.lax.Precision.HIGHEST)
    got = jax.value_and_grad(lambda r, w: loss(ours, r, w), argnums=(0, 1))(rows, w)
    want = jax.value_and_grad(lambda r, w: loss(ref, r, w), argnums=(0, 1))(rows, w)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, atol=2 ** -6 * np.abs(y).max(), rtol=0)


def test_float32_is_the_plain_einsum():
    """A float32 compute dtype is exactly the einsum it replaced (the float32 programs are unchanged)."""
    a, b = jnp.ones((8, 4)), jnp.ones((4, 6))
    ours = jax.jit(lambda a, b: mixed.einsum("nd,df->nf", a, b, dtype=jnp.float32)).lower(a, b).as_text()
    plain = jax.jit(lambda a, b: jnp.einsum("nd,df->nf", a, b.astype(jnp.float32),
                                            preferred_element_type=jnp.float32)).lower(a, b).as_text()
    assert ours == plain


def test_bf16_losses_track_float32():
    """A short bf16 run's losses track the float32 run's on the same batches (the 300-step `tiny`
    comparison, within 2%, is benchmarks/precision.py's)."""
    losses = {}
    for dtype, overrides in (("float32", ("mesh.data=1", "model.dtype=float32")), ("bfloat16", ("mesh.data=1",))):
        cfg, rt = runtime("tiny", overrides, 1)  # the bf16 one is the first case's (compiled once)
        state, out = rt.init_state(), []
        for step in range(12):
            state, metrics = rt.train_step(state, rt.to_global(random_batch(cfg, seed=step % 3)))
            out.append(metrics["loss"])
        losses[dtype] = np.asarray(jax.device_get(out))
    assert losses["float32"][-1] < 0.9 * losses["float32"][0]  # it learns, so the comparison means something
    # Seen: within 1e-4 relative over these 12 steps; 0.5% leaves room for other machines' rounding.
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.005)
