"""`jaxinfra hf check HF_DIR [RUN]`: does a conversion score as transformers does?

The HF checkpoint is imported in memory (or RUN, an import / run made from it, is loaded) and scores a
few token rows: the reference's own tokens when HF_DIR holds a `reference.npz`, else fixed ids from the
vocabulary. The reference is transformers itself when torch and transformers are importable (float32,
eager attention, `output_hidden_states=True`), else the `reference.npz` arrays `tokens`, `logits` and
`hidden_states` (what scripts/make_hf_fixtures.py writes); with neither, one line says what to install.

Printed: the max relative logit difference per position (max |ours - ref| / max |ref| over the batch and
vocabulary at that position), the loss of each, and on a mismatch the first diverging layer: our
per-layer hidden states (`layer_hidden_states`, the stack run through its public pieces) against
transformers' (the embeddings, then each layer's output; its last entry is after the final norm).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.hf.families import HFError
from models.config import ModelConfig

INSTALL = "pip install torch transformers"
ROWS, LENGTH = 2, 16  # fixed prompts when HF_DIR has no reference tokens
TOL = 1e-5


class NoReference(HFError):
    """Neither transformers nor a reference.npz to compare with."""


def layer_hidden_states(model: nnx.Module, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hidden [L + 1, B, T, d] as transformers' `hidden_states`: the embeddings, each layer's output, the
    last one final-normed; logits [B, T, V]). Runs the one layer runner (models/stack.py) with layer
    functions that hand each layer's output back as its y, so the model is not forked."""
    from models.stack import run
    from models.transformer import sequence_order
    from sharding.plan import SINGLE_DEVICE

    h, positions, ropes = model._embed(tokens, None, SINGLE_DEVICE)  # the forward's own embedding
    mask = jnp.ones(tokens.shape, jnp.bool_)
    order = sequence_order(positions, None)

    def dense(blk, h, _, spec):
        out = blk(h, positions, None, ropes[spec.rope], window=spec.window)
        return out, out

    def moe(blk, h, _, spec):
        out = blk(h, positions, None, ropes[spec.rope], mask, order, window=spec.window)[0]
        return out, out

    embedded = h
    h, ys = run(model, h, dense, moe)
    # Back to running order from the per-stack y's.
    outs = [ys["moe_layers" if spec.kind == "moe" else "layers"][spec.index] for spec in model.schedule.layers]
    final = model.final_norm(h)
    hidden = jnp.stack([embedded, *outs[:-1], final]).astype(jnp.float32)
    return hidden, model.logits(final)


@functools.cache
def _scorer(cfg: ModelConfig):
    """One jitted (hidden states, logits) per model config (a process checking several dirs compiles once)."""
    from jaxinfra.infer.loading import inference_model_config
    from jaxinfra.state import model_graphdef

    graphdef = model_graphdef(inference_model_config(cfg))
    return jax.jit(lambda p, t: layer_hidden_states(nnx.merge(graphdef, p), t))


def ours(cfg: ModelConfig, params: Any, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our (hidden states, logits) for the token rows, in float32 on one device."""
    dev = jax.devices()[0]
    params = jax.device_put(params, dev)
    hidden, logits = _scorer(cfg)(params, jax.device_put(jnp.asarray(tokens, jnp.int32), dev))
    return np.asarray(hidden), np.asarray(logits)


def has_transformers() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def check_reference_available(hf_dir: pathlib.Path) -> None:
    """Fail fast (before any import or compile) when there is nothing to compare with."""
    stored = hf_dir / "reference.npz"
    if not has_transformers() and not (stored.is_file() and "logits" in np.load(stored).files):
        raise NoReference(f"hf check needs torch and transformers to score {hf_dir} (no reference.npz with "
                          f"tokens and logits there): {INSTALL}")


def transformers_reference(hf_dir: pathlib.Path, tokens: np.ndarray) -> dict[str, Any]:
    """transformers' logits and hidden states (float32, eager attention)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(tokens)).long(), output_hidden_states=True)
    return {"logits": out.logits.float().numpy(),
            "hidden_states": np.stack([h.float().numpy() for h in out.hidden_states]),
            "source": f"transformers {transformers.__version__}"}


def reference_for(hf_dir: pathlib.Path, vocab: int) -> tuple[np.ndarray, dict[str, Any]]:
    """(tokens, reference arrays + `source`): transformers when importable, else reference.npz."""
    stored = hf_dir / "reference.npz"
    saved = dict(np.load(stored)) if stored.is_file() else {}
    tokens = saved.get("tokens")
    if tokens is None:  # fixed ids spread over the vocabulary, the same every run
        tokens = np.random.default_rng(0).integers(0, vocab, (ROWS, LENGTH)).astype(np.int32)
    live = transformers_reference(hf_dir, tokens) if has_transformers() else None
    if live is not None:
        return tokens, live
    check_reference_available(hf_dir)
    return tokens, {**saved, "source": f"{stored} (torch/transformers not installed)"}


def mean_loss(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Mean next-token cross-entropy in float64 (logits[:, :-1] predict tokens[:, 1:])."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, tokens[:, 1:, None].astype(np.int64), -1).mean())


def rel_diff(got: np.ndarray, ref: np.ndarray, axis: Sequence[int] | None = None) -> np.ndarray:
    return np.max(np.abs(got - ref), axis=axis) / np.maximum(np.max(np.abs(ref), axis=axis), 1e-30)


def first_diverging_layer(hidden: np.ndarray, ref_hidden: np.ndarray | None, tol: float) -> str:
    """Which piece first differs: the embeddings, layer i (0-based, HF numbering) or the head."""
    if ref_hidden is None or ref_hidden.shape != hidden.shape:
        return "unknown (no per-layer reference hidden states to compare)"
    for i, d in enumerate(rel_diff(hidden, ref_hidden, axis=(1, 2, 3))):
        if d > tol:
            if i == 0:
                return f"the embeddings (model.embed_tokens; rel diff {d:.2e})"
            last = " + final norm" if i == len(hidden) - 1 else ""
            return f"layer {i - 1} (model.layers.{i - 1}{last}; rel diff of its output {d:.2e})"
    return "the output head (lm_head; every layer's output matches)"


def load_ours(hf_dir: pathlib.Path, run: str | pathlib.Path | None) -> tuple[ModelConfig, Any, str]:
    """(model config, params, what was loaded): HF_DIR imported in memory on one device, or RUN as saved."""
    if run is not None:
        from jaxinfra.infer import load_model

        cfg, params = load_model(str(run), [])
        if cfg.lora.enabled or cfg.quant.weights != "none":  # not the HF model's function, nor its params' layout
            raise HFError(f"hf check: {run} is a LoRA or int8 run; check the float base it came from (or "
                          f"`jaxinfra lora merge` it first)")
        return cfg.model, params, f"the conversion in {run}"
    from jaxinfra.hf.families import from_hf, rope_interleaved
    from jaxinfra.hf.importer import build_config, check_unused, load_params, read_hf_config
    from jaxinfra.hf.safetensors_io import SafetensorsDir

    hf = read_hf_config(hf_dir)
    family, model = from_hf(hf)
    devices = jax.devices()[:1]
    cfg = build_config(model, [], len(devices))
    files = SafetensorsDir(hf_dir)
    params = load_params(cfg, family, rope_interleaved(hf, family), files, devices)
    check_unused(files, cfg.model, family)
    return cfg.model, params, f"{family} imported in memory"


def check_hf(hf_dir: str | pathlib.Path, run: str | pathlib.Path | None = None, tol: float = TOL) -> dict[str, Any]:
    """Score the reference tokens with our conversion and the reference; the report's `ok` is
    max rel logit diff <= tol. Raises NoReference (exit 2) when there is nothing to compare with."""
    hf_dir = pathlib.Path(hf_dir)
    check_reference_available(hf_dir)
    cfg, params, what = load_ours(hf_dir, run)
    tokens, ref = reference_for(hf_dir, cfg.vocab_size)
    hidden, logits = ours(cfg, params, tokens)
    per_position = rel_diff(logits, ref["logits"], axis=(0, 2))
    worst = float(per_position.max())  # the table's worst row: stricter than the global max|diff| / max|ref|
    report = {"ours": what, "reference": ref["source"], "tokens": list(tokens.shape), "per_position": per_position,
              "max_rel_diff": worst, "loss": mean_loss(logits, tokens), "ref_loss": mean_loss(ref["logits"], tokens),
              "tol": tol, "ok": worst <= tol}
    if not report["ok"]:
        report["first_diverging"] = first_diverging_layer(hidden, ref.get("hidden_states"), tol)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The short table `hf check` prints."""
    rows, length = report["tokens"]
    lines = [f"hf check: {report['ours']} vs {report['reference']}; {rows} rows x {length} tokens",
             "position  max rel logit diff"]
    lines += [f"{t:>8d}  {d:.2e}" for t, d in enumerate(report["per_position"])]
    lines.append(f"loss: jaxinfra {report['loss']:.6f}, reference {report['ref_loss']:.6f} "
                 f"(rel diff {abs(report['loss'] - report['ref_loss']) / abs(report['ref_loss']):.1e})")
    verdict = "OK" if report["ok"] else "MISMATCH"
    lines.append(f"max rel logit diff {report['max_rel_diff']:.2e} (tol {report['tol']:.0e}): {verdict}")
    if not report["ok"]:
        lines.append(f"first diverging: {report['first_diverging']}")
    return "\n".join(lines)
