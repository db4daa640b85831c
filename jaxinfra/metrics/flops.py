"""Analytic parameter and FLOP counts for the Llama-style decoder in models/config.py.

These numbers feed MFU (model FLOPs utilisation): they count the work the
*model* requires, not what the hardware ends up executing (rematerialisation,
padding and elementwise ops are not counted), which is the usual MFU convention.
"""

from __future__ import annotations

from models.config import ModelConfig


def _layer_matmul_params(cfg: ModelConfig) -> int:
    """Weight-matrix parameters of one decoder layer (attention + SwiGLU MLP)."""
    d, h, kv, dh, m = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim, cfg.mlp_dim
    attention = d * h * dh + 2 * d * kv * dh + h * dh * d  # wq, wk + wv (GQA: kv heads), wo
    mlp = 3 * d * m  # w_gate, w_up, w_down
    return attention + mlp


def _layer_norm_params(cfg: ModelConfig) -> int:
    """Norm scales of one layer: pre-attention and pre-MLP RMSNorm, optional q/k norms."""
    qk = 2 * cfg.resolved_head_dim if cfg.qk_norm else 0
    return 2 * cfg.d_model + qk


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
        matmul, so it is left out. Norm scales are left out.
    """
    vocab_d = cfg.vocab_size * cfg.d_model
    embedding = vocab_d
    output = 0 if cfg.tie_embeddings else vocab_d
    layers = cfg.num_layers * (_layer_matmul_params(cfg) + _layer_norm_params(cfg))
    final_norm = cfg.d_model
    total = embedding + output + layers + final_norm
    matmul = cfg.num_layers * _layer_matmul_params(cfg) + vocab_d
    return {
        "total": total,
        "embedding": embedding,
        "output": output,
        "non_embedding": total - embedding - output,
        "matmul": matmul,
    }


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
        GQA does not shrink this term: every query head still attends.

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
    attention = 2 * 2 * cfg.num_heads * cfg.resolved_head_dim * seq_len * cfg.num_layers
    if causal:
        attention /= 2
    forward = 2 * n_matmul + attention
    return float(3 * forward if training else forward)
