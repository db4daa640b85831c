"""The distillation terms of one loss chunk (jaxinfra/distill/extension.py `token_sums`).

The output projections run inside `chunked_sums` (model.loss_chunk_size), so neither the
student's nor the teacher's [batch, length, vocab] float32 logits exist whole: only the hidden
states do. Each returns `soft_sum` and `teacher_ce_sum`, mixed by `jaxinfra.distill.loss.mix`.

- online: the teacher's logits from its hidden states (its forward runs in the same jitted
  step on its own params, a frozen step input: `stop_gradient` on its hidden states and logits);
- offline: the batch carries the teacher's top-k ids and logits and its per-token
  cross-entropy (`teacher_ids`, `teacher_values`, `teacher_ce`, from jaxinfra/distill/logits.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfra.distill.loss import teacher_soft_loss_sum, top_k_soft_loss_sum
from jaxinfra.loss import cross_entropy_sums

LOGIT_KEYS = ("teacher_ids", "teacher_values", "teacher_ce")  # what an offline batch adds


def online_token_sums(s: jax.Array, t: jax.Array, targets: jax.Array, mask: jax.Array, temperature: jax.Array,
                      top_k: int | None) -> dict[str, jax.Array]:
    """The soft loss against the teacher's logits `t` of this chunk, and the teacher's cross-entropy."""
    t = jax.lax.stop_gradient(t)
    return {"soft_sum": teacher_soft_loss_sum(s, t, mask, temperature, top_k),
            "teacher_ce_sum": cross_entropy_sums(t, targets, mask)["ce_sum"]}


def offline_token_sums(s: jax.Array, ids: jax.Array, values: jax.Array, teacher_ce: jax.Array, mask: jax.Array,
                       temperature: jax.Array) -> dict[str, jax.Array]:
    """The soft loss against the saved top-k logits (the first `top_k` of the saved, most likely first)."""
    return {"soft_sum": top_k_soft_loss_sum(s, ids, values, mask, temperature),
            "teacher_ce_sum": jnp.sum(jnp.where(mask, teacher_ce, 0.0))}
