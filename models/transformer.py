"""Decoder-only Transformer (Llama-style), written to read like the papers.

    h = embed(tokens)
    for each layer:  h = h + attn(norm(h));  h = h + mlp(norm(h))     (mlp: dense or MoE)
                     (norm_placement="post", OLMo 2: h = h + norm(attn(h));  h = h + norm(mlp(h)))
                     ("sandwich", Gemma 2/3: h = h + norm(attn(norm(h)));  h = h + norm(mlp(norm(h))))
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

Which stacks exist and the order their layers run in is the model's layer schedule, and one
runner applies it for training, inference and the pipeline (models/stack.py). Sliding-window
layers (Gemma 2/3, gpt-oss) are a property of a layer's schedule entry: its window and its RoPE
table (`rope_tables`: the global one, and rope_local_theta's for sliding layers when set). Inference
(jaxinfra/infer/, docs/inference.md) runs the same blocks through it: `prefill` is the forward
that also returns each layer's KV-cache entries, `decode` runs one token per row with the
layer scan over (layer params, layer cache).

How the computation is laid out on devices is the `plan` argument (sharding/plan.py), passed
down to every layer that shards; its default is one device, so bare calls compute plainly.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention, Cache
from models.cache import group_name, has_sliding, layer_slots
from models.cache import write as write_cache
from models.config import ModelConfig
from models.layers import DTYPES, MLP, RMSNorm, param, rope_tables
from models.lora_config import NO_LORA, LoraConfig
from models.mla import MLA
from models.moe import MOE_STATS, MoE
from models.project import lookup, prepare_weights, project_attr, weight
from models.quant_config import NO_QUANT, QuantConfig
from models.stack import STACKS, LayerSchedule, LayerSpec, layer_schedule, run, run_pipelined
from sharding.plan import SINGLE_DEVICE, ParallelPlan


def make_attention(cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT,
                   lora: LoraConfig = NO_LORA) -> nnx.Module:
    return MLA(cfg, rngs, quant, lora) if cfg.is_mla else Attention(cfg, rngs, quant, lora)


RESIDUAL = ("batch", "residual_length", "embed")  # the residual stream's logical axes


class _Norms(nnx.Module):
    """The block's RMSNorms, where `model.norm_placement` puts them: "pre" normalises each
    sub-layer's input (attn_norm, mlp_norm), "post" its output before the residual add
    (attn_post_norm, mlp_post_norm; OLMo 2), "sandwich" both (Gemma 2/3). A missing norm is the identity."""

    def _add_norm(self, cfg: ModelConfig, sub: str) -> None:
        """The norm(s) of sub-layer `sub` ("attn" or "mlp")."""
        if cfg.norm_placement in ("pre", "sandwich"):
            setattr(self, f"{sub}_norm", RMSNorm(cfg.d_model, cfg))
        if cfg.norm_placement in ("post", "sandwich"):
            setattr(self, f"{sub}_post_norm", RMSNorm(cfg.d_model, cfg))

    def _norm(self, name: str, x: jax.Array) -> jax.Array:
        norm = getattr(self, name, None)
        return x if norm is None else norm(x)


class Block(_Norms):
    """Residual block: attention then SwiGLU MLP (norms as `_Norms` places them)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA):
        self._add_norm(cfg, "attn")
        self.attn = make_attention(cfg, rngs, quant, lora)
        self._add_norm(cfg, "mlp")
        self.mlp = MLP(cfg, rngs, quant=quant, lora=lora)

    def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array, *, window: int | None = None,
                 plan: ParallelPlan = SINGLE_DEVICE) -> jax.Array:
        """`window`: this layer's sliding window (its LayerSpec's; None: global)."""
        a = self.attn(self._norm("attn_norm", h), positions, segment_ids, rope_freqs, window=window, plan=plan)
        return self._ffn(h + self._norm("attn_post_norm", a), plan)

    def prefill(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array, *, window: int | None = None,
                plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.prefill(self._norm("attn_norm", h), positions, rope_freqs, window=window, plan=plan)
        return self._ffn(h + self._norm("attn_post_norm", a), plan), entries

    def decode(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array, cache: Cache, absorb: bool, *,
               window: int | None = None, plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.decode(self._norm("attn_norm", h), positions, rope_freqs, cache, absorb, window=window,
                                      plan=plan)
        return self._ffn(h + self._norm("attn_post_norm", a), plan), entries

    def _ffn(self, h: jax.Array, plan: ParallelPlan) -> jax.Array:
        h = h + self._norm("mlp_post_norm", self.mlp(self._norm("mlp_norm", h), plan=plan))
        return plan.constrain(h, RESIDUAL)


class MoEBlock(_Norms):
    """Residual block: attention then a Mixture-of-Experts feed-forward (norms as `_Norms` places them)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA):
        self._add_norm(cfg, "attn")
        self.attn = make_attention(cfg, rngs, quant, lora)
        self._add_norm(cfg, "mlp")
        self.moe = MoE(cfg, rngs, quant, lora)

    def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 rope_freqs: jax.Array, mask: jax.Array, order: jax.Array, *, window: int | None = None,
                 plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, dict[str, jax.Array]]:
        a = self.attn(self._norm("attn_norm", h), positions, segment_ids, rope_freqs, window=window, plan=plan)
        return self._ffn(h + self._norm("attn_post_norm", a), mask, order, plan)

    def prefill(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array, *, window: int | None = None,
                plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.prefill(self._norm("attn_norm", h), positions, rope_freqs, window=window, plan=plan)
        h = h + self._norm("attn_post_norm", a)
        return self._ffn(h, jnp.ones(h.shape[:2], jnp.bool_), None, plan)[0], entries

    def decode(self, h: jax.Array, positions: jax.Array, rope_freqs: jax.Array, cache: Cache, absorb: bool, *,
               window: int | None = None, plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, Cache]:
        a, entries = self.attn.decode(self._norm("attn_norm", h), positions, rope_freqs, cache, absorb, window=window,
                                      plan=plan)
        h = h + self._norm("attn_post_norm", a)
        return self._ffn(h, jnp.ones(h.shape[:2], jnp.bool_), None, plan)[0], entries

    def _ffn(self, h: jax.Array, mask: jax.Array, order: jax.Array | None,
             plan: ParallelPlan) -> tuple[jax.Array, dict[str, jax.Array]]:
        y, stats = self.moe(self._norm("mlp_norm", h), mask, order, plan=plan)
        return plan.constrain(h + self._norm("mlp_post_norm", y), RESIDUAL), stats


def sequence_order(positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Per row, token indices in original sequence order: packed documents are numbered in
    order and positions count up within each, so (segment id, position) sorts them even
    when a layout has permuted the row (ring attention's load balancing)."""
    if segment_ids is None:
        return jnp.argsort(positions, axis=-1, stable=True)
    return jnp.lexsort((positions, segment_ids), axis=-1)


def _stack(cfg: ModelConfig, rngs: nnx.Rngs, cls: type, count: int, quant: QuantConfig,
           lora: LoraConfig) -> nnx.Module:
    """`count` layers of `cls` with parameters stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return cls(cfg, rngs, quant, lora)

    return make(rngs)


def _keyed(blk: nnx.Module, key: jax.Array | None) -> nnx.Module:
    """`blk` (a layer merged for this step) with its LoRA modules given this layer's dropout key, one
    per module path (models/project.py folds in each projection's name)."""
    if key is not None:
        for path, module in nnx.iter_modules(blk):
            if getattr(module, "lora_dropout", 0.0):
                module.lora_key = jax.random.fold_in(key, zlib.crc32("/".join(map(str, path)).encode()) & 0x7FFFFFFF)
    return blk


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, quant: QuantConfig = NO_QUANT, lora: LoraConfig = NO_LORA):
        """`quant` (the run's `quant` section) decides how the projections compute and how weights are
        stored; its default is plain float matmuls and weights. `lora` (the `lora` section) adds
        low-rank adapters to the projections it targets (models/project.py)."""
        self.cfg = cfg
        self.adapter_dropout = lora.dropout if lora.enabled else 0.0  # (prepare_weights sets lora_* per module)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, cfg.param_dtype)
        schedule = self.schedule
        if schedule.count("dense"):
            self.layers = _stack(cfg, rngs, Block, schedule.count("dense"), quant, lora)
        if schedule.is_moe:
            self.moe_layers = _stack(cfg, rngs, MoEBlock, schedule.count("moe"), quant, lora)
        self.final_norm = RMSNorm(cfg.d_model, cfg)
        if not cfg.tie_embeddings:
            self.unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std,
                                 cfg.param_dtype)
        # The table's rows are contracted with h by the unembedding when tied; untied, it is only looked up.
        prepare_weights(self, quant, {"embed": ("unembed" if cfg.tie_embeddings else "embed", (-1,)),
                                      "unembed": ("unembed", (-2,))}, DTYPES[cfg.dtype])

    @property
    def schedule(self) -> LayerSchedule:
        """The layers, their stacks and their running order (models/stack.py)."""
        return layer_schedule(self.cfg)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, *, plan: ParallelPlan = SINGLE_DEVICE) -> jax.Array:
        """tokens [batch, length] -> float32 logits [batch, length, vocab]."""
        return self.forward(tokens, positions, segment_ids, plan=plan)[0]

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                *, plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(logits, MoE statistics stacked over MoE layers: {} for a dense model).

        Statistics (see models/moe.py): counts [L_moe, E], dropped, aux_loss, z_loss [L_moe]."""
        h, stats = self.hidden(tokens, positions, segment_ids, plan=plan)
        return self.logits(h, plan=plan), stats

    @property
    def stochastic(self) -> bool:
        """Whether the training forward draws random numbers (LoRA dropout): it then takes `rng`."""
        return self.adapter_dropout > 0

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               *, plan: ParallelPlan = SINGLE_DEVICE,
               rng: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(final-normed hidden states [B, T, d], MoE statistics): the forward without the output
        projection. `logits(h)` finishes it; the loss applies it per sequence chunk
        (jaxinfra/loss.py) so that no [B, T, vocab] float32 buffer is ever whole. `rng`: this training
        step's key for LoRA dropout (None, or a model without dropout: none)."""
        h, positions, ropes = self._embed(tokens, positions, plan)
        keys = self._dropout_keys(rng)
        # Per-row inputs of every layer ("side"): the pipeline splits them into microbatches.
        side = (positions, segment_ids)
        if self.cfg.is_moe:
            mask = segment_ids > 0 if segment_ids is not None else jnp.ones(tokens.shape, jnp.bool_)
            side = (*side, mask, sequence_order(positions, segment_ids))

        def dense(blk: Block, h: jax.Array, side: tuple, key: jax.Array | None,
                  spec: LayerSpec) -> tuple[jax.Array, None]:
            return _keyed(blk, key)(h, side[0], side[1], ropes[spec.rope], window=spec.window, plan=plan), None

        def moe(blk: MoEBlock, h: jax.Array, side: tuple, key: jax.Array | None,
                spec: LayerSpec) -> tuple[jax.Array, dict]:
            return _keyed(blk, key)(h, side[0], side[1], ropes[spec.rope], *side[2:], window=spec.window, plan=plan)

        if plan.pipelined:  # the periods split over the `stage` mesh axis (sharding/pipeline.py)
            h, stats = run_pipelined(self, h, lambda blk, h, s, spec: dense(blk, h, s, None, spec),
                                     lambda blk, h, s, spec: moe(blk, h, s, None, spec), side, plan)
        else:
            h, ys = run(self, h, lambda blk, h, k, spec: dense(blk, h, side, k, spec),
                        lambda blk, h, k, spec: moe(blk, h, side, k, spec), xs=keys, remat=True)
            stats = {k: ys["moe_layers"][k] for k in MOE_STATS} if self.cfg.is_moe else {}
        return self.final_norm(h), stats

    def logits(self, h: jax.Array, *, plan: ParallelPlan = SINGLE_DEVICE) -> jax.Array:
        """Final-normed hidden states [B, T, d] (or a chunk of T) -> float32 logits [B, T, vocab],
        soft-capped when configured."""
        cfg = self.cfg
        b, t, d = h.shape
        rows = h.reshape(b * t, d)  # a 2-D matmul, as models/layers.py MLP: no transposed copy of the logits' gradient
        if cfg.tie_embeddings:
            logits = project_attr(self, "nd,vd->nv", rows, "embed", out_dtype=jnp.float32)
        else:
            logits = project_attr(self, "nd,dv->nv", rows, "unembed", out_dtype=jnp.float32)
        logits = logits.reshape(b, t, -1)
        if cfg.logit_softcap is not None:
            logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
        return plan.constrain(logits, ("batch", "length", "vocab"))

    def _dropout_keys(self, rng: jax.Array | None) -> dict[str, jax.Array] | None:
        """One LoRA-dropout key per layer of each stacked group (the runner's per-layer xs), or None."""
        if rng is None or not self.stochastic:
            return None
        schedule = self.schedule
        return {stack: jax.random.split(jax.random.fold_in(rng, i), schedule.count(kind))
                for i, (kind, stack) in enumerate((("dense", "layers"), ("moe", "moe_layers"))) if schedule.count(kind)}

    # ------------------------------------------------------------ inference (jaxinfra/infer/)

    def prefill(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, dict[str, Cache]]:
        """The training forward on causal (unpacked) rows, plus every layer's cache entries.

        Returns (logits [B, T, vocab] float32, entries): per layer stack (`layers`,
        `moe_layers`) a dict of [L, B, heads, T, width] arrays (models/cache.py), to be
        made a cache by `models.cache.from_prefill` (or written at slots 0..T-1 of a cache
        without sliding layers, `models.cache.write`). MoE layers route each
        token on its own (pass a config with moe_dispatch="dropless" for exact decoding)."""
        h, positions, ropes = self._embed(tokens, positions, plan)
        step = lambda blk, h, _, spec: blk.prefill(h, positions, ropes[spec.rope], window=spec.window,  # noqa: E731
                                                   plan=plan)
        h, entries = run(self, h, step, step)
        return self._head(h, plan), entries

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict[str, Cache], absorb: bool = True, *,
               plan: ParallelPlan = SINGLE_DEVICE) -> tuple[jax.Array, dict[str, Cache]]:
        """One token per row with a cache: tokens, positions [B, 1] -> (logits [B, 1, vocab],
        cache with the tokens' entries written at their positions).

        The layer scan runs over (layer params, layer cache) together; each layer reads its
        cache slice and returns only the new token's entries, which are scattered into the
        stacked cache once after the scan (in place when the caller donates the cache). With
        sliding layers the cache groups are not the stacks (models/cache.py): the scan's per-layer
        input is then the layer's index in its group, and the layer reads its slice from the group
        its spec names. absorb: MLA's absorbed (True) or explicit (False) decode, see models/mla.py."""
        h, positions, ropes = self._embed(tokens, positions, plan)
        cfg = self.cfg
        sliding = has_sliding(cfg)

        def step(blk, h, c, spec):
            if sliding:  # c: the layer's index in its cache group
                c = jax.tree.map(lambda a: a[c], cache[group_name(STACKS[spec.kind], spec.window)])
            return blk.decode(h, positions, ropes[spec.rope], c, absorb, window=spec.window, plan=plan)

        xs = {stack: jnp.asarray(i) for stack, i in layer_slots(cfg).items()} if sliding else cache
        h, entries = run(self, h, step, step, xs=xs)
        return self._head(h, plan), write_cache(cache, entries, positions[:, 0], cfg if sliding else None)

    # ------------------------------------------------------------ pieces

    def _embed(self, tokens: jax.Array, positions: jax.Array | None,
               plan: ParallelPlan) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(embedded tokens, positions, the RoPE tables by name: models/layers.py rope_tables)."""
        cfg, dt = self.cfg, DTYPES[self.cfg.dtype]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        # Gather the FSDP-sharded table first (as for any weight): a lookup straight into a
        # table sharded on `embed` makes GSPMD replicate the activations instead under data x fsdp.
        table = jax.tree.map(lambda a: plan.constrain(a, ("vocab", None)), weight(self, "embed"))
        h = lookup(table, tokens, dt)
        if cfg.embed_scale:  # Gemma: the scale rounded to the embeddings' dtype first, as HF's
            h = h * jnp.asarray(cfg.d_model ** 0.5, h.dtype)
        return plan.constrain(h, RESIDUAL), positions, rope_tables(cfg)

    def _head(self, h: jax.Array, plan: ParallelPlan) -> jax.Array:  # inference: norm and logits
        return self.logits(self.final_norm(h), plan=plan)
