"""The decoding cache: what each attention layer keeps per token, stacked like the layers.

A cache is a dict per cache group, each a dict of arrays [L, batch, heads, slots, width]. The
groups are the layer stacks (`layers`, and `moe_layers` for MoE models, as the parameters are
stacked), each split by window class when the model has sliding-window layers
(model.sliding_window): `layers` / `moe_layers` hold the stack's global layers (slots = max_len),
`layers_sliding` / `moe_layers_sliding` its sliding layers (slots = min(sliding_window, max_len)),
each in stack order (`groups`). Per layer:

    MHA/GQA/MQA  k, v     [L, batch, kv_heads, slots, head_dim]        2 L kv_heads head_dim / token
    MLA          latent   [L, batch, 1, max_len, kv_lora_rank]         L (kv_lora_rank + qk_rope_head_dim)
                 k_rope   [L, batch, 1, max_len, qk_rope_head_dim]      / token (k_rope absent when 0)

in the compute dtype, keys stored after RoPE; MLA's latent and rope key are one "head"
shared by all query heads. Heads come before the cache length so that decode attention's
products are batched over (batch, heads) and read the cache in place (with the length
first, XLA:CPU transposed the whole cache every step: about half of a `small` decode step
at batch 8). In a global group slot j of row b holds the token at position j of that row, so a
row's next write index is its own length: right-padded prompts of different lengths share one
cache, and attention masks slots at or beyond each row's position (models/attention.py:
decode_attention). A sliding group is a ring buffer of S = min(window, max_len) slots: position p
lives in slot p % S, so it holds each row's last S positions; decode masks the slots whose latest
position is outside the window (the slot about to be overwritten, unwritten ones), and the
prefill cache keeps each row's last S valid prompt positions (`from_prefill`: padding never
overwrites them). Logical axes (`layers`, `batch`, `kv_heads` | None, `kv_length`,
`head_dim` | `kv_lora`): the batch is split like the activations' and KV heads over
`tensor`; the cache length is never split.

An int8 cache (`quantized=True`, quant.kv_cache=int8) stores each array as int8 values plus
`<name>_scale` [L, batch, heads, slots, 1] float32: one symmetric scale per token and head
(absmax over the width / 127), so a token costs (width + 4) bytes per head instead of
2 * width in bfloat16. Entries are quantized when written (`quantize_entries`); decode
attention applies the scales to its scores and probabilities (models/attention.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.layers import DTYPES
from models.quant import quantize_int8

Cache = dict[str, dict[str, jax.Array]]
SLIDING = "_sliding"  # suffix of a stack's sliding-window cache group


@dataclasses.dataclass(frozen=True)
class Group:
    """One cache group: which stack's layers it holds (their indices in the stack) and their window."""

    stack: str
    layers: tuple[int, ...]
    window: int | None  # None: global layers (max_len slots)

    def slots(self, max_len: int) -> int:
        return max_len if self.window is None else min(self.window, max_len)


def group_name(stack: str, window: int | None) -> str:
    """The cache group of a layer of `stack` with this window (its LayerSpec's)."""
    return stack if window is None else stack + SLIDING


def groups(cfg: ModelConfig) -> dict[str, Group]:
    """The model's cache groups in cache order (per stack: global, then sliding)."""
    members: dict[str, list[int]] = {}
    seen = {"layers": 0, "moe_layers": 0}
    for sparse, window in zip(cfg.moe_layer_flags(), cfg.layer_windows(), strict=True):
        stack = "moe_layers" if sparse else "layers"
        members.setdefault(group_name(stack, window), []).append(seen[stack])
        seen[stack] += 1
    order = [group_name(stack, w) for stack in ("layers", "moe_layers") for w in (None, 1)]
    return {name: Group(name.removesuffix(SLIDING), tuple(members[name]),
                        cfg.sliding_window if name.endswith(SLIDING) else None)
            for name in order if name in members}


def has_sliding(cfg: ModelConfig) -> bool:
    """Whether some cache group is a sliding window's (else the groups are the stacks, as before windows)."""
    return any(g.window is not None for g in groups(cfg).values())


def layer_slots(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Per stack, each layer's index in its cache group (the decode runner's per-layer inputs)."""
    out = {stack: np.zeros(n, np.int32) for stack, n in (("layers", cfg.moe_layer_flags().count(False)),
                                                         ("moe_layers", cfg.moe_layer_flags().count(True))) if n}
    for g in groups(cfg).values():
        out[g.stack][list(g.layers)] = np.arange(len(g.layers))
    return out


def layout(cfg: ModelConfig, batch: int, max_len: int,
           quantized: bool = False) -> dict[str, dict[str, tuple[tuple[int, ...], tuple]]]:
    """{group: {name: (shape, logical axis names)}} of a cache for `batch` rows of `max_len` positions
    (sliding groups: min(window, max_len) slots; int8 values plus per-token-per-head scales when
    `quantized`)."""
    if cfg.is_mla:  # (heads, width, their logical names)
        per_layer = {"latent": (1, cfg.kv_lora_rank, (None, "kv_lora"))}
        if cfg.qk_rope_head_dim:
            per_layer["k_rope"] = (1, cfg.qk_rope_head_dim, (None, "head_dim"))
    else:
        kv = (cfg.kv_heads, cfg.resolved_head_dim, ("kv_heads", "head_dim"))
        per_layer = {"k": kv, "v": kv}
    if quantized:
        per_layer |= {f"{name}_scale": (heads, 1, (names[0], None)) for name, (heads, _, names) in per_layer.items()}
    return {name: {array: ((len(g.layers), batch, heads, g.slots(max_len), width),
                           ("layers", "batch", names[0], "kv_length", names[1]))
                   for array, (heads, width, names) in per_layer.items()}
            for name, g in groups(cfg).items()}


def _dtype(name: str, cfg: ModelConfig, quantized: bool):
    if not quantized:
        return DTYPES[cfg.dtype]
    return jnp.float32 if name.endswith("_scale") else jnp.int8


def init(cfg: ModelConfig, batch: int, max_len: int, quantized: bool = False) -> Cache:
    """A zero cache (call under jit with out_shardings to create it sharded)."""
    return {stack: {name: jnp.zeros(shape, _dtype(name, cfg, quantized)) for name, (shape, _) in arrays.items()}
            for stack, arrays in layout(cfg, batch, max_len, quantized).items()}


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, quantized: bool = False) -> int:
    """Bytes of a whole cache for `batch` rows of `max_len` positions (sliding layers keep
    min(window, max_len) slots)."""
    return sum(math.prod(shape) * jnp.dtype(_dtype(name, cfg, quantized)).itemsize
               for arrays in layout(cfg, batch, max_len, quantized).values() for name, (shape, _) in arrays.items())


def bytes_per_token(cfg: ModelConfig, quantized: bool = False) -> int:
    """Cache bytes one token takes over all layers (the formulas in the module docstring), while it
    is inside every sliding layer's window (`cache_bytes` counts the windows)."""
    return cache_bytes(cfg, 1, 1, quantized)


def quantize_entries(entries: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One layer stack's float entries [L, B, H, T, W] -> int8 values + `<name>_scale` [L, B, H, T, 1]."""
    out = {}
    for name, e in entries.items():
        out[name], out[f"{name}_scale"] = quantize_int8(e, axis=-1)
    return out


def from_prefill(cfg: ModelConfig, entries: Cache, lengths: jax.Array, max_len: int) -> Cache:
    """A float cache of `max_len` positions from prefill's entries (per stack [L, B, H, T, W], T the
    padded prompt length; `lengths` [B] each row's real length): global groups hold slots 0..T-1 and
    are padded; a sliding group of S slots takes each row's last S real positions q, q at slot q % S
    (a gather, so the padding of a shorter row never lands on its valid slots)."""
    out = {}
    for name, g in groups(cfg).items():
        e = _group_entries(cfg, g, entries)
        t = jax.tree.leaves(e)[0].shape[3]
        if g.window is None:
            pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, max_len - t), (0, 0)])  # noqa: E731
            out[name] = jax.tree.map(pad, e)
            continue
        s, last = g.slots(max_len), lengths[:, None] - 1
        held = jnp.clip(last - jnp.mod(last - jnp.arange(s)[None], s), 0, t - 1)  # [B, S] newest position per slot
        out[name] = jax.tree.map(lambda x: jnp.take_along_axis(x, held[None, :, None, :, None], axis=3), e)
    return out


def _group_entries(cfg: ModelConfig, g: Group, entries: Cache) -> dict[str, jax.Array]:
    """A group's layers' entries out of their stack's (all of them: the stack's own, no gather)."""
    e = entries[g.stack]
    if len(g.layers) == jax.tree.leaves(e)[0].shape[0]:
        return e
    index = np.asarray(g.layers)
    return jax.tree.map(lambda x: x[index], e)


def write(cache: Cache, entries: Cache, starts: jax.Array, cfg: ModelConfig | None = None) -> Cache:
    """Write per-row entries [L, B, H, T, W] at slots starts[b] .. starts[b] + T - 1 of row b.

    `cfg` (needed for a model with sliding layers): `entries` come per stack and each cache group takes
    its layers'; a sliding group of S slots writes position p at slot p % S (T = 1: decode).
    One dynamic_update_slice per row (in place when the cache is donated). A batched scatter
    (vmap of the same update) was ~50 ms per decode step slower at batch 8 on XLA:CPU
    (`small` preset): it rewrote the whole cache instead of the few slots."""

    def one(c: jax.Array, e: jax.Array, at: jax.Array) -> jax.Array:
        e = e.astype(c.dtype)
        for b in range(c.shape[1]):
            c = jax.lax.dynamic_update_slice(c, e[:, b:b + 1], (0, b, 0, at[b], 0))
        return c

    def entries_of(group: str) -> dict[str, jax.Array]:  # an int8 cache quantizes what it stores
        quantized = any(name.endswith("_scale") for name in cache[group])
        e = entries[group] if cfg is None else _group_entries(cfg, groups(cfg)[group], entries)
        return quantize_entries(e) if quantized else e

    def slots_of(group: str) -> jax.Array:
        g = None if cfg is None else groups(cfg)[group]
        return starts if g is None or g.window is None else jnp.mod(starts, jax.tree.leaves(cache[group])[0].shape[3])

    return {group: {name: one(cache[group][name], e[name], at) for name in cache[group]}
            for group, e, at in ((group, entries_of(group), slots_of(group)) for group in cache)}
