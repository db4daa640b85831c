"""Rooflines: when a piece of work is bound by compute, by memory bandwidth or by a link.

    time >= max(FLOPs / peak, bytes / bandwidth)          the roofline
    intensity = FLOPs / bytes,  ridge = peak / bandwidth   compute-bound iff intensity > ridge

Within a chip the bytes are HBM traffic and the ridge is the device table's peak over its memory
bandwidth (jaxinfra/plan/devices.py). Between chips the bytes are what a collective sends over a
link (jaxinfra/plan/links.py: S x f for nccl-tests' bus factor f) and the ridge is the FLOP/s the
step's compute runs at (peak x efficiency, as jaxinfra/plan/time.py prices compute) over the link's
bandwidth. The two communication rooflines below are the plan's own pricing (time.py:
`fsdp_collectives`, `tensor_collectives`, `step_flops`) summed over one step of a layout without a
pipeline or gradient accumulation, so their crossovers are where `jaxinfra plan` changes its
bottleneck:

    FSDP    comm = 3 (n-1)/n P b / W + 3 (L+1) latency          (2 all-gathers + 1 reduce-scatter of
            compute = tokens x FLOPs per token / (peak x eff)    the P parameters of b bytes each)
            compute-bound iff tokens per device > comm x (peak x eff) / FLOPs per token
    tensor  bytes per token = (a L + 2) x d x s x 2(n-1)/n       (a = 4 all-reduces of the residual
            compute-bound iff FLOPs per token / bytes per token    stream per layer, + 1 per recomputed
                              > (peak x eff) / W                   out or down projection; s bytes per
                                                                   value; 2 for embedding and head)
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfra.metrics.flops import param_counts
from jaxinfra.plan.activations import effective_policy
from jaxinfra.plan.devices import DeviceSpec
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.links import LINKS, Link, axis_link, bus_factor
from jaxinfra.plan.time import RECOMPUTED, step_flops


def ridge_point(flops_per_s: float, bytes_per_s: float) -> float:
    """FLOPs per byte at which compute time equals transfer time."""
    return flops_per_s / bytes_per_s


def device_ridge(spec: DeviceSpec, dtype: str = "bfloat16") -> float:
    """The HBM ridge of a device kind: dense peak over memory bandwidth (the device table's)."""
    return ridge_point(spec.peak(dtype), spec.memory_bandwidth)


def roofline_seconds(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    """The roofline's lower bound on the time of work that can overlap its compute and its transfers."""
    return max(flops / flops_per_s, nbytes / bytes_per_s)


def matmul_intensity(b: int, d: int, f: int, item_bytes: int = 2) -> float:
    """[b, d] x [d, f] -> [b, f]: 2 b d f FLOPs over reading both inputs and writing the output once."""
    return 2 * b * d * f / (item_bytes * (b * d + d * f + b * f))


def matmul_critical_batch(d: int, f: int, ridge: float, item_bytes: int = 2) -> float:
    """The b at which `matmul_intensity(b, d, f)` equals `ridge` (inf when no b reaches it); about
    ridge x item_bytes / 2 when that is small against d and f."""
    denominator = 2 * d * f - ridge * item_bytes * (d + f)
    return ridge * item_bytes * d * f / denominator if denominator > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class LinkRoofline:
    """One step's compute against one parallelism's traffic on its link, per device."""

    what: str
    link: Link
    flops: float  # executed FLOPs per step
    throughput: float  # FLOP/s the compute runs at (peak x efficiency, shared on CPU)
    link_bytes: float  # bytes per step over the link: the collectives' sizes x bus factors
    calls: float  # collectives per step (each pays the link's latency)

    @property
    def compute_s(self) -> float:
        return self.flops / self.throughput

    @property
    def comm_s(self) -> float:
        return self.link_bytes / self.link.bandwidth + self.calls * self.link.latency

    @property
    def intensity(self) -> float:
        """FLOPs computed per byte sent over the link."""
        return self.flops / self.link_bytes

    @property
    def ridge(self) -> float:
        """The link's ridge: the intensity above which the compute outlasts the transfers (latency aside)."""
        return ridge_point(self.throughput, self.link.bandwidth)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.comm_s else "communication"


def _check(lay: Layout, axis: str) -> None:
    if lay.sizes[axis] == 1:
        raise ValueError(f"the layout has no {axis} axis (mesh.{axis}=1)")
    if lay.pp > 1 or lay.cfg.train.grad_accum_steps > 1:
        raise ValueError("the link rooflines cover layouts without a pipeline or gradient accumulation")


def link_of(lay: Layout, spec: DeviceSpec, axis: str) -> Link:
    """The link a mesh axis's collectives use (the plan's rule, jaxinfra/plan/links.py: axis_link)."""
    name = axis_link(axis, lay.sizes, lay.cfg.mesh.dcn_sizes(), spec.domain, spec.fast_link, spec.slow_link)
    return LINKS[name]


def tokens_per_device(lay: Layout) -> float:
    t = lay.cfg.train
    return t.batch_size * t.seq_len / (lay.batch_shards * lay.cp)


def fsdp_roofline(lay: Layout, spec: DeviceSpec) -> LinkRoofline:
    """ZeRO-3 over `fsdp`: all the params gathered in the forward and again in the backward, their
    gradients reduce-scattered, each layer (and the embedding and head, as one more) once a step."""
    _check(lay, "fsdp")
    n, m = lay.sizes["fsdp"], lay.model
    params = param_counts(m)["total"] * lay.param_bytes / lay.tp  # what the fsdp axis gathers
    moved = 3 * bus_factor("all_gather", n) * params
    calls = 3 * (m.num_layers + 1)
    return LinkRoofline("FSDP gathers and reduce-scatters", link_of(lay, spec, "fsdp"), step_flops(lay).executed,
                        spec.throughput(m.dtype), moved, calls)


def fsdp_crossover_tokens(lay: Layout, spec: DeviceSpec) -> float:
    """Tokens per device at which FSDP's traffic takes as long as the compute it hides under: the
    compute grows with the tokens, the traffic does not (the weights are the same whatever the batch)."""
    r = fsdp_roofline(lay, spec)
    return tokens_per_device(lay) * r.comm_s / r.compute_s


def tensor_all_reduces_per_layer(lay: Layout) -> int:
    """Residual-stream all-reduces per layer a step: 2 forward (after the out and down projections),
    2 backward (the input gradients of qkv and the MLP's up), and one more for each of the two
    row-parallel projections the remat policy runs again."""
    again = RECOMPUTED[effective_policy(lay)]
    return 4 + ("out" in again) + ("ffn_down" in again)


def tensor_roofline(lay: Layout, spec: DeviceSpec) -> LinkRoofline:
    """Megatron over `tensor`: all-reduces of [tokens, d_model] activations (exposed: the next matmul
    needs them) against the step's compute, of which each device does 1/tensor."""
    _check(lay, "tensor")
    n, m = lay.tp, lay.model
    calls = tensor_all_reduces_per_layer(lay) * m.num_layers + 2
    stream = tokens_per_device(lay) * m.d_model * lay.compute_bytes
    moved = calls * stream * bus_factor("all_reduce", n)
    return LinkRoofline("tensor-parallel all-reduces", link_of(lay, spec, "tensor"), step_flops(lay).executed,
                        spec.throughput(m.dtype), moved, calls)


def tensor_crossover_mlp_dim(lay: Layout, spec: DeviceSpec) -> float:
    """The MLP width (model.mlp_dim) at which the tensor all-reduces take as long as the compute: the
    compute grows linearly with the width, the all-reduces (of d_model-wide activations) do not."""
    r = tensor_roofline(lay, spec)
    width = lay.model.mlp_dim
    wider = lay.with_config(dataclasses.replace(lay.cfg, model=dataclasses.replace(lay.model, mlp_dim=2 * width)))
    per_width = (tensor_roofline(wider, spec).compute_s - r.compute_s) / width
    return width + (r.comm_s - r.compute_s) / per_width
