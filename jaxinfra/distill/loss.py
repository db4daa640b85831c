"""The distillation loss as token sums (so it chunks over the sequence and accumulates exactly).

    soft  = T^2 * KL(softmax(t / T) || softmax(s / T))      per token, t teacher and s student logits
    loss  = alpha * soft + (1 - alpha) * CE(s, labels)      (+ z-loss and MoE router losses, unweighted)

The T^2 factor keeps the soft term's gradient, T * (q_T - p_T), on the scale of the hard term's
as T grows (Hinton et al. 2015). With the teacher's top-k ids, the KL runs over those k tokens:
the teacher's k logits and the student's logits gathered at the same ids, both renormalised by
their softmax over the k (as tunix / MaxText do); k = vocabulary size is the full KL.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfra.distill.config import DistillConfig


def soft_loss_sum(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
                  temperature: jax.Array | float) -> jax.Array:
    """Sum over unmasked tokens of T^2 * KL(softmax(t/T) || softmax(s/T)) along the last axis, float32.

    The last axis is the vocabulary, or the teacher's top-k tokens (see `top_k_soft_loss_sum`)."""
    t = jnp.asarray(temperature, jnp.float32)
    log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / t, axis=-1)
    log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / t, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return t * t * jnp.sum(jnp.where(mask, kl, 0.0))


def top_k_soft_loss_sum(student_logits: jax.Array, teacher_ids: jax.Array, teacher_values: jax.Array,
                        mask: jax.Array, temperature: jax.Array | float) -> jax.Array:
    """The soft loss over the teacher's top-k tokens: ids and values [..., k], the student's
    logits [..., vocab] gathered at those ids; both renormalised over the k."""
    gathered = jnp.take_along_axis(student_logits, teacher_ids.astype(jnp.int32), axis=-1)
    return soft_loss_sum(gathered, teacher_values, mask, temperature)


def teacher_soft_loss_sum(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
                          temperature: jax.Array | float, top_k: int) -> jax.Array:
    """Online: the full-vocabulary soft loss (top_k = 0) or the one over the teacher's top_k tokens."""
    if not top_k:
        return soft_loss_sum(student_logits, teacher_logits, mask, temperature)
    values, ids = jax.lax.top_k(teacher_logits, top_k)
    return top_k_soft_loss_sum(student_logits, ids, values, mask, temperature)


def mix(sums: dict[str, jax.Array], alpha: jax.Array) -> dict[str, jax.Array]:
    """Add the soft loss to the cross-entropy sums: loss_sum + alpha * (soft - CE).

    `sums` holds `cross_entropy_sums` keys plus `soft_sum` and `teacher_ce_sum`. Written as an
    increment of the plain objective, alpha = 0 gives exactly the plain loss and gradients.
    `means` are token sums the train step reports divided by the token count."""
    ce, soft = sums["ce_sum"], sums["soft_sum"]
    delta = alpha * (soft - ce)
    means = {"loss": ce + delta, "distill_soft_loss": soft, "distill_hard_loss": ce,
             "teacher_loss": sums["teacher_ce_sum"]}
    return {**sums, "loss_sum": sums["loss_sum"] + delta, "means": means}


def scheduled(start: jax.Array | float, end: jax.Array | float | None, kind: str, step: jax.Array,
              total_steps: int) -> jax.Array:
    """`start` moved to `end` over `total_steps` (linear or half-cosine in step / total_steps);
    constant when `end` is None (or equal). `step` counts the steps completed before this one, as the lr."""
    start = jnp.asarray(start, jnp.float32)
    if end is None:
        return start
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / max(total_steps, 1), 0.0, 1.0)
    if kind == "cosine":
        frac = 0.5 * (1.0 - jnp.cos(math.pi * frac))
    return start + (jnp.asarray(end, jnp.float32) - start) * frac


def schedule_knobs(cfg: DistillConfig) -> np.ndarray:
    """[alpha, alpha_end, T, T_end] float32 (an end equal to its start when unset): a step input
    rather than constants, so runs that differ only in these share one compiled step."""
    alpha_end = cfg.alpha if cfg.alpha_end is None else cfg.alpha_end
    t_end = cfg.temperature if cfg.temperature_end is None else cfg.temperature_end
    return np.asarray([cfg.alpha, alpha_end, cfg.temperature, t_end], np.float32)


def alpha_and_temperature(knobs: jax.Array, kind: str, step: jax.Array,
                          total_steps: int) -> tuple[jax.Array, jax.Array]:
    """This step's alpha and temperature from `schedule_knobs` (start + (end - start) * f(step):
    exactly the start value when the end equals it)."""
    return (scheduled(knobs[0], knobs[1], kind, step, total_steps),
            scheduled(knobs[2], knobs[3], kind, step, total_steps))
