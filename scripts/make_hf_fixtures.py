"""Tiny random Hugging Face checkpoints + reference logits, for tests/test_hf.py.

Families: Llama (GQA, untied), Qwen2 (q/k/v bias), Qwen3 (QK-norm, tied), Mixtral (8 experts top-2),
DeepSeek-V3 (MLA with q_lora_rank, YaRN, sigmoid MoE with bias, groups, shared expert, first layer dense),
DeepSeek-V2 (MLA without q_lora_rank, softmax greedy MoE, 2 shared experts), Qwen3-MoE (QK-norm, GQA 8/2
with head_dim 16 != d/heads, 4 experts top-2 without renormalisation, layer 0 dense via mlp_only_layers, untied) and
OLMo 2 (post-sub-layer norms, QK-norm over the whole q / k projections, GQA, head_dim != d_model / heads),
Gemma 3 (text: sandwich norms with (1 + w) weights, QK-norm, GeGLU, scaled embeddings, sliding and global layers
with their own RoPE, linear scaling on the global ones) and Gemma 2 (the same block without QK-norm, one RoPE,
attention and logit soft-caps); `gemma3_mm` is Gemma3ForConditionalGeneration around the gemma3 decoder.

Run with the fixture venv (torch + transformers; the test suite itself never imports them):

    python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf/<name>/
    python scripts/make_hf_fixtures.py --check-export EXPORT_DIR --reference tests/fixtures/hf/llama

Each fixture dir holds what `save_pretrained(safe_serialization=True)` writes (config.json,
model.safetensors) plus `reference.npz`: `tokens` [2, 16] int32 ([2, 32] for the Gemma ones: longer than
their window), `logits` [2, 16, vocab] float32 and `loss`, the mean next-token cross-entropy over all
predictions computed in float32 from those logits (HF's `labels=` convention: logits[:, :-1] predict tokens[:, 1:]), and
`hidden_states` [layers + 1, 2, 16, hidden] float32 (`output_hidden_states=True`: the embeddings, each
layer's output, the last one final-normed) for `jaxinfra hf check`'s first-diverging-layer report.
`--add-hidden-states` adds that array to existing fixtures' reference.npz, leaving the other arrays and
files as they are (it checks the reloaded model still gives the stored logits exactly).

Weights are re-drawn with larger scales than HF's init (std 0.02 makes every logit ~0 and the
MoE routers near-ties, which would test nothing); norm weights are 1 + noise; DeepSeek's
e_score_correction_bias gets non-zero values so the selection bias is exercised.

`--check-export` loads a jaxinfra-exported directory back with transformers and compares its
logits on the reference tokens with the reference logits (max |diff| / max |ref|).
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf"
VOCAB, SEQ, BATCH = 128, 16, 2


def configs() -> dict[str, transformers.PretrainedConfig]:
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, torch_dtype="float32")
    return {**_global_configs(common), **_windowed_configs(common)}


def _global_configs(common: dict) -> dict[str, transformers.PretrainedConfig]:
    """The families whose layers all attend globally."""
    return {
        "llama": transformers.LlamaConfig(**common, num_key_value_heads=2, intermediate_size=128,
                                          tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0),
        "qwen2": transformers.Qwen2Config(**common, num_key_value_heads=2, intermediate_size=128,
                                          tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6),
        "qwen3": transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=24, intermediate_size=128,
                                          tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6),
        "mixtral": transformers.MixtralConfig(**common, num_key_value_heads=2, intermediate_size=32,
                                              num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                                              rms_norm_eps=1e-5, rope_theta=1e6),
        "deepseek_v3": transformers.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "max_position_embeddings": 32}, intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
            tie_word_embeddings=False, rms_norm_eps=1e-6,
            # YaRN x4 over an original length of 8 < 16 tokens: the frequency ramp and MLA's softmax scale matter.
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 0.707, "mscale_all_dim": 0.707}),
        # V2-Lite shape: full-rank queries (q_proj), softmax greedy routing without renormalisation, 2 shared.
        "deepseek_v2": transformers.DeepseekV2Config(
            **{**common, "num_hidden_layers": 3}, num_key_value_heads=4, intermediate_size=96,
            moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1,
            routed_scaling_factor=1.5, topk_method="greedy", norm_topk_prob=False, tie_word_embeddings=False,
            rms_norm_eps=1e-6, rope_theta=10000.0),
        # Held-out against the qwen3-30b-a3b preset: a dense first layer, norm_topk_prob false (HF's default).
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **{**common, "num_attention_heads": 8}, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False, rms_norm_eps=1e-6,
            rope_theta=1e6),
        # OLMo 2: norms after the sub-layers, QK-norm over the whole projections (GQA here: k_norm is
        # 2 * 24 wide, q_norm 4 * 24; head_dim 24 != 64 / 4, so the widths are not d_model's).
        "olmo2": transformers.Olmo2Config(**common, num_key_value_heads=2, head_dim=24, intermediate_size=96,
                                          tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=500000.0,
                                          pad_token_id=1, eos_token_id=2),
    }


def _windowed_configs(common: dict) -> dict[str, transformers.PretrainedConfig]:
    """The families with sliding-window layers (sequences longer than the window: SEQS)."""
    return {
        # Gemma 3 (text): 6 layers, every 3rd global (layer_types), a window of 8 over 32 tokens, the global
        # layers' RoPE linearly scaled x4 on base 5e4, the sliding ones' base 1e4; GQA 4/2 with head_dim 16 !=
        # 48 / 4 and query_pre_attn_scalar 24 != head_dim; tied.
        "gemma3": transformers.Gemma3TextConfig(
            **{**common, "hidden_size": 48, "num_hidden_layers": 6}, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            tie_word_embeddings=True, rms_norm_eps=1e-6),
        # Gemma 2: 4 layers alternating sliding (window 8 over 32 tokens) and global, soft-caps low enough
        # (attention 4, logits 6) that tanh bends the scores; untied; query_pre_attn_scalar 12 != head_dim 16.
        "gemma2": transformers.Gemma2Config(
            **{**common, "hidden_size": 32, "num_hidden_layers": 4}, num_key_value_heads=1, head_dim=16,
            intermediate_size=64, query_pre_attn_scalar=12, sliding_window=8, attn_logit_softcapping=4.0,
            final_logit_softcapping=6.0, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0),
        # gpt-oss: 4 layers alternating sliding (window 8 < the 32 tokens) and full, GQA 8/2 with head_dim 16 !=
        # 64 / 8, 6 experts top-2 of width 32 (MXFP4 blocks need multiples of 32), biases everywhere, sinks, yarn
        # x4 over 16 positions with truncate=false, and swiglu_limit 1.0 so that the clamp bites (checked).
        "gpt_oss": transformers.GptOssConfig(
            **{**common, "num_hidden_layers": 4, "num_attention_heads": 8, "max_position_embeddings": 64},
            num_key_value_heads=2, head_dim=16, intermediate_size=32,
            num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
            swiglu_limit=1.0, tie_word_embeddings=False, rms_norm_eps=1e-5, attention_bias=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
    }

# Seeds by name for families added later, so that fixtures keep their seed whatever the dict order.
SEEDS = {"qwen3_moe": 31, "olmo2": 7, "gemma3": 33, "gemma2": 22, "gpt_oss": 20}
# Sequence lengths other than SEQ: these fixtures' sequences are longer than their sliding window.
SEQS = {"gemma3": 32, "gemma2": 32, "gpt_oss": 32}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-init random weights so that logits and routing are far from ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or "layernorm" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
            for name, p in model.named_parameters():
                if name.endswith(".sinks"):  # gpt-oss: sinks of order of the scores, so that they matter
                    p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def hidden_states(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), output_hidden_states=True)
    return np.stack([h.float().numpy() for h in out.hidden_states])


def add_hidden_states(fixture: pathlib.Path) -> None:
    """Adds `hidden_states` to an existing reference.npz; every other array is written back unchanged."""
    ref = dict(np.load(fixture / "reference.npz"))
    model = transformers.AutoModelForCausalLM.from_pretrained(fixture, attn_implementation="eager").float().eval()
    assert _rel_err(reference(model, ref["tokens"])[0], ref["logits"]) == 0.0, f"{fixture}: logits changed"
    ref["hidden_states"] = hidden_states(model, ref["tokens"])
    np.savez(fixture / "reference.npz", **ref)
    print(f"{fixture.name}: hidden_states {ref['hidden_states'].shape}")


def reference(model: torch.nn.Module, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    logp = torch.log_softmax(torch.from_numpy(logits[:, :-1]).float(), dim=-1)
    targets = torch.from_numpy(tokens[:, 1:]).long()
    loss = float(-logp.gather(-1, targets[..., None]).mean())
    return logits, loss


def build(name: str, cfg: transformers.PretrainedConfig, seed: int) -> None:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomize(model, seed)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQS.get(name, SEQ))).astype(np.int32)
    logits, loss = reference(model, tokens)
    with torch.no_grad():  # HF's own loss (labels shifted inside) agrees with ours
        hf_loss = float(model(torch.from_numpy(tokens).long(), labels=torch.from_numpy(tokens).long()).loss)
    assert abs(hf_loss - loss) <= 1e-5 * abs(loss), (hf_loss, loss)
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    model.save_pretrained(out, safe_serialization=True)
    np.savez(out / "reference.npz", tokens=tokens, logits=logits, loss=np.float32(loss),
             hidden_states=hidden_states(model, tokens))
    # What did transformers write? (5.x may store fused expert tensors; the Hub uses per-expert names.)
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "np") as f:
        keys = sorted(f.keys())
    experts = [k for k in keys if ".experts." in k][:3]
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name}: {len(keys)} tensors, {size / 1024:.0f} KiB, loss {loss:.6f}, expert keys e.g. {experts}")
    # Reload check: what we wrote loads back to the same logits.
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    err = _rel_err(reference(again, tokens)[0], logits)
    assert err == 0.0, f"{name}: reload changed logits (rel err {err})"
    if name == "gpt_oss":
        gpt_oss_checks(model, tokens, logits)
        build_mxfp4(model, tokens, out / "mxfp4")


def gpt_oss_checks(model: torch.nn.Module, tokens: np.ndarray, logits: np.ndarray) -> None:
    """The fixture exercises what it claims: the clamp bites, the window cuts, sinks and biases are non-zero."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    limit, seen = model.config.swiglu_limit, []
    original = m.GptOssExperts._apply_gate

    def spy(self, gate_up):
        seen.append(float((gate_up[..., ::2] > limit).float().mean()))
        return original(self, gate_up)

    m.GptOssExperts._apply_gate = spy
    try:
        reference(model, tokens)
    finally:
        m.GptOssExperts._apply_gate = original
    full = copy.deepcopy(model)
    full.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    cut = _rel_err(reference(full, tokens)[0], logits)
    sinks = min(float(layer.self_attn.sinks.detach().abs().min()) for layer in model.model.layers)
    print(f"gpt_oss: gate > limit in {min(seen):.1%}..{max(seen):.1%} of values per expert call; window off "
          f"changes logits by {cut:.2e} rel; min |sink| {sinks:.3f}")
    assert 0.01 < np.mean(seen) < 0.9 and cut > 1e-3 and sinks > 0


def mxfp4_quantize(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[E, in, out] float -> (blocks [E, out, in / 32, 16] uint8, scales [E, out, in / 32] uint8), the layout
    gpt-oss's checkpoints use, per the OCP MX spec: each block of 32 inputs shares the exponent 2^s that brings
    its largest |value| to at most 6, and each value becomes the nearest FP4 e2m1 code, two per byte (low first)."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = np.asarray(FP4_VALUES, np.float32)
    x = w.detach().float().numpy().transpose(0, 2, 1)  # [E, out, in]
    e, rows, cols = x.shape
    x = x.reshape(e, rows, cols // 32, 32)
    amax = np.abs(x).max(-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    codes = np.abs(x[..., None] / np.ldexp(1.0, exp)[..., None, None] - lut).argmin(-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    # contiguous: safetensors.numpy writes an array's buffer as is, whatever its strides
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exp + 127).astype(np.uint8))


def build_mxfp4(model: torch.nn.Module, tokens: np.ndarray, out: pathlib.Path) -> None:
    """The fixture's expert weights quantized to MXFP4 (`*_blocks`, `*_scales`: only these small tensors are
    stored, the test puts them in place of gate_up_proj / down_proj), what transformers' own dequantization
    (integrations/mxfp4.py convert_moe_packed_tensors) makes of layer 0's, and the logits of the model on the
    dequantized weights."""
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out.mkdir(parents=True, exist_ok=True)
    quantized, dequantized = {}, {}
    deq_model = copy.deepcopy(model)
    for i, layer in enumerate(deq_model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = mxfp4_quantize(getattr(layer.mlp.experts, proj))
            quantized |= {f"{key}_blocks": blocks, f"{key}_scales": scales}
            deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(deq)
            if i == 0:
                dequantized[key] = deq.numpy()
    save_file(quantized, out / "experts.safetensors")
    logits, loss = reference(deq_model, tokens)
    np.savez(out / "reference.npz", tokens=tokens, logits=logits, loss=np.float32(loss), **dequantized)
    moved = _rel_err(logits, reference(model, tokens)[0])
    print(f"gpt_oss mxfp4: {len(quantized)} tensors, logits moved by {moved:.2e} rel from the unquantized ones")


def build_gemma3_mm(seed: int = 34) -> None:
    """`gemma3_mm`: Gemma3ForConditionalGeneration (image + text) whose text decoder is the `gemma3` fixture's
    model, weight for weight, beside a tiny random SigLIP tower and projector. Scored on text alone it gives the
    gemma3 fixture's logits exactly; save_pretrained names its tensors as the Hub does (`language_model.model.*`,
    `vision_tower.*`, `multi_modal_projector.*`)."""
    text = transformers.AutoModelForCausalLM.from_pretrained(OUT / "gemma3", attn_implementation="eager").float()
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    text_config = {k: v for k, v in text.config.to_dict().items() if k != "_name_or_path"}  # a local path
    cfg = transformers.Gemma3Config(text_config=text_config, vision_config=vision.to_dict(),
                                    mm_tokens_per_image=1, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="eager").float().eval()
    randomize(model, seed)
    model.model.language_model.load_state_dict(text.model.state_dict())
    ref = dict(np.load(OUT / "gemma3" / "reference.npz"))
    with torch.no_grad():
        out = model(torch.from_numpy(ref["tokens"]).long(), output_hidden_states=True)
    logits = out.logits.float().numpy()
    assert _rel_err(logits, ref["logits"]) == 0.0, "the wrapper scores its text decoder differently"
    out_dir = OUT / "gemma3_mm"
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*"):
        old.unlink()
    model.save_pretrained(out_dir, safe_serialization=True)
    np.savez(out_dir / "reference.npz", tokens=ref["tokens"], logits=logits, loss=ref["loss"],
             hidden_states=np.stack([h.float().numpy() for h in out.hidden_states]))
    from safetensors import safe_open
    with safe_open(out_dir / "model.safetensors", "np") as f:
        keys = sorted(f.keys())
    print(f"gemma3_mm: {len(keys)} tensors, e.g. {keys[0]}, {keys[-1]}")


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def check_export(export_dir: pathlib.Path, reference_dir: pathlib.Path) -> int:
    ref = np.load(reference_dir / "reference.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation="eager",
                                                              torch_dtype=torch.float32).eval()
    logits, loss = reference(model, ref["tokens"])
    err = _rel_err(logits, ref["logits"])
    loss_err = abs(loss - float(ref["loss"])) / abs(float(ref["loss"]))
    ok = err <= 1e-4 and loss_err <= 1e-5
    print(f"check-export {export_dir} vs {reference_dir.name}: {type(model).__name__}, max rel logits err "
          f"{err:.2e}, loss rel err {loss_err:.2e}: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="fixture names (default: all)")
    parser.add_argument("--check-export", type=pathlib.Path, metavar="EXPORT_DIR")
    parser.add_argument("--reference", type=pathlib.Path, metavar="FIXTURE_DIR")
    parser.add_argument("--add-hidden-states", action="store_true",
                        help="add hidden_states to the existing fixtures' reference.npz (--only: those)")
    args = parser.parse_args()
    if args.add_hidden_states:
        for fixture in sorted(p for p in OUT.iterdir() if (p / "reference.npz").is_file()):
            if not args.only or fixture.name in args.only:
                add_hidden_states(fixture)
        return 0
    if args.check_export:
        if args.reference is None:
            parser.error("--check-export needs --reference FIXTURE_DIR")
        return check_export(args.check_export, args.reference)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for i, (name, cfg) in enumerate(configs().items()):
        if not args.only or name in args.only:
            build(name, cfg, seed=SEEDS.get(name, i + 1))
    if not args.only or "gemma3_mm" in args.only:  # after gemma3: it wraps that fixture's decoder
        build_gemma3_mm()
    return 0


if __name__ == "__main__":
    sys.exit(main())
