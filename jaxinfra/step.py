"""The jitted training and evaluation steps (pure functions of state and batch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxinfra.loss import add_moe_sums, chunked_sums, cross_entropy_sums, moe_metrics
from jaxinfra.metrics.hlo import LOSS_SCOPE, OPTIMIZER_SCOPE
from jaxinfra.optim import global_norm, tree_all_finite
from jaxinfra.state import TrainState
from models import ModelConfig
from models.project import merge_observations, roll_histories, zero_histories
from models.router import apply_bias_updates
from sharding.plan import SINGLE_DEVICE, ParallelPlan

Batch = dict[str, jax.Array]


def _forward_sums(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, cfg: ModelConfig,
                  plan: ParallelPlan) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, params)
    h, moe_stats = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"], plan=plan)

    def token_sums(h: jax.Array, targets: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
        return cross_entropy_sums(model.logits(h, plan=plan), targets, mask, cfg.z_loss_weight)

    with jax.named_scope(LOSS_SCOPE):  # names only (for profiles, jaxinfra/metrics/hlo.py): same numerics
        sums = chunked_sums(token_sums, cfg.loss_chunk_size, h, batch["targets"], batch["segment_ids"] > 0)
    return add_moe_sums(sums, moe_stats, cfg.moe_aux_loss_weight, cfg.moe_z_loss_weight)


def _update(state: TrainState, sums: dict, grads: nnx.State, tx: optax.GradientTransformation, cfg: ModelConfig,
            nan_steps: tuple[int, ...]) -> tuple[nnx.State, optax.OptState, jax.Array, jax.Array, jax.Array]:
    """(params, opt_state, grad norm, finite, tokens): the summed gradients scaled, the optimizer
    applied, and the old state kept where the step is not finite."""
    # fp8 delayed scaling: amax histories get observations, not gradients (models/project.py).
    observed, grads = grads, zero_histories(grads)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    scale = 1.0 / tokens
    if nan_steps:
        scale = jnp.where(jnp.isin(state.step + 1, jnp.asarray(nan_steps)), jnp.nan, scale)
    grads = jax.tree.map(lambda g: g * scale, grads)
    grad_norm = global_norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # DeepSeek-V3 aux-loss-free balancing: outside the gradient. With a fixed (imported) bias,
    # rate 0 restores it exactly, so neither the optimizer nor weight decay ever moves it.
    if cfg.moe_bias_update_rate or cfg.moe_router_bias:
        params = apply_bias_updates(params, state.params, sums["moe_counts"], cfg.moe_bias_update_rate)
    params = roll_histories(params, state.params, observed)
    # The new params too: a NaN/inf learning rate or optimizer state poisons them while the loss
    # and gradients of the step still look finite.
    finite = jnp.isfinite(sums["loss_sum"]) & jnp.isfinite(grad_norm) & tree_all_finite(params)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    return keep(params, state.params), keep(opt_state, state.opt_state), grad_norm, finite, tokens


def make_train_step(graphdef: nnx.GraphDef, cfg: ModelConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int,
                    nan_steps: tuple[int, ...] = (), loss_sums: Callable[..., dict] | None = None,
                    plan: ParallelPlan = SINGLE_DEVICE) -> Callable[..., tuple[TrainState, dict]]:
    """One optimizer step over `grad_accum_steps` microbatches.

    Gradients of token *sums* are accumulated and divided once by the total token
    count, so accumulation gives exactly the large-batch gradient. A step whose loss,
    gradient norm or new params are not finite leaves params and optimizer state unchanged
    (`state.step` still counts it) and reports `nonfinite=1`. `nan_steps` injects
    NaN gradients at those (1-based) steps, for fault-tolerance tests.

    `loss_sums(params, microbatch, step, *inputs)` replaces the cross-entropy sums (distillation,
    jaxinfra/distill/step.py); `inputs` are the step's arguments after the batch (a teacher's
    params: never differentiated), and its `means` entry holds token sums reported as means.
    `plan` (sharding/plan.py) lays the model out on the devices; it is fixed when the step is
    made, so what the step traces depends only on its arguments.
    """

    def sums_and_grads(params: nnx.State, micro: Batch, step: jax.Array, inputs: tuple) -> tuple[dict, nnx.State]:
        def objective(p: nnx.State) -> tuple[jax.Array, dict]:
            sums = (loss_sums(p, micro, step, *inputs) if loss_sums is not None
                    else _forward_sums(graphdef, p, micro, cfg, plan))
            return sums["loss_sum"], sums

        (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return sums, grads

    def train_step(state: TrainState, batch: Batch, *inputs: Any) -> tuple[TrainState, dict]:
        if grad_accum_steps == 1:
            sums, grads = sums_and_grads(state.params, batch, state.step, inputs)
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum_steps, -1, *x.shape[1:]), batch)

            def accumulate(carry, mb):
                sums, grads = sums_and_grads(state.params, mb, state.step, inputs)
                return (jax.tree.map(jnp.add, carry[0], sums), merge_observations(carry[1], grads)), None

            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(sums_and_grads, state.params,
                                                                 jax.tree.map(lambda x: x[0], micro), state.step,
                                                                 inputs))
            (sums, grads), _ = jax.lax.scan(accumulate, zeros, micro)
        with jax.named_scope(OPTIMIZER_SCOPE):  # names only (for profiles): same numerics
            params, opt_state, grad_norm, finite, tokens = _update(state, sums, grads, tx, cfg, nan_steps)
        metrics = {
            "loss": sums["ce_sum"] / tokens,
            "z_loss": sums["z_sum"] / tokens,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": sums["tokens"],
            "nonfinite": (~finite).astype(jnp.int32),
            **moe_metrics(sums, tokens),
            **{k: v / tokens for k, v in sums.get("means", {}).items()},
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, cfg: ModelConfig,
                   plan: ParallelPlan = SINGLE_DEVICE) -> Callable[[nnx.State, Batch], dict]:
    """Summed cross-entropy and token count of one batch (averaged over batches by the caller)."""

    def eval_step(params: nnx.State, batch: Batch) -> dict[str, jax.Array]:
        sums = _forward_sums(graphdef, params, batch, cfg, plan)
        return {"ce_sum": sums["ce_sum"], "tokens": sums["tokens"]}

    return eval_step


def loss_fn(graphdef: nnx.GraphDef, cfg: ModelConfig,
            plan: ParallelPlan = SINGLE_DEVICE) -> Callable[[nnx.State, Batch], jax.Array]:
    """Mean cross-entropy of a batch: what tests differentiate."""

    def loss(params: nnx.State, batch: Batch) -> jax.Array:
        sums = _forward_sums(graphdef, params, batch, cfg, plan)
        return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1.0)

    return loss
