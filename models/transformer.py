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

Inference (jaxinfra/infer/, docs/inference.md) runs the same blocks through the same layer
runner: `prefill` is the forward that also returns each layer's KV-cache entries, `decode`
runs one token per row with the layer scan over (layer params, layer cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention, Cache
from models.cache import write as write_cache
from models.config import ModelConfig
from models.layers import DTYPES, MLP, RMSNorm, param, rope_frequencies
from models.mla import MLA
from models.moe import MOE_STATS, PARTIAL_STATS, MoE, merge_stats
from models.project import lookup, prepare_weights, project_attr, weight
from models.quant_config import NO_QUANT, QuantConfig
from models.remat import remat_policy
from sharding import pipeline
from sharding.rules import constrain


def make_attention(cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT) -> nnx.Module:
    return MLA(cfg, rngs, quant) if cfg.is_mla else Attention(cfg, rngs, quant)


class Block(nnx.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = make_attention(cfg, rngs, quant)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.mlp = MLP(cfg, rngs, quant=quant)

    def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array) -> jax.Array:
        return self._ffn(h + self.attn(self.attn_norm(h), positions, segment_ids, rope_freqs))

    def prefill(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.prefill(self.attn_norm(h), positions, rope_freqs)
        return self._ffn(h + a), entries

    def decode(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array, cache: Cache,
               absorb: bool) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.decode(self.attn_norm(h), positions, rope_freqs, cache, absorb)
        return self._ffn(h + a), entries

    def _ffn(self, h: jax.Array) -> jax.Array:
        h = h + self.mlp(self.mlp_norm(h))
        return constrain(h, ("batch", "residual_length", "embed"))


class MoEBlock(nnx.Module):
    """Pre-norm residual block: attention then a Mixture-of-Experts feed-forward."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = make_attention(cfg, rngs, quant)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.moe = MoE(cfg, rngs, quant)

    def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array, mask: jax.Array,
                 order: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        h = h + self.attn(self.attn_norm(h), positions, segment_ids, rope_freqs)
        return self._ffn(h, mask, order)

    def prefill(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.prefill(self.attn_norm(h), positions, rope_freqs)
        return self._ffn(h + a, jnp.ones(h.shape[:2], jnp.bool_), None)[0], entries

    def decode(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array, cache: Cache,
               absorb: bool) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.decode(self.attn_norm(h), positions, rope_freqs, cache, absorb)
        return self._ffn(h + a, jnp.ones(h.shape[:2], jnp.bool_), None)[0], entries

    def _ffn(self, h: jax.Array, mask: jax.Array, order: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        y, stats = self.moe(self.mlp_norm(h), mask, order)
        return constrain(h + y, ("batch", "residual_length", "embed")), stats


def sequence_order(positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Per row, token indices in original sequence order: packed documents are numbered in
    order and positions count up within each, so (segment id, position) sorts them even
    when a layout has permuted the row (ring attention's load balancing)."""
    if segment_ids is None:
        return jnp.argsort(positions, axis=-1, stable=True)
    return jnp.lexsort((positions, segment_ids), axis=-1)


def _stack(cfg: ModelConfig, rngs: nnx.Rngs, cls: type, count: int, quant: QuantConfig) -> nnx.Module:
    """`count` layers of `cls` with parameters stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return cls(cfg, rngs, quant)

    return make(rngs)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT):
        """`quant` (the run's `quant` section) decides how the projections compute and how weights are
        stored; its default is plain float matmuls and weights."""
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, cfg.param_dtype)

        flags = cfg.moe_layer_flags()
        dense, sparse = flags.count(False), flags.count(True)
        if dense:
            self.layers = _stack(cfg, rngs, Block, dense, quant)
        if sparse:
            self.moe_layers = _stack(cfg, rngs, MoEBlock, sparse, quant)
        self.final_norm = RMSNorm(cfg.d_model, cfg)
        if not cfg.tie_embeddings:
            self.unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std,
                                 cfg.param_dtype)
        # The table's rows are contracted with h by the unembedding when tied; untied, it is only looked up.
        prepare_weights(self, quant, {"embed": ("unembed" if cfg.tie_embeddings else "embed", (-1,)),
                                      "unembed": ("unembed", (-2,))}, DTYPES[cfg.dtype])

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens [batch, length] -> float32 logits [batch, length, vocab]."""
        return self.forward(tokens, positions, segment_ids)[0]

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(logits, MoE statistics stacked over MoE layers: {} for a dense model).

        Statistics (see models/moe.py): counts [L_moe, E], dropped, aux_loss, z_loss [L_moe]."""
        h, stats = self.hidden(tokens, positions, segment_ids)
        return self.logits(h), stats

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(final-normed hidden states [B, T, d], MoE statistics): the forward without the output
        projection. `logits(h)` finishes it; the loss applies it per sequence chunk
        (jaxinfra/loss.py) so that no [B, T, vocab] float32 buffer is ever whole."""
        cfg = self.cfg
        h, positions, rope_freqs = self._embed(tokens, positions)
        stats: dict[str, jax.Array] = {}
        if cfg.is_moe:
            mask = segment_ids > 0 if segment_ids is not None else jnp.ones(tokens.shape, jnp.bool_)
            order = sequence_order(positions, segment_ids)
            if pipeline.is_pipelined():
                h, stats = self._moe_pipelined(h, positions, segment_ids, rope_freqs, mask, order)
            else:
                h, (_, stats) = self._run_layers(
                    h, lambda blk, h, _: (blk(h, positions, segment_ids, rope_freqs), None),
                    lambda blk, h, _: blk(h, positions, segment_ids, rope_freqs, mask, order), remat=True)
                stats = {k: stats[k] for k in MOE_STATS}
        else:
            h = self._dense_stack(h, positions, segment_ids, rope_freqs)
        return self.final_norm(h), stats

    def logits(self, h: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, T, d] (or a chunk of T) -> float32 logits [B, T, vocab],
        soft-capped when configured."""
        cfg = self.cfg
        if cfg.tie_embeddings:
            logits = project_attr(self, "btd,vd->btv", h, "embed", out_dtype=jnp.float32)
        else:
            logits = project_attr(self, "btd,dv->btv", h, "unembed", out_dtype=jnp.float32)
        if cfg.logit_softcap is not None:
            logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
        return constrain(logits, ("batch", "length", "vocab"))

    # ------------------------------------------------------------ inference (jaxinfra/infer/)

    def prefill(self, tokens: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, dict[str, Cache]]:
        """The training forward on causal (unpacked) rows, plus every layer's cache entries.

        Returns (logits [B, T, vocab] float32, entries): per layer stack (`layers`,
        `moe_layers`) a dict of [L, B, heads, T, width] arrays (models/cache.py), to be
        written at slots 0..T-1 of a cache (`models.cache.write`). MoE layers route each
        token on its own (pass a config with moe_dispatch="dropless" for exact decoding)."""
        h, positions, rope_freqs = self._embed(tokens, positions)
        h, ys = self._run_layers(h, lambda blk, h, _: blk.prefill(h, positions, rope_freqs),
                                 lambda blk, h, _: blk.prefill(h, positions, rope_freqs))
        return self._head(h), self._by_stack(ys)

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict[str, Cache],
               absorb: bool = True) -> tuple[jax.Array, dict[str, Cache]]:
        """One token per row with a cache: tokens, positions [B, 1] -> (logits [B, 1, vocab],
        cache with the tokens' entries written at their positions).

        The layer scan runs over (layer params, layer cache) together; each layer reads its
        cache slice and returns only the new token's entries, which are scattered into the
        stacked cache once after the scan (in place when the caller donates the cache).
        absorb: MLA's absorbed (True) or explicit (False) decode, see models/mla.py."""
        h, positions, rope_freqs = self._embed(tokens, positions)
        h, ys = self._run_layers(
            h, lambda blk, h, c: blk.decode(h, positions, rope_freqs, c, absorb),
            lambda blk, h, c: blk.decode(h, positions, rope_freqs, c, absorb),
            dense_xs=cache.get("layers"), moe_xs=cache.get("moe_layers"))
        return self._head(h), write_cache(cache, self._by_stack(ys), positions[:, 0])

    # ------------------------------------------------------------ pieces

    def _embed(self, tokens: jax.Array, positions: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg, dt = self.cfg, DTYPES[self.cfg.dtype]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        # Gather the FSDP-sharded table first (as for any weight): a lookup straight into a
        # table sharded on `embed` makes GSPMD replicate the activations instead under data x fsdp.
        table = jax.tree.map(lambda a: constrain(a, ("vocab", None)), weight(self, "embed"))
        h = lookup(table, tokens, dt)
        h = constrain(h, ("batch", "residual_length", "embed"))
        return h, positions, rope_frequencies(cfg)

    def _head(self, h: jax.Array) -> jax.Array:
        return self.logits(self.final_norm(h))

    def _by_stack(self, ys: tuple) -> dict:
        dense, sparse = ys
        out = {}
        if hasattr(self, "layers"):
            out["layers"] = dense
        if hasattr(self, "moe_layers"):
            out["moe_layers"] = sparse
        return out

    def _dense_stack(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                     rope_freqs: jax.Array) -> jax.Array:
        cfg = self.cfg
        if pipeline.is_pipelined():  # layers split over the `stage` mesh axis (sharding/pipeline.py)
            graphdef, stacked = nnx.split(self.layers)

            def layer(h: jax.Array, layer_state, side) -> jax.Array:
                return nnx.merge(graphdef, layer_state)(h, side[0], side[1], rope_freqs)

            if cfg.remat_policy != "none":
                layer = jax.checkpoint(layer, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
            return pipeline.apply_layers(layer, h, stacked, (positions, segment_ids), scan_layers=cfg.scan_layers)
        h, _ = self._run_layers(h, lambda blk, h, _: (blk(h, positions, segment_ids, rope_freqs), None), None,
                                remat=True)
        return h

    def _layer_step(self, graphdef: nnx.GraphDef, fn, remat: bool):
        """(h, (layer params, x)) -> fn(layer module, h, x), under the config's remat policy when
        `remat` (training)."""
        def step(h, xs):
            layer_state, x = xs
            return fn(nnx.merge(graphdef, layer_state), h, x)

        if remat and self.cfg.remat_policy != "none":
            step = jax.checkpoint(step, policy=remat_policy(self.cfg.remat_policy),
                                  prevent_cse=not self.cfg.scan_layers)
        return step

    def _run_layers(self, h: jax.Array, dense_fn, moe_fn, dense_xs=None, moe_xs=None,
                    remat: bool = False) -> tuple[jax.Array, tuple]:
        """Every layer in order: the dense prefix, then periods of (moe_every - 1) dense blocks
        and one MoE block (a dense model: one scan over `layers`).

        dense_fn(block, h, x) -> (h, y) and moe_fn(block, h, x) -> (h, y) apply one layer; x is
        that layer's slice of dense_xs / moe_xs (stacked like the layers; None: nothing) and
        the y's come back stacked in layer order: (dense ys [L_dense, ...], moe ys [L_moe, ...]).
        `remat` applies the config's remat policy (training)."""
        cfg = self.cfg
        prefix, per = cfg.moe_first_dense_layers, cfg.moe_every - 1
        dense_def, dense = nnx.split(self.layers) if hasattr(self, "layers") else (None, None)
        take = lambda tree, lo, hi: jax.tree.map(lambda x: x[lo:hi], tree)  # noqa: E731
        at = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731

        dense_block = self._layer_step(dense_def, dense_fn, remat)
        if not cfg.is_moe:
            if cfg.scan_layers:
                h, ys = jax.lax.scan(dense_block, h, (dense, dense_xs))
            else:
                outs = []
                for i in range(cfg.num_layers):
                    h, y = dense_block(h, at((dense, dense_xs), i))
                    outs.append(y)
                ys = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
            return h, (ys, None)

        moe_def, moe = nnx.split(self.moe_layers)

        moe_block = self._layer_step(moe_def, moe_fn, remat)

        def period(h, xs):
            group, group_xs, layer_state, x = xs
            ys = []
            for j in range(per):
                h, y = dense_block(h, at((group, group_xs), j))
                ys.append(y)
            h, y = moe_block(h, (layer_state, x))
            return h, (jax.tree.map(lambda *xs: jnp.stack(xs), *ys) if per else None, y)

        periods = jax.tree.leaves(moe)[0].shape[0]
        groups = group_xs = None
        if per:  # the dense blocks after the prefix, as [periods, per, ...]
            as_groups = lambda tree: jax.tree.map(  # noqa: E731
                lambda x: x.reshape(periods, per, *x.shape[1:]), take(tree, prefix, None))
            groups, group_xs = as_groups(dense), as_groups(dense_xs)
        if cfg.scan_layers:
            prefix_ys = None
            if prefix:
                h, prefix_ys = jax.lax.scan(dense_block, h, (take(dense, 0, prefix), take(dense_xs, 0, prefix)))
            h, (group_ys, moe_ys) = jax.lax.scan(period, h, (groups, group_xs, moe, moe_xs))
        else:
            prefix_outs = []
            for i in range(prefix):
                h, y = dense_block(h, at((dense, dense_xs), i))
                prefix_outs.append(y)
            outs = []
            for p in range(periods):
                h, out = period(h, at((groups, group_xs, moe, moe_xs), p))
                outs.append(out)
            stack = lambda outs: jax.tree.map(lambda *xs: jnp.stack(xs), *outs) if outs else None  # noqa: E731
            prefix_ys = stack(prefix_outs)
            group_ys, moe_ys = stack([o[0] for o in outs]), stack([o[1] for o in outs])
        dense_ys = None
        if hasattr(self, "layers"):  # back to the order of `layers`: prefix, then each period's group
            parts = [prefix_ys] if prefix else []
            if per:
                parts.append(jax.tree.map(lambda x: x.reshape(periods * per, *x.shape[2:]), group_ys))
            dense_ys = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if parts else None
        return h, (dense_ys, moe_ys)

    def _moe_pipelined(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                       rope_freqs: jax.Array, mask: jax.Array,
                       order: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """A MoE stack split over the `stage` mesh axis (sharding/pipeline.py).

        The dense prefix runs first, outside the pipeline (replicated over `stage`, like the
        embeddings); each period of (moe_every - 1) dense blocks + one MoE block is one pipeline
        layer. Router statistics come out of the pipeline as sums over microbatches
        (`PARTIAL_STATS`), from which `merge_stats` rebuilds the whole batch's losses exactly."""
        cfg = self.cfg
        prefix, per = cfg.moe_first_dense_layers, cfg.moe_every - 1
        dense_def, dense = nnx.split(self.layers) if hasattr(self, "layers") else (None, None)
        moe_def, moe = nnx.split(self.moe_layers)
        at = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731

        # Per-row inputs travel as `side` so that the pipeline can split them into microbatches.
        dense_step = self._layer_step(dense_def, lambda blk, h, side: (blk(h, *side[:2], rope_freqs), None), True)
        moe_step = self._layer_step(moe_def, lambda blk, h, side: blk(h, *side[:2], rope_freqs, *side[2:]), True)
        dense_block = lambda h, layer_state, side: dense_step(h, (layer_state, side))  # noqa: E731

        side = (positions, segment_ids, mask, order)
        if prefix:
            head = jax.tree.map(lambda x: x[:prefix], dense)
            if cfg.scan_layers:
                h, _ = jax.lax.scan(lambda h, p: dense_block(h, p, side), h, head)
            else:
                for i in range(prefix):
                    h, _ = dense_block(h, at(head, i), side)
        periods = jax.tree.leaves(moe)[0].shape[0]
        groups = None
        if per:  # the dense blocks after the prefix, as [periods, per, ...]
            groups = jax.tree.map(lambda x: x[prefix:].reshape(periods, per, *x.shape[1:]), dense)

        def stage_layer(h, xs, side):
            group, layer_state = xs
            for j in range(per):
                h, _ = dense_block(h, at(group, j), side)
            h, stats = moe_step(h, (layer_state, side))
            return h, {k: stats[k] for k in PARTIAL_STATS}

        h, partial = pipeline.apply_layers(stage_layer, h, (groups, moe), side, scan_layers=cfg.scan_layers,
                                           with_stats=True)
        return h, merge_stats(partial, cfg.moe_top_k)
