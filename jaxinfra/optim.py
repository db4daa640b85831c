"""Learning-rate schedules and the AdamW optimizer (decay mask, clipping)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxinfra.config import OptimizerConfig, ScheduleConfig
from models.layers import Bias


def make_schedule(sched: ScheduleConfig, peak_lr: float, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to peak_lr, then cosine / linear / WSD / constant down to peak * min_lr_ratio."""
    warmup = min(sched.warmup_steps, total_steps)
    floor = peak_lr * sched.min_lr_ratio
    decay_steps = max(total_steps - warmup, 1)
    if sched.name == "cosine":
        after = optax.cosine_decay_schedule(peak_lr, decay_steps, alpha=sched.min_lr_ratio)
    elif sched.name == "linear":
        after = optax.linear_schedule(peak_lr, floor, decay_steps)
    elif sched.name == "constant":
        after = optax.constant_schedule(peak_lr)
    elif sched.name == "wsd":
        # Warmup-stable-decay (MiniCPM, Hu et al. 2024): hold the peak, then decay linearly
        # over the final decay_fraction of all steps.
        cool = max(int(round(total_steps * sched.decay_fraction)), 1)
        stable = max(decay_steps - cool, 0)
        after = optax.join_schedules(
            [optax.constant_schedule(peak_lr), optax.linear_schedule(peak_lr, floor, cool)], [stable])
    else:  # pragma: no cover - the config's Literal rejects other names
        raise ValueError(sched.name)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup), after], [warmup])


def decay_mask(params: Any, opt: OptimizerConfig) -> Any:
    """True where weight decay applies: matrices; norm scales, biases and embeddings only when asked.

    Decided from each parameter's logical axes, so new layers need no new rule.
    """

    def wants_decay(v: nnx.Variable) -> bool:
        names = tuple(v.get_metadata().get("out_sharding") or ())
        if len(names) - ("layers" in names) == 1 or isinstance(v, Bias):  # a norm scale or a bias
            return opt.decay_norms
        if "vocab" in names:
            return opt.decay_embeddings
        return True

    return jax.tree.map(wants_decay, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(opt: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with the decay mask; the lr follows `schedule`."""
    parts = []
    if opt.clip_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(opt.clip_grad_norm))
    parts.append(optax.adamw(schedule, b1=opt.beta1, b2=opt.beta2, eps=opt.eps,
                             weight_decay=opt.weight_decay, mask=lambda p: decay_mask(p, opt)))
    return optax.chain(*parts)


def global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def tree_all_finite(tree: Any) -> jax.Array:
    """A boolean scalar: every element of every array in `tree` is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


_all_finite_jit = jax.jit(tree_all_finite)


def all_finite(tree: Any) -> bool:
    """`tree_all_finite` on the host's side: one jitted reduction, one sync."""
    return bool(_all_finite_jit(tree))
