"""Decoder-only Transformer (Llama-style), written to read like the papers.

    h = embed(tokens)
    for each layer:  h = h + attn(norm(h));  h = h + mlp(norm(h))
    logits = norm(h) @ embed^T   (or an untied output matrix), optionally soft-capped

Layer parameters are always stored stacked on a leading `layers` axis; the
`scan_layers` switch only chooses how they run (lax.scan, or a Python loop
over slices). So both modes share one checkpoint format, and the scan-vs-unrolled
test compares the same weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention
from models.config import ModelConfig
from models.layers import DTYPES, MLP, RMSNorm, param, rope_frequencies
from sharding.rules import constrain

# Names saved for the backward pass by each remat policy (see models.config.RematPolicy).
_SAVED_NAMES = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_qkv_attn_out": ("query_proj", "key_proj", "value_proj", "attn_out"),
    "save_qkv_attn_mlp": ("query_proj", "key_proj", "value_proj", "attn_out", "mlp_hidden"),
}


def remat_policy(name: str):
    """jax.checkpoint policy for a policy name; None means no rematerialisation."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "save_dots":
        return jax.checkpoint_policies.checkpoint_dots
    if name == "save_dots_no_batch":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name in _SAVED_NAMES:
        return jax.checkpoint_policies.save_only_these_names(*_SAVED_NAMES[name])
    raise ValueError(f"unknown remat policy {name!r}")


class Block(nnx.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array) -> jax.Array:
        h = h + self.attn(self.attn_norm(h), positions, segment_ids, rope_freqs)
        h = h + self.mlp(self.mlp_norm(h))
        return constrain(h, ("batch", "residual_length", "embed"))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, cfg.param_dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg)
        if not cfg.tie_embeddings:
            self.unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std,
                                 cfg.param_dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens [batch, length] -> float32 logits [batch, length, vocab]."""
        cfg, dt = self.cfg, DTYPES[self.cfg.dtype]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        # Gather the FSDP-sharded table first (as for any weight): a lookup straight into a
        # table sharded on `embed` makes GSPMD replicate the activations instead under data x fsdp.
        table = constrain(self.embed[...], ("vocab", None))
        h = jnp.take(table, tokens, axis=0).astype(dt)
        h = constrain(h, ("batch", "residual_length", "embed"))
        rope_freqs = rope_frequencies(cfg)

        graphdef, stacked = nnx.split(self.layers)

        def block(h: jax.Array, layer_state) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, layer_state)(h, positions, segment_ids, rope_freqs), None

        policy = remat_policy(cfg.remat_policy)
        if cfg.remat_policy != "none":
            block = jax.checkpoint(block, policy=policy, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            h, _ = jax.lax.scan(block, h, stacked)
        else:
            for i in range(cfg.num_layers):
                h, _ = block(h, jax.tree.map(lambda x, i=i: x[i], stacked))

        h = self.final_norm(h)
        if cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", h, self.embed[...].astype(dt), preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("btd,dv->btv", h, self.unembed[...].astype(dt), preferred_element_type=jnp.float32)
        if cfg.logit_softcap is not None:
            logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
        return constrain(logits, ("batch", "length", "vocab"))
