"""Next-token cross-entropy with padding mask and PaLM's z-loss, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array,
                       z_loss_weight: float = 0.0) -> dict[str, jax.Array]:
    """Sums over unmasked tokens (not means): microbatches add up exactly, then divide once.

    Returns {"loss_sum": CE + z-loss, "ce_sum": CE, "z_sum": z-loss, "tokens": count}.
    z-loss = weight * log(Z)^2 keeps the softmax normaliser near 1 (Chowdhery et al. 2022).
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    ce = (log_z - target_logit) * mask
    z = z_loss_weight * jnp.square(log_z) * mask
    return {"loss_sum": jnp.sum(ce + z), "ce_sum": jnp.sum(ce), "z_sum": jnp.sum(z), "tokens": jnp.sum(mask)}
