"""Decoder-only Transformer (Llama-style), written to read like the papers.

    h = embed(tokens)
    for each layer:  h = h + attn(norm(h));  h = h + mlp(norm(h))     (mlp: dense or MoE)
    logits = norm(h) @ embed^T   (or an untied output matrix), optionally soft-capped

Layer parameters are always stored stacked on a leading `layers` axis; the
`scan_layers` switch only chooses how they run (lax.scan, or a Python loop
over slices). So both modes share one checkpoint format, and the scan-vs-unrolled
test compares the same weights.

Attention is MHA/GQA/MQA (models/attention.py) or DeepSeek's MLA (models/mla.py).
With MoE, the dense blocks stay in `layers` and the MoE blocks form a second stack,
`moe_layers`. The layer order (the first `moe_first_dense_layers` dense, then periods of
`moe_every - 1` dense blocks followed by one MoE block) runs as: one scan over the dense
prefix, then one scan over the periods, each step running its dense blocks and its MoE
block. Per-layer router statistics come out of that scan as stacked outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention
from models.config import ModelConfig
from models.layers import DTYPES, MLP, RMSNorm, param, rope_frequencies
from models.mla import MLA
from models.moe import PARTIAL_STATS, MoE, merge_stats
from sharding import pipeline
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


def make_attention(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return MLA(cfg, rngs) if cfg.is_mla else Attention(cfg, rngs)


class Block(nnx.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = make_attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array) -> jax.Array:
        h = h + self.attn(self.attn_norm(h), positions, segment_ids, rope_freqs)
        h = h + self.mlp(self.mlp_norm(h))
        return constrain(h, ("batch", "residual_length", "embed"))


class MoEBlock(nnx.Module):
    """Pre-norm residual block: attention then a Mixture-of-Experts feed-forward."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = make_attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.moe = MoE(cfg, rngs)

    def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array, mask: jax.Array,
                 order: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        h = h + self.attn(self.attn_norm(h), positions, segment_ids, rope_freqs)
        y, stats = self.moe(self.mlp_norm(h), mask, order)
        return constrain(h + y, ("batch", "residual_length", "embed")), stats


def sequence_order(positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Per row, token indices in original sequence order: packed documents are numbered in
    order and positions count up within each, so (segment id, position) sorts them even
    when a layout has permuted the row (ring attention's load balancing)."""
    if segment_ids is None:
        return jnp.argsort(positions, axis=-1, stable=True)
    return jnp.lexsort((positions, segment_ids), axis=-1)


def _stack(cfg: ModelConfig, rngs: nnx.Rngs, cls: type, count: int) -> nnx.Module:
    """`count` layers of `cls` with parameters stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return cls(cfg, rngs)

    return make(rngs)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, cfg.param_dtype)

        flags = cfg.moe_layer_flags()
        dense, sparse = flags.count(False), flags.count(True)
        if dense:
            self.layers = _stack(cfg, rngs, Block, dense)
        if sparse:
            self.moe_layers = _stack(cfg, rngs, MoEBlock, sparse)
        self.final_norm = RMSNorm(cfg.d_model, cfg)
        if not cfg.tie_embeddings:
            self.unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std,
                                 cfg.param_dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens [batch, length] -> float32 logits [batch, length, vocab]."""
        return self.forward(tokens, positions, segment_ids)[0]

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(logits, MoE statistics stacked over MoE layers: {} for a dense model).

        Statistics (see models/moe.py): counts [L_moe, E], dropped, aux_loss, z_loss [L_moe]."""
        cfg, dt = self.cfg, DTYPES[self.cfg.dtype]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        # Gather the FSDP-sharded table first (as for any weight): a lookup straight into a
        # table sharded on `embed` makes GSPMD replicate the activations instead under data x fsdp.
        table = constrain(self.embed[...], ("vocab", None))
        h = jnp.take(table, tokens, axis=0).astype(dt)
        h = constrain(h, ("batch", "residual_length", "embed"))
        rope_freqs = rope_frequencies(cfg)
        stats: dict[str, jax.Array] = {}
        if cfg.is_moe:
            mask = segment_ids > 0 if segment_ids is not None else jnp.ones(tokens.shape, jnp.bool_)
            order = sequence_order(positions, segment_ids)
            h, stats = self._moe_stack(h, positions, segment_ids, rope_freqs, mask, order)
        else:
            h = self._dense_stack(h, positions, segment_ids, rope_freqs)
        h = self.final_norm(h)
        if cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", h, self.embed[...].astype(dt), preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("btd,dv->btv", h, self.unembed[...].astype(dt), preferred_element_type=jnp.float32)
        if cfg.logit_softcap is not None:
            logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
        return constrain(logits, ("batch", "length", "vocab")), stats

    def _dense_stack(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                     rope_freqs: jax.Array) -> jax.Array:
        cfg = self.cfg
        graphdef, stacked = nnx.split(self.layers)
        if pipeline.is_pipelined():  # layers split over the `stage` mesh axis (sharding/pipeline.py)
            def layer(h: jax.Array, layer_state, side) -> jax.Array:
                return nnx.merge(graphdef, layer_state)(h, side[0], side[1], rope_freqs)

            if cfg.remat_policy != "none":
                layer = jax.checkpoint(layer, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
            return pipeline.apply_layers(layer, h, stacked, (positions, segment_ids), scan_layers=cfg.scan_layers)

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
        return h

    def _moe_stack(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                   rope_freqs: jax.Array, mask: jax.Array,
                   order: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Dense prefix, then periods of (moe_every - 1) dense blocks + one MoE block.

        Pipelined (mesh.stage > 1): the prefix runs first, outside the pipeline (replicated
        over `stage`, like the embeddings); the periods are the pipeline's layers, and their
        router statistics come out as sums over microbatches, from which `merge_stats`
        rebuilds the whole batch's losses exactly."""
        cfg = self.cfg
        prefix, per = cfg.moe_first_dense_layers, cfg.moe_every - 1
        dense_def, dense = nnx.split(self.layers) if hasattr(self, "layers") else (None, None)
        moe_def, moe = nnx.split(self.moe_layers)
        take = lambda tree, lo, hi: jax.tree.map(lambda x: x[lo:hi], tree)  # noqa: E731

        # Per-row inputs travel as `side` so that the pipeline can split them into microbatches.
        def dense_block(h, layer_state, side):
            pos, seg = side[:2]
            return nnx.merge(dense_def, layer_state)(h, pos, seg, rope_freqs), None

        def moe_block(h, layer_state, side):
            return nnx.merge(moe_def, layer_state)(h, *side[:2], rope_freqs, *side[2:])

        if cfg.remat_policy != "none":
            policy = remat_policy(cfg.remat_policy)
            dense_block = jax.checkpoint(dense_block, policy=policy, prevent_cse=not cfg.scan_layers)
            moe_block = jax.checkpoint(moe_block, policy=policy, prevent_cse=not cfg.scan_layers)

        def period(h, xs, side):
            group, layer_state = xs
            for j in range(per):
                h, _ = dense_block(h, jax.tree.map(lambda x, j=j: x[j], group), side)
            return moe_block(h, layer_state, side)

        side = (positions, segment_ids, mask, order)
        periods = jax.tree.leaves(moe)[0].shape[0]
        groups = None
        if per:  # the dense blocks after the prefix, as [periods, per, ...]
            groups = jax.tree.map(lambda x: x.reshape(periods, per, *x.shape[1:]), take(dense, prefix, None))
        if cfg.scan_layers:
            if prefix:
                h, _ = jax.lax.scan(lambda h, p: dense_block(h, p, side), h, take(dense, 0, prefix))
        else:
            for i in range(prefix):
                h, _ = dense_block(h, jax.tree.map(lambda x, i=i: x[i], dense), side)
        if pipeline.is_pipelined():  # periods split over the `stage` mesh axis (sharding/pipeline.py)
            def stage_layer(h, xs, side):
                h, stats = period(h, xs, side)
                return h, {k: stats[k] for k in PARTIAL_STATS}

            h, partial = pipeline.apply_layers(stage_layer, h, (groups, moe), side, scan_layers=cfg.scan_layers,
                                               with_stats=True)
            return h, merge_stats(partial, cfg.moe_top_k)
        if cfg.scan_layers:
            h, stats = jax.lax.scan(lambda h, xs: period(h, xs, side), h, (groups, moe))
        else:
            outs = []
            for p in range(periods):
                h, out = period(h, jax.tree.map(lambda x, p=p: x[p], (groups, moe)), side)
                outs.append(out)
            stats = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
        return h, {k: stats[k] for k in ("counts", "dropped", "aux_loss", "z_loss")}
