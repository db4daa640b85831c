"""`jaxinfra plan --search`: every layout of the devices that fits, ranked by predicted step time.

Enumerated: mesh factorisations of the device count over (data, stage, fsdp, expert, context,
tensor) x strategy (dp, zero1, fsdp) x remat policy x gradient-accumulation microbatches (1 to 32), and
with stage > 1 the pipeline schedule (gpipe, 1f1b, circular with 2 repeats) and its
microbatches. A candidate is kept when the config validation accepts it (Layout.of, the same
checks as `jaxinfra train`) and its analytic memory fits the device. Pruned: dp and zero1 only
with fsdp = 1 (there the fsdp axis is just more data parallelism), expert only for MoE models,
tensor and context within one fast-link domain (an NVLink node, a slice), stage up to 16.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

from jaxinfra.config import Config, ConfigError, validate
from jaxinfra.plan.devices import DeviceSpec
from jaxinfra.plan.estimate import Plan, plan_layout
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.links import Measured
from jaxinfra.plan.memory import estimate
from sharding.mesh import MESH_AXES, MeshConfig

REMAT = ("none", "save_dots_no_batch", "save_dots", "full")
SCHEDULES = ("gpipe", "1f1b", "circular")
ACCUMULATION = (1, 2, 4, 8, 16, 32)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cfg: Config, devices: int, domain: int) -> Iterator[dict[str, int]]:
    """Per-slice (ICI) axis sizes whose product is the devices per slice (the config's DCN slice
    counts are kept)."""
    slices = math.prod(cfg.mesh.dcn_sizes().values())
    if devices % slices:
        return
    per_slice = devices // slices
    m = cfg.model
    limits = {"tensor": min(domain, 8), "context": min(domain, 8), "stage": 16,
              "expert": m.moe_num_experts if m.is_moe else 1}
    options = [[d for d in divisors(per_slice) if d <= limits.get(axis, per_slice)] for axis in MESH_AXES[1:]]
    for sizes in itertools.product(*options):
        used = math.prod(sizes)
        if per_slice % used == 0:
            yield {"data": per_slice // used, **dict(zip(MESH_AXES[1:], sizes))}


def variants(cfg: Config, sizes: dict[str, int]) -> Iterator[Config]:
    """Configs for one mesh: strategies x remat x accumulation (x pipeline settings)."""
    fsdp = sizes["fsdp"] * cfg.mesh.dcn_fsdp
    strategies = ("fsdp",) if fsdp > 1 else ("dp", "zero1")
    models = [dataclasses.replace(cfg.model, remat_policy=r) for r in dict.fromkeys((*REMAT, cfg.model.remat_policy))]
    trains = [dataclasses.replace(cfg.train, grad_accum_steps=a) for a in ACCUMULATION if cfg.train.batch_size % a == 0]
    pipelines = [(cfg.parallelism.pipeline_schedule, cfg.parallelism.microbatches, cfg.parallelism.pipeline_repeats)]
    if sizes["stage"] > 1:
        s = sizes["stage"]
        pipelines = [(sch, mb, 2 if sch == "circular" else 1) for sch in SCHEDULES for mb in (s, 2 * s)]
    parallel = [dataclasses.replace(cfg.parallelism, strategy=st, pipeline_schedule=sch, microbatches=mb,
                                    pipeline_repeats=rep) for st in strategies for sch, mb, rep in pipelines]
    mesh = MeshConfig(**sizes, **{f"dcn_{a}": v for a, v in cfg.mesh.dcn_sizes().items()})
    for p, model, train in itertools.product(parallel, models, trains):
        yield dataclasses.replace(cfg, mesh=mesh, model=model, train=train, parallelism=p)


@dataclasses.dataclass
class Rejections:
    """Why `search` kept nothing: so an empty result names the real cause (a size that divides nothing is
    not a memory problem)."""

    invalid: dict[str, str] = dataclasses.field(default_factory=dict)  # mesh -> its first validation refusal
    too_big: int = 0  # layouts the validation accepted whose memory does not fit
    meshes: int = 0

    def explain(self, devices: int, kind: str, memory: str) -> str:
        """The one line for an empty search."""
        if self.too_big:
            return (f"no layout of {devices} {kind} devices fits {memory} per device (mesh x strategy x remat x "
                    f"accumulation searched); use more devices, a smaller batch or model.loss_chunk_size")
        if not self.meshes:
            return f"no mesh of {devices} devices: the count does not divide by the config's DCN slices (mesh.dcn_*)"
        reasons = "; ".join(dict.fromkeys(self.invalid.values()))  # distinct, in the order found
        return (f"no layout of {devices} {kind} devices passes the config validation (memory was never the "
                f"limit): {reasons}; choose a device count these sizes divide, or change them")


def search(cfg: Config, devices: int, spec: DeviceSpec, measured: Measured | None = None,
           rejected: Rejections | None = None) -> list[Plan]:
    """Every accepted layout that fits, fastest first (ties: fewer mesh axes, then less memory);
    `rejected` (when given) collects why the others were dropped."""
    validate(cfg)  # the rest of the config once; each candidate then gets the layout checks
    found, rejected = [], rejected if rejected is not None else Rejections()
    for sizes in meshes(cfg, devices, spec.domain):
        rejected.meshes += 1
        for candidate in variants(cfg, sizes):
            try:
                lay = Layout.of(candidate, devices, spec.platform, base_checked=True, target=spec.kernel_target)
            except ConfigError as e:
                rejected.invalid.setdefault(str(sizes), str(e))
                continue
            memory = estimate(lay)
            if memory.total <= spec.memory_bytes:  # price only what fits
                found.append(plan_layout(lay, spec, measured, memory=memory))
            else:
                rejected.too_big += 1
    # Ties (same predicted time) go to the simpler layout (fewer mesh axes in use), then less memory.
    found.sort(key=lambda p: (round(p.time.step_s, 9), sum(s > 1 for s in p.layout.sizes.values()), p.memory.total))
    return found


def overrides(plan: Plan) -> list[str]:
    """The KEY=VALUE overrides that turn the searched config into this plan's layout."""
    cfg = plan.layout.cfg
    out = [f"mesh.{a}={getattr(cfg.mesh, a)}" for a in MESH_AXES]
    out += [f"parallelism.strategy={cfg.parallelism.strategy}", f"model.remat_policy={cfg.model.remat_policy}",
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}"]
    if plan.layout.pp > 1:
        p = cfg.parallelism
        out += [f"parallelism.pipeline_schedule={p.pipeline_schedule}", f"parallelism.microbatches={p.microbatches}",
                f"parallelism.pipeline_repeats={p.pipeline_repeats}"]
    return out
