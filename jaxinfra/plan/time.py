"""Step time, analytic: compute at the device's throughput, communication per mesh axis, overlap,
the pipeline bubble, and the bottleneck.

    compute   = sum over kinds (step_work: matmul and batched FLOPs, elementwise bytes, softmax and
                loss elements) of the work per device / the kind's rate: probed at the step's shapes
                on this CPU (probes.py), else peak x efficiency or the memory bandwidth (devices.py)
    comm      = sum over collectives of calls x (latency + bytes x f / bandwidth)   (links.py)
    update    = optimizer traffic per device / memory bandwidth            (memory-bound, after the backward)
    accumulate = gradient-sum traffic per device / memory bandwidth      (pipeline ticks, accumulation)
    step      = max(compute + bubble, overlapped comm) + exposed comm + update + accumulate  (accelerators)
    step      = compute + bubble + all comm + update + accumulate                (CPU: fake devices share cores)

Executed FLOPs are the model's (jaxinfra/metrics/flops.py: matmuls and attention, x3 for the
backward) plus what the step really runs on top: the forward work the remat policy recomputes,
the loss chunks' recomputed logits, capacity-dispatch padding and its one-hot einsums, the work
of pipeline bubble slots (the SPMD pipeline computes them), 1F1B's extra forward, and on CPU
the dense ragged_dot of the dropless path (every expert for every row). MFU counts model FLOPs
only, against the datasheet peak (CPU: the probe), as metrics.jsonl does.

Overlap: FSDP all-gathers and reduce-scatters, data-parallel gradient reductions and ring
attention's K/V shifts are issued ahead of the compute that needs them (XLA's latency-hiding
scheduler) and hide under it; tensor-parallel all-reduces (or SP's all-gather/reduce-scatter),
the all-gather of context-parallel K/V, expert all-to-alls, pipeline sends and ZeRO-1's final
parameter all-gather sit on the critical path and are exposed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jaxinfra.metrics.flops import attention_keys, flops_per_token
from jaxinfra.plan import work
from jaxinfra.plan.activations import capacity_slots, effective_policy, saved_per_layer
from jaxinfra.plan.devices import DeviceSpec
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.links import LINKS, Link, Measured, axis_link, collective_seconds
from jaxinfra.plan.memory import StateBytes
from models.config import REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class Collective:
    what: str  # e.g. "FSDP weight all-gather"
    op: str  # links.OPS
    axes: tuple[str, ...]
    size: float  # bytes per device per call
    calls: float  # per step
    overlapped: bool
    seconds: float = 0.0  # per step, filled by `price`

    @property
    def label(self) -> str:
        return f"{self.what} on {'x'.join(self.axes)}"


# ---------------------------------------------------------------- FLOPs


def layer_flops(lay: Layout, moe: bool) -> dict[str, float]:
    """Forward FLOPs per token of one layer, by piece, as this device executes them (its share of
    heads and MLP width under tensor parallelism). Pieces: qkv, attention, out, ffn_up, ffn_down,
    plus for MoE router and dispatch (capacity one-hot einsums)."""
    m, tp, t = lay.model, lay.tp, lay.cfg.train.seq_len
    d, h = m.d_model, m.num_heads
    if m.is_mla:
        qk, dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        q = d * h * qk if m.q_lora_rank is None else d * m.q_lora_rank + m.q_lora_rank * h * qk
        qkv = 2 * (q + d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + dv))
    else:
        qk = dv = m.resolved_head_dim
        qkv = 2 * d * (h + 2 * m.kv_heads) * qk
    flash = lay.attention_keeps.skips_masked_blocks  # the kernels say (kernels/facts.py)
    # Keys per query: a flash kernel skips the blocks outside the causal (and window) band, averaged
    # over the layers; the XLA path computes every T x T score, windows or not.
    keys = attention_keys(m, t, causal=True) / m.num_layers if flash else t
    pieces = {"qkv": qkv / tp, "attention": 2 * h * (qk + dv) * keys / tp,
              "out": 2 * h * dv * d / tp}
    if not moe:
        return {**pieces, "ffn_up": 4 * d * m.mlp_dim / tp, "ffn_down": 2 * m.mlp_dim * d / tp}
    fe = m.expert_dim
    routed = work.routed_rows(lay)  # expert rows computed per token
    shared = m.moe_shared_experts * fe
    pieces.update(ffn_up=4 * d * (routed * fe + shared) / tp, ffn_down=2 * d * (routed * fe + shared) / tp,
                  router=2 * d * m.moe_num_experts)
    if m.moe_dispatch == "capacity":
        pieces["dispatch"] = 2 * 2 * capacity_slots(lay) * d  # dispatch + combine: E x C x d MACs per token each
    return pieces


RECOMPUTED = {  # forward pieces a remat policy runs again in the backward
    "none": (), "save_dots": (), "full": ("qkv", "attention", "out", "ffn_up", "ffn_down", "router", "dispatch"),
    "save_dots_no_batch": ("attention", "dispatch"),
    "save_qkv_proj": ("attention", "out", "ffn_up", "ffn_down", "router", "dispatch"),
    "save_qkv_attn_out": ("out", "ffn_up", "ffn_down", "router", "dispatch"),
    "save_qkv_attn_mlp": ("out", "ffn_up", "router", "dispatch"),
}
assert set(RECOMPUTED) == set(REMAT_POLICIES), "models/config.py has a remat policy the time model does not price"


def _passes(lay: Layout, pieces: dict[str, float], recomputed: tuple[str, ...] | None = None,
            backward: float = 2.0) -> tuple[float, float]:
    """(useful, executed) amounts per token of one layer over forward, backward and recompute (FLOPs,
    or the work.py amounts); executed adds the pipeline's bubble slots, which the SPMD pipeline
    computes. `recomputed`: the pieces run again (default: the remat policy's RECOMPUTED);
    `backward`: the backward's cost in forwards (2 for a matmul: two matmuls of the same size).

    1F1B (sharding/pipeline.py) runs the forward once over M + S - 1 ticks, then per backward
    tick (M + 2S - 2 of them) the chunk's forward again, and its VJP (a forward, the policy's
    recompute, and the backward)."""
    forward = sum(pieces.values())
    again_names = RECOMPUTED[effective_policy(lay)] if recomputed is None else recomputed
    again = sum(v for k, v in pieces.items() if k in again_names)
    once = (1 + backward) * forward + again
    if lay.pp == 1:
        return once, once
    micro, repeats = lay.pipeline
    s = lay.pp
    if lay.cfg.parallelism.pipeline_schedule == "1f1b":
        return once + 2 * forward, forward * (micro + s - 1) / micro + (once + forward) * (micro + 2 * s - 2) / micro
    return once, once * (repeats * micro + s - 1) / (repeats * micro)


def _layers(lay: Layout, pieces_of: Callable[[bool], dict[str, float]],
            recomputed: tuple[str, ...] | None = None, backward: float = 2.0) -> tuple[float, float, float]:
    """(useful, executed, prefix) per device per step of per-token, per-layer forward amounts
    `pieces_of(moe)`: the (pipelined) layers' passes, and a MoE pipeline's dense prefix, run
    forward and backward on every stage."""
    t, m = lay.cfg.train, lay.model
    tokens = t.batch_size * t.seq_len / (lay.batch_shards * lay.cp)  # this device's tokens per step
    outside, dense, sparse = lay.layer_counts
    dense_pieces = pieces_of(False)
    dense_pass = _passes(lay, dense_pieces, recomputed, backward)
    moe_pass = _passes(lay, pieces_of(True), recomputed, backward) if m.is_moe else dense_pass
    useful = tokens * (dense * dense_pass[0] + sparse * moe_pass[0])
    executed = tokens * (dense * dense_pass[1] + sparse * moe_pass[1])
    return useful, executed, tokens * outside * sum(dense_pieces.values()) * (1 + backward)


@dataclasses.dataclass(frozen=True)
class Flops:
    executed: float  # per device per step, bubble slots included
    bubble: float  # of which bubble-slot work
    model: float  # per device per step, model FLOPs (MFU's numerator)
    layers: float  # the (pipelined) layers' useful work, executed minus head, prefix and bubble


def step_flops(lay: Layout) -> Flops:
    t, m = lay.cfg.train, lay.model
    useful, executed, prefix = _layers(lay, lambda moe: layer_flops(lay, moe))
    head = _head_flops(lay)
    model = t.batch_size * t.seq_len * flops_per_token(m, t.seq_len) / lay.devices
    return Flops(executed + prefix + head, executed - useful, model, useful)


def _head_flops(lay: Layout) -> float:
    """The unembedding's FLOPs per device per step: forward, backward (and a chunked loss's recomputed logits)."""
    t, m = lay.cfg.train, lay.model
    tokens = t.batch_size * t.seq_len / (lay.batch_shards * lay.cp)
    chunked = m.loss_chunk_size and m.loss_chunk_size < t.seq_len
    return tokens * 2 * m.vocab_size * m.d_model / lay.tp * (4 if chunked else 3)


# Pieces of layer_flops that are batched dots (attention's scores and weighted values, capacity
# dispatch and combine); the rest are weight matmuls.
BATCHED_PIECES = ("attention", "dispatch")


def step_work(lay: Layout) -> dict[str, tuple[float, float]]:
    """Per device per step, by kind (probes.KINDS): (executed, of which bubble-slot work). FLOPs
    for matmul (the layers' weight matmuls), head (the unembedding) and batched, bytes for
    elementwise (the pipeline's slot copies included), elements for softmax and loss
    (jaxinfra/plan/work.py). The FLOP kinds add up to step_flops' executed."""
    out = {}
    for kind, keep in (("matmul", False), ("batched", True)):
        useful, executed, prefix = _layers(lay, lambda moe, keep=keep: {
            k: v for k, v in layer_flops(lay, moe).items() if (k in BATCHED_PIECES) == keep})
        out[kind] = (executed + prefix, executed - useful)
    out["head"] = (_head_flops(lay), 0.0)  # the unembedding, at its own (wide) shape
    # Under any remat policy but none the backward runs the layer's elementwise work again (only
    # dots, or named tensors, are saved).
    again = () if effective_policy(lay) == "none" else work.ELEMENTWISE_PIECES
    useful, executed, prefix = _layers(lay, lambda moe: work.layer_elementwise(lay, moe), again)
    out["elementwise"] = (executed + prefix + work.pipeline_buffer_bytes(lay, pipeline_ticks(lay)), executed - useful)
    useful, executed, prefix = _layers(lay, lambda moe: work.layer_dispatch(lay, moe), again)
    out["dispatch"] = (executed + prefix, executed - useful)
    # The softmax's backward (p x (dy - sum(p dy))) costs about one forward here: no exponentials.
    useful, executed, prefix = _layers(lay, lambda moe: {"attention": work.layer_softmax(lay)}, backward=1.0)
    out["softmax"] = (executed + prefix, executed - useful)
    out["loss"] = (work.loss_elements(lay), 0.0)
    return out


# ---------------------------------------------------------------- communication


def collectives(lay: Layout, state: StateBytes) -> list[Collective]:
    found: list[Collective] = []
    for fn in COLLECTIVES:
        found += fn(lay, state)
    return [c for c in found if c.calls > 0 and c.size > 0]


def _recompute_sends(lay: Layout) -> int:
    """Forward all-reduces a policy runs again per layer (the out projection, the MLP down)."""
    return {"full": 2, "save_qkv_proj": 2, "save_qkv_attn_out": 2, "save_qkv_attn_mlp": 1}.get(
        effective_policy(lay), 0)


def _layer_calls(lay: Layout) -> float:
    """Layer calls per step on this device: layers x microbatches (x pipeline ticks)."""
    outside, dense, sparse = lay.layer_counts
    ticks = pipeline_ticks(lay)[0]
    return lay.cfg.train.grad_accum_steps * ((dense + sparse) * ticks / lay.pipeline[1] + outside)


def pipeline_ticks(lay: Layout) -> tuple[int, int]:
    """(forward, backward) ticks of one pass through the pipeline: gpipe and circular run R x M + S - 1
    each way (the backward is the forward scan transposed), 1F1B M + S - 1 forward and M + 2S - 2
    backward (sharding/pipeline.py); (1, 1) without a pipeline."""
    micro, repeats = lay.pipeline
    s = lay.pp
    if s == 1:
        return 1, 1
    if lay.cfg.parallelism.pipeline_schedule == "1f1b":
        return micro + s - 1, micro + 2 * s - 2
    return repeats * micro + s - 1, repeats * micro + s - 1


def layer_visits(lay: Layout, state: StateBytes, backward: bool) -> tuple[float, float]:
    """(calls, bytes per call) per step of per-layer weight traffic on this device: FSDP's gathers,
    the gradient reductions. Each layer (and the embedding and head, as one more) once per
    microbatch; in a pipeline the stage's chunk of layers once per tick, bubble ticks included: the
    partitioner reduces each backward tick's partial weight gradients into the accumulator, which is
    replicated over the batch axes (the compiled gpipe step all-reduces one layer's gradients per
    layer per backward tick). A MoE model's dense prefix is counted with the pipelined stacks."""
    outside, dense, sparse = lay.layer_counts
    repeats = lay.pipeline[1]
    ticks = pipeline_ticks(lay)[1 if backward else 0]
    calls = ticks * (dense + sparse) / repeats + outside + 1
    volume = ticks * state.layer_params / repeats + state.params - state.layer_params
    return lay.cfg.train.grad_accum_steps * calls, volume / calls


def fsdp_collectives(lay: Layout, state: StateBytes) -> list[Collective]:
    """ZeRO-3: every layer's weights all-gathered in the forward and again in the backward, every
    layer's gradients reduce-scattered, per microbatch (per tick in a pipeline)."""
    f = lay.sizes["fsdp"]
    if f == 1 or lay.cfg.parallelism.strategy != "fsdp":
        return []
    fwd_calls, fwd_size = layer_visits(lay, state, backward=False)
    bwd_calls, bwd_size = layer_visits(lay, state, backward=True)
    gathered = (fwd_calls * fwd_size + bwd_calls * bwd_size) / (fwd_calls + bwd_calls)
    grads = bwd_size * f * state.trained_share  # a frozen base (LoRA) has no gradients to reduce
    return [Collective("FSDP weight all-gather", "all_gather", ("fsdp",), gathered * f, fwd_calls + bwd_calls, True),
            Collective("FSDP gradient reduce-scatter", "reduce_scatter", ("fsdp",), grads, bwd_calls, True)]


def data_parallel_collectives(lay: Layout, state: StateBytes) -> list[Collective]:
    """Gradients reduced over the axes that replicate the params (per microbatch, per tick in a
    pipeline: they accumulate in the optimizer's sharding); ZeRO-1 reduce-scatters them and
    all-gathers the new params."""
    strategy = lay.cfg.parallelism.strategy
    axes = tuple(a for a in ("data", "fsdp") if lay.sizes[a] > 1 and not (a == "fsdp" and strategy == "fsdp"))
    out = []
    calls, size = layer_visits(lay, state, backward=True)
    size *= state.trained_share  # gradients of the trained params only (a frozen base has none)
    if axes:
        op = "reduce_scatter" if strategy == "zero1" else "all_reduce"
        out.append(Collective("gradient " + op.replace("_", "-"), op, axes, size, calls, True))
        if strategy == "zero1":
            out.append(Collective("ZeRO-1 param all-gather", "all_gather", axes, state.trained, 1, False))
    if lay.ep > 1:  # non-expert params are replicated over `expert` (it is a data axis for them)
        dense = 1 - _expert_bytes(lay) / state.params
        out.append(Collective("gradient all-reduce", "all_reduce", ("expert",), size * dense, calls, True))
    return out


def _expert_bytes(lay: Layout) -> float:
    m = lay.model
    if not m.is_moe:
        return 0.0
    fsdp = lay.sizes["fsdp"] if lay.cfg.parallelism.strategy == "fsdp" else 1
    experts = m.moe_layer_flags().count(True) * m.moe_num_experts * 3 * m.d_model * m.expert_dim
    return experts * lay.param_bytes / (lay.ep * lay.tp * fsdp * lay.pp)


def tensor_collectives(lay: Layout, state: StateBytes) -> list[Collective]:
    """Megatron: two all-reduces of the residual stream per layer forward, two backward (and the
    recomputed forward's); under sequence parallelism each is an all-gather + reduce-scatter pair
    of the same bytes. Plus the embedding lookup and the head's input gradient per microbatch."""
    if lay.tp == 1:
        return []
    stream = lay.tokens * lay.model.d_model * lay.compute_bytes
    per_layer = 4 + _recompute_sends(lay)
    what = "SP all-gather/reduce-scatter" if lay.residual_split > 1 else "TP all-reduce"
    head = 2 * lay.cfg.train.grad_accum_steps * lay.pipeline[0]
    return [Collective(what, "all_reduce", ("tensor",), stream, _layer_calls(lay) * per_layer + head, False)]


def context_collectives(lay: Layout, state: StateBytes) -> list[Collective]:
    """All-gather of K/V per layer (and the reduce-scatter of their gradients), or the ring's
    cp - 1 shifts of a K/V block per forward (and rematerialised forward), cp - 1 more in its
    custom VJP, which also passes the float32 dK/dV round the ring (sharding/ring.py)."""
    cp = lay.cp
    if cp == 1:
        return []
    m = lay.model
    width = lay.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) if m.is_mla else \
        2 * lay.kv_heads * m.resolved_head_dim
    block = lay.rows * lay.seq * width * lay.compute_bytes  # this device's K and V
    calls = _layer_calls(lay) * (2 + (1 if effective_policy(lay) in RECOMPUTE_ATTENTION else 0))
    if lay.cfg.parallelism.context_impl == "ring":
        grads = block * 4 // lay.compute_bytes  # dK/dV travel in float32
        return [Collective("ring K/V shift", "ppermute", ("context",), block, calls * (cp - 1), True),
                Collective("ring dK/dV shift", "ppermute", ("context",), grads, _layer_calls(lay) * cp, True)]
    return [Collective("K/V all-gather", "all_gather", ("context",), block * cp, calls, False)]


RECOMPUTE_ATTENTION = ("full", "save_dots_no_batch", "save_qkv_proj")


def expert_collectives(lay: Layout, state: StateBytes) -> list[Collective]:
    """Two all-to-alls per MoE layer forward (tokens out, results back), two backward, and the
    recomputed forward's: capacity slots [rows, E x C, d], or the dropless path's routed rows."""
    m = lay.model
    if lay.ep == 1 or not m.is_moe:
        return []
    _, dense, sparse = lay.layer_counts
    calls = _layer_calls(lay) * sparse / max(dense + sparse, 1) * 2 * (2 + (1 if m.remat_policy != "none" else 0))
    if m.moe_dispatch == "capacity":
        size = lay.rows * capacity_slots(lay) * m.d_model * lay.compute_bytes
    else:  # XLA:CPU emulates the ragged exchange with a padded all_to_all (sharding/expert.py)
        size = lay.tokens * m.moe_top_k * m.d_model * lay.compute_bytes * (lay.ep if lay.backend == "cpu" else 1)
    return [Collective("expert all-to-all", "all_to_all", ("expert",), size, calls, False)]


def pipeline_collectives(lay: Layout, state: StateBytes) -> list[Collective]:
    """Per tick, microbatch slots moved between stages and the last stage's output (its cotangent
    in the backward) picked out of the stage-sharded buffer, an all-reduce of one slot over
    `stage`. The compiled steps move a slot twice per forward tick (the ring shift, the last
    stage's output to the first) and three times per backward tick (gpipe: the transposed shift
    and pick; 1F1B: its two shifts and the pick) (tests/test_plan.py counts them in the HLO)."""
    if lay.pp == 1:
        return []
    slot = lay.tokens * lay.model.d_model * lay.compute_bytes
    forward, backward = pipeline_ticks(lay)
    accum = lay.cfg.train.grad_accum_steps
    return [Collective("pipeline send", "ppermute", ("stage",), slot, (2 * forward + 3 * backward) * accum, False),
            Collective("pipeline output all-reduce", "all_reduce", ("stage",), slot, (forward + backward) * accum,
                       False)]


COLLECTIVES = [fsdp_collectives, data_parallel_collectives, tensor_collectives, context_collectives,
               expert_collectives, pipeline_collectives]


# ---------------------------------------------------------------- the step


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float  # useful work (with recompute), bubble excluded
    bubble_s: float
    collectives: tuple[Collective, ...]
    step_s: float
    bottleneck: str
    flops: Flops
    peak: float  # per-device peak MFU divides by
    update_s: float = 0.0  # the optimizer update, memory-bound
    accumulate_s: float = 0.0  # gradient sums over pipeline ticks and accumulation microbatches, memory-bound
    compute_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)  # compute_s split by kind

    @property
    def exposed_s(self) -> float:
        return sum(c.seconds for c in self.collectives if not c.overlapped)

    @property
    def overlapped_s(self) -> float:
        return sum(c.seconds for c in self.collectives if c.overlapped)


def price(c: Collective, lay: Layout, spec: DeviceSpec, measured: Measured | None) -> Collective:
    """Seconds per step of a collective on its axes' slowest link (or a measured one)."""
    n = math.prod(lay.sizes[a] for a in c.axes)
    links = [_link(lay, spec, axis, c.op, measured) for axis in c.axes]
    slowest = min(links, key=lambda link: link.bandwidth)
    return dataclasses.replace(c, seconds=c.calls * collective_seconds(c.op, c.size, n, slowest))


def _link(lay: Layout, spec: DeviceSpec, axis: str, op: str, measured: Measured | None) -> Link:
    if measured and (axis, op) in measured:
        return measured[axis, op]
    dcn = lay.cfg.mesh.dcn_sizes()
    return LINKS[axis_link(axis, lay.sizes, dcn, spec.domain, spec.fast_link, spec.slow_link)]


# Bytes one gradient sum moves per byte of the gradients added: read the sum and the new
# gradients, write the sum.
ACCUMULATE_TRAFFIC = 3


def accumulate_bytes(lay: Layout, state: StateBytes) -> float:
    """Memory traffic per step of gradient sums outside the backward's own work: a pipeline adds
    each backward tick's chunk gradients into the stage's accumulator (bubble ticks too), and
    gradient accumulation adds each microbatch's gradients into the optimizer-sharded sum."""
    accum = lay.cfg.train.grad_accum_steps
    piped = pipeline_ticks(lay)[1] * state.layer_params / lay.pipeline[1] if lay.pp > 1 else 0.0
    summed = state.opt_params if accum > 1 else 0.0
    return ACCUMULATE_TRAFFIC * accum * (piped + summed)


# Passes over the residuals a scanned layer saves for its backward: the stacked [layers, ...]
# buffers zero-filled once a step (`wrapped_broadcast`), each layer's slice written in by a
# dynamic-update-slice (read and written), and read back in the backward.
RESIDUAL_PASSES = 4


def residual_stack_bytes(lay: Layout) -> float:
    """Memory traffic per step on this device of the scan's stacked residuals (model.scan_layers):
    what each layer keeps under the remat policy (activations.saved_per_layer, the memory model's
    figure), per layer call. Large buffers: priced at the memory bandwidth probe's rate."""
    if not lay.model.scan_layers:
        return 0.0
    _, dense, sparse = lay.layer_counts
    if dense + sparse == 0:
        return 0.0
    kept = (dense * saved_per_layer(lay, False) + sparse * saved_per_layer(lay, True)) / (dense + sparse)
    return RESIDUAL_PASSES * kept * _layer_calls(lay)


# Bytes the optimizer step moves per byte of one params-shaped tree in the optimizer's sharding:
# AdamW reads params, gradients and both moments and writes params and moments (7), the gradient
# norm and the NaN guard's all-finite check read the gradients and new params once more (2), and
# the clip scales the gradients (1).
UPDATE_TRAFFIC = 10


def step_time(lay: Layout, state: StateBytes, spec: DeviceSpec, measured: Measured | None = None) -> StepTime:
    flops = step_flops(lay)
    amounts = step_work(lay)
    dtype = lay.model.dtype
    by_kind = {kind: (executed - bubble) / spec.rate(kind, dtype) for kind, (executed, bubble) in amounts.items()}
    bubble = sum(b / spec.rate(kind, dtype) for kind, (_, b) in amounts.items())
    if spec.rates:  # measured: the scan's residual stacks too (datasheet efficiencies already hold them)
        by_kind["residuals"] = residual_stack_bytes(lay) / spec.memory_bandwidth
    compute = sum(by_kind.values())
    update = UPDATE_TRAFFIC * state.opt_params / spec.memory_bandwidth
    accumulate = accumulate_bytes(lay, state) / spec.memory_bandwidth
    priced = tuple(price(c, lay, spec, measured) for c in collectives(lay, state))
    overlapped = sum(c.seconds for c in priced if c.overlapped)
    exposed = sum(c.seconds for c in priced if not c.overlapped)
    if spec.platform == "cpu":  # fake devices: collectives are memcpys on the same cores as the compute
        step = compute + bubble + overlapped + exposed + update + accumulate
    else:
        step = max(compute + bubble, overlapped) + exposed + update + accumulate
    return StepTime(compute, bubble, priced, step, _bottleneck(compute, bubble, update, accumulate, priced, spec),
                    flops, spec.peak(dtype), update, accumulate, by_kind)


def _bottleneck(compute: float, bubble: float, update: float, accumulate: float, priced: tuple[Collective, ...],
                spec: DeviceSpec) -> str:
    """The largest share of the step: compute, the bubble, the optimizer update, the gradient sums, one exposed
    collective, or the overlapped collectives when they outlast the compute they hide under (named
    by the largest)."""
    cpu = spec.platform == "cpu"
    candidates = {"compute": compute, "pipeline bubble": bubble, "optimizer update (memory bandwidth)": update,
                  "gradient accumulation (memory bandwidth)": accumulate}
    for c in priced:
        if cpu or not c.overlapped:
            candidates[c.label] = candidates.get(c.label, 0.0) + c.seconds
    hidden = [c for c in priced if c.overlapped and not cpu]
    excess = sum(c.seconds for c in hidden) - (compute + bubble)
    if hidden and excess > 0:
        largest = max(hidden, key=lambda c: c.seconds)
        candidates[largest.label] = candidates.get(largest.label, 0.0) + compute + bubble + excess
    return max(candidates, key=candidates.get)

