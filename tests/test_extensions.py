"""The step-extension seam (jaxinfra/extensions.py): an extension's loss term, batch field, frozen
input, own state and trainable subset, each checked against a plain computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from parity import PARAM_ATOL, packed_batches, parity_config

from jaxinfra.checkpoint import Checkpointer, abstract_with_shardings
from jaxinfra.config import CheckpointConfig, OptimizerConfig, load_config
from jaxinfra.extensions import StepContext, StepExtension
from jaxinfra.loss import cross_entropy_sums
from jaxinfra.optim import global_norm
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_state
from models import ModelConfig
from models.router import RouterBias

V, BATCH, SEQ = 64, 4, 16
MODEL = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    loss_chunk_size=4)  # the extension's per-token field is cut into chunks like the hidden states
OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad_norm=None, eps=1e-5)  # eps: see tests/test_step.py


class LogitPenalty(StepExtension):
    """Adds weight * sum_t w_t * mean(logits_t^2) to the objective (w: a batch field, weight: a frozen
    step input) and counts the tokens it has seen in its own state."""

    name = "logit_penalty"
    metric_names = ("logit_sq",)

    def __init__(self, weight: float):
        self.weight = np.float32(weight)

    def inputs(self):
        return self.weight

    def input_shardings(self):
        return None  # jit's default: replicated

    def init_state(self, params):
        return {"seen": jnp.zeros((), jnp.float32)}

    def per_token(self, ctx: StepContext, hidden):
        return (ctx.batch["token_weight"],)

    def token_sums(self, ctx, logits, per_token, targets, mask):
        sq = jnp.mean(jnp.square(logits.astype(jnp.float32)), axis=-1)
        return {"logit_sq_sum": jnp.sum(jnp.where(mask, per_token[0] * sq, 0.0))}

    def objective(self, ctx, sums):
        return {**sums, "loss_sum": sums["loss_sum"] + ctx.inputs * sums["logit_sq_sum"]}

    def metrics(self, sums, tokens):
        return {"logit_sq": sums["logit_sq_sum"] / tokens}

    def post_update(self, new, old, sums, observed):
        return new.replace(ext={**new.ext, self.name: {"seen": old.ext[self.name]["seen"] + sums["tokens"]}})


class LayersOnly(StepExtension):
    """A trainable subset (as LoRA adapters over a frozen base will be): the optimizer sees the layers only."""

    name = "layers_only"
    trainable = nnx.All(nnx.Param, nnx.PathContains("layers"))


def _batch(seed: int = 1) -> dict[str, np.ndarray]:
    batch = dict(packed_batches(BATCH, SEQ, V, 1, seed=seed)[0])
    batch["token_weight"] = np.random.default_rng(seed).uniform(0.5, 2.0, (BATCH, SEQ)).astype(np.float32)
    return batch


def _plain_loss(rt, params, batch: dict, weight: float) -> jax.Array:
    """The same objective written out: whole-sequence logits, no chunks, no hooks."""
    model = nnx.merge(rt.graphdef, params)
    h, _ = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
    logits, mask = model.logits(h), batch["segment_ids"] > 0
    sums = cross_entropy_sums(logits, batch["targets"], mask, MODEL.z_loss_weight)
    sq = jnp.sum(jnp.where(mask, batch["token_weight"] * jnp.mean(jnp.square(logits), axis=-1), 0.0))
    return (sums["loss_sum"] + weight * sq) / sums["tokens"], sq / sums["tokens"]


@pytest.fixture(scope="module")
def penalty_run():
    cfg = parity_config(MODEL, OPT, {}, batch=BATCH, seq=SEQ)
    rt = build_runtime(cfg, jax.devices()[:1], extensions=[LogitPenalty(0.3)])
    state = rt.init_state()
    before = jax.device_get(state)
    state, metrics = rt.train_step(state, rt.to_global(_batch()))
    return rt, before, jax.device_get(state), jax.device_get(metrics), state


def test_loss_term_batch_field_and_frozen_input_match_the_plain_objective(penalty_run):
    rt, before, after, metrics, _ = penalty_run
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    # jitted: one program each instead of the reference compiled op by op (the cold-cache cost)
    plain = jax.jit(jax.value_and_grad(lambda p: _plain_loss(rt, p, batch, 0.3), has_aux=True))
    (loss, sq), grads = plain(before.params)
    assert float(metrics["logit_sq"]) == pytest.approx(float(sq), rel=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(float(jax.jit(global_norm)(grads)), rel=1e-5)
    want = jax.jit(lambda g, o, p: optax.apply_updates(p, rt.tx.update(g, o, p)[0]))(
        grads, before.opt_state, before.params)
    for got, w in zip(jax.tree.leaves(after.params), jax.tree.leaves(want), strict=True):
        # chunked vs whole-sequence logits round differently; Adam scales that by lr / eps
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-5, atol=PARAM_ATOL)
    assert float(loss) > float(metrics["loss"])  # the reported cross-entropy excludes the penalty


def test_own_state_is_outside_the_optimizer_updated_after_it_and_checkpointed(penalty_run, tmp_path):
    rt, before, after, metrics, state = penalty_run
    assert float(before.ext["logit_penalty"]["seen"]) == 0.0
    assert float(after.ext["logit_penalty"]["seen"]) == float(metrics["tokens"])
    plain = abstract_state(MODEL, rt.tx)  # the optimizer state of the params alone
    assert jax.tree.structure(plain.opt_state) == jax.tree.structure(after.opt_state)
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(async_save=False))
    ckpt.save(1, state, {}, {})
    ckpt.close()
    target = abstract_with_shardings(rt.abstract_state(), rt.state_shardings)
    _, restored, _, _ = Checkpointer(tmp_path / "checkpoints", CheckpointConfig()).restore_latest(target)
    assert float(restored.ext["logit_penalty"]["seen"]) == float(metrics["tokens"])


def test_trainable_subset_leaves_the_rest_frozen_and_out_of_the_optimizer():
    cfg = parity_config(MODEL, OPT, {}, batch=BATCH, seq=SEQ)
    rt = build_runtime(cfg, jax.devices()[:1], extensions=[LayersOnly()])
    state = rt.init_state()
    before = jax.device_get(state.params)
    batch = {k: v for k, v in _batch().items() if k != "token_weight"}
    state, _ = rt.train_step(state, rt.to_global(batch))
    after = jax.device_get(state.params)
    moved = {"/".join(map(str, p)): not np.array_equal(np.asarray(a[...]), np.asarray(b[...]))
             for (p, a), (_, b) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after))}
    assert moved and all(m == ("layers" in path) for path, m in moved.items()), moved
    trained = nnx.split_state(abstract_state(MODEL, rt.tx).params, LayersOnly.trainable, ...)[0]
    assert len(jax.tree.leaves(state.opt_state)) == len(jax.tree.leaves(abstract_state(MODEL, rt.tx).opt_state)) - (
        2 * (len(jax.tree.leaves(abstract_state(MODEL, rt.tx).params)) - len(jax.tree.leaves(trained))))


def test_router_bias_is_a_stat_beside_the_params_not_in_the_optimizer():
    cfg = load_config("deepseek-tiny")
    tx = optax.adamw(1e-3)
    state = abstract_state(cfg.model, tx)
    in_stats = [v for v in jax.tree.leaves(state.stats, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    assert in_stats and all(isinstance(v, RouterBias) for v in in_stats)
    flat_opt = ocp.tree.to_flat_dict(state.opt_state, sep="/")
    flat_params = ocp.tree.to_flat_dict(state.params, sep="/")
    assert not any("router/bias" in k for k in (*flat_opt, *flat_params))
