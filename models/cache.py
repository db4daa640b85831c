"""The decoding cache: what each attention layer keeps per token, stacked like the layers.

A cache is a dict per layer stack (`layers`, and `moe_layers` for MoE models, as the
parameters are stacked), each a dict of arrays [L, batch, heads, max_len, width]:

    MHA/GQA/MQA  k, v     [L, batch, kv_heads, max_len, head_dim]      2 L kv_heads head_dim / token
    MLA          latent   [L, batch, 1, max_len, kv_lora_rank]         L (kv_lora_rank + qk_rope_head_dim)
                 k_rope   [L, batch, 1, max_len, qk_rope_head_dim]      / token (k_rope absent when 0)

in the compute dtype, keys stored after RoPE; MLA's latent and rope key are one "head"
shared by all query heads. Heads come before the cache length so that decode attention's
products are batched over (batch, heads) and read the cache in place (with the length
first, XLA:CPU transposed the whole cache every step: about half of a `small` decode step
at batch 8). Slot j of row b holds the token at position j of that row, so a row's next
write index is its own length: right-padded prompts of different lengths share one cache,
and attention masks slots at or beyond each row's position (models/attention.py:
decode_attention). Logical axes (`layers`, `batch`, `kv_heads` | None, `kv_length`,
`head_dim` | `kv_lora`): the batch is split like the activations' and KV heads over
`tensor`; the cache length is never split.

An int8 cache (`quantized=True`, quant.kv_cache=int8) stores each array as int8 values plus
`<name>_scale` [L, batch, heads, max_len, 1] float32: one symmetric scale per token and head
(absmax over the width / 127), so a token costs (width + 4) bytes per head instead of
2 * width in bfloat16. Entries are quantized when written (`quantize_entries`); decode
attention applies the scales to its scores and probabilities (models/attention.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import DTYPES
from models.quant import quantize_int8

Cache = dict[str, dict[str, jax.Array]]


def layout(cfg: ModelConfig, batch: int, max_len: int,
           quantized: bool = False) -> dict[str, dict[str, tuple[tuple[int, ...], tuple]]]:
    """{stack: {name: (shape, logical axis names)}} of a cache for `batch` rows of `max_len` slots
    (int8 values plus per-token-per-head scales when `quantized`)."""
    flags = cfg.moe_layer_flags()
    counts = {"layers": flags.count(False), "moe_layers": flags.count(True)}
    if cfg.is_mla:  # (heads, width, their logical names)
        per_layer = {"latent": (1, cfg.kv_lora_rank, (None, "kv_lora"))}
        if cfg.qk_rope_head_dim:
            per_layer["k_rope"] = (1, cfg.qk_rope_head_dim, (None, "head_dim"))
    else:
        kv = (cfg.kv_heads, cfg.resolved_head_dim, ("kv_heads", "head_dim"))
        per_layer = {"k": kv, "v": kv}
    if quantized:
        per_layer |= {f"{name}_scale": (heads, 1, (names[0], None)) for name, (heads, _, names) in per_layer.items()}
    return {stack: {name: ((n, batch, heads, max_len, width), ("layers", "batch", names[0], "kv_length", names[1]))
                    for name, (heads, width, names) in per_layer.items()}
            for stack, n in counts.items() if n}


def _dtype(name: str, cfg: ModelConfig, quantized: bool):
    if not quantized:
        return DTYPES[cfg.dtype]
    return jnp.float32 if name.endswith("_scale") else jnp.int8


def init(cfg: ModelConfig, batch: int, max_len: int, quantized: bool = False) -> Cache:
    """A zero cache (call under jit with out_shardings to create it sharded)."""
    return {stack: {name: jnp.zeros(shape, _dtype(name, cfg, quantized)) for name, (shape, _) in arrays.items()}
            for stack, arrays in layout(cfg, batch, max_len, quantized).items()}


def bytes_per_token(cfg: ModelConfig, quantized: bool = False) -> int:
    """Cache bytes one token takes over all layers (the formulas in the module docstring)."""
    return sum(math.prod(shape) * jnp.dtype(_dtype(name, cfg, quantized)).itemsize
               for arrays in layout(cfg, 1, 1, quantized).values() for name, (shape, _) in arrays.items())


def quantize_entries(entries: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One layer stack's float entries [L, B, H, T, W] -> int8 values + `<name>_scale` [L, B, H, T, 1]."""
    out = {}
    for name, e in entries.items():
        out[name], out[f"{name}_scale"] = quantize_int8(e, axis=-1)
    return out


def write(cache: Cache, entries: Cache, starts: jax.Array) -> Cache:
    """Write per-row entries [L, B, H, T, W] at slots starts[b] .. starts[b] + T - 1 of row b.

    One dynamic_update_slice per row (in place when the cache is donated). A batched scatter
    (vmap of the same update) was ~50 ms per decode step slower at batch 8 on XLA:CPU
    (`small` preset): it rewrote the whole cache instead of the few slots."""

    def one(c: jax.Array, e: jax.Array) -> jax.Array:
        e = e.astype(c.dtype)
        for b in range(c.shape[1]):
            c = jax.lax.dynamic_update_slice(c, e[:, b:b + 1], (0, b, 0, starts[b], 0))
        return c

    def entries_of(stack: str) -> dict[str, jax.Array]:  # an int8 cache quantizes what it stores
        quantized = any(name.endswith("_scale") for name in cache[stack])
        return quantize_entries(entries[stack]) if quantized else entries[stack]

    return {stack: {name: one(cache[stack][name], e[name]) for name in cache[stack]}
            for stack, e in ((stack, entries_of(stack)) for stack in cache)}
