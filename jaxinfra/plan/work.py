"""The step's work outside the FLOP count, per device: what the clock prices at memory speed.

Each amount is forward work per token of one layer, by piece; jaxinfra/plan/time.py runs the
pieces through the same passes as the FLOPs (backward 2x forward, the remat policy's recompute,
the pipeline's bubble slots), so one rule counts both. Kinds (jaxinfra/plan/probes.py measures
each at the step's own shapes):

    elementwise  bytes, each input read once and each output written once: the two RMSNorms
                 (float32 inside), the residual adds, RoPE on q and k, the q/k norms and MLA's
                 latent norms, SwiGLU's activation, MoE routing or the dropless gather
    dispatch     bytes of MoE capacity routing's [tokens, E x C] float32 masks and their copies
    softmax      score elements of XLA attention's softmax ([heads, keys] per query; a flash
                 kernel does it inside its own batched dots)
    loss         [tokens, vocab] elements of the cross-entropy (logsumexp and its gradient),
                 once per step (priced forward and backward together: the probe runs both)
    buffers      bytes of the pipeline's per-tick slot copies (the shift, the input pick and
                 the output write), forward and backward ticks as compiled
"""

from __future__ import annotations

from jaxinfra.plan.activations import capacity_slots
from jaxinfra.plan.layout import F32_BYTES, Layout

ELEMENTWISE_PIECES = ("norm", "residual", "latent_norm", "qk_norm", "rope", "act", "router", "dispatch_masks",
                      "gather")  # all run again in the backward under any remat policy but none


def layer_elementwise(lay: Layout, moe: bool) -> dict[str, float]:
    """Forward bytes per token of one layer's elementwise work on this device, keyed by piece."""
    m, cb = lay.model, lay.compute_bytes
    d = m.d_model / lay.residual_split  # norms and residual adds run on the whole stream unless SP splits it
    pieces = {"norm": 2 * 2 * d * F32_BYTES, "residual": 2 * 3 * d * cb}
    if m.is_mla:
        rope = (lay.heads + 1) * m.qk_rope_head_dim  # the rope key is one head, shared
        latents = (m.q_lora_rank or 0) + m.kv_lora_rank
        pieces["latent_norm"] = 2 * latents * F32_BYTES
    else:
        rope = (lay.heads + lay.kv_heads) * m.resolved_head_dim
        if m.qk_norm:
            pieces["qk_norm"] = 2 * rope * F32_BYTES
    pieces["rope"] = 2 * rope * cb
    if not moe:
        pieces["act"] = 3 * lay.mlp * cb  # read gate and up, write the hidden
        return pieces
    width = (routed_rows(lay) * m.expert_dim + m.moe_shared_experts * m.expert_dim) / lay.tp
    pieces["act"] = 3 * width * cb
    pieces["router"] = 3 * m.moe_num_experts * F32_BYTES  # logits, probabilities, top-k
    if m.moe_dispatch != "capacity":
        pieces["gather"] = 4 * m.moe_top_k * m.d_model * cb  # sort, gather in, scatter out, weight
    return pieces


def routed_rows(lay: Layout) -> float:
    """Expert FFN rows per token: top-k, or the capacity slots (padding computes too), or on CPU's
    dropless path every expert (XLA:CPU's ragged_dot is a dense matmul per group)."""
    m = lay.model
    if m.moe_dispatch == "capacity":
        return capacity_slots(lay) / lay.seq
    return m.moe_num_experts if lay.backend == "cpu" else m.moe_top_k


# Passes over a token's [E x C] float32 row of capacity routing, forward, as compiled: the one-hot
# dispatch and the combine weights written, and a transposed copy of each (written and read) for
# the einsums' [rows, E x C, seq] layout. Large ([tokens, E x C]: 25 MB a layer for qwen3-moe-tiny at
# d 256, seq 256): they run at their own, memory-bound rate (probes.py kind `dispatch`).
DISPATCH_PASSES = 6


def layer_dispatch(lay: Layout, moe: bool) -> dict[str, float]:
    """Forward bytes per token of one layer's capacity-routing tensors (none for dense layers and
    dropless routing)."""
    if not moe or lay.model.moe_dispatch != "capacity":
        return {}
    return {"dispatch_masks": DISPATCH_PASSES * capacity_slots(lay) * F32_BYTES}


def layer_softmax(lay: Layout) -> float:
    """Score elements per token of one layer's softmax (XLA attention only)."""
    if not lay.attention_keeps.scores:
        return 0.0
    return lay.heads * lay.kv_seq


def loss_elements(lay: Layout) -> float:
    """[tokens, vocab] elements of the loss per step on this device (a chunked loss recomputes its
    logits in the backward: the softmax runs once more)."""
    t, m = lay.cfg.train, lay.model
    tokens = t.batch_size * t.seq_len / (lay.batch_shards * lay.cp)
    chunked = m.loss_chunk_size and m.loss_chunk_size < t.seq_len
    return tokens * lay.vocab * (1.5 if chunked else 1.0)


# Slot copies per pipeline tick as compiled: forward: the ring shift, the stage's input pick, the
# output write (each a read and a write); backward: the same transposed plus the cotangent's pick.
FORWARD_SLOT_COPIES, BACKWARD_SLOT_COPIES = 6, 9


def pipeline_buffer_bytes(lay: Layout, ticks: tuple[int, int]) -> float:
    """Bytes per step of the pipeline's per-tick slot copies on this device (0 without a pipeline)."""
    if lay.pp == 1:
        return 0.0
    slot = lay.tokens * lay.model.d_model * lay.compute_bytes
    forward, backward = ticks
    return lay.cfg.train.grad_accum_steps * slot * (FORWARD_SLOT_COPIES * forward + BACKWARD_SLOT_COPIES * backward)
