"""Memory per device, analytic, as a list of components.

Each component is one small function `(Layout, StateBytes) -> Component | None` in
`COMPONENTS`; a new feature that needs memory adds one function to that list. A component
belongs to one phase of the step, and the peak is

    total = resident + max(step + max(head, layer), update)

    resident  the whole step: params, gradients (or their accumulator), optimizer state
    step      forward and backward: activations kept for the backward (all layers on this
              device), one microbatch's gradients under accumulation
    head      the output head: logits and loss, the gathered embedding tables
    layer     one layer's backward: rebuilt activations (attention scores, MoE dispatch
              buffers), gradient buffers, the layer's all-gathered FSDP weights, pipeline buffers
    update    after the backward: new params and moments built before the NaN guard picks them
    rollout   GRPO only, between steps: the sampler's KV cache and batch while it draws completions
              (total = resident + max(step + max(head, layer), update, rollout))

The head and layer peaks happen while the step's activations are alive (the head at the end of
the forward, a layer in its backward); the update happens after they are freed. The rules were
fitted against XLA's memory analysis on 8 fake CPU devices (benchmarks/plan.py memory); the
quant and distill sections add their components here (params' dtype, teacher params).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from jaxinfra.config import OptimizerConfig, ScheduleConfig
from jaxinfra.config_sections import preference_data, prompt_data
from jaxinfra.dpo.saved import is_saved_reference
from jaxinfra.optim import make_optimizer, make_schedule
from jaxinfra.plan import activations as act
from jaxinfra.plan.layout import DTYPE_BYTES, F32_BYTES, Layout, split
from jaxinfra.state import abstract_state, sharding_rules
from models import cache as kv_cache
from models.config import ModelConfig
from models.lora_config import NO_LORA, LoraConfig
from models.quant_config import NO_QUANT, QuantConfig
from sharding.mesh import MESH_AXES
from sharding.rules import logical_to_mesh, rules_for

Phase = Literal["resident", "step", "head", "layer", "update", "rollout"]
PHASES: tuple[Phase, ...] = ("resident", "step", "head", "layer", "update", "rollout")


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    bytes: float
    phase: Phase
    note: str = ""


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Per-device bytes of the TrainState's parts, from the abstract state's shardings (jaxinfra/info.py)."""

    params: int
    opt_state: int
    params_total: int
    layer_params: int = 0  # of `params`, the leaves stacked over layers (the ones a pipeline stages)
    frozen: int = 0  # of `params`, a frozen base's (LoRA): no gradients, no moments, never rewritten

    @property
    def opt_params(self) -> float:
        """Bytes of one trained-params-shaped tree in the optimizer state's sharding (AdamW keeps two):
        the gradients' size too, since only the trained params get gradients."""
        return self.opt_state / 2

    @property
    def trained(self) -> int:
        """Bytes of the params the optimizer updates (all but a frozen base), in their own sharding."""
        return self.params - self.frozen

    @property
    def trained_share(self) -> float:
        """The trained params' share of the params: what the gradient collectives move."""
        return self.trained / self.params if self.params else 1.0

    @classmethod
    def of(cls, lay: Layout) -> StateBytes:
        p = lay.cfg.parallelism
        model = dataclasses.replace(lay.model, remat_policy="none")  # the state does not depend on it
        return _state_bytes(model, lay.cfg.optimizer, lay.cfg.quant, lay.cfg.lora, p.strategy,
                            tuple(sorted(p.rules.items())), tuple(lay.sizes[a] for a in MESH_AXES))


@functools.lru_cache(maxsize=1024)
def _state_bytes(model: ModelConfig, optimizer: OptimizerConfig, quant: QuantConfig, lora: LoraConfig, strategy: str,
                 rules: tuple, sizes: tuple[int, ...]) -> StateBytes:
    mesh = AbstractMesh(sizes, MESH_AXES)
    tables = rules_for(strategy, overrides=dict(rules))
    params, opt_state, frozen = _state_leaves(model, optimizer, quant, lora)
    stacked = tuple(leaf for leaf in params if "layers" in leaf[0])
    return StateBytes(_per_device(params, tables.params, mesh), _per_device(opt_state, tables.opt_state, mesh),
                      sum(math.prod(shape) * size for _, shape, size in params),
                      _per_device(stacked, tables.params, mesh), _per_device(frozen, tables.params, mesh))


Leaf = tuple[tuple, tuple[int, ...], int]  # (logical axis names, shape, bytes per element)


def lora_trainable(lora: LoraConfig) -> Any:
    """The params LoRA trains (its adapters) as an nnx filter, None (all) when LoRA is off: the filter the
    `lora` step extension gives the optimizer (jaxinfra/lora/extension.py)."""
    if not lora.enabled:
        return None
    from jaxinfra.lora.extension import ADAPTERS

    return ADAPTERS


@functools.lru_cache(maxsize=16)
def _state_leaves(model: ModelConfig, optimizer: OptimizerConfig, quant: QuantConfig = NO_QUANT,
                  lora: LoraConfig = NO_LORA) -> tuple[tuple[Leaf, ...], tuple[Leaf, ...], tuple[Leaf, ...]]:
    """(params, optimizer state, frozen params) leaves of the abstract TrainState, as `jaxinfra info`
    sees them (with the quant section's extra leaves: fp8 amax histories, int8 weights + scales; with
    LoRA the adapters, the only trained params: the optimizer state is theirs and the rest is the
    frozen base); cached per model, since a search prices many layouts of one model."""
    tx = make_optimizer(optimizer, make_schedule(ScheduleConfig(), optimizer.lr, 1))
    trainable = lora_trainable(lora)
    state = abstract_state(model, tx, quant, trainable=trainable, lora=lora)

    def leaves(tree: Any) -> tuple[Leaf, ...]:
        out = []
        for x in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable)):
            names = (x.get_metadata().get("out_sharding") if isinstance(x, nnx.Variable) else None) or (None,) * x.ndim
            out.append((tuple(names), tuple(x.shape), np.dtype(x.dtype).itemsize))
        return tuple(out)

    frozen = () if trainable is None else leaves(nnx.split_state(state.params, trainable, ...)[1])
    # stats (router bias, amax) beside params: no gradients either way
    return leaves((state.params, state.stats)), leaves(state.opt_state), frozen


def _per_device(leaves: tuple[Leaf, ...], table: Any, mesh: AbstractMesh) -> int:
    """Bytes one device holds of these leaves under `table` (logical_to_mesh, as state.tree_shardings)."""
    total = 0
    for names, shape, size in leaves:
        spec = logical_to_mesh(names, table, mesh, shape)
        ways = [math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)) if e else 1 for e in spec]
        total += math.prod(dim // w for dim, w in zip(shape, ways + [1] * (len(shape) - len(ways)))) * size
    return total


Fn = Callable[[Layout, StateBytes], "Component | None"]


def params(lay: Layout, state: StateBytes) -> Component:
    if state.frozen:
        return Component("params", state.trained, "resident", "trained: the LoRA adapters (float32), by the "
                         "parameter rules")
    return Component("params", state.params, "resident", f"{lay.model.param_dtype}, by the parameter rules")


def frozen_params(lay: Layout, state: StateBytes) -> Component | None:
    """A frozen base (LoRA): resident, but no gradients, no optimizer state, no new copy in the update."""
    if not state.frozen:
        return None
    stored = ("int8 + float32 scales" if lay.cfg.quant.weights == "int8" else lay.model.param_dtype)
    return Component("frozen params", state.frozen, "resident", f"the frozen base ({stored}): no gradients or "
                     "optimizer state")


def gradients(lay: Layout, state: StateBytes) -> Component:
    """The step's gradients, in the optimizer state's sharding: GSPMD reduce-scatters each
    layer's gradients there as the backward produces them (ZeRO-1 and FSDP alike). Only the trained
    params have gradients (a frozen base has none)."""
    accum = lay.cfg.train.grad_accum_steps > 1
    return Component("gradients", state.opt_params, "resident", ("accumulated, " if accum else "")
                     + "in the optimizer state's sharding" + (", adapters only" if state.frozen else ""))


def microbatch_gradients(lay: Layout, state: StateBytes) -> Component | None:
    """Gradient accumulation: one microbatch's gradients and their sum with the accumulator."""
    if lay.cfg.train.grad_accum_steps == 1:
        return None
    return Component("microbatch gradients", 2 * state.opt_params, "step",
                     f"{lay.cfg.train.grad_accum_steps} microbatches: one's gradients + the new sum")


def optimizer_state(lay: Layout, state: StateBytes) -> Component:
    return Component("optimizer state", state.opt_state, "resident", "AdamW moments, by the optimizer rules")


def activations(lay: Layout, state: StateBytes) -> Component:
    """Saved activations of every layer on this device (see jaxinfra/plan/activations.py), times
    the layer calls alive at once: pipeline ticks (gpipe, circular) or stashed inputs (1f1b)."""
    outside, dense, sparse = lay.layer_counts
    per_call = dense * act.saved_per_layer(lay, False) + sparse * act.saved_per_layer(lay, True)
    policy = lay.model.remat_policy + ("" if act.effective_policy(lay) == lay.model.remat_policy else
                                       f" (as {act.effective_policy(lay)} under the stage vmap)")
    if lay.attention_impl != lay.model.attention_impl:  # auto, or a fallback: name what the kernels run
        policy += f", attention {lay.model.attention_impl} -> {lay.attention_impl}"
    if lay.pp == 1:
        return Component("activations", per_call, "step", f"remat {policy}, {dense + sparse} layers")
    micro, repeats = lay.pipeline
    stream = lay.tokens * lay.model.d_model * lay.compute_bytes  # one microbatch's residual stream
    prefix = outside * act.saved_per_layer(lay, False, staged=False) * micro  # the dense prefix: whole batch
    if lay.cfg.parallelism.pipeline_schedule == "1f1b":  # inputs of every microbatch + the stash
        kept = micro * stream + (2 * lay.pp - 1) * stream
        return Component("activations", prefix + kept, "step", f"1f1b: {micro} inputs + {2 * lay.pp - 1} stashed")
    ticks = repeats * micro + lay.pp - 1
    kept = ticks * (per_call / repeats + stream)
    return Component("activations", prefix + kept, "step", f"remat {policy}, {ticks} pipeline ticks")


def logits_and_loss(lay: Layout, state: StateBytes) -> Component:
    """float32 logits, softmax pieces and their gradient, per loss chunk ([rows, chunk, vocab])."""
    m, t = lay.model, lay.cfg.train.seq_len
    chunk = m.loss_chunk_size if m.loss_chunk_size and m.loss_chunk_size < t else t
    rows = lay.accum_rows
    logits = rows * split(chunk, lay.cp) * lay.vocab * F32_BYTES
    hidden = rows * lay.seq * m.d_model * lay.compute_bytes  # the final norm's output, kept for the head
    note = f"[{rows}, {split(chunk, lay.cp)}, {lay.vocab}] float32" + (f", chunks of {chunk}" if chunk < t else "")
    return Component("logits and loss", 3 * logits + 2 * hidden, "head", note)


def gathered_embeddings(lay: Layout, state: StateBytes) -> Component | None:
    """The embedding table is gathered before the lookup (and the output matrix before the
    logits) when FSDP shards them; each has a full-size gradient before its reduce-scatter."""
    m = lay.model
    if lay.sizes["fsdp"] == 1 or lay.cfg.parallelism.strategy != "fsdp":
        return None
    tables = 1 if m.tie_embeddings else 2
    size = tables * lay.vocab * m.d_model * lay.param_bytes
    return Component("gathered embeddings", 2 * size, "head", f"{tables} table(s) + gradient, over fsdp")


def layer_backward(lay: Layout, state: StateBytes) -> Component:
    """The largest layer's backward working set (jaxinfra/plan/activations.py: rebuilt matmul
    outputs and softmax, and the gradient buffers)."""
    kinds = [moe for moe, n in zip((False, True), lay.layer_counts[1:]) if n] or [False]
    return Component("layer backward", max(act.backward_working_set(lay, moe) for moe in kinds), "layer",
                     "rebuilt activations + their gradients")


def gathered_layer_weights(lay: Layout, state: StateBytes) -> Component | None:
    """FSDP (ZeRO-3): a layer's weights all-gathered for its backward. Between two layers three
    layers' worth are alive (this layer's weights and full gradient before its reduce-scatter,
    the next layer's prefetched weights); that moment is the peak when it exceeds one layer's
    weights plus the layer's working set."""
    if lay.sizes["fsdp"] == 1 or lay.cfg.parallelism.strategy != "fsdp":
        return None
    layers = lay.model.num_layers
    per_layer = (state.params_total - _embedding_bytes(lay)) / layers / lay.tp / (lay.ep if lay.model.is_moe else 1)
    working = layer_backward(lay, state).bytes
    copies = 2 if state.frozen else 3  # a frozen base's layer has no full-size weight gradient
    return Component("gathered layer weights", max(per_layer, copies * per_layer - working), "layer",
                     f"one layer's weights over fsdp ({copies} at a layer boundary)")


def pipeline_buffers(lay: Layout, state: StateBytes) -> Component | None:
    """The pipeline's own buffers in its backward (sharding/pipeline.py): the stage-sharded copy
    of this stage's layer weights, their gradient summed over ticks and one tick's gradient (and,
    for circular with repeats > 1, the interleaved copy and its gradient); the microbatched input
    and output streams ([M, micro, seq, d], whole on every stage); under 1f1b, the residuals of
    the chunk whose backward a tick runs."""
    if lay.pp == 1:
        return None
    micro, repeats = lay.pipeline
    weights = state.params - _embedding_bytes(lay) / max(lay.tp, 1)
    copies = 3 + (2 if repeats > 1 else 0)
    streams = 2 * lay.accum_rows * lay.seq * lay.model.d_model * lay.compute_bytes
    chunk = 0.0
    if lay.cfg.parallelism.pipeline_schedule == "1f1b":
        _, dense, sparse = lay.layer_counts
        chunk = dense * act.saved_per_layer(lay, False) + sparse * act.saved_per_layer(lay, True)
    return Component("pipeline buffers", copies * weights + streams + chunk, "layer",
                     f"{copies} stage weight copies/gradients, input/output streams"
                     + (", one chunk's residuals" if chunk else ""))


def _embedding_bytes(lay: Layout) -> float:
    m = lay.model
    return (1 if m.tie_embeddings else 2) * m.vocab_size * m.d_model * lay.param_bytes


def optimizer_update(lay: Layout, state: StateBytes) -> Component:
    """New params (in their own sharding) and new moments (in the optimizer's) exist beside the
    old ones until the NaN guard (jaxinfra/step.py) selects them; the gradients' buffer is reused."""
    new = state.trained + 2 * state.opt_params  # a frozen base is passed through, never rebuilt
    return Component("optimizer update", max(0.0, new - state.opt_params), "update",
                     "new params + moments before the NaN guard, less the reused gradients")


# ------------------------------------------------------------ quantization (docs/quantization.md)
@dataclasses.dataclass(frozen=True)
class Projection:
    """One weight matmul of a layer on this device: `tokens` rows of `inputs` features to
    `outputs` features, over `copies` weights (the experts on this device)."""

    name: str
    tokens: float
    inputs: int
    outputs: int
    copies: int = 1


def projections(lay: Layout, moe: bool) -> list[Projection]:
    """One layer's projections (models/project.py names), widths split over `tensor`; FSDP gathers
    the whole weight of the layer before its matmul."""
    m, n, d, h = lay.model, lay.tokens, lay.model.d_model, lay.heads
    if m.is_mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        out = ([Projection("mla.q", n, d, h * qk)] if m.q_lora_rank is None else
               [Projection("mla.q_a", n, d, m.q_lora_rank), Projection("mla.q_b", n, m.q_lora_rank, h * qk)])
        out += [Projection("mla.kv_a", n, d, m.kv_lora_rank + m.qk_rope_head_dim),
                Projection("mla.kv_b", n, m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim)),
                Projection("mla.o", n, h * m.v_head_dim, d)]
    else:
        dh = m.resolved_head_dim
        out = [Projection("attention.q", n, d, h * dh), Projection("attention.k", n, d, lay.kv_heads * dh),
               Projection("attention.v", n, d, lay.kv_heads * dh), Projection("attention.o", n, h * dh, d)]
    width = lay.mlp
    if moe:
        rows = lay.rows * act.capacity_slots(lay) if m.moe_dispatch == "capacity" else n * m.moe_top_k
        f, local = split(m.expert_dim, lay.tp), split(m.moe_num_experts, lay.ep)
        out += [Projection("experts.gate", rows, d, f, local), Projection("experts.up", rows, d, f, local),
                Projection("experts.down", rows, f, d, local)]
        width = split(m.moe_shared_experts * m.expert_dim, lay.tp)
    if width:
        out += [Projection("mlp.gate", n, d, width), Projection("mlp.up", n, d, width),
                Projection("mlp.down", n, width, d)]
    return out


def quantized_operands(lay: Layout, state: StateBytes) -> Component | None:
    """`quant.train`: one layer's backward holds, per quantized projection, the low-precision
    operands its forward made (models/qdot.py): the input (int8 + a float32 scale per token, or
    fp8) and the weight (int8 + a scale per output channel, or fp8), and the output gradient
    requantized, twice for int8 (per token for dx, per feature for dw, each with its scales) and
    once for fp8 (one per-tensor scale serves both)."""
    q = lay.cfg.quant
    if q.train == "none":
        return None
    int8 = q.train == "int8"
    kinds = [moe for moe, n in zip((False, True), lay.layer_counts[1:]) if n] or [False]

    def layer(moe: bool) -> float:
        total = 0.0
        for p in projections(lay, moe):
            if q.matmul(p.name).mode == "none":
                continue
            x, y, w = p.tokens * p.inputs, p.tokens * p.outputs, p.copies * p.inputs * p.outputs
            total += x + w + (2 if int8 else 1) * y
            if int8:
                total += F32_BYTES * (p.tokens + p.copies * p.outputs + p.tokens + p.outputs)
        return total

    return Component("quantized operands", max(layer(moe) for moe in kinds), "layer",
                     f"{q.train} copies of one layer's matmul inputs, weights and output gradients")

def _dequantized_layer_bytes(lay: Layout, moe: bool) -> float:
    """One layer's int8-stored projection weights on this device, converted to the compute dtype."""
    q = lay.cfg.quant
    return lay.compute_bytes * sum(p.inputs * p.outputs * p.copies for p in projections(lay, moe)
                                   if q.stores_int8(p.name))


def dequantized_weights(lay: Layout, state: StateBytes) -> Component | None:
    """QLoRA (an int8 base under training): each matmul converts its int8 weight to the compute dtype
    (models/project.py) in the forward and again for the backward's input gradient, so one layer's
    converted weights sit beside its backward working set (fitted: XLA's temporaries equal the float
    base's there)."""
    if lay.cfg.quant.weights != "int8" or not state.frozen:
        return None
    kinds = [moe for moe, n in zip((False, True), lay.layer_counts[1:]) if n] or [False]
    return Component("dequantized weights", max(_dequantized_layer_bytes(lay, moe) for moe in kinds), "layer",
                     f"one layer's int8 weights as {lay.model.dtype} for its matmuls")


def saved_dequantized_weights(lay: Layout, state: StateBytes) -> Component | None:
    """QLoRA without remat: autodiff saves every layer's converted weight (a matmul operand) for the
    backward, so the forward keeps all layers' weights in the compute dtype (remat policies that
    recompute or save only dot outputs keep none of them)."""
    if lay.cfg.quant.weights != "int8" or not state.frozen or act.effective_policy(lay) != "none":
        return None
    outside, dense, sparse = lay.layer_counts
    saved = (outside + dense) * _dequantized_layer_bytes(lay, False) + sparse * _dequantized_layer_bytes(lay, True)
    return Component("saved dequantized weights", saved, "step",
                     f"remat none: {outside + dense + sparse} layers' int8 weights as {lay.model.dtype}")


# ------------------------------------------------------------ distillation (docs/distillation.md)
@functools.lru_cache(maxsize=16)
def _teacher_model(path: str, dtype: str, vocab: int) -> ModelConfig:
    """The teacher's model as the distillation runs it (its config.yaml, in `teacher_dtype`); a
    missing or mismatched teacher is the one-line error `jaxinfra train` gives."""
    from jaxinfra.distill.teacher import resolve_teacher

    return resolve_teacher(path, vocab).compute_model(dtype)


def teacher_params(lay: Layout, state: StateBytes) -> Component | None:
    """Online distillation: the teacher's params in `distill.teacher_dtype`, sharded by the
    student's parameter rules, resident for the whole step (a step input: no gradients, no
    optimizer state)."""
    d = lay.cfg.distill
    if not d.online:
        return None
    model = _teacher_model(d.teacher, d.teacher_dtype, lay.model.vocab_size)
    leaves = _state_leaves(model, lay.cfg.optimizer)[0]
    mesh = AbstractMesh(tuple(lay.sizes[a] for a in MESH_AXES), MESH_AXES)
    tables = rules_for(lay.cfg.parallelism.strategy, overrides=dict(lay.cfg.parallelism.rules))
    return Component("teacher params", _per_device(leaves, tables.params, mesh), "resident",
                     f"{model.num_layers} layers, d_model {model.d_model}, {d.teacher_dtype}")


def teacher_logits(lay: Layout, state: StateBytes) -> Component | None:
    """What the teacher adds at the head: online, its final hidden states ([rows, seq, d_teacher]
    in its dtype) and, per loss chunk, four more [rows, chunk, vocab] float32 buffers (the teacher's
    logits and tempered softmax, the student's tempered log-softmax and the KL's gradient: what
    XLA's memory analysis adds over the plain step), eight with `distill.top_k` (fitted: XLA:CPU's
    top-k keeps values and indices for the whole vocabulary); offline, the saved top-k batch (ids,
    float32 values, the teacher's per-token cross-entropy) on this device."""
    d, m, t = lay.cfg.distill, lay.model, lay.cfg.train
    if not d.enabled:
        return None
    rows = lay.accum_rows
    if not d.online:
        from jaxinfra.distill.logits import LogitsDir

        k = d.top_k or LogitsDir.open(d.logits).top_k
        ids = 2 if m.vocab_size <= 2**16 else 4
        batch = t.batch_size // lay.batch_shards * lay.seq * (k * (ids + F32_BYTES) + F32_BYTES)
        return Component("teacher logits", batch, "resident", f"the saved top-{k} ids, logits and CE per token")
    teacher = _teacher_model(d.teacher, d.teacher_dtype, m.vocab_size)
    chunk = m.loss_chunk_size if m.loss_chunk_size and m.loss_chunk_size < t.seq_len else t.seq_len
    logits = (8 if d.top_k else 4) * rows * split(chunk, lay.cp) * lay.vocab * F32_BYTES
    hidden = rows * lay.seq * teacher.d_model * DTYPE_BYTES[d.teacher_dtype]
    return Component("teacher logits", logits + hidden, "head", "teacher hidden states + float32 logits per chunk")


# ------------------------------------------------------------ DPO and GRPO (docs/post-training.md)
def _reference_model(lay: Layout) -> tuple[str, str | None] | None:
    """(method, dpo/grpo.reference) when the run holds a separate frozen reference model, else None:
    not DPO or GRPO, GRPO without its KL term (kl_beta 0), LoRA with a null reference (the base with
    the adapters off: no second copy), or DPO's saved reference log-probs (no model in memory)."""
    cfg = lay.cfg
    if preference_data(cfg):
        method, path = "dpo", cfg.dpo.reference
        if path is not None and is_saved_reference(path):
            return None
    elif prompt_data(cfg) and cfg.grpo.kl_beta > 0:
        method, path = "grpo", cfg.grpo.reference
    else:
        return None
    if cfg.lora.enabled and path is None:
        return None
    return method, path


def reference_params(lay: Layout, state: StateBytes) -> Component | None:
    """DPO / GRPO: the frozen reference policy's params, resident for the whole run like the
    distillation teacher's (a step input: no gradients, no optimizer state). It has the run's own
    architecture (a reference of another shape is refused) and is restored in the run's param dtype
    by the run's parameter rules, so it costs the run's params without LoRA adapters."""
    found = _reference_model(lay)
    if found is None:
        return None
    method, path = found
    p = lay.cfg.parallelism
    model = dataclasses.replace(lay.model, remat_policy="none")
    ref = _state_bytes(model, lay.cfg.optimizer, lay.cfg.quant, NO_LORA, p.strategy, tuple(sorted(p.rules.items())),
                       tuple(lay.sizes[a] for a in MESH_AXES))
    where = f"{method}.reference={path}" if path else "the starting checkpoint"
    return Component("reference params", ref.params, "resident", f"{where}, {lay.model.param_dtype}, frozen")


def kv_cache_bytes(lay: Layout, rows: int, length: int) -> float:
    """Per-device bytes of the decode cache for `rows` x `length` positions, laid out as models/cache.py
    stores it (per layer k and v, or MLA's latent + rope key; int8 + float32 scales with
    quant.kv_cache=int8) and sharded by the activation rules, as the Generator pins it."""
    mesh = AbstractMesh(tuple(lay.sizes[a] for a in MESH_AXES), MESH_AXES)
    table = sharding_rules(lay.cfg.parallelism).activations
    quantized = lay.cfg.quant.kv_cache == "int8"
    total = 0.0
    for arrays in kv_cache.layout(lay.model, rows, length, quantized).values():
        for name, (shape, names) in arrays.items():
            spec = logical_to_mesh(names, table, mesh, shape)
            ways = math.prod(math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)) if e else 1
                             for e in spec)
            item = (F32_BYTES if name.endswith("_scale") else 1) if quantized else lay.compute_bytes
            total += math.prod(shape) / ways * item
    return total


def _rollout(lay: Layout) -> bool:
    return prompt_data(lay.cfg)


def rollout_kv_cache(lay: Layout, state: StateBytes) -> Component | None:
    """GRPO: the sampler's KV cache during a rollout, train.batch_size rows (prompts x group_size)
    of train.seq_len positions (prompt + grpo.max_new_tokens fit in it), on the run's mesh."""
    if not _rollout(lay):
        return None
    t, q = lay.cfg.train, lay.cfg.quant
    int8 = ", int8 + scales" if q.kv_cache == "int8" else ""
    return Component("rollout kv cache", kv_cache_bytes(lay, t.batch_size, t.seq_len), "rollout",
                     f"{t.batch_size} rows x {t.seq_len} positions{int8}")


def rollout_prompt_len(lay: Layout) -> int:
    """The longest prompt bucket a rollout prefills: seq_len - max_new_tokens, rounded up to the
    Generator's bucket of 16 (jaxinfra/infer/generation.py PROMPT_BUCKET)."""
    room = lay.cfg.train.seq_len - lay.cfg.grpo.max_new_tokens
    return -(-room // 16) * 16


def rollout_prefill(lay: Layout, state: StateBytes) -> Component | None:
    """GRPO: the prefill's float32 logits over the whole prompt bucket ([rows, prompt, vocab]; the
    sampler keeps each row's last), the largest transient of a rollout at a large vocabulary."""
    if not _rollout(lay):
        return None
    rows, prompt = lay.cfg.train.batch_size / lay.batch_shards, rollout_prompt_len(lay)
    return Component("rollout prefill", rows * prompt * lay.vocab * F32_BYTES, "rollout",
                     f"[{lay.cfg.train.batch_size}, {prompt}, {lay.model.vocab_size}] float32 prompt logits")


def sampler_batch(lay: Layout, state: StateBytes) -> Component | None:
    """GRPO: one decode step's float32 logits [rows, vocab] and their tempered copy (what the draw
    and the log-prob read), and the rollout's sampled ids (int32) and log-probs (float32)
    [rows, max_new_tokens], rows split like the batch and the vocabulary over `tensor`."""
    if not _rollout(lay):
        return None
    t, g = lay.cfg.train, lay.cfg.grpo
    rows = t.batch_size / lay.batch_shards
    logits = 2 * rows * lay.vocab * F32_BYTES
    tokens = rows * g.max_new_tokens * (4 + F32_BYTES)
    return Component("sampler batch", logits + tokens, "rollout", f"[{t.batch_size}, {lay.model.vocab_size}] "
                     f"float32 logits x 2 + ids and log-probs [{t.batch_size}, {g.max_new_tokens}]")


COMPONENTS: list[Fn] = [params, frozen_params, gradients, optimizer_state, activations, microbatch_gradients,
                        logits_and_loss, gathered_embeddings, layer_backward, gathered_layer_weights, pipeline_buffers,
                        optimizer_update, quantized_operands, dequantized_weights, saved_dequantized_weights,
                        teacher_params, teacher_logits, reference_params, rollout_kv_cache, rollout_prefill,
                        sampler_batch]


@dataclasses.dataclass(frozen=True)
class Memory:
    components: tuple[Component, ...]

    def phase(self, name: Phase) -> float:
        return sum(c.bytes for c in self.components if c.phase == name)

    @property
    def total(self) -> float:
        return self.phase("resident") + max(self._step, self.phase("update"), self.phase("rollout"))

    @property
    def _step(self) -> float:
        return self.phase("step") + max(self.phase("head"), self.phase("layer"))

    @property
    def peak_phase(self) -> str:
        if self.phase("rollout") > max(self._step, self.phase("update")):
            return "rollout"
        if self.phase("update") > self._step:
            return "update"
        return "head" if self.phase("head") >= self.phase("layer") else "layer"

    def as_dict(self) -> dict[str, int]:
        out = {"total": int(self.total)}
        for c in self.components:
            out[c.name.replace(" ", "_")] = int(c.bytes)
        return out


def estimate(lay: Layout, components: list[Fn] | None = None, state: StateBytes | None = None) -> Memory:
    state = state or StateBytes.of(lay)
    found = (fn(lay, state) for fn in (components or COMPONENTS))
    return Memory(tuple(c for c in found if c is not None))
