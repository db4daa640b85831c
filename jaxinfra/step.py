"""The jitted training and evaluation steps (pure functions of state and batch).

Features join the step through `jaxinfra/extensions.py` hooks (loss terms, batch fields, frozen
inputs, own state, post-update), never through branches here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxinfra.extensions import StepContext, StepExtension, defines_loss_mask
from jaxinfra.loss import add_moe_sums, chunked_sums, cross_entropy_sums, moe_metrics
from jaxinfra.metrics.hlo import LOSS_SCOPE, OPTIMIZER_SCOPE
from jaxinfra.optim import global_norm, tree_all_finite
from jaxinfra.state import TrainState
from models import ModelConfig
from models.project import merge_observations
from sharding.plan import SINGLE_DEVICE, ParallelPlan

Batch = dict[str, jax.Array]
DROPOUT_SEED = 0x10A  # the training forward's dropout keys are this seed folded with the step number
SumsFn = Callable[..., dict[str, jax.Array]]


def _split_counts(flat: Sequence[jax.Array], counts: Sequence[int]) -> list[tuple[jax.Array, ...]]:
    out, at = [], 0
    for n in counts:
        out.append(tuple(flat[at:at + n]))
        at += n
    return out


def _loss_mask(batch: Batch, masks: Sequence[tuple[StepExtension, StepContext]]) -> jax.Array:
    """The real targets (`segment_ids > 0`) ANDed with every extension's loss_mask (None: no limit)."""
    mask = batch["segment_ids"] > 0
    for e, c in masks:
        limit = e.loss_mask(c)
        if limit is not None:
            mask = mask & limit
    return mask


def forward_sums(graphdef: nnx.GraphDef, cfg: ModelConfig, extensions: Sequence[StepExtension] = (),
                 plan: ParallelPlan = SINGLE_DEVICE, masks: Sequence[StepExtension] = ()) -> SumsFn:
    """sums(variables, batch, step, inputs, ext_state): the token sums of one (micro)batch.

    `variables` is a tuple of States merged into the model (params, stats); `inputs` holds each
    extension's frozen inputs, `ext_state` their own state by name. Without extensions this is
    the plain cross-entropy (+ z-loss, + MoE router terms) program. Every extension's `loss_mask`
    limits the targets that count; `masks` are extensions taken for that hook alone (the eval
    step's: no frozen inputs, no loss terms). `plan` (sharding/plan.py) lays the model out on
    the devices; it is fixed here, so what is traced depends only on the arguments."""

    def sums_fn(variables: tuple[nnx.State, ...], batch: Batch, step: Any = None, inputs: tuple = (),
                ext_state: dict | None = None) -> dict[str, jax.Array]:
        model = nnx.merge(graphdef, *variables)
        # Training draws a per-step key for a stochastic model (LoRA dropout); evaluation (no step) none.
        rng = jax.random.fold_in(jax.random.key(DROPOUT_SEED), step) if step is not None and model.stochastic else None
        h, moe_stats = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"], plan=plan, rng=rng)
        ctxs = [StepContext(model, batch, step, x, (ext_state or {}).get(e.name), plan)
                for e, x in zip(extensions, inputs or ((),) * len(extensions), strict=True)]
        extra = [e.per_token(c, h) for e, c in zip(extensions, ctxs)]
        counts, flat = [len(x) for x in extra], [a for x in extra for a in x]

        def token_sums(h: jax.Array, *rest: jax.Array) -> dict[str, jax.Array]:
            *chunk, targets, mask = rest
            logits = model.logits(h, plan=plan)
            sums = cross_entropy_sums(logits, targets, mask, cfg.z_loss_weight)
            for e, c, part in zip(extensions, ctxs, _split_counts(chunk, counts)):
                sums = {**sums, **e.token_sums(c, logits, part, targets, mask)}
            return sums

        mask = _loss_mask(batch, [*zip(extensions, ctxs),
                                  *((m, StepContext(model, batch, step, plan=plan)) for m in masks)])
        with jax.named_scope(LOSS_SCOPE):  # names only (for profiles, jaxinfra/metrics/hlo.py): same numerics
            sums = chunked_sums(token_sums, cfg.loss_chunk_size, h, *flat, batch["targets"], mask)
        for e, c in zip(extensions, ctxs):
            sums = e.objective(c, sums)
        return add_moe_sums(sums, moe_stats, cfg.moe_aux_loss_weight, cfg.moe_z_loss_weight)

    return sums_fn


def _trainable(params: nnx.State, trainable: Any) -> tuple[nnx.State, nnx.State]:
    """(what the optimizer trains, the frozen rest); all of it without a filter."""
    if trainable is None:
        return params, nnx.State({})
    return nnx.split_state(params, trainable, ...)


def _update(state: TrainState, sums: dict, grads: nnx.State, observed: nnx.State, tx: optax.GradientTransformation,
            extensions: Sequence[StepExtension], trainable: Any) -> tuple[TrainState, jax.Array, jax.Array, jax.Array]:
    """(new state, grad norm, finite, tokens): the summed gradients scaled, the optimizer applied, the
    extensions' post-update hooks run, and the old state kept where the step is not finite (the
    step count is the caller's to advance)."""
    tokens = jnp.maximum(sums["tokens"], 1.0)
    scale = 1.0 / tokens
    grads = jax.tree.map(lambda g: g * scale, grads)
    grad_norm = global_norm(grads)
    params, frozen = _trainable(state.params, trainable)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    params = optax.apply_updates(params, updates)
    if trainable is not None:
        params = nnx.merge_state(params, frozen)
    new = state.replace(params=params, opt_state=opt_state)
    for e in extensions:  # e.g. the router bias and amax histories (jaxinfra/extensions.py ModelStats)
        new = e.post_update(new, state, sums, observed)
    # The new params too: a NaN/inf learning rate or optimizer state poisons them while the loss
    # and gradients of the step still look finite.
    finite = (jnp.isfinite(sums["loss_sum"]) & jnp.isfinite(grad_norm)
              & tree_all_finite((new.params, new.stats, new.ext)))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    new = TrainState(step=state.step, params=keep(new.params, state.params),
                     opt_state=keep(new.opt_state, state.opt_state), stats=keep(new.stats, state.stats),
                     ext=keep(new.ext, state.ext))
    return new, grad_norm, finite, tokens


def make_train_step(graphdef: nnx.GraphDef, cfg: ModelConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int, extensions: Sequence[StepExtension] = (),
                    trainable: Any = None,
                    plan: ParallelPlan = SINGLE_DEVICE) -> Callable[..., tuple[TrainState, dict]]:
    """train_step(state, batch, inputs): one optimizer step over `grad_accum_steps` microbatches.

    Gradients of token *sums* are accumulated and divided once by the total token
    count, so accumulation gives exactly the large-batch gradient. A step whose loss,
    gradient norm or new state are not finite leaves params, stats and optimizer state unchanged
    (`state.step` still counts it) and reports `nonfinite=1`.

    `inputs` is a tuple with each extension's frozen inputs (never differentiated); the model's
    Stats are differentiated only for their cotangents, observations the post-update hooks use
    (fp8 amax); `trainable` (an nnx filter, jaxinfra/extensions.py) limits what the optimizer trains.
    `plan` (sharding/plan.py) is fixed when the step is made.
    """
    extensions = tuple(extensions)
    sums_fn = forward_sums(graphdef, cfg, extensions, plan)

    def sums_and_grads(state: TrainState, micro: Batch, inputs: tuple) -> tuple[dict, nnx.State, nnx.State]:
        params, frozen = _trainable(state.params, trainable)

        def objective(p: nnx.State, stats: nnx.State) -> tuple[jax.Array, dict]:
            sums = sums_fn((p, frozen, stats), micro, state.step, inputs, state.ext)
            return sums["loss_sum"], sums

        (_, sums), (grads, observed) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(params, state.stats)
        return sums, grads, observed

    def train_step(state: TrainState, batch: Batch, inputs: tuple = ()) -> tuple[TrainState, dict]:
        if grad_accum_steps == 1:
            sums, grads, observed = sums_and_grads(state, batch, inputs)
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum_steps, -1, *x.shape[1:]), batch)

            def accumulate(carry, mb):
                sums, grads, observed = sums_and_grads(state, mb, inputs)
                return (jax.tree.map(jnp.add, carry[0], sums), jax.tree.map(jnp.add, carry[1], grads),
                        merge_observations(carry[2], observed)), None

            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(sums_and_grads, state,
                                                                 jax.tree.map(lambda x: x[0], micro), inputs))
            (sums, grads, observed), _ = jax.lax.scan(accumulate, zeros, micro)
        with jax.named_scope(OPTIMIZER_SCOPE):  # names only (for profiles): same numerics
            new, grad_norm, finite, tokens = _update(state, sums, grads, observed, tx, extensions, trainable)
        metrics = {
            "loss": sums["ce_sum"] / tokens,
            "z_loss": sums["z_sum"] / tokens,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": sums["tokens"],
            "nonfinite": (~finite).astype(jnp.int32),
            **moe_metrics(sums, tokens),
        }
        for e in extensions:
            metrics.update(e.metrics(sums, tokens))
        return new.replace(step=state.step + 1), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, cfg: ModelConfig, plan: ParallelPlan = SINGLE_DEVICE,
                   extensions: Sequence[StepExtension] = ()) -> Callable[[nnx.State, Batch], dict]:
    """Summed cross-entropy and token count of one batch (averaged over batches by the caller);
    `variables` are the model's (jaxinfra/state.py model_state). Of `extensions` only the loss
    masks apply (jaxinfra/extensions.py), so an SFT run's eval loss is per trained token too."""
    sums_fn = forward_sums(graphdef, cfg, plan=plan, masks=[e for e in extensions if defines_loss_mask(e)])

    def eval_step(variables: nnx.State, batch: Batch) -> dict[str, jax.Array]:
        sums = sums_fn((variables,), batch)
        return {"ce_sum": sums["ce_sum"], "tokens": sums["tokens"]}

    return eval_step


def loss_fn(graphdef: nnx.GraphDef, cfg: ModelConfig,
            plan: ParallelPlan = SINGLE_DEVICE) -> Callable[[nnx.State, Batch], jax.Array]:
    """Mean cross-entropy of a batch: what tests differentiate."""

    sums_fn = forward_sums(graphdef, cfg, plan=plan)

    def loss(variables: nnx.State, batch: Batch) -> jax.Array:
        sums = sums_fn((variables,), batch)
        return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1.0)

    return loss
