"""The model's own configuration: a frozen dataclass that models/ reads.

It lives in models/ (not jaxinfra/) so that models never import the runtime;
jaxinfra/config.py embeds it as the `model` section of the run config.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

RematPolicy = Literal[
    "none",  # keep every activation (fastest, most memory)
    "full",  # recompute the whole block in the backward pass
    "save_dots",  # keep every matmul output, recompute elementwise ops
    "save_dots_no_batch",  # keep weight matmuls only (not attention's batched dots)
    "save_qkv_proj",  # keep the q/k/v projections only
    "save_qkv_attn_out",  # keep q/k/v projections and the attention output
    "save_qkv_attn_mlp",  # keep q/k/v, attention output and the MLP hidden activations
]
REMAT_POLICIES: tuple[str, ...] = RematPolicy.__args__  # type: ignore[attr-defined]

AttentionImpl = Literal["xla", "auto", "pallas_triton", "pallas_mosaic_tpu", "cudnn"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer (Llama-style: RMSNorm, RoPE, SwiGLU, GQA)."""

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: equal to num_heads (MHA); 1: MQA
    head_dim: int | None = None  # None: d_model // num_heads
    mlp_dim: int = 512  # SwiGLU hidden width
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    # Llama-3.1 frequency scaling; off when rope_scaling_factor is None.
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-6
    qk_norm: bool = False
    logit_softcap: float | None = None  # tanh soft-cap of output logits (Gemma-2)
    z_loss_weight: float = 0.0  # PaLM z-loss: weight * log(Z)^2
    init_std: float = 0.02
    scan_layers: bool = True
    remat_policy: RematPolicy = "none"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
    attention_impl: AttentionImpl = "xla"

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    def problems(self) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out: list[tuple[str, object, str]] = []
        positive = ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim")
        for name in positive:
            if getattr(self, name) < 1:
                out.append((name, getattr(self, name), "a positive integer"))
        if out:
            return out
        if self.head_dim is None and self.d_model % self.num_heads:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 128]
            out.append(("num_heads", self.num_heads,
                        f"a divisor of model.d_model={self.d_model} (e.g. {divisors[-6:]}) or set model.head_dim"))
        if self.head_dim is not None and self.head_dim < 1:
            out.append(("head_dim", self.head_dim, "a positive integer"))
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            allowed = [k for k in range(1, self.num_heads + 1) if self.num_heads % k == 0]
            out.append(("num_kv_heads", self.num_kv_heads,
                        f"a divisor of model.num_heads={self.num_heads}: one of {allowed}"))
        if self.resolved_head_dim % 2:
            out.append(("head_dim", self.resolved_head_dim, "an even number (RoPE rotates pairs)"))
        if self.rope_scaling_factor is not None and self.rope_scaling_factor < 1:
            out.append(("rope_scaling_factor", self.rope_scaling_factor, ">= 1 or null"))
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            out.append(("logit_softcap", self.logit_softcap, "> 0 or null"))
        return out
