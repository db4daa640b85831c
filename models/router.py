"""Token-choice top-k router for Mixture-of-Experts layers, with its balancing statistics.

Scores: softmax over experts (Switch, GShard, Mixtral, Qwen-MoE) or per-expert sigmoid
affinities (DeepSeek-V3). Selection: top-k, optionally restricted to the best
`moe_top_k_groups` of `moe_num_groups` expert groups (DeepSeek-V2 sec. 2.1.2 "device-limited
routing", DeepSeek-V3's node-limited form: a group scores the sum of its two best experts),
and optionally biased by DeepSeek-V3's auxiliary-loss-free balancing term, which steers only
*which* experts are chosen, never the weights they get.

Weights: the selected scores, renormalised to sum to 1 if `moe_norm_top_k`, times
`moe_routed_scale`.

Statistics (over real tokens only; padding is masked out):
* `counts` [E]: assignments per expert (token x choice), before any capacity drop;
* `aux_loss`: E * sum_i f_i * P_i, f_i the fraction of assignments to expert i and P_i the
  mean routing probability of i (Switch Transformer, Fedus et al. 2021, eq. 4; GShard,
  Lepikhin et al. 2020). 1 when perfectly balanced. For sigmoid scores P uses the scores
  normalised per token (DeepSeek-V3's complementary sequence-wise loss, eq. 17-20);
* `z_loss`: mean over tokens of logsumexp(router logits)^2 (ST-MoE, Zoph et al. 2022, eq. 5).
"""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import param, zeros_bias
from models.project import Projections, prepare_weights, project_attr
from models.quant_config import NO_QUANT, QuantConfig
from models.stat import Stat


class RouterBias(Stat):
    """DeepSeek-V3's per-expert selection bias: a Stat (models/stat.py), so it lives beside the params
    (checkpoints, shardings) but outside the optimizer; it enters only the discrete top-k, and the
    train step moves it after the optimizer with `update_bias`."""


@flax.struct.dataclass
class Routing:
    experts: jax.Array  # [N, k] int32 chosen expert ids
    weights: jax.Array  # [N, k] float32 combine weights
    counts: jax.Array  # [E] float32 assignments per expert (real tokens)
    aux_loss: jax.Array  # scalar load-balancing loss
    z_loss: jax.Array  # scalar router z-loss
    # Additive parts of the losses (sums over real tokens), from which `router_losses` rebuilds
    # them for a batch split into microbatches (the pipeline, sharding/pipeline.py).
    prob_sum: jax.Array  # [E] sum of routing probabilities
    z_sum: jax.Array  # scalar sum of logsumexp(logits)^2
    tokens: jax.Array  # scalar count of real tokens


class Router(nnx.Module):
    PROJECTIONS: ClassVar[Projections] = {"w": ("router", (-2,))}  # models/project.py prepare_weights

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT):
        # The router matrix is tiny and read by every token: kept replicated over `expert`.
        self.w = param(rngs, (cfg.d_model, cfg.moe_num_experts), ("embed", None), cfg.init_std, cfg.param_dtype)
        if cfg.moe_bias_update_rate > 0 or cfg.moe_router_bias:
            self.bias = RouterBias(jnp.zeros((cfg.moe_num_experts,), jnp.float32), out_sharding=("experts",),
                                   eager_sharding=False)
        if cfg.moe_router_logit_bias:  # gpt-oss: a trained bias on the logits (selection and weights alike)
            self.logit_bias = zeros_bias((cfg.moe_num_experts,), (None,), cfg.param_dtype)
        self.cfg = cfg
        prepare_weights(self, quant, self.PROJECTIONS, jnp.float32)

    def __call__(self, rows: jax.Array, mask: jax.Array) -> Routing:
        """rows [N, d], mask [N] (True for real tokens)."""
        # Routing in float32: top-k decisions flip on bfloat16 rounding of near-equal logits.
        logits = project_attr(self, "nd,de->ne", rows.astype(jnp.float32), "w")
        if hasattr(self, "logit_bias"):
            logits = logits + self.logit_bias[...].astype(jnp.float32)
        bias = jax.lax.stop_gradient(self.bias[...]) if hasattr(self, "bias") else None
        return route(logits, mask, self.cfg, bias)


def route(logits: jax.Array, mask: jax.Array, cfg: ModelConfig, bias: jax.Array | None = None) -> Routing:
    """Top-k routing of float32 logits [N, E]; see the module docstring."""
    n, e = logits.shape
    k = cfg.moe_top_k
    if cfg.moe_router_score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = scores if bias is None else scores + bias
    choice = jax.lax.stop_gradient(choice)
    if cfg.moe_num_groups > 1 and cfg.moe_top_k_groups < cfg.moe_num_groups:
        choice = _limit_to_top_groups(choice, cfg.moe_num_groups, cfg.moe_top_k_groups)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.moe_norm_top_k:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.moe_routed_scale

    m = mask.astype(jnp.float32)
    tokens = jnp.sum(m)
    counts = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32) * m[:, None, None], axis=(0, 1))
    prob_sum = jnp.sum(probs * m[:, None], axis=0)
    z_sum = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * m)
    aux_loss, z_loss = router_losses(counts, prob_sum, z_sum, tokens, k)
    return Routing(experts.astype(jnp.int32), weights, counts, aux_loss, z_loss, prob_sum, z_sum, tokens)


def router_losses(counts: jax.Array, prob_sum: jax.Array, z_sum: jax.Array, tokens: jax.Array,
                  top_k: int) -> tuple[jax.Array, jax.Array]:
    """(aux_loss, z_loss) from additive sums over a batch's real tokens: counts, prob_sum [..., E],
    z_sum, tokens [...]. Summing these over microbatches first gives the whole batch's losses."""
    e = counts.shape[-1]
    tokens = jnp.maximum(tokens, 1.0)[..., None]
    mean_prob = prob_sum / tokens
    aux_loss = e * jnp.sum(jax.lax.stop_gradient(counts / (tokens * top_k)) * mean_prob, axis=-1)
    return aux_loss, z_sum / tokens[..., 0]


def _limit_to_top_groups(choice: jax.Array, groups: int, keep: int) -> jax.Array:
    """-inf for experts outside each token's `keep` best groups (a group scores the sum of its
    two best experts, DeepSeek-V3; its only expert when groups hold one)."""
    n, e = choice.shape
    per_group = choice.reshape(n, groups, e // groups)
    group_score = jnp.sum(jax.lax.top_k(per_group, min(2, e // groups))[0], axis=-1)  # [N, G]
    _, top_groups = jax.lax.top_k(group_score, keep)
    allowed = jnp.sum(jax.nn.one_hot(top_groups, groups, dtype=jnp.bool_), axis=1, dtype=jnp.bool_)  # [N, G]
    return jnp.where(allowed[:, :, None], per_group, -jnp.inf).reshape(n, e)


def update_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's balancing step: b_i += rate * sign(mean load - load_i), per layer.

    bias, counts: [..., E]. Overloaded experts become less likely to be chosen, underloaded
    ones more; the step size is fixed, so the bias tracks the load without a gradient."""
    mean = jnp.mean(counts, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - counts)


def load_stats(counts: jax.Array) -> dict[str, jax.Array]:
    """Expert load summaries from counts [layers, E], averaged over layers.

    Loads are relative to the mean (1 = perfectly balanced): max, min, and the coefficient
    of variation std / mean."""
    rel = counts / jnp.maximum(jnp.mean(counts, axis=-1, keepdims=True), 1e-9)
    return {"moe_load_max": jnp.mean(jnp.max(rel, axis=-1)), "moe_load_min": jnp.mean(jnp.min(rel, axis=-1)),
            "moe_load_cv": jnp.mean(jnp.std(rel, axis=-1))}


def apply_bias_updates(stats: nnx.State, counts: jax.Array, rate: float) -> nnx.State:
    """`stats` with every RouterBias [layers, E] moved by `update_bias` (rate 0: unchanged, an imported bias)."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    def one(v):
        return v.replace(update_bias(v[...], counts, rate)) if isinstance(v, RouterBias) else v

    return jax.tree.map(one, stats, is_leaf=is_var)
