"""GRPO's per-token loss terms (Shao et al. 2024; the clipped surrogate of PPO, per token).

For a completion token with log-prob logp under the policy being trained (`target_logps` of the
logits / temperature: the sampler's definition, jaxinfra/loss.py), old_logp under the sampler
that drew it, advantage A of its row and ref_logp under the frozen reference:

    ratio = exp(logp - old_logp)
    pg    = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
    kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1          (k3, Schulman 2020; >= 0)
    loss_sum = sum over completion tokens of (pg + kl_beta * kl)

and the step divides by the count of completion tokens of the global batch (token-level
normalisation, as DAPO / TRL's default "dapo" loss: every generated token weighs the same, so long
completions are not down-weighted per token). A token is "clipped" when the clipped term is the
one taken and differs from the unclipped one: ratio < 1 - eps with A < 0, or ratio > 1 + eps with A > 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PG_SUM, KL_SUM, CLIP_SUM = "grpo_pg_sum", "grpo_kl_sum", "grpo_clip_sum"


def grpo_token_sums(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                    clip_eps: float, ref_logp: jax.Array | None = None) -> dict[str, jax.Array]:
    """Sums over the masked tokens of the policy-gradient term, the k3 KL (0 without a reference)
    and the clipped-token count; every array is [...] float32 (mask bool)."""
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = -jnp.minimum(ratio * advantages, clipped * advantages)
    active = ((ratio < 1.0 - clip_eps) & (advantages < 0)) | ((ratio > 1.0 + clip_eps) & (advantages > 0))
    out = {PG_SUM: jnp.sum(jnp.where(mask, pg, 0.0)),
           CLIP_SUM: jnp.sum(jnp.where(mask, active, False)).astype(jnp.float32)}
    if ref_logp is None:
        out[KL_SUM] = jnp.zeros((), jnp.float32)
    else:
        d = ref_logp - logp
        out[KL_SUM] = jnp.sum(jnp.where(mask, jnp.exp(d) - d - 1.0, 0.0))
    return out
