"""One plan: a layout's memory per device, step time, throughput and bottleneck on a device kind."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfra.config import Config
from jaxinfra.plan.devices import DeviceSpec
from jaxinfra.plan.layout import Layout
from jaxinfra.plan.links import Measured
from jaxinfra.plan.memory import COMPONENTS, Fn, Memory, StateBytes, estimate
from jaxinfra.plan.time import StepTime, step_time

# The analytic estimate's margin of error: a plan up to 10% over the device's memory is still run by
# `jaxinfra train` (its pre-flight) and passed by `jaxinfra plan`; beyond it both refuse (exit 2).
FIT_MARGIN = 1.1


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: Layout
    spec: DeviceSpec
    memory: Memory
    time: StepTime
    inference: bool = False  # a decode plan (jaxinfra/plan/inference.py): a step is one token per row

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.spec.memory_bytes

    @property
    def refused(self) -> bool:
        """Over the device's memory by more than FIT_MARGIN: `train` refuses it without --force, `plan`
        exits 2 without --report (one rule for both)."""
        return self.memory.total > FIT_MARGIN * self.spec.memory_bytes

    @property
    def tokens_per_step(self) -> int:
        t = self.layout.cfg.train
        return t.batch_size if self.inference else t.batch_size * t.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs per device per second / the device's peak (as metrics.jsonl's mfu)."""
        return self.time.flops.model / self.time.step_s / self.time.peak

    @property
    def wall_s(self) -> float:
        return self.layout.cfg.train.steps * self.time.step_s

    @property
    def bottleneck(self) -> str:
        if not self.fits:
            return "memory"
        return self.time.bottleneck

    def as_json(self) -> dict[str, Any]:
        lay, t = self.layout, self.time
        return {
            "devices": lay.devices, "device_kind": self.spec.kind,
            "mesh": {a: s for a, s in lay.sizes.items() if s > 1},
            "strategy": lay.cfg.parallelism.strategy, "remat_policy": lay.model.remat_policy,
            "attention_impl": lay.attention_impl,  # what model.attention_impl runs as there (kernels/facts.py)
            "memory_bytes_per_device": self.memory.as_dict(), "memory_peak_phase": self.memory.peak_phase,
            "device_memory_bytes": int(self.spec.memory_bytes), "fits": self.fits,
            "refused": self.refused,
            "step_time_s": t.step_s, "compute_s": t.compute_s, "compute_by_kind": t.compute_by_kind,
            "probe_rates": self.spec.rates, "bubble_s": t.bubble_s, "update_s": t.update_s,
            "accumulate_s": t.accumulate_s, "exposed_comm_s": t.exposed_s, "overlapped_comm_s": t.overlapped_s,
            "collectives": [{"what": c.what, "op": c.op, "axes": list(c.axes), "bytes_per_call": int(c.size),
                             "calls": c.calls, "seconds": c.seconds, "overlapped": c.overlapped}
                            for c in t.collectives],
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "wall_s": self.wall_s,
            "bottleneck": self.bottleneck, "executed_flops_per_device": t.flops.executed,
            "model_flops_per_device": t.flops.model, "peak_flops_per_device": t.peak,
            "efficiency": self.spec.efficiency, "inference": self.inference,
        }


def make_plan(cfg: Config, devices: int, spec: DeviceSpec, measured: Measured | None = None,
              components: list[Fn] | None = None, inference: bool = False) -> Plan:
    """Validate `cfg` for `devices` (a refused layout raises the trainer's ConfigError), then price
    a training step, or with `inference` a decode step of `jaxinfra generate`."""
    lay = Layout.of(cfg, devices, spec.platform, target=spec.kernel_target)
    if inference:
        from jaxinfra.plan.inference import INFERENCE_COMPONENTS, decode_time

        state = StateBytes.of(lay)
        return Plan(lay, spec, estimate(lay, components or INFERENCE_COMPONENTS, state),
                    decode_time(lay, state, spec), inference=True)
    return plan_layout(lay, spec, measured, components or COMPONENTS)


def plan_layout(lay: Layout, spec: DeviceSpec, measured: Measured | None = None,
                components: list[Fn] | None = None, memory: Memory | None = None) -> Plan:
    state = StateBytes.of(lay)
    memory = memory or estimate(lay, components, state)
    return Plan(lay, spec, memory, step_time(lay, state, spec, measured))
