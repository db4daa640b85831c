"""Building blocks: parameters with logical axes, RMSNorm, RoPE, SwiGLU MLP."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.lora_config import NO_LORA, LoraConfig
from models.project import Projections, prepare_weights, project_attr
from models.quant_config import NO_QUANT, QuantConfig
from sharding.plan import SINGLE_DEVICE, ParallelPlan

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str], std: float, dtype: str) -> nnx.Param:
    """A normal(0, std) weight tagged with logical axis names (sharding is applied by the runtime)."""
    value = std * jax.random.normal(rngs.params(), tuple(shape), DTYPES[dtype])
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


class Bias(nnx.Param):
    """An additive bias (Qwen2's q/k/v): like a norm scale, no weight decay unless asked
    (jaxinfra/optim.py decay_mask), though it has a matrix's rank."""


def zeros_bias(shape: Sequence[int], names: Sequence[str], dtype: str) -> Bias:
    return Bias(jnp.zeros(tuple(shape), DTYPES[dtype]), out_sharding=tuple(names), eager_sharding=False)


def ones_param(shape: Sequence[int], names: Sequence[str], dtype: str) -> nnx.Param:
    return nnx.Param(jnp.ones(tuple(shape), DTYPES[dtype]), out_sharding=tuple(names), eager_sharding=False)


def norm_param(shape: Sequence[int], names: Sequence[str], cfg: ModelConfig) -> nnx.Param:
    """An RMSNorm weight: 1 - model.norm_weight_offset everywhere, so (offset + w) starts at 1."""
    if not cfg.norm_weight_offset:
        return ones_param(shape, names, cfg.param_dtype)
    value = jnp.full(tuple(shape), 1.0 - cfg.norm_weight_offset, DTYPES[cfg.param_dtype])
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _norm_scale(scale: jax.Array, offset: float) -> jax.Array:
    """The float32 multiplier (offset + w); no add at offset 0 (the program stays as it was)."""
    scale = scale.astype(jnp.float32)
    return scale + offset if offset else scale


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32 (the mean of squares is precision-sensitive), result in x's dtype;
    multiplied by (offset + scale) (Gemma's (1 + w): offset 1)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * _norm_scale(scale, offset)).astype(x.dtype)


def rms_norm_heads(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm of x [..., heads, head_dim] over the whole projection (heads and head_dim together,
    OLMo 2's QK-norm), `scale` [heads * head_dim]; float32 inside as rms_norm. Under tensor parallelism
    the mean reduces across the head shards (GSPMD adds the all-reduce)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=(-2, -1), keepdims=True) + eps)
    return (y * _norm_scale(scale, offset).reshape(x.shape[-2:])).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig, names: Sequence[str] = ("norm",)):
        self.scale = norm_param((dim,), names, cfg)
        self.eps = cfg.norm_eps
        self.offset = cfg.norm_weight_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


def rope_frequencies(cfg: ModelConfig) -> jnp.ndarray:
    """Inverse frequencies theta^(-2i/d) over `cfg.rope_dim`, with Llama-3.1's or YaRN's
    long-context scaling when configured."""
    dim = cfg.rope_dim
    freqs = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_scaling_factor is None:
        return freqs
    if cfg.rope_scaling_type == "yarn":
        return _yarn_frequencies(freqs, cfg)
    if cfg.rope_scaling_type == "linear":  # positions divided by the factor (Gemma 3's global layers)
        return freqs / cfg.rope_scaling_factor
    factor, orig = cfg.rope_scaling_factor, cfg.rope_original_max_len
    low_wavelen = orig / cfg.rope_low_freq_factor
    high_wavelen = orig / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept,
    # and the band in between is interpolated smoothly.
    smooth = (orig / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    return jnp.where(wavelen < high_wavelen, freqs, jnp.where(wavelen > low_wavelen, freqs / factor, blended))


def rope_local_frequencies(cfg: ModelConfig) -> jnp.ndarray:
    """Inverse frequencies of the sliding layers' RoPE: base rope_local_theta, no scaling (Gemma 3)."""
    dim = cfg.rope_dim
    return 1.0 / (cfg.rope_local_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def rope_tables(cfg: ModelConfig) -> dict[str, jnp.ndarray]:
    """The RoPE tables the layers name in their LayerSpec (models/stack.py): "global", and "local"
    when model.rope_local_theta is set."""
    tables = {"global": rope_frequencies(cfg)}
    if cfg.rope_local_theta is not None:
        tables["local"] = rope_local_frequencies(cfg)
    return tables


def _yarn_frequencies(freqs: jnp.ndarray, cfg: ModelConfig) -> jnp.ndarray:
    """YaRN "NTK-by-parts" (Peng et al. 2023, sec. 3.2), in DeepSeek-V2/V3's form.

    Dimension pairs that rotate more than beta_fast times over the original context keep
    their frequency (extrapolate); those rotating fewer than beta_slow times are divided by
    the factor (interpolate); a linear ramp over pair index joins the two.
    """
    dim, base, orig = cfg.rope_dim, cfg.rope_theta, cfg.rope_original_max_len

    def correction_dim(rotations: float) -> float:  # the pair index that rotates `rotations` times
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_yarn_beta_fast), correction_dim(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:  # HF's rope_parameters.truncate (default true; gpt-oss: false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high if high > low else low + 0.001  # avoid a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return freqs / cfg.rope_scaling_factor * ramp + freqs * (1 - ramp)


def yarn_softmax_scale(cfg: ModelConfig) -> float:
    """YaRN's attention temperature as a factor on the softmax scale: (0.1 * m * ln s + 1)^2,
    1 without rope scaling (DeepSeek-V2 applies it to MLA's scale; m = mscale_all_dim)."""
    s = cfg.rope_scaling_factor
    if s is None or s <= 1 or cfg.rope_scaling_type != "yarn":
        return 1.0
    return (0.1 * cfg.rope_yarn_mscale * math.log(s) + 1.0) ** 2


def apply_rope(x: jax.Array, positions: jax.Array, freqs: jax.Array) -> jax.Array:
    """Rotary embedding on [batch, length, heads, head_dim], rotate-half convention (as HF Llama)."""
    angles = positions[..., None].astype(jnp.float32) * freqs  # [B, T, D/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}  # model.mlp_activation


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """hidden = act(gate, up) of a gated MLP (model.mlp_activation and, for clamped_swiglu, its alpha / limit)."""

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> GatedActivation:
        return cls(cfg.mlp_activation, cfg.mlp_swiglu_alpha, cfg.mlp_swiglu_limit)

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.name != "clamped_swiglu":
            return ACTIVATIONS[self.name](gate) * up
        # gpt-oss: the gate clamped from above only, the up projection both ways and shifted by 1
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)), or GeGLU with gelu_tanh in place of silu (Gemma);
    `width` overrides cfg.mlp_dim (MoE shared experts)."""

    # weight -> (projection name, contracted dims): models/project.py prepare_weights
    PROJECTIONS: ClassVar[Projections] = {
        "w_gate": ("mlp.gate", (-2,)), "w_up": ("mlp.up", (-2,)), "w_down": ("mlp.down", (-2,))}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None, quant: QuantConfig = NO_QUANT,
                 lora: LoraConfig = NO_LORA):
        d, f, std = cfg.d_model, cfg.mlp_dim if width is None else width, cfg.init_std
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), std, cfg.param_dtype)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), std, cfg.param_dtype)
        # Residual-branch outputs are scaled down with depth (GPT-2) so the stream's variance stays flat.
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), std / math.sqrt(2 * cfg.num_layers), cfg.param_dtype)
        self.activation = GatedActivation.of(cfg)
        prepare_weights(self, quant, self.PROJECTIONS, DTYPES[cfg.dtype], lora, rngs)

    def __call__(self, x: jax.Array, *, plan: ParallelPlan = SINGLE_DEVICE) -> jax.Array:
        # Matmuls on [batch*length, features]: with one row dimension the backward's weight
        # gradients need no transposed copy of the wide hidden activations (on XLA:CPU such a
        # copy cost ~20% of the step; see benchmarks/RESULTS.md).
        b, t, d = x.shape
        rows = x.reshape(b * t, d)
        gate = project_attr(self, "nd,df->nf", rows, "w_gate")
        up = project_attr(self, "nd,df->nf", rows, "w_up")
        hidden = checkpoint_name(self.activation(gate, up), "mlp_hidden")
        hidden = plan.constrain(hidden, ("rows", "mlp"))
        return project_attr(self, "nf,fd->nd", hidden, "w_down").reshape(b, t, d)
