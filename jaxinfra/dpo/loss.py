"""DPO's loss: per-segment log-prob sums of a loss chunk, and the pair losses of TRL's `dpo_loss`.

A preference row (jaxinfra/data/preference.py) packs pairs as segments: pair k's chosen half is
segment 2k - 1 and its rejected half 2k. Each loss chunk adds, per (row, segment), the log-probs of
its completion targets under the policy and the reference (`jax.ops.segment_sum` over the flat id
row * S + segment, S = seq_len + 1: never a [B, T, S] one-hot), and the token count; the chunks add
up (jaxinfra/loss.py chunked_sums), and the step's objective turns the [B, S] sums into pairs.

With z = (pi_c - pi_r) - (ref_c - ref_r) of summed completion log-probs (TRL's `dpo_loss`):
    sigmoid  -(1 - ls) log sigmoid(beta z) - ls log sigmoid(-beta z)   (ls: label smoothing, cDPO)
    ipo      (z' - 1 / (2 beta))^2, z' from per-token MEAN log-probs (TRL normalises IPO by the
             completion's length)
    hinge    relu(1 - beta z)
Rewards are beta * (policy - reference) summed sequence log-probs, for every loss type (as TRL's
trainer logs them); accuracy counts pairs whose chosen reward exceeds the rejected one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfra.loss import target_logps

# The [rows * S] per-segment sums a chunk adds (dropped from the step's sums once paired).
SEGMENT_KEYS = ("dpo_policy", "dpo_ref", "dpo_count")
PAIR_SUMS = ("dpo_loss_sum", "dpo_chosen_sum", "dpo_rejected_sum", "dpo_correct_sum", "dpo_pairs",
             "dpo_policy_correct_sum")


def segment_sums(policy_logits: jax.Array, ref_logps: jax.Array, targets: jax.Array, segment_ids: jax.Array,
                 mask: jax.Array, segments: int) -> dict[str, jax.Array]:
    """One chunk's per-(row, segment) sums [rows * segments] of the policy's and the reference's
    completion log-probs (`mask`: the completion targets) and of the completion token counts."""
    rows = segment_ids.shape[0]
    ids = (jnp.arange(rows, dtype=jnp.int32)[:, None] * segments + segment_ids).reshape(-1)
    policy = target_logps(policy_logits, targets)

    def total(x: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(jnp.where(mask, x, 0.0).reshape(-1), ids, num_segments=rows * segments)

    return {"dpo_policy": total(policy), "dpo_ref": total(ref_logps.astype(jnp.float32)),
            "dpo_count": total(jnp.ones_like(policy))}


def pair_losses(z: jax.Array, beta: float, loss: str, label_smoothing: float = 0.0) -> jax.Array:
    """Each pair's loss from z = policy log-ratio - reference log-ratio (TRL's dpo_loss)."""
    if loss == "sigmoid":
        return (-jax.nn.log_sigmoid(beta * z) * (1 - label_smoothing)
                - jax.nn.log_sigmoid(-beta * z) * label_smoothing)
    if loss == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    if loss == "hinge":
        return jax.nn.relu(1 - beta * z)
    raise ValueError(f"dpo.loss={loss!r}: one of sigmoid, ipo, hinge")


def dpo_outputs(policy: tuple[jax.Array, jax.Array], ref: tuple[jax.Array, jax.Array],
                counts: tuple[jax.Array, jax.Array], beta: float, loss: str,
                label_smoothing: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(losses, chosen rewards, rejected rewards) per pair from the (chosen, rejected) summed
    log-probs of the policy and the reference and the completion token counts."""
    (pc, pr), (rc, rr) = policy, ref
    if loss == "ipo":  # per-token means (TRL): a long completion does not scale the squared loss
        nc, nr = (jnp.maximum(n, 1.0) for n in counts)
        z = (pc / nc - pr / nr) - (rc / nc - rr / nr)
    else:
        z = (pc - pr) - (rc - rr)
    return pair_losses(z, beta, loss, label_smoothing), beta * (pc - rc), beta * (pr - rr)


def pair_sums(sums: dict[str, jax.Array], rows: int, segments: int, beta: float, loss: str,
              label_smoothing: float) -> dict[str, jax.Array]:
    """The step's pair sums from the per-segment ones: a pair counts when both halves have
    completion tokens (padding and a row's unused segment slots have none)."""
    grid = {k: sums[k].reshape(rows, segments) for k in SEGMENT_KEYS}
    n = (segments - 1) // 2
    chosen = {k: v[:, 1:2 * n:2] for k, v in grid.items()}  # segments 1, 3, ...: pair k's chosen half
    rejected = {k: v[:, 2:2 * n + 1:2] for k, v in grid.items()}
    valid = (chosen["dpo_count"] > 0) & (rejected["dpo_count"] > 0)
    losses, cr, rr = dpo_outputs((chosen["dpo_policy"], rejected["dpo_policy"]),
                                 (chosen["dpo_ref"], rejected["dpo_ref"]),
                                 (chosen["dpo_count"], rejected["dpo_count"]), beta, loss, label_smoothing)
    total = lambda x: jnp.sum(jnp.where(valid, x, 0.0))  # noqa: E731
    return {"dpo_loss_sum": total(losses), "dpo_chosen_sum": total(cr), "dpo_rejected_sum": total(rr),
            "dpo_correct_sum": total((cr > rr).astype(jnp.float32)), "dpo_pairs": jnp.sum(valid).astype(jnp.float32),
            # the policy's own preference (chosen more likely than rejected), without the reference
            "dpo_policy_correct_sum": total((chosen["dpo_policy"] > rejected["dpo_policy"]).astype(jnp.float32))}


def pair_metrics(sums: dict[str, jax.Array], prefix: str = "") -> dict[str, jax.Array]:
    """Means over the pairs: `loss` and `dpo/loss` (the DPO loss), the rewards, their margin, accuracy."""
    pairs = jnp.maximum(sums["dpo_pairs"], 1.0)
    chosen, rejected = sums["dpo_chosen_sum"] / pairs, sums["dpo_rejected_sum"] / pairs
    out = {"dpo/loss": sums["dpo_loss_sum"] / pairs, "rewards/chosen": chosen, "rewards/rejected": rejected,
           "rewards/margin": chosen - rejected, "rewards/accuracy": sums["dpo_correct_sum"] / pairs}
    if "dpo_policy_correct_sum" in sums and prefix:  # evaluation only: the policy's own preference
        out["logps/accuracy"] = sums["dpo_policy_correct_sum"] / pairs
    return {f"{prefix}{k}": v for k, v in out.items()}
