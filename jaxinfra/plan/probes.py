"""Per-kind rates from short probes at the step's own shapes, cached per machine.

    kind         probe (per device, jitted, on this process's devices at once)         rate unit
    matmul       [tokens, d] x [d, mlp] in the model dtype, float32 accumulation          FLOP/s
    head         the unembedding, [tokens, d] x [d, vocab], likewise                     FLOP/s
    batched      attention's [rows x heads, seq, dh] x [rows x heads, dh, keys]           FLOP/s
    elementwise  an RMSNorm + residual add over [tokens, d] float32                      bytes/s (read + written)
    dispatch     the same over MoE capacity routing's [tokens, E x C] (capacity MoE only) bytes/s
    softmax      softmax over [rows x heads, seq, keys] float32                          elements/s
    loss         logsumexp cross-entropy and its gradient over [tokens, vocab] float32   elements/s

Shapes are the layout's per-device shapes (jaxinfra/plan/layout.py), capped so that one probe
call stays under ~0.1 s here. N planned fake devices share the host: the probe runs the
per-device shape on min(N, this process's devices) devices at once and the host's rate is
divided among the N. A bf16 model's dots are probed as bf16 x bf16 -> float32 dots (the dtype's
real peak on this machine). Results are cached in `$XDG_CACHE_HOME/jaxinfra/plan-probes.json`
(`~/.cache/...`), keyed by machine (host name, CPU model, cores), jax version, device kind,
probe devices, kind, shape and dtype, so another machine or jax re-measures; `jaxinfra plan
--no-probe-cache` re-measures and rewrites its entries. Only this machine's own kind is probed:
a plan for GPUs or TPUs from here keeps the datasheet (devices.DeviceSpec.rate).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxinfra.atomic import atomic_write_text
from jaxinfra.plan.layout import Layout

KINDS = ("matmul", "head", "batched", "elementwise", "dispatch", "softmax", "loss")
DOTS = ("matmul", "head", "batched")  # FLOP kinds, probed in the model dtype
MAX_ELEMENTS = 2**24  # per probe array: 64 MiB of float32
MAX_FLOPS = 8e9  # per dot of a probe step (two dots chained)


def probe_shapes(lay: Layout) -> dict[str, tuple[int, ...]]:
    """Per-device shapes of each kind's probe in this layout's step (leading dimension capped)."""
    m = lay.model
    d, tokens, batch = m.d_model, lay.tokens, lay.rows * lay.heads
    dh = m.qk_nope_head_dim + m.qk_rope_head_dim if m.is_mla else m.resolved_head_dim
    loss_tokens = lay.accum_rows * lay.seq
    shapes = {"matmul": (tokens, d, lay.mlp), "head": (loss_tokens, d, lay.vocab),
              "batched": (batch, lay.seq, lay.kv_seq, dh),
              "elementwise": (tokens, d), "softmax": (batch, lay.seq, lay.kv_seq),
              "loss": (loss_tokens, lay.vocab)}
    # Per row of the leading dimension: the largest array's elements, and the FLOPs.
    row = {"matmul": max(d, lay.mlp), "head": max(d, lay.vocab),
           "batched": max(lay.seq, lay.kv_seq) * max(dh, lay.kv_seq),
           "elementwise": d, "softmax": lay.seq * lay.kv_seq, "loss": lay.vocab}
    flops = {"matmul": 2 * d * lay.mlp, "head": 2 * d * lay.vocab, "batched": 2 * lay.seq * lay.kv_seq * dh}
    if m.is_moe and m.moe_dispatch == "capacity":
        from jaxinfra.plan.activations import capacity_slots

        slots = int(capacity_slots(lay))
        shapes["dispatch"], row["dispatch"] = (tokens, slots), slots
    out = {}
    for kind, shape in shapes.items():
        lead = min(shape[0], max(1, MAX_ELEMENTS // row[kind]))
        if kind in flops:
            lead = min(lead, max(1, int(MAX_FLOPS // flops[kind])))
        out[kind] = (lead, *shape[1:])
    return out


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclasses.dataclass
class Probe:
    kind: str
    shape: tuple[int, ...]
    work: float  # per device per call, in the kind's unit
    run: Callable[[], Any]  # one call on all probe devices, blocking

    def seconds(self) -> float:
        start = time.perf_counter()
        self.run()
        return time.perf_counter() - start


# Work of one probe call summed over its devices, by unit: the op is chained in a loop inside one
# program (as in the step: no dispatch between ops) until a call is ~10-50 ms here.
CALL_WORK = {"flops": 4e9, "bytes": 4e8, "elements": 3e7}


def _body(kind: str, shape: tuple[int, ...], low: Any) -> tuple[Callable, list, float, str]:
    """(carry -> carry step given the constants, [(shape, dtype, fill)] of carry then constants,
    work of one step, its unit). The dots chain the step's pair (up then down projection; the
    unembedding and its input gradient; attention's scores then weighted values) with constant
    weights that keep the values bounded."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    if kind in ("matmul", "head"):
        t, d, f = shape

        def step(x, w1, w2):
            h = jnp.dot(x, w1, preferred_element_type=f32).astype(low)
            return jnp.dot(h, w2, preferred_element_type=f32).astype(low)
        return step, [((t, d), low, 0.5), ((d, f), low, 1 / d), ((f, d), low, 1 / f)], 4.0 * t * d * f, "flops"
    if kind == "batched":
        b, s, k, dh = shape

        def step(q, kk, v):
            scores = jnp.einsum("bqd,bkd->bqk", q, kk, preferred_element_type=f32).astype(low)
            return jnp.einsum("bqk,bkd->bqd", scores, v, preferred_element_type=f32).astype(low)
        return step, [((b, s, dh), low, 0.5), ((b, k, dh), low, 1 / dh), ((b, k, dh), low, 1 / k)], \
            4.0 * b * s * k * dh, "flops"
    if kind in ("elementwise", "dispatch"):
        t, d = shape
        step = lambda x, r: r + x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
        return step, [((t, d), f32, 0.5), ((t, d), f32, 0.5)], 3.0 * t * d * 4, "bytes"
    if kind == "softmax":
        return (lambda x: jax.nn.softmax(x, axis=-1)), [(shape, f32, 0.5)], float(_prod(shape)), "elements"
    if kind == "loss":
        step = jax.grad(lambda x: jnp.sum(jax.nn.logsumexp(x, -1) - x[..., 0]))
        return step, [(shape, f32, 0.5)], float(_prod(shape)), "elements"
    raise ValueError(f"unknown probe kind {kind!r}: one of {KINDS}")


def build(kind: str, shape: tuple[int, ...], dtype: str, devices: list) -> Probe:
    """A compiled, warmed-up probe of `kind` at the per-device `shape`, on `devices` at once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n, spec = len(devices), PartitionSpec("p")
    mesh = Mesh(np.array(devices), ("p",))
    step, arrays, work, unit = _body(kind, shape, jnp.dtype(dtype))
    repeats = max(1, math.ceil(CALL_WORK[unit] / (n * work)))
    args = [jax.jit(lambda dims=dims, dt=dt, fill=fill: jnp.full((n, *dims), fill, dt),
                    out_shardings=NamedSharding(mesh, spec))() for dims, dt, fill in arrays]

    def meet(x):
        """The devices meet once per step of the chain, as the train step's devices do at its
        per-layer collectives: on a shared host a descheduled device holds up the others there,
        which free-running probes would not see. One scalar psum written into the carry."""
        if n == 1 or kind not in DOTS:  # a layer's pair of dots per step; elementwise ops come 10 to a layer
            return x
        corner = (0,) * x.ndim
        return x.at[corner].set((jax.lax.psum(x[corner].astype(jnp.float32), "p") / n).astype(x.dtype))

    def local(carry, *consts):  # each device on its own shard (shard_map: no partitioner in between)
        out = jax.lax.fori_loop(0, repeats, lambda i, x: meet(step(x, *(c[0] for c in consts))), carry[0])
        return out[None]

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec))
    jax.block_until_ready(run(*args))  # compile and a first run
    return Probe(kind, shape, work * repeats, lambda: jax.block_until_ready(run(*args)))


def measure(probe: Probe, budget_s: float = 0.3, least: int = 3) -> float:
    """The probe's per-device rate (its unit per second): the median of at least `least` calls,
    more while under `budget_s`."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget_s and len(times) < 15):
        times.append(probe.seconds())
    times.sort()
    return probe.work / times[len(times) // 2]


def peak_flops(device: Any, dtype: str) -> float:
    """The CPU's matmul peak for `dtype` (MFU's denominator): float32 is metrics.peak's 2048^3 probe;
    bfloat16 a 2048^3 bf16 x bf16 -> float32 dot, the form the model's bf16 matmuls take (a bf16-out
    dot up-converts on XLA:CPU and runs at the float32 rate)."""
    from jaxinfra.metrics.peak import peak_flops_per_device

    if dtype != "bfloat16":
        return peak_flops_per_device(device, dtype)[0]
    if dtype not in _PEAKS:
        _PEAKS[dtype] = measure(build("matmul", (2048, 2048, 2048), dtype, [device]), least=5)
    return _PEAKS[dtype]


_PEAKS: dict[str, float] = {}  # once per process, as metrics.peak's probe


def probe_dtype(kind: str, dtype: str) -> str:
    """The dtype a kind's probe runs in: the model's for the dots, float32 for the rest (norms,
    softmax and the loss compute in float32 whatever the model dtype)."""
    return dtype if kind in DOTS else "float32"


def build_all(lay: Layout, devices: list) -> list[Probe]:
    """Every kind's probe at this layout's shapes, on `devices` (benchmarks/plan.py samples them)."""
    return [build(kind, shape, probe_dtype(kind, lay.model.dtype), devices)
            for kind, shape in probe_shapes(lay).items()]


def default_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfra", "plan-probes.json")


def machine() -> str:
    """This host, as the cache keys it: name, CPU model, cores."""
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{platform.node()}|{model}|{os.cpu_count()} cores"


def cache_key(kind: str, shape: tuple[int, ...], dtype: str, devices: list) -> str:
    import jax

    d = devices[0]
    return json.dumps([machine(), f"jax {jax.__version__}", d.platform, d.device_kind, len(devices), kind,
                       list(shape), dtype])


def read_cache(path: str) -> dict[str, float]:
    """The cached rates; a missing file is empty, an unreadable one is empty with a warning."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
            raise ValueError("not an object of rates")
        return data
    except (OSError, ValueError) as e:
        print(f"jaxinfra: warning: the probe cache {path} is unreadable ({e}); re-measuring", file=sys.stderr)
        return {}


def rates(lay: Layout, devices: list, count: int, *, use_cache: bool = True, path: str | None = None,
          measure_fn: Callable[[str, tuple[int, ...], str, list], float] | None = None) -> dict[str, float]:
    """Per-device rates ("kind:dtype" -> rate, DeviceSpec.rates) of `count` planned devices of this
    machine's kind, probed on min(count, len(devices)) of `devices` (cached unless `use_cache` is off:
    then measured again and written over)."""
    path = path or default_path()
    measure_fn = measure_fn or (lambda kind, shape, dtype, devs: measure(build(kind, shape, dtype, devs)))
    probing = list(devices[:max(1, min(count, len(devices)))])
    dtype = lay.model.dtype
    cache = read_cache(path)  # kept whole: other shapes' and machines' entries are written back
    out, changed = {}, False
    for kind, shape in probe_shapes(lay).items():
        key = cache_key(kind, shape, probe_dtype(kind, dtype), probing)
        if not use_cache or key not in cache:
            cache[key] = measure_fn(kind, shape, probe_dtype(kind, dtype), probing)
            changed = True
        out[f"{kind}:{dtype}"] = cache[key] * len(probing) / count  # the host's rate shared by the planned devices
    if changed:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_write_text(path, json.dumps(cache, indent=1, sort_keys=True), replace=True)
    return out
