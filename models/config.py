"""The model's own configuration: a frozen dataclass that models/ reads.

It lives in models/ (not jaxinfra/) so that models never import the runtime;
jaxinfra/config.py embeds it as the `model` section of the run config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

from kernels.config import AttentionImpl  # jax-free (kernels.attention would load jax and Pallas)
from sharding.ranges import range_problems, ranged

RematPolicy = Literal[
    "none",  # keep every activation (fastest, most memory)
    "full",  # recompute the whole block in the backward pass
    "save_dots",  # keep every matmul output, recompute elementwise ops
    "save_dots_no_batch",  # keep weight matmuls only (not attention's batched dots)
    "save_qkv_proj",  # keep the q/k/v projections only
    "save_qkv_attn_out",  # keep q/k/v projections and the attention output
    "save_qkv_attn_mlp",  # keep q/k/v, attention output and the MLP hidden activations
]
REMAT_POLICIES: tuple[str, ...] = get_args(RematPolicy)
# The activations each name-based policy keeps for the backward pass (the `checkpoint_name`s the
# blocks attach): models/remat.py builds the jax policy from it, jaxinfra/plan/ prices it.
SAVED_NAMES: dict[str, tuple[str, ...]] = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_qkv_attn_out": ("query_proj", "key_proj", "value_proj", "attn_out"),
    "save_qkv_attn_mlp": ("query_proj", "key_proj", "value_proj", "attn_out", "mlp_hidden"),
}

DType = Literal["float32", "bfloat16"]
AttentionType = Literal[
    "mha",  # multi-head attention with grouped K/V heads: MHA, GQA, MQA (num_kv_heads)
    "mla",  # DeepSeek-V2/V3 multi-head latent attention (models/mla.py)
]
RopeScaling = Literal["llama3", "yarn", "linear"]
RouterScore = Literal["softmax", "sigmoid"]
NormPlacement = Literal[
    "pre",  # RMSNorm on each sub-layer's input (Llama, Qwen, Mixtral, DeepSeek)
    "post",  # RMSNorm on each sub-layer's output before the residual add, none on its input (OLMo 2)
    "sandwich",  # both: on each sub-layer's input and on its output before the residual add (Gemma 2/3)
]
NORM_PLACEMENTS: tuple[str, ...] = get_args(NormPlacement)
QKNormScope = Literal[
    "head",  # one RMSNorm over each head's head_dim, its [head_dim] weight shared by the heads (Qwen3)
    "full",  # one RMSNorm over the whole q projection (heads * head_dim) and the whole k projection (OLMo 2)
]
QK_NORM_SCOPES: tuple[str, ...] = get_args(QKNormScope)
MLPActivation = Literal[
    "silu",  # SwiGLU: silu(x @ gate) * (x @ up) (Llama, Qwen, Mistral, DeepSeek, OLMo 2)
    "gelu_tanh",  # GeGLU with tanh-approximated GELU (Gemma)
    # gpt-oss: g = min(gate, limit), u = clip(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g)
    # (model.mlp_swiglu_alpha / mlp_swiglu_limit); dense MLP and experts alike
    "clamped_swiglu",
]
MLP_ACTIVATIONS: tuple[str, ...] = get_args(MLPActivation)
MoEDispatch = Literal[
    "capacity",  # fixed expert capacity, overflow dropped; dense einsums (GShard, Switch)
    "dropless",  # tokens sorted by expert, grouped matmuls with jax.lax.ragged_dot (MegaBlocks)
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer (Llama-style: RMSNorm, RoPE, SwiGLU, GQA), optionally with
    DeepSeek's multi-head latent attention and Mixture-of-Experts feed-forward layers."""

    vocab_size: int = ranged(256, 1)
    d_model: int = ranged(128, 1)
    num_layers: int = ranged(2, 1)
    num_heads: int = ranged(4, 1)
    num_kv_heads: int | None = ranged(None, 1)  # None: equal to num_heads (MHA); 1: MQA
    head_dim: int | None = ranged(None, 1)  # None: d_model // num_heads
    mlp_dim: int = ranged(512, 1)  # SwiGLU hidden width
    tie_embeddings: bool = True
    rope_theta: float = ranged(10000.0, 0, lo_open=True)
    # Llama-3.1 frequency scaling; off when rope_scaling_factor is None.
    rope_scaling_factor: float | None = ranged(None, 1)
    rope_low_freq_factor: float = ranged(1.0, 0, lo_open=True)
    rope_high_freq_factor: float = ranged(4.0, 0, lo_open=True)
    rope_original_max_len: int = ranged(8192, 1)
    # "yarn" (Peng et al. 2023, as DeepSeek-V2/V3): frequencies between the two correction
    # dimensions (beta_fast / beta_slow rotations over the original length) are interpolated,
    # and MLA's softmax scale is multiplied by (0.1 * rope_yarn_mscale * ln(factor) + 1)^2.
    rope_scaling_type: RopeScaling = "llama3"
    rope_yarn_beta_fast: float = ranged(32.0, 0, lo_open=True)
    rope_yarn_beta_slow: float = ranged(1.0, 0, lo_open=True)
    rope_yarn_mscale: float = ranged(1.0, 0)  # DeepSeek's mscale_all_dim
    # MHA/GQA with yarn: HF multiplies RoPE's cos and sin by this "attention_factor" (gpt-oss: 0.1 ln(factor) + 1),
    # so the scores by its square; applied by pre-scaling q after RoPE (query_prescale). None: 1 (MLA: null).
    rope_yarn_attention_factor: float | None = ranged(None, 0, lo_open=True)
    # HF's rope_parameters.truncate: floor/ceil the yarn ramp's correction dims (DeepSeek: true; gpt-oss: false).
    rope_yarn_truncate: bool = True
    # Sliding-window attention (Mistral, Gemma 2/3, gpt-oss): a sliding layer's query at position i
    # sees keys j with i - sliding_window < j <= i (itself included, HF's convention); its KV cache
    # keeps only those slots. None: every layer attends to the whole causal prefix.
    sliding_window: int | None = ranged(None, 1)
    # Which layers slide (with sliding_window): n > 0 makes layer i global (full causal) when
    # (i + 1) % n == 0, the others sliding (HF Gemma 3's sliding_window_pattern: 6 -> 5 local, 1
    # global; gpt-oss alternates: 2); 0: every layer slides (Mistral v0.1).
    sliding_window_pattern: int = ranged(0, 0, note="n: every n-th layer global; 0: every layer slides")
    # RoPE base of the sliding layers, with no frequency scaling (Gemma 3's rope_local_base_freq);
    # None: the sliding layers rotate like the global ones (rope_theta and its scaling).
    rope_local_theta: float | None = ranged(None, 0, lo_open=True)
    norm_eps: float = ranged(1e-6, 0, lo_open=True)
    # Where the blocks' RMSNorms sit. A name, not a flag, so that Gemma's pre + post "sandwich" can
    # join as a third value.
    norm_placement: NormPlacement = "pre"
    # RMSNorm weights multiply as (offset + w): Gemma's (1 + w) is offset 1.0 with w initialised to 0
    # (init is 1 - offset, the same function at step 0). Every RMSNorm: blocks, QK-norm, final, MLA latents.
    norm_weight_offset: float = ranged(0.0, note="Gemma: 1.0")
    qk_norm: bool = False
    qk_norm_scope: QKNormScope = "head"  # what one q/k RMSNorm spans (with qk_norm)
    qkv_bias: bool = False  # additive biases on the q/k/v projections (Qwen2; HF imports)
    attn_out_bias: bool = False  # an additive bias [d_model] on the attention output projection (gpt-oss's o_proj)
    # gpt-oss attention sinks: a learned logit per query head (param `sinks` [heads], init 0, no
    # weight decay) joins the softmax denominator with no value. Every attention_impl but cudnn.
    attention_sinks: bool = False
    # Softmax scale of the attention scores; None: head_dim ** -0.5. Gemma 2/3 use
    # query_pre_attn_scalar ** -0.5. Applied by scaling q after RoPE (MHA/GQA only).
    attention_scale: float | None = ranged(None, 0, lo_open=True, note="null: head_dim ** -0.5")
    logit_softcap: float | None = ranged(None, 0, lo_open=True)  # tanh soft-cap of output logits (Gemma-2)
    # tanh soft-cap of the attention scores before the softmax, cap * tanh(s / cap) (Gemma 2)
    attn_logit_softcap: float | None = ranged(None, 0, lo_open=True)
    mlp_activation: MLPActivation = "silu"  # the gated MLP's activation, experts too (gelu_tanh: dense models only)
    mlp_swiglu_alpha: float = ranged(1.702, 0, lo_open=True)  # clamped_swiglu's sigmoid gain (gpt-oss's swiglu_alpha)
    mlp_swiglu_limit: float = ranged(7.0, 0, lo_open=True)  # clamped_swiglu's clamp (gpt-oss's swiglu_limit)
    embed_scale: bool = False  # multiply the embeddings by sqrt(d_model), in their dtype (Gemma)
    z_loss_weight: float = ranged(0.0, 0)  # PaLM z-loss: weight * log(Z)^2
    init_std: float = ranged(0.02, 0, lo_open=True)
    scan_layers: bool = True
    remat_policy: RematPolicy = "none"
    param_dtype: DType = "float32"
    dtype: DType = "float32"  # compute dtype
    attention_impl: AttentionImpl = "xla"
    # Sequence positions per chunk of the output projection + loss (jaxinfra/loss.py
    # chunked_sums): the [batch, length, vocab] float32 logits exist one chunk at a time.
    # 0: the whole sequence at once. Must divide train.seq_len.
    loss_chunk_size: int = ranged(0, 0, note="0: no chunking")

    # ---- multi-head latent attention (attention_type="mla"; DeepSeek-V2 sec. 2.1)
    attention_type: AttentionType = "mha"
    q_lora_rank: int | None = ranged(None, 1)  # None: full-rank query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = ranged(512, 1)  # width of the jointly compressed K/V latent
    qk_nope_head_dim: int = ranged(128, 0)  # per-head query/key part without RoPE
    qk_rope_head_dim: int = ranged(64, 0)  # decoupled RoPE part; the key's is shared by all heads (0: no RoPE)
    v_head_dim: int = ranged(128, 1)
    # Epsilon of MLA's two latent RMSNorms (q_norm, kv_norm); None: norm_eps, like the others.
    # HF's DeepSeek-V2/V3 fix these at 1e-6 whatever rms_norm_eps is, so imports set it then.
    mla_norm_eps: float | None = ranged(None, 0, lo_open=True, note="null: norm_eps")

    # ---- Mixture-of-Experts feed-forward (moe_num_experts > 0)
    moe_num_experts: int = ranged(0, 0, note="0: dense")  # routed experts per MoE layer; 0: a dense model
    moe_top_k: int = ranged(2, 1)  # routed experts per token
    moe_mlp_dim: int | None = ranged(None, 1)  # SwiGLU width of one expert; None: mlp_dim
    moe_shared_experts: int = ranged(0, 0)  # always-active experts of width moe_mlp_dim (DeepSeekMoE)
    moe_first_dense_layers: int = ranged(0, 0)  # the first k layers keep a dense MLP (DeepSeek's first_k_dense_replace)
    moe_every: int = ranged(1, 1)  # after those, every n-th layer is MoE, the others dense (n - 1 dense, then 1 MoE)
    moe_router_score: RouterScore = "softmax"  # sigmoid: DeepSeek-V3's affinities
    moe_norm_top_k: bool = True  # renormalise the selected experts' weights to sum to 1
    moe_num_groups: int = ranged(1, 1)  # group-limited routing (DeepSeek-V2/V3): experts in this many groups ...
    moe_top_k_groups: int = ranged(1, 1)  # ... and each token may pick experts only from this many groups
    # Multiplies the routed experts' weights (DeepSeek's routed_scaling_factor).
    moe_routed_scale: float = ranged(1.0, 0, lo_open=True)
    moe_dispatch: MoEDispatch = "dropless"
    # Capacity path: slots per expert = factor * tokens * top_k / experts.
    moe_capacity_factor: float = ranged(1.25, 0, lo_open=True)
    moe_aux_loss_weight: float = ranged(0.0, 0)  # load-balancing loss (Switch / GShard form), summed over MoE layers
    moe_z_loss_weight: float = ranged(0.0, 0)  # router z-loss (ST-MoE), summed over MoE layers
    # Auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2): a per-expert bias added to the scores
    # for top-k selection only, moved by this much per step toward balance (0: off, no bias).
    moe_bias_update_rate: float = ranged(0.0, 0, note="0: off")
    # Keep that selection bias as a parameter even when it is not updated (rate 0): an imported
    # DeepSeek-V3 checkpoint carries trained values (HF's e_score_correction_bias).
    moe_router_bias: bool = False
    # A trained bias on the router logits (gpt-oss's router Linear has one): unlike moe_router_bias it
    # shifts the logits that both select the experts and weight them (a Bias param, no weight decay).
    moe_router_logit_bias: bool = False
    # Per-expert biases on the gate/up projections [E, expert_dim] and the down projection [E, d_model]
    # (gpt-oss); the down bias is weighted by the expert's routing weight like its output.
    moe_expert_bias: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def is_mla(self) -> bool:
        return self.attention_type == "mla"

    @property
    def latent_norm_eps(self) -> float:
        """Epsilon of MLA's latent norms (q_norm, kv_norm)."""
        return self.norm_eps if self.mla_norm_eps is None else self.mla_norm_eps

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: the head dim, or MLA's decoupled rope part."""
        return self.qk_rope_head_dim if self.is_mla else self.resolved_head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe_num_experts > 0

    @property
    def expert_dim(self) -> int:
        return self.moe_mlp_dim if self.moe_mlp_dim is not None else self.mlp_dim

    @property
    def query_prescale(self) -> float:
        """Factor q is multiplied by after RoPE so that the kernels' default head_dim ** -0.5 scale
        gives the configured softmax scale (1.0: nothing to do)."""
        scale = 1.0 if self.attention_scale is None else self.attention_scale * self.resolved_head_dim ** 0.5
        if self.rope_yarn_attention_factor is not None and not self.is_mla:  # HF's cos/sin factor on q and k
            scale *= self.rope_yarn_attention_factor ** 2
        return scale

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window (tokens it sees, itself included), or None for a global layer."""
        n, w = self.sliding_window_pattern, self.sliding_window
        if w is None:
            return (None,) * self.num_layers
        return tuple(None if n > 0 and (i + 1) % n == 0 else w for i in range(self.num_layers))

    def layer_ropes(self) -> tuple[str, ...]:
        """Per layer, which RoPE table it rotates with: "local" (rope_local_theta, unscaled) on sliding
        layers when rope_local_theta is set, else "global" (rope_theta and its scaling)."""
        local = self.rope_local_theta is not None
        return tuple("local" if local and w is not None else "global" for w in self.layer_windows())

    def layer_period(self) -> int:
        """Layers in the smallest repeating unit of the layer stack after the dense prefix: the lcm of
        the MoE period (moe_every) and the window pattern (sliding_window_pattern); models/stack.py."""
        moe = self.moe_every if self.is_moe else 1
        windows = self.sliding_window_pattern if self.sliding_window is not None and self.sliding_window_pattern else 1
        return math.lcm(max(moe, 1), max(windows, 1))

    def moe_layer_flags(self) -> tuple[bool, ...]:
        """Per layer, whether it is MoE: the first k dense, then every moe_every-th sparse."""
        if not self.is_moe:
            return (False,) * self.num_layers
        k, n = self.moe_first_dense_layers, self.moe_every
        return tuple(i >= k and (i - k + 1) % n == 0 for i in range(self.num_layers))

    def problems(self) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out = range_problems(self)  # the declared ranges first: the checks below divide by these sizes
        if out:
            return out
        if self.is_mla:
            out += self._mla_problems()
        elif self.head_dim is None and self.d_model % self.num_heads:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 128]
            out.append(("num_heads", self.num_heads,
                        f"a divisor of model.d_model={self.d_model} (e.g. {divisors[-6:]}) or set model.head_dim"))
        if self.num_heads % self.kv_heads:
            allowed = [k for k in range(1, self.num_heads + 1) if self.num_heads % k == 0]
            out.append(("num_kv_heads", self.num_kv_heads,
                        f"a divisor of model.num_heads={self.num_heads}: one of {allowed}"))
        if not self.is_mla and self.resolved_head_dim % 2:
            out.append(("head_dim", self.resolved_head_dim, "an even number (RoPE rotates pairs)"))
        out += self._gemma_problems()
        out += self._window_problems()
        if self.attention_sinks and self.attention_impl == "cudnn":
            out.append(("attention_impl", self.attention_impl, "not cudnn with model.attention_sinks=true (sinks "
                        "join the log-sum-exp, which cudnn does not return)"))
        if self.qk_norm_scope != "head" and not self.qk_norm:
            out.append(("qk_norm_scope", self.qk_norm_scope, "head unless model.qk_norm=true"))
        if self.moe_num_experts:
            out += self._moe_problems()
        return out

    def _gemma_problems(self) -> list[tuple[str, object, str]]:
        out: list[tuple[str, object, str]] = []
        if self.norm_placement not in NORM_PLACEMENTS:
            out.append(("norm_placement", self.norm_placement, f"one of {list(NORM_PLACEMENTS)}"))
        if self.mlp_activation not in MLP_ACTIVATIONS:
            out.append(("mlp_activation", self.mlp_activation, f"one of {list(MLP_ACTIVATIONS)}"))
        elif self.mlp_activation == "gelu_tanh" and self.is_moe:
            out.append(("mlp_activation", self.mlp_activation,
                        "silu or clamped_swiglu with moe_num_experts > 0 (experts are SwiGLU)"))
        cap = self.attn_logit_softcap
        if cap is not None and self.attention_impl == "cudnn":
            out.append(("attn_logit_softcap", cap, "null with attention_impl=cudnn (cuDNN has no soft-cap)"))
        elif cap is not None and self.is_mla:
            out.append(("attn_logit_softcap", cap, "null with attention_type=mla"))
        return out

    def _window_problems(self) -> list[tuple[str, object, str]]:
        out: list[tuple[str, object, str]] = []
        if self.sliding_window is not None and self.is_mla:
            out.append(("sliding_window", self.sliding_window, "null with attention_type=mla"))
        if self.attention_scale is not None and self.is_mla:
            out.append(("attention_scale", self.attention_scale, "null with attention_type=mla"))
        return out + self._gpt_oss_problems()

    def _gpt_oss_problems(self) -> list[tuple[str, object, str]]:
        out: list[tuple[str, object, str]] = []
        factor = self.rope_yarn_attention_factor
        if factor is not None and (self.is_mla or self.rope_scaling_type != "yarn" or
                                     self.rope_scaling_factor is None):
            out.append(("rope_yarn_attention_factor", factor,
                        "null unless rope_scaling_type=yarn with a rope_scaling_factor and attention_type=mha"))
        if self.attn_out_bias and self.is_mla:
            out.append(("attn_out_bias", self.attn_out_bias, "false with attention_type=mla"))
        for name in ("moe_router_logit_bias", "moe_expert_bias"):
            if getattr(self, name) and not self.is_moe:
                out.append((name, getattr(self, name), "false unless moe_num_experts > 0"))
        return out

    def _mla_problems(self) -> list[tuple[str, object, str]]:
        out: list[tuple[str, object, str]] = []
        if self.qk_nope_head_dim + self.qk_rope_head_dim < 1:
            out.append(("qk_nope_head_dim", self.qk_nope_head_dim, "> 0 when qk_rope_head_dim is 0"))
        if self.qk_rope_head_dim % 2:
            out.append(("qk_rope_head_dim", self.qk_rope_head_dim, "an even number (RoPE rotates pairs)"))
        if self.qk_norm:
            out.append(("qk_norm", self.qk_norm, "false with attention_type=mla (its latents are normalised)"))
        if self.qkv_bias:
            out.append(("qkv_bias", self.qkv_bias, "false with attention_type=mla"))
        if self.attention_sinks:
            out.append(("attention_sinks", self.attention_sinks, "false with attention_type=mla"))
        if self.num_kv_heads not in (None, self.num_heads):
            out.append(("num_kv_heads", self.num_kv_heads,
                        "null with attention_type=mla (K/V come from a shared latent)"))
        return out

    def _moe_problems(self) -> list[tuple[str, object, str]]:
        out: list[tuple[str, object, str]] = []
        e = self.moe_num_experts
        if self.moe_top_k > e:
            out.append(("moe_top_k", self.moe_top_k, f"between 1 and moe_num_experts={e}"))
        if self.moe_first_dense_layers >= self.num_layers:
            out.append(("moe_first_dense_layers", self.moe_first_dense_layers,
                        f"between 0 and num_layers - 1 = {self.num_layers - 1}"))
        elif (self.num_layers - self.moe_first_dense_layers) % self.moe_every:
            out.append(("moe_every", self.moe_every, f"a divisor of num_layers - moe_first_dense_layers = "
                                                     f"{self.num_layers - self.moe_first_dense_layers}"))
        g = self.moe_num_groups
        if e % g:
            out.append(("moe_num_groups", g, f"a divisor of moe_num_experts={e}"))
        elif self.moe_top_k_groups > g:
            out.append(("moe_top_k_groups", self.moe_top_k_groups, f"between 1 and moe_num_groups={g}"))
        elif self.moe_top_k_groups * (e // g) < self.moe_top_k:
            out.append(("moe_top_k_groups", self.moe_top_k_groups,
                        f"large enough that the chosen groups hold moe_top_k={self.moe_top_k} experts"))
        return out
