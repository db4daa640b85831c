"""The jitted training and evaluation steps (pure functions of state and batch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxinfra.loss import cross_entropy_sums
from jaxinfra.optim import global_norm
from jaxinfra.state import TrainState
from models import ModelConfig

Batch = dict[str, jax.Array]


def _forward_sums(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, cfg: ModelConfig) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    return cross_entropy_sums(logits, batch["targets"], batch["segment_ids"] > 0, cfg.z_loss_weight)


def make_train_step(graphdef: nnx.GraphDef, cfg: ModelConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """One optimizer step over `grad_accum_steps` microbatches.

    Gradients of token *sums* are accumulated and divided once by the total token
    count, so accumulation gives exactly the large-batch gradient.
    """

    def sums_and_grads(params: nnx.State, micro: Batch) -> tuple[dict, nnx.State]:
        def objective(p: nnx.State) -> tuple[jax.Array, dict]:
            sums = _forward_sums(graphdef, p, micro, cfg)
            return sums["loss_sum"], sums

        (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return sums, grads

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        if grad_accum_steps == 1:
            sums, grads = sums_and_grads(state.params, batch)
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum_steps, -1, *x.shape[1:]), batch)

            def accumulate(carry, mb):
                sums, grads = sums_and_grads(state.params, mb)
                return jax.tree.map(jnp.add, carry, (sums, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(sums_and_grads, state.params,
                                                                 jax.tree.map(lambda x: x[0], micro)))
            (sums, grads), _ = jax.lax.scan(accumulate, zeros, micro)
        tokens = jnp.maximum(sums["tokens"], 1.0)
        grads = jax.tree.map(lambda g: g / tokens, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": sums["ce_sum"] / tokens,
            "z_loss": sums["z_sum"] / tokens,
            "grad_norm": global_norm(grads),
            "lr": schedule(state.step),
            "tokens": sums["tokens"],
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, cfg: ModelConfig) -> Callable[[nnx.State, Batch], dict]:
    """Summed cross-entropy and token count of one batch (averaged over batches by the caller)."""

    def eval_step(params: nnx.State, batch: Batch) -> dict[str, jax.Array]:
        sums = _forward_sums(graphdef, params, batch, cfg)
        return {"ce_sum": sums["ce_sum"], "tokens": sums["tokens"]}

    return eval_step


def loss_fn(graphdef: nnx.GraphDef, cfg: ModelConfig) -> Callable[[nnx.State, Batch], jax.Array]:
    """Mean cross-entropy of a batch: what tests differentiate."""

    def loss(params: nnx.State, batch: Batch) -> jax.Array:
        sums = _forward_sums(graphdef, params, batch, cfg)
        return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1.0)

    return loss
