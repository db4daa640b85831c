"""Analytic parameter and FLOP counts for the decoder in models/config.py (dense, MLA, MoE).

These numbers feed MFU (model FLOPs utilisation): they count the work the
*model* requires, not what the hardware ends up executing (rematerialisation,
padding and elementwise ops are not counted), which is the usual MFU convention.
"""

from __future__ import annotations

from models.config import ModelConfig


def _attention_params(cfg: ModelConfig) -> int:
    """Weight-matrix parameters of one attention layer."""
    d, h = cfg.d_model, cfg.num_heads
    if cfg.is_mla:  # DeepSeek-V2 MLA: low-rank query (optional) and joint K/V latent + shared rope key
        dqk, dv = _attention_dims(cfg)
        rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        q = d * h * dqk if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * h * dqk
        kv = d * (rank + rope) + rank * h * (cfg.qk_nope_head_dim + dv)  # W_dkv + W_kr, then W_uk + W_uv
        return q + kv + h * dv * d
    kv, dh = cfg.kv_heads, cfg.resolved_head_dim
    return d * h * dh + 2 * d * kv * dh + h * dh * d  # wq, wk + wv (GQA: kv heads), wo


def _layer_matmul_params(cfg: ModelConfig, moe: bool = False, active: bool = False) -> int:
    """Weight-matrix parameters of one decoder layer (attention + SwiGLU MLP or MoE).

    A MoE layer counts the router, its routed experts (all of them, or with `active` the
    top-k a token uses) and its shared experts."""
    swiglu = 3 * cfg.d_model  # w_gate, w_up, w_down per unit of hidden width
    if not moe:
        return _attention_params(cfg) + swiglu * cfg.mlp_dim
    routed = cfg.moe_top_k if active else cfg.moe_num_experts
    experts = (routed + cfg.moe_shared_experts) * swiglu * cfg.expert_dim
    return _attention_params(cfg) + experts + cfg.d_model * cfg.moe_num_experts


def _expert_bias_params(cfg: ModelConfig) -> int:
    """One routed expert's biases (gpt-oss: gate, up [expert_dim] and down [d_model]); 0 without them."""
    return 2 * cfg.expert_dim + cfg.d_model if cfg.moe_expert_bias else 0


def _layer_norm_params(cfg: ModelConfig, moe: bool = False) -> int:
    """Norm scales of one layer (the attention and MLP RMSNorms, pre, post or both, q/k or MLA latent norms),
    plus a MoE router's selection bias (not a matmul either)."""
    if cfg.is_mla:
        attention = cfg.kv_lora_rank + (cfg.q_lora_rank or 0)
    else:
        qk = cfg.num_heads + cfg.kv_heads if cfg.qk_norm_scope == "full" else 2  # full: over all heads
        attention = qk * cfg.resolved_head_dim if cfg.qk_norm else 0
        attention += (cfg.num_heads + 2 * cfg.kv_heads) * cfg.resolved_head_dim if cfg.qkv_bias else 0
        attention += cfg.num_heads if cfg.attention_sinks else 0
        attention += cfg.d_model if cfg.attn_out_bias else 0
    bias = cfg.moe_num_experts if moe and (cfg.moe_bias_update_rate > 0 or cfg.moe_router_bias) else 0
    bias += cfg.moe_num_experts if moe and cfg.moe_router_logit_bias else 0
    bias += cfg.moe_num_experts * _expert_bias_params(cfg) if moe else 0
    blocks = 4 if cfg.norm_placement == "sandwich" else 2  # sandwich: input and output norm per sub-layer
    return blocks * cfg.d_model + attention + bias


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts derived from the config alone (no model is built).

    Keys:
      total: every parameter.
      embedding: the input embedding table [vocab, d].
      output: the untied output projection [d, vocab]; 0 when tied.
      non_embedding: total - embedding - output.
      matmul: parameters that enter a matmul for every token: all weight
        matrices plus the output projection. A tied embedding is counted once,
        as the output projection; an untied input table is a gather, not a
        matmul, so it is left out. Norm scales are left out. In a MoE layer only
        the router, the top-k routed experts and the shared experts count.
      active (MoE models only): parameters one token uses, i.e. total minus the
        routed experts it does not visit (the "activated parameters" of the
        DeepSeek, Mixtral and Qwen reports; embeddings included).
    """
    vocab_d = cfg.vocab_size * cfg.d_model
    embedding = vocab_d
    output = 0 if cfg.tie_embeddings else vocab_d
    flags = cfg.moe_layer_flags()
    layers = sum(_layer_matmul_params(cfg, moe) + _layer_norm_params(cfg, moe) for moe in flags)
    final_norm = cfg.d_model
    total = embedding + output + layers + final_norm
    matmul = sum(_layer_matmul_params(cfg, moe, active=True) for moe in flags) + vocab_d
    counts = {
        "total": total,
        "embedding": embedding,
        "output": output,
        "non_embedding": total - embedding - output,
        "matmul": matmul,
    }
    if cfg.is_moe:
        unused = (cfg.moe_num_experts - cfg.moe_top_k) * (3 * cfg.d_model * cfg.expert_dim + _expert_bias_params(cfg))
        counts["active"] = total - unused * sum(flags)
    return counts


def _attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(query/key head dim, value head dim)."""
    if cfg.is_mla:
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.resolved_head_dim, cfg.resolved_head_dim


def attention_keys(cfg: ModelConfig, seq_len: int, *, causal: bool = False) -> float:
    """Key positions one query attends, summed over the layers: T per global layer (causal: T / 2,
    the useful half of the score matrix); min(T, W) per sliding layer of window W (causal: the
    band's average over the queries, W - W^2 / 2T when W < T, else T / 2)."""
    total = 0.0
    for window in cfg.layer_windows():
        if window is None or window >= seq_len:
            total += seq_len / 2 if causal else seq_len
        else:
            total += window - window * window / (2 * seq_len) if causal else window
    return total


def flops_per_token(
    cfg: ModelConfig, seq_len: int, *, causal: bool = False, training: bool = True
) -> float:
    """Model FLOPs per token for a sequence of length `seq_len`.

    Forward pass per token:
      * 2 FLOPs (one multiply-add) per matmul parameter: q, k, v, o with their
        GQA shapes, the three SwiGLU matrices and the output projection
        (`param_counts(cfg)["matmul"]`).
      * attention, per layer: scores q·k^T and the weighted sum of values, each
        H * Dh multiply-adds per key position, i.e. 2 * 2 * H * Dh * T.
        GQA does not shrink this term: every query head still attends. With MLA
        the two use different head dims: 2 * H * (d_qk + d_v) * T.
      * MoE layers: the router, top-k routed and shared experts (`matmul` above);
        the capacity path's padding slots and dispatch einsums are not model FLOPs.

    Sliding-window layers (model.sliding_window) count min(T, W) keys per query in place of T
    (causal: the band's average, `attention_keys`).

    causal=True halves the attention term: a causal mask leaves only about
    half of the T x T score matrix useful. A flash-attention kernel skips the
    fully masked blocks, so it really does about half the work; XLA's dense
    path computes the full matrix and then masks it, so causal=False is the
    honest count for that path (and the conservative one for MFU).

    training=True multiplies by 3: the backward pass costs 2x the forward
    (one matmul for the gradient w.r.t. the inputs, one w.r.t. the weights).
    Rematerialised (recomputed) forward work is deliberately not counted.

    For a dense MHA config with H * Dh = d, the non-causal training count is
    exactly PaLM's 6N + 12 * L * d * T with N the matmul parameters
    (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
    appendix B, which writes it 6N + 12 * L * H * Q * T).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n_matmul = param_counts(cfg)["matmul"]
    d_qk, d_v = _attention_dims(cfg)
    attention = 2 * cfg.num_heads * (d_qk + d_v) * attention_keys(cfg, seq_len, causal=causal)
    forward = 2 * n_matmul + attention
    return float(3 * forward if training else forward)
