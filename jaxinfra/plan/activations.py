"""What one decoder layer keeps for its backward pass, per device, under each remat policy.

A layer is described as the tensors JAX's autodiff would save for it (its residuals): for
each one, its bytes on this device for one layer call (one microbatch), whether it is the
output of a weight matmul ("dot"), of a batched matmul inside attention or the expert
dispatch ("bdot"), or of an elementwise op (None), its `checkpoint_name` if it has one, and
whether the un-rematerialised layer keeps it (`none`). The remat policies (models/config.py,
models/remat.py) then select:

    none                 the `none` tensors (everything the backward reads, elementwise included)
    full                 nothing but the layer input (the scan carry)
    save_dots            layer input + every dot and bdot output
    save_dots_no_batch   layer input + weight-matmul (dot) outputs
    save_qkv_*           layer input + the tensors with those checkpoint names (SAVED_NAMES)

inside a pipeline's stage vmap save_dots_no_batch selects as full (`effective_policy`); the
attention keeps what kernels/facts.py says the implementation it resolves to keeps.

The lists follow the model code (models/attention.py, mla.py, layers.py, moe.py and
kernels/attention.py's XLA path), and tests/test_plan.py checks them against the residuals
`jax.ad_checkpoint` reports for the real layers. During the backward of one layer, the tensors
a policy did not save are rebuilt: `recomputed_bytes` is that layer's working set.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxinfra.plan.layout import F32_BYTES as F32
from jaxinfra.plan.layout import Layout, split
from models.config import REMAT_POLICIES, SAVED_NAMES

# The policies by name and the checkpoint names each keeps come from the model (models/config.py,
# the same table models/remat.py builds the jax policies from); the rest select by matmul kind.
BY_KIND = ("none", "full", "save_dots", "save_dots_no_batch")
assert set(REMAT_POLICIES) == {*BY_KIND, *SAVED_NAMES}, "a remat policy the planner does not price"


@dataclasses.dataclass(frozen=True)
class Tensor:
    what: str
    bytes: float
    kind: str | None = None  # "dot" (weight matmul), "bdot" (batched matmul) or None (elementwise)
    name: str | None = None  # checkpoint_name in the model code
    none: bool = False  # kept by the un-rematerialised layer
    block: str = "attention"  # or "ffn" (the MLP or MoE half of the layer)


def saved(tensors: tuple[Tensor, ...], policy: str) -> float:
    """Bytes a policy keeps of these tensors (the layer input is counted by `layer_input`)."""
    if policy == "none":
        return sum(t.bytes for t in tensors if t.none)
    return sum(t.bytes for t in tensors if _keeps(t, policy))


def layer_input(lay: Layout) -> float:
    """The residual stream entering a layer: what every remat policy but `none` saves per layer."""
    return lay.tokens / lay.residual_split * lay.model.d_model * lay.compute_bytes


def _norm(lay: Layout, what: str) -> list[Tensor]:
    """RMSNorm (float32 inside) of the residual stream, and its output rows for the next matmuls."""
    n, d, c = lay.tokens, lay.model.d_model, lay.compute_bytes
    return [Tensor(f"{what} (float32)", n / lay.residual_split * (d + 2) * F32, none=True),
            Tensor(f"{what} output", n * d * c, none=True)]


def _scores(lay: Layout, heads: int, v_dim: int, fused: bool) -> list[Tensor]:
    """Softmax attention over kv_seq keys, as the kernels say the resolved implementation keeps
    it (kernels/facts.py KEEPS): the XLA path materialises [rows, heads, seq, kv_seq] float32
    scores (jax.nn.dot_product_attention, or the dense reference for MLA's unequal head dims);
    a flash kernel (Pallas, cuDNN) keeps only its output and log-sum-exp."""
    n, c, scores = lay.tokens, lay.compute_bytes, lay.tokens * heads * lay.kv_seq
    out = Tensor("attention output", n * heads * v_dim * c, "bdot", "attn_out", True)
    if not lay.attention_keeps.scores:
        return [Tensor("log-sum-exp", n * heads * F32, none=True), dataclasses.replace(out, kind=None)]
    elementwise = 3 if fused else 2  # jax.nn keeps masked scores, exp and probabilities; the reference 2
    return [Tensor("scores", scores * F32, "bdot"),
            Tensor("softmax pieces", scores * (elementwise * F32 + 1) + n * heads * 2 * F32, none=True), out]


def mha_tensors(lay: Layout) -> list[Tensor]:
    """models/attention.py: q/k/v projections, RoPE, attention, output projection."""
    m, n, c = lay.model, lay.tokens, lay.compute_bytes
    h, kv, dh = lay.heads, lay.kv_heads, m.resolved_head_dim
    return [*_norm(lay, "attention norm"),
            Tensor("q projection", n * h * dh * c, "dot", "query_proj"),
            Tensor("k projection", n * kv * dh * c, "dot", "key_proj"),
            Tensor("v projection", n * kv * dh * c, "dot", "value_proj", True),
            Tensor("q, k after RoPE", n * (h + kv) * dh * c + n * 2 * m.rope_dim * F32, none=True),
            *_scores(lay, h, dh, True),
            Tensor("output projection", n / lay.residual_split * m.d_model * c, "dot")]


def mla_tensors(lay: Layout) -> list[Tensor]:
    """models/mla.py, explicit (training) form: latents, up-projections, attention, output."""
    m, n, c, h = lay.model, lay.tokens, lay.compute_bytes, lay.heads
    qk, dv, rank, rope = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
    out = _norm(lay, "attention norm")
    if m.q_lora_rank:
        q = m.q_lora_rank
        out += [Tensor("q latent", n * q * c, "dot", none=True),
                Tensor("q latent norm", n * (q + 2) * F32 + n * q * c, none=True)]
    out += [Tensor("q up-projection", n * h * qk * c, "dot"),
            Tensor("kv latent + rope key", n * (rank + rope) * c, "dot", none=True),
            Tensor("kv latent norm", n * (rank + 2) * F32 + n * rank * c, none=True),
            Tensor("k, v up-projection", n * h * (m.qk_nope_head_dim + dv) * c, "dot"),
            Tensor("q, k (with rope)", 2 * n * h * qk * c, name="key_proj", none=True),
            Tensor("v", n * h * dv * c, name="value_proj", none=True),
            *_scores(lay, h, dv, False),
            Tensor("output projection", n / lay.residual_split * m.d_model * c, "dot")]
    return out


def swiglu_tensors(lay: Layout, rows: float, width: int, kind: str = "dot", what: str = "mlp") -> list[Tensor]:
    """SwiGLU on `rows` rows of hidden `width` (this device's share): gate, up, silu pieces, hidden."""
    c = lay.compute_bytes
    pieces = 5 if lay.model.mlp_activation == "gelu_tanh" else 3  # tanh GELU's backward reads two more
    return [Tensor(f"{what} gate, up", 2 * rows * width * c, kind, none=True),
            Tensor(f"{what} {lay.model.mlp_activation} pieces", pieces * rows * width * c, none=True),
            Tensor(f"{what} hidden", rows * width * c, name="mlp_hidden", none=True)]


def mlp_tensors(lay: Layout) -> list[Tensor]:
    n = lay.tokens
    return [Tensor("residual after attention", n / lay.residual_split * lay.model.d_model * lay.compute_bytes,
                   none=True), *_norm(lay, "mlp norm"), *swiglu_tensors(lay, n, lay.mlp)]


def moe_tensors(lay: Layout) -> list[Tensor]:
    """models/moe.py: router, then the capacity (one-hot einsum) or dropless (sorted rows) experts."""
    m, n, c, d = lay.model, lay.tokens, lay.compute_bytes, lay.model.d_model
    e, k = m.moe_num_experts, m.moe_top_k
    width = split(m.expert_dim, lay.tp)
    out = [Tensor("residual after attention", n / lay.residual_split * d * c, none=True), *_norm(lay, "moe norm"),
           Tensor("router logits", n * e * F32, "dot"), Tensor("router pieces", n * (e + 2 * k + 4) * F32, none=True)]
    if m.moe_dispatch == "capacity":
        slots = capacity_slots(lay)  # expert slots per row, all experts
        out += [Tensor("dispatch, combine", 2 * n * slots * F32, "bdot", none=True),
                Tensor("one-hot choices", n * k * (slots / e + e) * F32, none=True),
                Tensor("expert inputs", lay.rows * slots * d * c, "bdot", none=True),
                *swiglu_tensors(lay, lay.rows * slots, width, "bdot", "experts"),
                Tensor("expert outputs", lay.rows * slots * d * c, "bdot", none=True)]
    else:
        received = n * k * dropless_receive_factor(lay)
        out += [Tensor("sorted rows", received * d * c, none=True),
                *swiglu_tensors(lay, received, width, None, "experts"),
                Tensor("unsorted outputs", n * k * d * c, none=True)]
        if lay.backend == "cpu" and lay.ep > 1:  # XLA:CPU: padded all_to_all emulation (sharding/expert.py)
            out.append(Tensor("ragged exchange emulation", (lay.ep + lay.ep**2) * n * k * d * c, none=True))
    if m.moe_shared_experts:
        out += swiglu_tensors(lay, n, split(m.moe_shared_experts * m.expert_dim, lay.tp), what="shared experts")
    return out


def capacity_slots(lay: Layout) -> int:
    """Expert slots per sequence (all experts): E x ceil(factor x seq x k / E) (models/moe.py).

    The group is the whole sequence also under context parallelism: XLA gathers it over
    `context` for the dispatch, and every context shard computes all of its slots."""
    m = lay.model
    capacity = max(1, math.ceil(m.moe_capacity_factor * lay.cfg.train.seq_len * m.moe_top_k / m.moe_num_experts))
    return m.moe_num_experts * capacity


def dropless_receive_factor(lay: Layout) -> int:
    """Rows the dropless expert exchange allocates per routed row: the receive buffer holds the
    worst case (every row of every expert peer lands on one device: sharding/expert.py)."""
    return lay.ep


def attention_tensors(lay: Layout) -> list[Tensor]:
    return mla_tensors(lay) if lay.model.is_mla else mha_tensors(lay)


def _sandwich(lay: Layout, tensors: list[Tensor], what: str) -> list[Tensor]:
    """norm_placement=sandwich (Gemma) adds an RMSNorm on the sub-layer's output (pre and post have one)."""
    return tensors + _norm(lay, f"{what} output norm") if lay.model.norm_placement == "sandwich" else tensors


def _sandwich_mlp(lay: Layout) -> list[Tensor]:
    """The dense MLP; with sandwich norms its down-projection output feeds a norm, whose backward reads it
    (a dot output that save_dots keeps; the un-rematerialised layer's copy is the norm's float32 input)."""
    out = _sandwich(lay, mlp_tensors(lay), "ffn")
    if lay.model.norm_placement == "sandwich":
        out.append(Tensor("mlp down-projection", lay.tokens / lay.residual_split * lay.model.d_model
                          * lay.compute_bytes, "dot"))
    return out


@functools.lru_cache(maxsize=256)
def layer_tensors(lay: Layout, moe: bool) -> tuple[Tensor, ...]:
    ffn = _sandwich(lay, moe_tensors(lay), "ffn") if moe else _sandwich_mlp(lay)
    attention = _sandwich(lay, attention_tensors(lay), "attention")
    return tuple(attention + [dataclasses.replace(t, block="ffn") for t in ffn])


def effective_policy(lay: Layout, policy: str | None = None, staged: bool = True) -> str:
    """The policy as jax applies it to a layer. A pipeline stage runs its layers under
    `jax.vmap(..., spmd_axis_name="stage")` (sharding/pipeline.py), which gives every weight
    matmul a batch dimension (the stage), so `dots_with_no_batch_dims_saveable` saves none of
    them: save_dots_no_batch keeps what `full` keeps there (checked with print_saved_residuals).
    staged=False: a layer outside the pipeline (a MoE model's dense prefix)."""
    policy = policy or lay.model.remat_policy
    if staged and lay.pp > 1 and policy == "save_dots_no_batch":
        return "full"
    return policy


def saved_per_layer(lay: Layout, moe: bool, policy: str | None = None, staged: bool = True) -> float:
    """Bytes one layer keeps for the backward on this device (one microbatch)."""
    policy = effective_policy(lay, policy, staged)
    kept = saved(layer_tensors(lay, moe), policy)
    return kept if policy == "none" else kept + layer_input(lay)


def backward_working_set(lay: Layout, moe: bool, policy: str | None = None) -> float:
    """One layer's transient memory in its backward pass: what it rebuilds, and the gradients.

    A rematerialised layer first rebuilds its forward: the matmul outputs the policy did not
    keep, and the elementwise results the backward reads (norm outputs, RoPE'd q/k, softmax
    probabilities, the residual after attention, the SwiGLU hidden); the rest of the elementwise
    work fuses into its consumers. Then the feed-forward block's backward holds the gradients of
    its matmul outputs together, with three residual-stream buffers (the incoming and outgoing
    gradients and a partial sum). Checked against XLA's memory analysis (tests/test_plan.py)."""
    policy = effective_policy(lay, policy)
    tensors = layer_tensors(lay, moe)
    rebuilt = 0.0
    if policy != "none":
        rebuilt = sum(t.bytes for t in tensors if t.kind is not None and not _keeps(t, policy))
        rebuilt += sum(t.bytes for t in tensors if t.what in REBUILT and not _keeps(t, policy))
    grads = sum(t.bytes for t in tensors if t.block == "ffn" and (t.kind is not None or t.name == "mlp_hidden"))
    return rebuilt + grads + 3 * layer_input(lay) * lay.residual_split


# Elementwise results a rematerialised backward materialises again (the scores' probabilities
# are counted through "scores", the same size).
REBUILT = ("attention norm output", "mlp norm output", "moe norm output", "residual after attention",
           "q, k after RoPE", "scores", "mlp hidden", "experts hidden", "shared experts hidden",
           "ragged exchange emulation")


def _keeps(t: Tensor, policy: str) -> bool:
    if policy == "full":
        return False
    if policy == "save_dots":
        return t.kind is not None
    if policy == "save_dots_no_batch":
        return t.kind == "dot"
    return t.name in SAVED_NAMES.get(policy, ())
