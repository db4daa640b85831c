"""Inference: load a checkpoint, score token files, generate with a KV cache.

    cfg, params = load_model("runs/tiny-...", ["mesh.tensor=2"])   # run dir or RUN/checkpoints/<step>
    gen = Generator(cfg, params)
    result = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, temperature=0.0)
    result.tokens      # per prompt, the generated ids (ending at a stop token if one was drawn)
    loss, n = score(cfg, params, tokens)                        # mean next-token CE in float32

The model code is the training code (models/): `Transformer.prefill` is the training forward
that also returns every layer's cache entries, `Transformer.decode` runs one token per row
against the cache (layer scan over (layer params, layer cache)). See docs/inference.md for
the cache layout, MLA's absorbed decode and the memory / FLOP trade-offs.

loading.py      checkpoint path -> (Config, params) on the training mesh; InferenceError
generation.py   sampling and the Generator (jitted prefill + decode loop)
scoring.py      score(): mean next-token cross-entropy of token rows (`jaxinfra eval`)
logprobs.py     policy_token_logps(): per-token log-probs under the training forward (GRPO's recomputation)
text.py         the run's text codec (byte-level UTF-8 or tokenizer.json)
chat.py         `generate --chat`: one user turn through the run's chat template, the reply alone
cli.py          `jaxinfra generate` and `jaxinfra eval`
"""

import importlib
from typing import Any

# Everything loads on first use (PEP 562): `jaxinfra.infer.cli` registers its subcommands on the
# parser without loading jax.
_LAZY = {
    "generation": ("MAX_CONTEXT", "PROMPT_BUCKET", "GenerationResult", "Generator", "Sampling", "cache_len", "sample"),
    "loading": ("InferenceError", "inference_devices", "inference_mesh", "inference_model_config", "load_model",
                "resolve_checkpoint"),
    "scoring": ("check_token_array", "score", "token_rows"),
    "logprobs": ("LOGP_TOLERANCE", "policy_token_logps"),
    "text": ("text_codec",),
    "chat": ("chat_replies", "end_of_turn_id", "reply_text", "run_chat_template", "run_file"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
