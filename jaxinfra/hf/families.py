"""HF `config.json` <-> our `ModelConfig`, per model family.

Import is strict: an architecture we do not know, or a feature of a known family that our
model does not implement (sliding windows, MLP biases, another activation, a rope type we
lack), raises `HFError` naming it, rather than building a model that silently computes
something else. Export picks the one HF family that computes exactly what our config does,
or refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jaxinfra.config import ConfigError
from models.config import ModelConfig


class HFError(ConfigError):
    """Bad or unsupported HF input/output; one line naming the thing (the CLI exits 2)."""


# model_type -> the `architectures` entry we write on export.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
GEMMA = ("gemma2", "gemma3_text")
# Image + text models whose text decoder we import (its config is their text_config; its tensors are
# renamed by SafetensorsDir.read and the vision tower's are ignored): the decoder's architecture.
WRAPPERS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# transformers' config defaults, for keys a Gemma config.json leaves out (the Hub's Gemma 3 text_config
# holds only what differs from them): head_dim is 256 there, not hidden_size / heads.
_GEMMA_DEFAULTS = {
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        tie_word_embeddings=True),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                   tie_word_embeddings=True),
}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
HF_LATENT_NORM_EPS = 1e-6  # DeepseekV2/V3RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep
_BY_ARCH = {v: k for k, v in ARCHITECTURES.items()}
SUPPORTED = ", ".join(sorted([*ARCHITECTURES.values(), *WRAPPERS]))


def family_of(hf: dict[str, Any]) -> str:
    """The family (model_type) of an HF config; unknown ones are refused by name."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    if not archs and model_type in ARCHITECTURES:
        return model_type
    name = ", ".join(archs) or f"model_type={model_type!r}"
    raise HFError(f"unsupported architecture {name}; supported: {SUPPORTED}")


def _rope(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Rope theta and scaling: transformers 5 nests them in `rope_parameters`, 4.x used top-level keys."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    if family == "gpt_oss" and "rope_type" not in params and "type" not in params:
        params = {**GPT_OSS_ROPE, **params}  # GptOssConfig's defaults when config.json names no rope
    theta = params.get("rope_theta", hf.get("rope_theta", GPT_OSS_THETA if family == "gpt_oss" else 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind == "yarn" and family == "gpt_oss":
        return {**out, **_mha_yarn(params, family)}
    if kind == "llama3" and family not in DEEPSEEK:
        return {**out, "rope_scaling_type": "llama3", "rope_scaling_factor": float(params["factor"]),
                "rope_low_freq_factor": float(params["low_freq_factor"]),
                "rope_high_freq_factor": float(params["high_freq_factor"]),
                "rope_original_max_len": int(params["original_max_position_embeddings"])}
    if kind == "yarn" and family in DEEPSEEK:
        mscale, mscale_all = params.get("mscale", 1.0), params.get("mscale_all_dim", 0.0)
        if mscale != mscale_all:  # HF then scales cos/sin by mscale/mscale_all_dim, which we do not model
            raise HFError(f"rope yarn with mscale={mscale} != mscale_all_dim={mscale_all} is not supported")
        return {**out, "rope_scaling_type": "yarn", "rope_scaling_factor": float(params["factor"]),
                "rope_original_max_len": int(params["original_max_position_embeddings"]),
                "rope_yarn_beta_fast": float(params.get("beta_fast", 32.0)),
                "rope_yarn_beta_slow": float(params.get("beta_slow", 1.0)),
                "rope_yarn_mscale": float(mscale_all)}
    raise HFError(f"{family}: rope type {kind!r} is not supported (default, llama3; yarn for DeepSeek and gpt-oss)")


GPT_OSS_THETA = 150000.0  # GptOssConfig.default_theta
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def _mha_yarn(params: dict[str, Any], family: str) -> dict[str, Any]:
    """YaRN on MHA/GQA as transformers applies it (modeling_rope_utils._compute_yarn_parameters): the ramped
    frequencies, `truncate`, and cos / sin multiplied by attention_factor (given, or from mscale and mscale_all_dim,
    or 0.1 ln(factor) + 1)."""
    factor = float(params["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return {"rope_scaling_type": "yarn", "rope_scaling_factor": factor,
            "rope_original_max_len": int(params["original_max_position_embeddings"]),
            "rope_yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "rope_yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "rope_yarn_truncate": bool(params.get("truncate", True)),
            "rope_yarn_attention_factor": float(attention)}


def _refuse(hf: dict[str, Any], family: str, key: str, ok: Any, why: str) -> None:
    value = hf.get(key)  # absent or null is always fine
    if value is not None and value != ok:
        raise HFError(f"{family}: config.json {key}={value!r} is not supported ({why})")


def text_decoder_config(hf: dict[str, Any]) -> dict[str, Any]:
    """An image + text model's config (WRAPPERS) -> its text decoder's own config.json; others as they are."""
    arch = next((a for a in hf.get("architectures") or [] if a in WRAPPERS), None)
    if arch is None:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise HFError(f"{arch}: config.json has no text_config")
    family = _BY_ARCH[WRAPPERS[arch]]
    return {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **text,
            "architectures": [WRAPPERS[arch]], "model_type": family}


def from_hf(hf: dict[str, Any]) -> tuple[str, ModelConfig]:
    """(family, ModelConfig) for an HF config.json dict (an image + text model's: its text decoder's)."""
    hf = text_decoder_config(hf)
    family = family_of(hf)
    if family in GEMMA:
        hf = {**_GEMMA_DEFAULTS[family], **hf}
    try:
        cfg = _model_config(hf, family)
        check_honoured(hf, family, cfg)
        return family, cfg
    except KeyError as e:
        raise HFError(f"{family}: config.json has no {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, HFError):
            raise
        raise HFError(f"{family}: config.json has a value of the wrong type ({e})") from None


# ---------------------------------------------------------------- fields every family must honour


def _window_in_effect(hf: dict[str, Any]) -> Any:
    """HF's sliding window where some layer uses it (Mistral: whenever set; Qwen2/3: with use_sliding_window;
    Gemma 2/3, gpt-oss: on the layer_types that say sliding_attention), else None."""
    window, types = hf.get("sliding_window"), hf.get("layer_types")
    if window is None or hf.get("use_sliding_window") is False:
        return None
    if isinstance(types, list) and "sliding_attention" not in types:
        return None
    return window


def _layer_types_match(types: Any, cfg: ModelConfig) -> bool:
    """layer_types (one of full_attention / sliding_attention per layer) says what cfg.layer_windows() does."""
    if not isinstance(types, list) or len(types) != cfg.num_layers:
        return False
    if not set(types) <= {"full_attention", "sliding_attention"}:
        return False
    return [t == "sliding_attention" for t in types] == [w is not None for w in cfg.layer_windows()]


def _rope_per_layer_type(hf: dict[str, Any], cfg: ModelConfig) -> bool:
    """transformers 5's per-layer-type rope_parameters ({"full_attention": {...}, "sliding_attention": {...}}):
    the global layers' base is rope_theta, the sliding layers' the local base (or rope_theta, unscaled)."""
    params = hf.get("rope_parameters")
    if not isinstance(params, dict):
        return True  # _rope reads (or refuses) the one-type forms
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if not isinstance(full, dict) or not isinstance(local, dict):
        return False
    if "rope_theta" in full and float(full["rope_theta"]) != cfg.rope_theta:
        return False
    if "rope_theta" in local and _window_in_effect(hf) is not None:
        if local.get("rope_type", "default") != "default":
            return False
        theta = cfg.rope_local_theta
        if theta is None:
            return cfg.rope_scaling_factor is None and float(local["rope_theta"]) == cfg.rope_theta
        return float(local["rope_theta"]) == theta
    return True


def check_honoured(hf: dict[str, Any], family: str, cfg: ModelConfig) -> None:
    """config.json fields that change what a model computes, whatever its family, checked against the mapped
    config: a family that maps a field passes, one that does not refuses it naming the field and its value
    (rather than import a model that computes something else). Absent and null fields pass."""
    scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.resolved_head_dim ** -0.5
    window = _window_in_effect(hf)
    local = hf.get("rope_local_base_freq")
    checks: tuple[tuple[str, Any, Callable[[Any], bool]], ...] = (
        ("attn_logit_softcapping", hf.get("attn_logit_softcapping"), lambda v: cfg.attn_logit_softcap == v),
        ("final_logit_softcapping", hf.get("final_logit_softcapping"), lambda v: cfg.logit_softcap == v),
        ("sliding_window", window, lambda v: cfg.sliding_window == v),
        ("layer_types", hf.get("layer_types"), lambda v: _layer_types_match(v, cfg)),
        ("rope_parameters", hf.get("rope_parameters"), lambda v: _rope_per_layer_type(hf, cfg)),
        ("rope_local_base_freq", None if window is None else local,
         lambda v: (cfg.rope_local_theta or (cfg.rope_theta if cfg.rope_scaling_factor is None else None)) == v),
        ("query_pre_attn_scalar", hf.get("query_pre_attn_scalar"),
         lambda v: v > 0 and math.isclose(scale, float(v) ** -0.5, rel_tol=1e-6)),
        ("partial_rotary_factor", hf.get("partial_rotary_factor"), lambda v: v == 1),
        ("use_bidirectional_attention", hf.get("use_bidirectional_attention"), lambda v: v is False),
    )
    for key, value, honoured in checks:
        if value is not None and not honoured(value):
            shown = repr(value) if len(repr(value)) <= 120 else repr(value)[:117] + "..."
            raise HFError(f"{family}: config.json {key}={shown} is not supported (the model it maps to "
                          f"would not compute it)")


def _model_config(hf: dict[str, Any], family: str) -> ModelConfig:
    if family not in GEMMA and hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"{family}: hidden_act={hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    _refuse(hf, family, "mlp_bias", False, "MLP biases are not modelled")
    heads = int(hf["num_attention_heads"])
    fields: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        mlp_dim=int(hf["intermediate_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family in GEMMA)),  # Gemma's default: tied
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), init_std=float(hf.get("initializer_range", 0.02)),
        param_dtype="float32", dtype="float32", **(_gemma_rope(hf, family) if family in GEMMA else _rope(hf, family)))
    head_dim = hf.get("head_dim")
    if family not in DEEPSEEK and head_dim and int(head_dim) != fields["d_model"] // heads:
        fields["head_dim"] = int(head_dim)
    if family in ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe"):
        _refuse(hf, family, "attention_bias", False, "attention biases are modelled for qwen2 only")
    if family in ("mistral", "mixtral"):
        _refuse(hf, family, "sliding_window", None, "sliding-window attention is not modelled")
    if family in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise HFError(f"{family}: use_sliding_window=true is not supported (sliding-window attention)")
    if family == "qwen2":
        fields["qkv_bias"] = True  # Qwen2 always has q/k/v biases (and none on o_proj)
    if family in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True
    if family == "qwen3_moe":
        fields.update(_qwen3_moe(hf, family, fields["num_layers"]))
    if family == "mixtral":
        fields.update(moe_num_experts=int(hf["num_local_experts"]), moe_top_k=int(hf["num_experts_per_tok"]),
                      moe_mlp_dim=int(hf["intermediate_size"]), moe_router_score="softmax", moe_norm_top_k=True,
                      moe_dispatch="dropless")
    if family in DEEPSEEK:
        fields.update(_deepseek(hf, family))
    if family == "olmo2":
        fields.update(_olmo2(hf))
    if family in GEMMA:
        fields.update(_gemma(hf, family, fields["num_layers"], fields.get("head_dim", fields["d_model"] // heads)))
    if family == "gpt_oss":
        fields.update(_gpt_oss(hf, fields["num_layers"]))
    cfg = ModelConfig(**fields)
    problems = cfg.problems()
    if problems:
        key, value, allowed = problems[0]
        raise HFError(f"{family}: mapped config has model.{key}={value!r}; must be {allowed}")
    return cfg


def _olmo2(hf: dict[str, Any]) -> dict[str, Any]:
    """OLMo 2: RMSNorm after attention and after the MLP (post_attention_layernorm,
    post_feedforward_layernorm), none before; QK-norm over the whole q and k projections."""
    _refuse(hf, "olmo2", "attention_bias", False, "attention biases (o_proj's too) are not modelled")
    return dict(norm_placement="post", qk_norm=True, qk_norm_scope="full")


def _gemma(hf: dict[str, Any], family: str, num_layers: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2/3: RMSNorm before and after each sub-layer with (1 + w) weights, GeGLU with tanh GELU,
    embeddings times sqrt(d_model), softmax scale query_pre_attn_scalar ** -0.5, sliding layers in a
    pattern; Gemma 3 adds per-head QK-norm and a RoPE base of its own for the sliding layers. Absent keys
    take transformers' defaults (Gemma 2 soft-caps attention at 50 and logits at 30)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise HFError(f"{family}: config.json hidden_activation={act!r} is not supported (gelu_pytorch_tanh only)")
    _refuse(hf, family, "attention_bias", False, "attention biases are not modelled")
    _refuse(hf, family, "use_bidirectional_attention", False, "bidirectional attention: causal decoders only")
    gemma2 = family == "gemma2"
    if not gemma2:  # its attention never reads the field (5.x); Gemma 3 checkpoints leave it null
        _refuse(hf, family, "attn_logit_softcapping", None, "transformers' Gemma 3 does not apply it")
    caps = {key: hf.get(key, default if gemma2 else None)
            for key, default in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0))}
    caps = {key: None if value is None else float(value) for key, value in caps.items()}
    scalar = float(hf.get("query_pre_attn_scalar", 256))
    window, pattern = _window_pattern(hf, family, num_layers)
    return dict(norm_placement="sandwich", norm_weight_offset=1.0, mlp_activation="gelu_tanh", embed_scale=True,
                qk_norm=not gemma2, attention_scale=None if scalar == head_dim else scalar ** -0.5,
                sliding_window=window, sliding_window_pattern=pattern,
                logit_softcap=caps["final_logit_softcapping"], attn_logit_softcap=caps["attn_logit_softcapping"])


LAYER_TYPES = ("sliding_attention", "full_attention")


def _window_pattern(hf: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, int]:
    """(sliding_window, sliding_window_pattern) computing HF's layer_types (transformers 4.x configs: their
    sliding_window_pattern, Gemma 2 alternating). HF's sliding mask keeps keys j > i - sliding_window, j <= i:
    our convention, so the window maps as is. A list no pattern n (layer i global iff (i + 1) % n == 0;
    0: none global) gives is refused by name."""
    types, key = hf.get("layer_types"), "layer_types"
    if types is None:
        n, key = hf.get("sliding_window_pattern", 2 if family == "gemma2" else 6), "sliding_window_pattern"
        if not isinstance(n, int) or n < 1:
            raise HFError(f"{family}: config.json sliding_window_pattern={n!r} is not supported (a positive integer)")
        types = [LAYER_TYPES[(i + 1) % n == 0] for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise HFError(f"{family}: config.json layer_types={types!r} is not supported "
                      f"({num_layers} entries, each one of {', '.join(LAYER_TYPES)})")
    full = [t == "full_attention" for t in types]
    if all(full):
        return None, 0
    window = hf.get("sliding_window", 4096)
    if not isinstance(window, int) or window < 1:
        raise HFError(f"{family}: config.json sliding_window={window!r} is not supported (sliding layers need "
                      "a positive integer)")
    for n in range(num_layers + 1):
        if full == [n > 0 and (i + 1) % n == 0 for i in range(num_layers)]:
            return window, n
    raise HFError(f"{family}: config.json {key}={hf.get(key)!r} is not supported (ours: layer i global iff "
                  "(i + 1) % n == 0 for one n, the others sliding)")


def _rope_default_or_linear(params: dict[str, Any], family: str, key: str) -> dict[str, Any]:
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    if kind == "linear":
        return {**out, "rope_scaling_type": "linear", "rope_scaling_factor": float(params["factor"])}
    if kind != "default":
        raise HFError(f"{family}: config.json {key} rope_type={kind!r} is not supported (default or linear)")
    return out


def _gemma_rope(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Gemma's RoPE: one default or linear rope (Gemma 2); Gemma 3's per layer type (transformers 5's
    rope_parameters {full_attention: ..., sliding_attention: ...}, or 4.x's rope_theta + rope_scaling for the
    global layers and rope_local_base_freq for the sliding ones). The sliding layers' rope as ours: the
    global one, or rope_local_theta without scaling."""
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention")
    else:
        full = {**(hf.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", hf.get("rope_theta", 10000.0 if family == "gemma2" else 1e6))
        local = None if family == "gemma2" else {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    out = _rope_default_or_linear(full, family, "rope_parameters.full_attention")
    if local is None:
        return out
    ours = _rope_default_or_linear(local, family, "rope_parameters.sliding_attention")
    if ours == out:
        return out
    if "rope_scaling_type" in ours:
        raise HFError(f"{family}: config.json rope_parameters.sliding_attention={local!r} is not supported "
                      "(the sliding layers' rope: the global one, or default with its own rope_theta)")
    return {**out, "rope_local_theta": ours["rope_theta"]}


def _gpt_oss(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss: biases on q, k, v and o (attention_bias), attention sinks, sliding and full layers (layer_types),
    a MoE on every layer (router with a logit bias, top-k of the logits then softmax over them = softmax, top-k,
    renormalised; experts with biases and the clamped SwiGLU). MXFP4 checkpoints are dequantized on import
    (jaxinfra/hf/safetensors_io.py)."""
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise HFError(f"gpt_oss: config.json quantization_config.quant_method={quant.get('quant_method')!r} is not "
                      f"supported (mxfp4, dequantized on import, or none)")
    bias = bool(hf.get("attention_bias", True))
    return dict(qkv_bias=bias, attn_out_bias=bias, attention_sinks=True, **_gpt_oss_windows(hf, num_layers),
                moe_num_experts=int(hf["num_local_experts"]), moe_top_k=int(hf["num_experts_per_tok"]),
                moe_mlp_dim=int(hf["intermediate_size"]), moe_router_score="softmax", moe_norm_top_k=True,
                moe_router_logit_bias=True, moe_expert_bias=True, moe_dispatch="dropless",
                mlp_activation="clamped_swiglu", mlp_swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                mlp_swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def _gpt_oss_windows(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """layer_types -> (sliding_window, sliding_window_pattern): every n-th layer full (n = 2 by default, HF's
    alternation), all sliding (0), or none (no window). Other lists are refused naming the field."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    window = hf.get("sliding_window")
    full = [t == "full_attention" for t in types] if isinstance(types, list) else None
    if full is None or len(types) != num_layers or not all(t in ("full_attention", "sliding_attention")
                                                           for t in types):
        raise HFError(f"gpt_oss: config.json layer_types={types!r} is not supported (one of full_attention, "
                      f"sliding_attention per layer)")
    if all(full) or window is None:
        if not all(full):
            raise HFError("gpt_oss: config.json sliding_window=None with sliding_attention layers is not supported")
        return {}
    for n in [0, *range(1, num_layers + 1)]:
        if all(f == (n > 0 and (i + 1) % n == 0) for i, f in enumerate(full)):
            return dict(sliding_window=int(window), sliding_window_pattern=n)
    raise HFError(f"gpt_oss: config.json layer_types={types!r} is not supported (ours: every n-th layer full, "
                  f"the others sliding)")


def _deepseek(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """MLA + DeepSeekMoE. V3: sigmoid scores with the selection bias, group-limited (top-2 sum per
    group), optional renormalisation. V2 as transformers 5 computes it: softmax, greedy top-k, no
    renormalisation (HF's V2 router ignores norm_topk_prob), times routed_scaling_factor."""
    v3 = family == "deepseek_v3"
    _refuse(hf, family, "attention_bias", False, "attention biases are not modelled")
    _refuse(hf, family, "moe_layer_freq", 1, "every layer after first_k_dense_replace is MoE")
    if v3:
        _refuse(hf, family, "topk_method", "noaux_tc", "only DeepSeek-V3's noaux_tc routing is modelled")
        _refuse(hf, family, "scoring_func", "sigmoid", "only sigmoid scores")
    else:  # group_limited_greedy scores a group by its best expert; ours by its two best (V3)
        _refuse(hf, family, "topk_method", "greedy", "only greedy routing is modelled for V2")
        _refuse(hf, family, "scoring_func", "softmax", "only softmax scores")
    # HF's q_a_layernorm / kv_a_layernorm keep their default eps whatever rms_norm_eps says; null
    # (= norm_eps) when the two agree, so those imports' configs stay as they were.
    same = float(hf.get("rms_norm_eps", HF_LATENT_NORM_EPS)) == HF_LATENT_NORM_EPS
    latent_eps = None if same else HF_LATENT_NORM_EPS
    num_kv = hf.get("num_key_value_heads")
    if num_kv not in (None, hf["num_attention_heads"]):
        raise HFError(f"{family}: num_key_value_heads={num_kv} != num_attention_heads (MLA has no KV groups)")
    routing = dict(moe_router_score="sigmoid", moe_norm_top_k=bool(hf.get("norm_topk_prob", True)),
                   moe_num_groups=int(hf.get("n_group") or 1), moe_top_k_groups=int(hf.get("topk_group") or 1),
                   moe_router_bias=True) if v3 else dict(moe_router_score="softmax", moe_norm_top_k=False)
    return dict(**routing,
        num_kv_heads=None, attention_type="mla", mla_norm_eps=latent_eps,
        q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        moe_num_experts=int(hf["n_routed_experts"]), moe_top_k=int(hf["num_experts_per_tok"]),
        moe_mlp_dim=int(hf["moe_intermediate_size"]), moe_shared_experts=int(hf.get("n_shared_experts") or 0),
        moe_first_dense_layers=int(hf.get("first_k_dense_replace") or 0), moe_every=1,
        moe_routed_scale=float(hf.get("routed_scaling_factor", 1.0)), moe_dispatch="dropless")


def _qwen3_moe(hf: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's experts: softmax over all experts, top-k, renormalised if norm_topk_prob (HF's default
    false), no shared experts. router_aux_loss_coef only matters to HF's training (output_router_logits):
    not imported, as for Mixtral. transformers 5 writes num_local_experts, the Hub's configs num_experts."""
    experts = int(hf.get("num_experts", hf.get("num_local_experts")) or 0)
    schedule = _moe_schedule(hf, family, num_layers) if experts else None
    if schedule is None:  # no MoE layer at all: HF builds dense MLPs of intermediate_size everywhere
        return {}
    first_dense, every = schedule
    return dict(moe_num_experts=experts, moe_top_k=int(hf["num_experts_per_tok"]),
                moe_mlp_dim=int(hf["moe_intermediate_size"]), moe_router_score="softmax",
                moe_norm_top_k=bool(hf.get("norm_topk_prob", False)), moe_first_dense_layers=first_dense,
                moe_every=every, moe_dispatch="dropless")


def _moe_schedule(hf: dict[str, Any], family: str, num_layers: int) -> tuple[int, int] | None:
    """(moe_first_dense_layers, moe_every) giving HF's MoE layers: layer i is MoE iff i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0. None when no layer is MoE; a pattern our
    schedule (a dense prefix, then every n-th layer MoE, n dividing the rest) cannot hold is refused."""
    step = 1 if hf.get("decoder_sparse_step") is None else hf["decoder_sparse_step"]
    only = hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise HFError(f"{family}: config.json decoder_sparse_step={step!r} is not supported (a positive integer)")
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise HFError(f"{family}: config.json mlp_only_layers={only!r} is not supported (a list of layer indices)")
    flags = tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))
    if not any(flags):
        return None
    for n in range(1, num_layers + 1):  # ModelConfig.moe_layer_flags' rule, with its divisibility check;
        for k in range(num_layers):  # the smallest n first: a dense prefix reads as one, not as every 2nd
            ours = tuple(i >= k and (i - k + 1) % n == 0 for i in range(num_layers))
            if (num_layers - k) % n == 0 and ours == flags:
                return k, n
    key, value = ("mlp_only_layers", only) if only else ("decoder_sparse_step", step)
    dense = [i for i, moe in enumerate(flags) if not moe]
    raise HFError(f"{family}: config.json {key}={value!r} is not supported (dense layers {dense} of "
                  f"{num_layers}; ours: the first k dense, then every n-th layer MoE, n dividing the rest)")


def rope_interleaved(hf: dict[str, Any], family: str) -> bool:
    """Whether the checkpoint's rope columns are in DeepSeek's interleaved-pair order (V2's complex
    rotation always is; V3 unless rope_interleave is false)."""
    return family == "deepseek_v2" or (family == "deepseek_v3" and bool(hf.get("rope_interleave", True)))


# ---------------------------------------------------------------- export


def hf_family(cfg: ModelConfig) -> str:
    """The HF family that computes what `cfg` computes, or HFError naming the feature HF lacks."""
    def refuse(what: str) -> None:
        raise HFError(f"no Hugging Face family for this model: {what}")

    if cfg.norm_placement == "sandwich":
        return _gemma_family(cfg, refuse)
    if cfg.logit_softcap is not None:
        refuse(f"model.logit_softcap={cfg.logit_softcap} (Gemma 2/3 soft-cap logits: they have "
               "norm_placement=sandwich)")
    if _uses_gpt_oss_features(cfg):
        return _gpt_oss_family(cfg, refuse)
    if not cfg.rope_yarn_truncate:
        refuse("model.rope_yarn_truncate=false (gpt-oss only)")
    # Gemma's features outside Gemma's block
    for key, plain in (("norm_weight_offset", 0.0), ("mlp_activation", "silu"), ("embed_scale", False),
                       ("attn_logit_softcap", None), ("attention_scale", None), ("sliding_window", None),
                       ("rope_local_theta", None), ("attention_sinks", False)):
        if getattr(cfg, key) != plain:
            refuse(f"model.{key}={getattr(cfg, key)!r} (no supported HF family has it without Gemma's "
                   "norm_placement=sandwich)")
    if cfg.norm_placement != "pre" or cfg.qk_norm_scope != "head":
        return _olmo2_family(cfg, refuse)
    if cfg.is_mla:
        if not cfg.is_moe:
            refuse("MLA without MoE (DeepSeek-V3 needs MoE layers)")
        if cfg.moe_every != 1 or cfg.qkv_bias:
            refuse("MLA + MoE needs moe_every=1 and no qkv_bias (DeepSeek)")
        if cfg.latent_norm_eps != HF_LATENT_NORM_EPS:
            refuse(f"MLA latent norms with eps {cfg.latent_norm_eps} (model.mla_norm_eps, or norm_eps when null): "
                   f"HF's DeepSeek fixes them at {HF_LATENT_NORM_EPS}")
        if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type != "yarn":
            refuse("llama3 rope scaling with MLA")
        if cfg.moe_router_score == "sigmoid":
            return "deepseek_v3"
        if cfg.moe_norm_top_k or cfg.moe_num_groups != 1 or cfg.moe_bias_update_rate or cfg.moe_router_bias:
            refuse("MLA + softmax MoE other than DeepSeek-V2's (greedy top-k, no renormalisation, groups or bias)")
        return "deepseek_v2"
    if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type != "llama3":
        refuse("yarn rope scaling without MLA")
    if cfg.is_moe and cfg.qk_norm:
        return _qwen3_moe_family(cfg)
    if cfg.is_moe:
        plain = (cfg.moe_router_score == "softmax" and cfg.moe_norm_top_k and not cfg.moe_shared_experts
                 and cfg.moe_num_groups == 1 and cfg.moe_routed_scale == 1.0 and cfg.moe_first_dense_layers == 0
                 and cfg.moe_every == 1 and not cfg.qk_norm and not cfg.qkv_bias
                 and not (cfg.moe_bias_update_rate or cfg.moe_router_bias))
        if not plain:
            refuse("MoE other than Mixtral's (softmax, renormalised top-k, no shared experts, groups, bias, "
                   "dense layers, scale, qk_norm or qkv_bias)")
        return "mixtral"
    if cfg.qk_norm and cfg.qkv_bias:
        refuse("qk_norm together with qkv_bias")
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "llama"


def _gemma_family(cfg: ModelConfig, refuse: Callable[[str], None]) -> str:
    """Sandwich norms are Gemma's: Gemma 3 with per-head QK-norm, Gemma 2 without (and one RoPE base)."""
    for key, value in (("norm_weight_offset", 1.0), ("mlp_activation", "gelu_tanh"), ("embed_scale", True),
                       ("attention_sinks", False), ("qkv_bias", False), ("attn_out_bias", False),
                       ("qk_norm_scope", "head")):
        if getattr(cfg, key) != value:
            refuse(f"model.norm_placement=sandwich with model.{key}={getattr(cfg, key)!r} "
                   f"(Gemma 2/3 have {key}={value!r})")
    if cfg.is_mla or cfg.is_moe:
        refuse("model.norm_placement=sandwich with MLA or MoE (Gemma 2/3 have neither)")
    if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type != "linear":
        refuse(f"model.rope_scaling_type={cfg.rope_scaling_type} with Gemma's sandwich norms (Gemma: linear)")
    if _pre_attn_scalar(cfg) is None:
        refuse(f"model.attention_scale={cfg.attention_scale} (Gemma's query_pre_attn_scalar = attention_scale ** -2 "
               f"= {cfg.attention_scale ** -2:.6g} must be an integer)")
    if not cfg.qk_norm:
        if cfg.rope_local_theta is not None:
            refuse(f"model.rope_local_theta={cfg.rope_local_theta} without qk_norm (Gemma 2 has one RoPE base)")
        return "gemma2"
    if cfg.attn_logit_softcap is not None:
        refuse(f"model.attn_logit_softcap={cfg.attn_logit_softcap} with qk_norm (transformers' Gemma 3 does "
               "not apply it; Gemma 2 has no qk_norm)")
    return "gemma3_text"


def _pre_attn_scalar(cfg: ModelConfig) -> int | None:
    """HF Gemma's query_pre_attn_scalar for our softmax scale (transformers 5 types it int); None if not one."""
    if cfg.attention_scale is None:
        return cfg.resolved_head_dim
    scalar = cfg.attention_scale ** -2
    return round(scalar) if abs(scalar - round(scalar)) <= 1e-9 * scalar else None


def _gemma_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """Gemma's keys: transformers 5's (rope_parameters, per layer type for Gemma 3; layer_types), and for
    Gemma 3 also 4.x's rope_scaling and rope_local_base_freq, which 5.x folds into rope_parameters."""
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor is not None:
        full.update(rope_type="linear", factor=cfg.rope_scaling_factor)
    out: dict[str, Any] = dict(
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=_pre_attn_scalar(cfg),
        # HF builds a sliding mask even with no sliding layer, so the window needs a value then too.
        sliding_window=cfg.sliding_window or 4096,
        layer_types=[LAYER_TYPES[w is None] for w in cfg.layer_windows()],
        final_logit_softcapping=cfg.logit_softcap, attn_logit_softcapping=cfg.attn_logit_softcap,
        use_bidirectional_attention=False, rope_parameters=full)
    if family == "gemma3_text":
        local = full if cfg.rope_local_theta is None else {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
        out.update(rope_parameters={"full_attention": full, "sliding_attention": local},
                   rope_local_base_freq=local["rope_theta"], rope_scaling=None if cfg.rope_scaling_factor is None
                   else {"rope_type": "linear", "factor": cfg.rope_scaling_factor})
    return out


def _uses_gpt_oss_features(cfg: ModelConfig) -> bool:
    """Whether `cfg` uses a feature only gpt-oss has among the supported families."""
    return (cfg.attention_sinks or cfg.attn_out_bias or cfg.mlp_activation == "clamped_swiglu"
            or cfg.moe_expert_bias or cfg.moe_router_logit_bias)


def _gpt_oss_family(cfg: ModelConfig, refuse: Callable[[str], None]) -> str:
    """gpt-oss computes exactly: pre norms, GQA with sinks and q/k/v/o biases (all or none), every layer MoE with
    a logit-biased softmax router (top-k renormalised), biased experts with the clamped SwiGLU, windows on every
    layer or on all but every n-th, default or yarn RoPE."""
    want = dict(attention_sinks=True, mlp_activation="clamped_swiglu", moe_expert_bias=True,
                moe_router_logit_bias=True, attn_out_bias=cfg.qkv_bias, moe_router_score="softmax",
                moe_norm_top_k=True, moe_shared_experts=0, moe_num_groups=1, moe_routed_scale=1.0,
                moe_first_dense_layers=0, moe_every=1, moe_bias_update_rate=0.0, moe_router_bias=False,
                norm_placement="pre", qk_norm=False, attention_type="mha", norm_weight_offset=0.0, embed_scale=False,
                attn_logit_softcap=None, attention_scale=None, rope_local_theta=None)
    if not cfg.is_moe:
        refuse("gpt-oss's features (sinks, o bias, clamped_swiglu, expert or router logit biases) without MoE")
    for key, value in want.items():
        if getattr(cfg, key) != value:
            refuse(f"model.{key}={getattr(cfg, key)!r} with gpt-oss's features (gpt-oss has {value!r})")
    if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type != "yarn":
        refuse(f"rope_scaling_type={cfg.rope_scaling_type} with gpt-oss (default or yarn)")
    return "gpt_oss"


def _gpt_oss_hf(cfg: ModelConfig) -> dict[str, Any]:
    """gpt-oss's keys: the experts, the clamped SwiGLU, layer_types from the window pattern, yarn as HF reads it."""
    windows = cfg.layer_windows()
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    max_len = max(4096, cfg.rope_original_max_len)
    if cfg.rope_scaling_factor is not None:
        rope.update(rope_type="yarn", factor=cfg.rope_scaling_factor, beta_fast=cfg.rope_yarn_beta_fast,
                    beta_slow=cfg.rope_yarn_beta_slow, truncate=cfg.rope_yarn_truncate,
                    original_max_position_embeddings=cfg.rope_original_max_len,
                    attention_factor=1.0 if cfg.rope_yarn_attention_factor is None else cfg.rope_yarn_attention_factor)
        max_len = int(cfg.rope_original_max_len * cfg.rope_scaling_factor)
    return dict(num_local_experts=cfg.moe_num_experts, num_experts_per_tok=cfg.moe_top_k,
                intermediate_size=cfg.expert_dim, attention_bias=cfg.qkv_bias, swiglu_alpha=cfg.mlp_swiglu_alpha,
                swiglu_limit=cfg.mlp_swiglu_limit, sliding_window=cfg.sliding_window,
                layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
                router_aux_loss_coef=cfg.moe_aux_loss_weight, output_router_logits=False, rope_parameters=rope,
                max_position_embeddings=max_len)


def _qwen3_moe_family(cfg: ModelConfig) -> str:
    """MoE with qk_norm is Qwen3-MoE's: softmax over all experts, top-k (renormalised or not), no shared
    experts, groups, bias or scale; any dense prefix / every-n-th schedule (mlp_only_layers holds it)."""
    if (cfg.moe_router_score != "softmax" or cfg.moe_shared_experts or cfg.moe_num_groups != 1
            or cfg.moe_routed_scale != 1.0 or cfg.moe_bias_update_rate or cfg.moe_router_bias or cfg.qkv_bias):
        raise HFError("no Hugging Face family for this model: MoE with qk_norm other than Qwen3-MoE's (softmax, "
                      "top-k, no shared experts, groups, bias, scale or qkv_bias)")
    return "qwen3_moe"


def _qwen3_moe_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3-MoE's keys. The schedule as decoder_sparse_step + mlp_only_layers: step n with the dense prefix
    listed when it is a multiple of n (then HF's (i + 1) % n is ours), else step 1 and every dense layer."""
    k, n = cfg.moe_first_dense_layers, cfg.moe_every
    step = n if k % n == 0 else 1
    only = list(range(k)) if step == n else [i for i, moe in enumerate(cfg.moe_layer_flags()) if not moe]
    # num_experts (the Hub's key; transformers 5 maps it to num_local_experts) so that 4.x reads it too.
    return dict(num_experts=cfg.moe_num_experts, num_experts_per_tok=cfg.moe_top_k,
                moe_intermediate_size=cfg.expert_dim, norm_topk_prob=cfg.moe_norm_top_k, decoder_sparse_step=step,
                mlp_only_layers=only, router_aux_loss_coef=cfg.moe_aux_loss_weight, output_router_logits=False,
                use_sliding_window=False, sliding_window=None)


def _olmo2_family(cfg: ModelConfig, refuse: Callable[[str], None]) -> str:
    """OLMo 2 is the one HF family with post-sub-layer norms or full-projection QK-norm, and it has both."""
    what = f"model.norm_placement={cfg.norm_placement} with model.qk_norm_scope={cfg.qk_norm_scope}"
    if cfg.norm_placement != "post" or not (cfg.qk_norm and cfg.qk_norm_scope == "full"):
        refuse(f"{what} (OLMo 2 has post norms, qk_norm=true and qk_norm_scope=full together)")
    if cfg.is_mla or cfg.is_moe or cfg.qkv_bias:
        refuse(f"{what} and MLA, MoE or qkv_bias (OLMo 2 has none)")
    if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type != "llama3":
        refuse("yarn rope scaling without MLA")
    return "olmo2"


def to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """config.json for `cfg` (see hf_family)."""
    family = hf_family(cfg)
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
    elif cfg.rope_scaling_factor is not None:
        rope.update(rope_type="yarn", factor=cfg.rope_scaling_factor, beta_fast=cfg.rope_yarn_beta_fast,
                    beta_slow=cfg.rope_yarn_beta_slow, mscale=cfg.rope_yarn_mscale,
                    mscale_all_dim=cfg.rope_yarn_mscale, original_max_position_embeddings=cfg.rope_original_max_len)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "max_position_embeddings": max(4096, cfg.rope_original_max_len), "attention_bias": False,
        "dtype": dtype, "use_cache": True,
    }
    if family not in DEEPSEEK:
        out["head_dim"] = cfg.resolved_head_dim
    if family == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
        out.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3_moe":
        out.update(_qwen3_moe_hf(cfg))
    if family == "gpt_oss":
        out.update(_gpt_oss_hf(cfg))
    if family in ("mixtral", "mistral"):
        out["sliding_window"] = None
    if family == "mixtral":
        if cfg.expert_dim != cfg.mlp_dim:
            out["intermediate_size"] = cfg.expert_dim  # Mixtral has no dense MLPs: only the expert width matters
        out.update(num_local_experts=cfg.moe_num_experts, num_experts_per_tok=cfg.moe_top_k,
                   router_jitter_noise=0.0, output_router_logits=False)
    if family in GEMMA:
        out.update(_gemma_hf(cfg, family))
    if family in DEEPSEEK:
        out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                   qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                   v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim,
                   n_routed_experts=cfg.moe_num_experts, num_experts_per_tok=cfg.moe_top_k,
                   moe_intermediate_size=cfg.expert_dim, n_shared_experts=cfg.moe_shared_experts,
                   first_k_dense_replace=cfg.moe_first_dense_layers, routed_scaling_factor=cfg.moe_routed_scale,
                   norm_topk_prob=cfg.moe_norm_top_k)
    if family == "deepseek_v3":
        out.update(n_group=cfg.moe_num_groups, topk_group=cfg.moe_top_k_groups, topk_method="noaux_tc",
                   scoring_func="sigmoid", rope_interleave=True, num_nextn_predict_layers=0)
    if family == "deepseek_v2":
        out.update(n_group=None, topk_group=None, topk_method="greedy", scoring_func="softmax")
    return out

