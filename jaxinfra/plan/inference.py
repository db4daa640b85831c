"""`jaxinfra plan --inference`: memory and decode speed of `jaxinfra generate` for a config.

The geometry is train.batch_size rows with a cache of train.seq_len positions (prompt + new
tokens), laid out as models/cache.py stores it: per layer k and v [batch, kv_heads, length,
head_dim] (MLA: the latent and the rope key), the batch split like the activations and KV heads
over `tensor` (logical axes, sharding/rules.py). Memory: the params as trained, the cache, and
the prefill's transient (float32 logits for the prompt, one layer's forward activations).

A decode step reads every parameter and the whole cache once and does 2 FLOPs per matmul
parameter per row: step = max(bytes / memory bandwidth, FLOPs / (peak x efficiency)).
"""

from __future__ import annotations

from jaxinfra.metrics.flops import param_counts
from jaxinfra.plan import activations as act
from jaxinfra.plan.devices import DeviceSpec
from jaxinfra.plan.layout import F32_BYTES, Layout
from jaxinfra.plan.memory import Component, Fn, StateBytes, kv_cache_bytes, params
from jaxinfra.plan.time import Flops, StepTime


def cache_bytes(lay: Layout) -> float:
    """Per-device bytes of the decode cache for train.batch_size rows x train.seq_len positions."""
    return kv_cache_bytes(lay, lay.cfg.train.batch_size, lay.cfg.train.seq_len)


def kv_cache_component(lay: Layout, state: StateBytes) -> Component:
    t, q = lay.cfg.train, lay.cfg.quant
    return Component("kv cache", cache_bytes(lay), "resident", f"{t.batch_size} rows x {t.seq_len} positions"
                     + (", int8 + scales" if q.kv_cache == "int8" else ""))


def prefill(lay: Layout, state: StateBytes) -> Component:
    """The prompt's float32 logits and one layer's forward peak: the attention scores and
    probabilities (XLA attention; none with a flash kernel) or the feed-forward's gate, up and
    hidden, whichever is larger."""
    logits = lay.cfg.train.batch_size / lay.batch_shards * lay.seq * lay.vocab * F32_BYTES

    def peak(moe: bool) -> float:
        tensors = act.layer_tensors(lay, moe)
        scores = sum(2 * t.bytes for t in tensors if t.what == "scores")
        ffn = sum(t.bytes for t in tensors if t.block == "ffn" and (t.kind is not None or t.name == "mlp_hidden"))
        return max(scores, ffn)

    layer = max(peak(moe) for moe in {False, lay.model.is_moe})
    return Component("prefill", logits + layer, "head", "prompt logits + one layer's forward peak")


INFERENCE_COMPONENTS: list[Fn] = [params, kv_cache_component, prefill]


def decode_time(lay: Layout, state: StateBytes, spec: DeviceSpec) -> StepTime:
    """One decode step (a token for every row) on one device of the layout."""
    read = (state.params + cache_bytes(lay)) / spec.memory_bandwidth
    flops = 2 * param_counts(lay.model)["matmul"] * lay.cfg.train.batch_size / lay.devices
    compute = flops / spec.throughput(lay.model.dtype)
    bound = "memory bandwidth (params + cache read per token)" if read >= compute else "compute"
    return StepTime(compute, 0.0, (), max(read, compute), bound, Flops(flops, 0.0, flops, flops),
                    spec.peak(lay.model.dtype))
