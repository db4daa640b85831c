"""Tensor names and layouts: each of our parameters <-> the HF tensors it is made of.

HF stores one tensor per layer (and per expert), Linear weights as [out, in]. We store
layers stacked on a leading axis (`layers` for dense blocks, `moe_layers` for MoE blocks,
each in model order: see models/transformer.py `_moe_stack`), experts stacked on the next
axis, and projections as [in, heads, head_dim]. A `Rule` says, for one of our parameters:
which HF tensors make one (layer, expert) slice, and how to convert that slice both ways.
Converting one slice at a time is what lets import and export stream.

DeepSeek's rope columns: HF DeepseekV3 with `rope_interleave` rotates pairs (x0, x1),
(x2, x3), ... of q_b_proj's / kv_a_proj_with_mqa's rope outputs, and its result is laid out
[even-rotated, odd-rotated]; our `apply_rope` is rotate-half on [first half, second half].
Moving the even columns first and the odd ones second in the weights makes our
rotate-half compute exactly HF's interleaved rotation (q.k is invariant to permuting
both alike), so the importer applies that permutation and the exporter its inverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from models.config import ModelConfig

Convert = Callable[[Sequence[np.ndarray]], np.ndarray]
Split = Callable[..., list[np.ndarray]]  # our slice (and the slices of the params it joins) -> HF tensors


@dataclasses.dataclass(frozen=True)
class Rule:
    path: str  # our parameter, e.g. "layers/attn/wq"
    lead: tuple[int, ...]  # sizes of the leading axes that index separate HF tensors (layers, experts)
    names: Callable[..., list[str]]  # HF tensor names for one lead index (layer, expert)
    load: Convert  # HF tensors of one slice -> our slice
    save: Split  # our slice -> HF tensors (same order as names)
    # Export: further params whose same slices `save` takes after this one's, save(ours, *joined) (gpt-oss's
    # gate_up_proj interleaves w_gate and w_up); a param written that way by another rule is not `exported`.
    joins: tuple[str, ...] = ()
    exported: bool = True
    # Import: the slice's first axis is the experts, as the HF tensors' first axis (one tensor per layer holds them
    # all, gpt-oss): a device shard reads only its experts' rows (SafetensorsDir.read_experts).
    expert_rows: bool = False


def _t(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def rope_perm(dim: int) -> np.ndarray:
    """Interleaved-pair order -> rotate-half order: even columns, then odd ones."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def _permute_tail(x: np.ndarray, rope: int, inverse: bool = False) -> np.ndarray:
    """Permute the last `rope` entries of the last axis (the rope part)."""
    if not rope:
        return x
    perm = rope_perm(rope)
    if inverse:
        perm = np.argsort(perm)
    head = x[..., : x.shape[-1] - rope]
    return np.concatenate([head, x[..., x.shape[-1] - rope:][..., perm]], axis=-1)


def linear(*shape: int, rope: int = 0) -> tuple[Convert, Split]:
    """HF [out, in] <-> ours [in, *shape] with out = prod(shape); optional rope permutation."""
    def load(ts: Sequence[np.ndarray]) -> np.ndarray:
        w = ts[0].T.reshape(ts[0].shape[1], *shape)
        return np.ascontiguousarray(_permute_tail(w, rope))

    def save(x: np.ndarray) -> list[np.ndarray]:
        w = _permute_tail(x, rope, inverse=True)
        return [_t(w.reshape(x.shape[0], -1))]

    return load, save


def out_linear(*shape: int) -> tuple[Convert, Split]:
    """HF [out, in] with in = prod(shape) <-> ours [*shape, out] (o_proj)."""
    def load(ts: Sequence[np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(ts[0].T.reshape(*shape, ts[0].shape[0]))

    def save(x: np.ndarray) -> list[np.ndarray]:
        return [_t(x.reshape(-1, x.shape[-1]))]

    return load, save


def vector(*shape: int) -> tuple[Convert, Split]:
    """Same values; with `shape`, ours is the HF vector reshaped (q/k/v biases as [heads, head_dim])."""
    def load(ts: Sequence[np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(ts[0].reshape(shape)) if shape else ts[0]

    def save(x: np.ndarray) -> list[np.ndarray]:
        return [np.ascontiguousarray(x.reshape(-1) if shape else x)]

    return load, save


def _rules_for_block(cfg: ModelConfig, stack: str, hf_layers: list[int], family: str,
                     interleaved: bool) -> list[Rule]:
    """Rules for one stacked block group (`layers` or `moe_layers`) whose slots are `hf_layers`."""
    n = len(hf_layers)
    pre = lambda i: f"model.layers.{hf_layers[i]}"  # noqa: E731
    rules: list[Rule] = []

    def add(path: str, hf: str, conv: tuple[Convert, Split]) -> None:
        rules.append(Rule(f"{stack}/{path}", (n,), lambda i, hf=hf: [f"{pre(i)}.{hf}"], *conv))

    if cfg.norm_placement == "sandwich":  # Gemma 2/3: post_attention_layernorm is after attention here too
        add("attn_norm/scale", "input_layernorm.weight", vector())
        add("attn_post_norm/scale", "post_attention_layernorm.weight", vector())
        add("mlp_norm/scale", "pre_feedforward_layernorm.weight", vector())
        add("mlp_post_norm/scale", "post_feedforward_layernorm.weight", vector())
    elif cfg.norm_placement == "post":  # OLMo 2: HF's post_attention_layernorm is then after attention
        add("attn_post_norm/scale", "post_attention_layernorm.weight", vector())
        add("mlp_post_norm/scale", "post_feedforward_layernorm.weight", vector())
    else:
        add("attn_norm/scale", "input_layernorm.weight", vector())
        add("mlp_norm/scale", "post_attention_layernorm.weight", vector())
    _add_attention(cfg, add, interleaved)
    if stack == "layers":
        f, d = cfg.mlp_dim, cfg.d_model
        add("mlp/w_gate", "mlp.gate_proj.weight", linear(f))
        add("mlp/w_up", "mlp.up_proj.weight", linear(f))
        add("mlp/w_down", "mlp.down_proj.weight", linear(d))
        return rules
    if family == "gpt_oss":
        return rules + _gpt_oss_experts(cfg, stack, pre, n)
    # MoE block: the routed experts have a second stacked axis, so they take their own Rule.
    e, f, d = cfg.moe_num_experts, cfg.expert_dim, cfg.d_model
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    add("moe/router/w", f"{moe}.gate.weight", linear(e))
    if cfg.moe_bias_update_rate > 0 or cfg.moe_router_bias:
        add("moe/router/bias", f"{moe}.gate.e_score_correction_bias", vector())
    for ours, theirs, width in (("w_gate", gate, f), ("w_up", up, f), ("w_down", down, d)):
        conv = linear(width)
        rules.append(Rule(f"{stack}/moe/{ours}", (n, e),
                          lambda i, j, theirs=theirs: [f"{pre(i)}.{moe}.experts.{j}.{theirs}.weight"], *conv))
    if cfg.moe_shared_experts:
        sf = cfg.moe_shared_experts * f
        add("moe/shared/w_gate", "mlp.shared_experts.gate_proj.weight", linear(sf))
        add("moe/shared/w_up", "mlp.shared_experts.up_proj.weight", linear(sf))
        add("moe/shared/w_down", "mlp.shared_experts.down_proj.weight", linear(d))
    return rules


def _columns(start: int) -> Convert:
    """Every other column of the last axis from `start`: one half of an interleaved gate/up tensor."""
    return lambda ts: np.ascontiguousarray(ts[0][..., start::2])


def _interleave(gate: np.ndarray, up: np.ndarray) -> list[np.ndarray]:
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
    out[..., 0::2], out[..., 1::2] = gate, up
    return [out]


def _gpt_oss_experts(cfg: ModelConfig, stack: str, pre: Callable[[int], str], n: int) -> list[Rule]:
    """gpt-oss's MoE, one tensor per layer for all experts: router Linear [E, d] + bias; gate_up_proj
    [E, d, 2I] with gate and up in alternate columns (and its bias [E, 2I] alike); down_proj [E, I, d] as ours.
    MXFP4 checkpoints (`*_blocks` + `*_scales`) are read dequantized (safetensors_io.SafetensorsDir.read)."""
    e = cfg.moe_num_experts
    out = []

    def rule(path: str, hf: str, load: Convert, save: Split, **kw) -> None:
        out.append(Rule(f"{stack}/moe/{path}", (n,), lambda i, hf=hf: [f"{pre(i)}.mlp.{hf}"], load, save,
                        **{"expert_rows": hf.startswith("experts."), **kw}))

    rule("router/w", "router.weight", *linear(e))
    rule("router/logit_bias", "router.bias", *vector())
    for gate, up, hf in (("w_gate", "w_up", "experts.gate_up_proj"), ("b_gate", "b_up", "experts.gate_up_proj_bias")):
        rule(gate, hf, _columns(0), _interleave, joins=(f"{stack}/moe/{up}",))
        rule(up, hf, _columns(1), _interleave, exported=False)
    rule("w_down", "experts.down_proj", *vector())
    rule("b_down", "experts.down_proj_bias", *vector())
    return out


def _add_attention(cfg: ModelConfig, add: Callable[[str, str, tuple[Convert, Split]], None],
                   interleaved: bool) -> None:
    """The attention block's rules, MLA or MHA/GQA, through `add(our path, HF name, conversion)`."""
    h, kv, dh = cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
    if cfg.is_mla:
        nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        r = rope if interleaved else 0
        if cfg.q_lora_rank is None:
            add("attn/wq", "self_attn.q_proj.weight", linear(h, nope + rope, rope=r))
        else:
            add("attn/wq_a", "self_attn.q_a_proj.weight", linear(cfg.q_lora_rank))
            add("attn/q_norm", "self_attn.q_a_layernorm.weight", vector())
            add("attn/wq_b", "self_attn.q_b_proj.weight", linear(h, nope + rope, rope=r))
        add("attn/wkv_a", "self_attn.kv_a_proj_with_mqa.weight", linear(cfg.kv_lora_rank + rope, rope=r))
        add("attn/kv_norm", "self_attn.kv_a_layernorm.weight", vector())
        add("attn/wkv_b", "self_attn.kv_b_proj.weight", linear(h, nope + dv))
        add("attn/wo", "self_attn.o_proj.weight", out_linear(h, dv))
        return
    add("attn/wq", "self_attn.q_proj.weight", linear(h, dh))
    add("attn/wk", "self_attn.k_proj.weight", linear(kv, dh))
    add("attn/wv", "self_attn.v_proj.weight", linear(kv, dh))
    add("attn/wo", "self_attn.o_proj.weight", out_linear(h, dh))
    if cfg.qkv_bias:
        add("attn/bq", "self_attn.q_proj.bias", vector(h, dh))
        add("attn/bk", "self_attn.k_proj.bias", vector(kv, dh))
        add("attn/bv", "self_attn.v_proj.bias", vector(kv, dh))
    if cfg.attn_out_bias:  # gpt-oss
        add("attn/bo", "self_attn.o_proj.bias", vector())
    if cfg.attention_sinks:  # gpt-oss
        add("attn/sinks", "self_attn.sinks", vector())
    if cfg.qk_norm:
        add("attn/q_norm", "self_attn.q_norm.weight", vector())
        add("attn/k_norm", "self_attn.k_norm.weight", vector())


def rules(cfg: ModelConfig, family: str, interleaved: bool = True) -> list[Rule]:
    """Every parameter of `cfg`'s model as a Rule (the order export writes them in)."""
    out = [Rule("embed", (), lambda: ["model.embed_tokens.weight"], *vector())]
    flags = cfg.moe_layer_flags()
    dense = [i for i, m in enumerate(flags) if not m]
    sparse = [i for i, m in enumerate(flags) if m]
    if dense:
        out += _rules_for_block(cfg, "layers", dense, family, interleaved)
    if sparse:
        out += _rules_for_block(cfg, "moe_layers", sparse, family, interleaved)
    out.append(Rule("final_norm/scale", (), lambda: ["model.norm.weight"], *vector()))
    if not cfg.tie_embeddings:
        out.append(Rule("unembed", (), lambda: ["lm_head.weight"], *linear(cfg.vocab_size)))
    return out


_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def ignored(name: str, cfg: ModelConfig, family: str) -> bool:
    """HF tensors we knowingly drop: rotary caches, a tied lm_head copy, DeepSeek's MTP layers, the vision
    tower and projector of Gemma 3's image + text checkpoints."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if cfg.tie_embeddings and name in ("lm_head.weight", "language_model.lm_head.weight"):
        return True
    if family == "gemma3_text" and name.startswith(_VISION):  # an image + text checkpoint's image side
        return True
    if family == "deepseek_v3" and name.startswith("model.layers."):
        # Multi-token-prediction modules are stored as layers num_hidden_layers and up; we do not model them.
        return int(name.split(".")[2]) >= cfg.num_layers
    return False
