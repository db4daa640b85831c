"""Next-token cross-entropy with padding mask and PaLM's z-loss, in float32; MoE router losses and metrics.

The loss is a sum over tokens, so it can be computed over sequence chunks (`chunked_sums`):
only one chunk's [batch, chunk, vocab] float32 logits exist at a time, in the forward and
(rematerialised) in the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from models.router import load_stats


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


def target_logps(logits: jax.Array, targets: jax.Array, temperature: jax.Array | float = 1.0) -> jax.Array:
    """float32 log-prob of each target id under softmax(logits / temperature): [..., V] logits and
    [...] targets -> [...]. The one definition the sampler records (jaxinfra/infer/generation.py)
    and the trainers recompute (DPO's sequence log-probs, GRPO's ratios), so they compare like with like."""
    scaled = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def chunked_sums(fn: Callable[..., dict[str, jax.Array]], chunk: int, *arrays: jax.Array) -> dict[str, jax.Array]:
    """sum over sequence chunks of fn(*chunks): every array is [B, T, ...] and is cut along T.

    `fn` returns a dict of token sums (e.g. `cross_entropy_sums` of a chunk's logits); it runs
    under `jax.checkpoint` inside a `lax.scan`, so its intermediates (the chunk's logits) are
    rebuilt in the backward instead of kept: peak memory holds one chunk's, not the sequence's.
    Chunks interleave (chunk j = positions j, j + n, ...; n = T / chunk) so that a sequence
    axis sharded over `context` or `tensor` keeps its sharding: no gather on entry.
    chunk 0 (or >= T): one call on the whole arrays.
    """
    t = arrays[0].shape[1]
    if not chunk or chunk >= t:
        return fn(*arrays)
    if t % chunk:
        raise ValueError(f"loss chunk {chunk} does not divide the sequence length {t}")
    n = t // chunk
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], chunk, n, *x.shape[2:]), 2, 0)  # noqa: E731
    pieces = tuple(split(x) for x in arrays)  # [n, B, chunk, ...]
    one = jax.checkpoint(fn)

    def body(total, xs):
        return jax.tree.map(jnp.add, total, one(*xs)), None

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *(x[0] for x in pieces)))
    total, _ = jax.lax.scan(body, zeros, pieces)
    return total


def add_moe_sums(sums: dict[str, jax.Array], stats: dict[str, jax.Array], aux_loss_weight: float,
                 z_loss_weight: float) -> dict[str, jax.Array]:
    """Add one microbatch's MoE router terms (models/moe.py statistics, stacked over MoE layers).

    The load-balancing and router z-losses are per-batch means, summed over MoE layers (as
    Switch and ST-MoE add one per layer); they enter `loss_sum` multiplied by the token count,
    so that dividing by tokens once (as for cross-entropy) gives their token-weighted mean
    over microbatches. Expert counts and drops are plain sums, exact under accumulation.
    A dense model (no statistics) is returned unchanged.
    """
    if not stats:
        return sums
    tokens = sums["tokens"]
    aux, z = stats["aux_loss"], stats["z_loss"]
    extra = aux_loss_weight * jnp.sum(aux) + z_loss_weight * jnp.sum(z)
    return {**sums, "loss_sum": sums["loss_sum"] + tokens * extra,
            "moe_aux_sum": tokens * jnp.mean(aux), "moe_z_sum": tokens * jnp.mean(z),
            "moe_counts": stats["counts"], "moe_dropped": jnp.sum(stats["dropped"])}


def moe_metrics(sums: dict[str, jax.Array], tokens: jax.Array) -> dict[str, jax.Array]:
    """Scalar MoE metrics for the metrics line, averaged over MoE layers ({} for a dense model).

    moe_aux_loss, moe_z_loss: unweighted router losses (aux is 1 when perfectly balanced);
    moe_load_max / moe_load_min / moe_load_cv: expert load relative to the mean and its
    coefficient of variation; moe_dropped_frac: share of assignments dropped for capacity."""
    if "moe_counts" not in sums:
        return {}
    counts = sums["moe_counts"]
    return {"moe_aux_loss": sums["moe_aux_sum"] / tokens, "moe_z_loss": sums["moe_z_sum"] / tokens,
            **load_stats(counts), "moe_dropped_frac": sums["moe_dropped"] / jnp.maximum(jnp.sum(counts), 1.0)}
