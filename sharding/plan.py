"""The parallel plan: everything about the devices that decides what the model computes.

One frozen value, built once per run (`jaxinfra/runtime.py: build_runtime`, the inference
entry points) and passed explicitly to the model and down to every layer that shards:

    mesh         the device mesh (None: one device, every constraint a no-op)
    rules        the logical-axis tables (sharding/rules.py)
    pipeline     the pipeline settings when mesh.stage > 1, else None (sharding/pipeline.py)
    platform     "cpu" / "gpu" / "tpu" of the mesh's devices (kernel dispatch, the expert exchange),
                 derived from the mesh; None for `single_device()`: the kernels' own default

A traced program is therefore a function of its visible arguments and of the plan the step was
made with; nothing is read from an ambient context while tracing, so the same model called
with the same plan always traces the same program, and a bare call (no plan) is the
single-device program on purpose, not by accident.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from sharding.config import PipelineSettings
from sharding.rules import ShardingRules, logical_to_mesh, rules_for


def device_platform(platform: str) -> str:
    """A device's platform name as the kernels name it (CUDA and ROCm are both "gpu")."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelPlan:
    """How one run's computation is laid out on its devices (see the module docstring)."""

    mesh: Mesh | None = None
    rules: ShardingRules = dataclasses.field(default_factory=rules_for)
    pipeline: PipelineSettings | None = None
    platform: str | None = None

    def __post_init__(self) -> None:
        if self.platform is None and self.mesh is not None:  # the devices' own, never jax's default backend
            object.__setattr__(self, "platform", device_platform(self.mesh.devices.flat[0].platform))
        # A pipelined mesh always has settings (the defaults when none were given), and a
        # plan without stages never carries any: `pipeline is None` iff not pipelined.
        if self.stages > 1 and self.pipeline is None:
            object.__setattr__(self, "pipeline", PipelineSettings())
        elif self.stages == 1 and self.pipeline is not None:
            object.__setattr__(self, "pipeline", None)

    # ------------------------------------------------------------ axis sizes

    def axis_size(self, axis: str) -> int:
        """Size of a mesh axis (1 without a mesh or without that axis)."""
        if self.mesh is None or axis not in self.mesh.axis_names:
            return 1
        return self.mesh.shape[axis]

    @property
    def stages(self) -> int:
        return self.axis_size("stage")

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @property
    def context_size(self) -> int:
        return self.axis_size("context")

    @property
    def expert_size(self) -> int:
        return self.axis_size("expert")

    @property
    def size(self) -> int:
        """Device count (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.size

    # ------------------------------------------------------------ context parallelism

    @property
    def context_impl(self) -> str:
        return self.rules.context_impl

    @property
    def load_balance(self) -> bool:
        return self.rules.load_balance

    # ------------------------------------------------------------ constraints

    def spec(self, names: Sequence[str | None], shape: Sequence[int] | None = None) -> jax.sharding.PartitionSpec:
        """The activation PartitionSpec of logical `names` on this plan's mesh."""
        return logical_to_mesh(names, self.rules.activations, self.mesh, shape)

    def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """Pin an activation's sharding by logical names; a no-op for a single-device plan."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(names, x.shape)))


SINGLE_DEVICE = ParallelPlan()


def single_device() -> ParallelPlan:
    """The plan of one device and no mesh: unit tests, bare model calls."""
    return SINGLE_DEVICE


def plan_for(mesh: Mesh, rules: ShardingRules, pipeline: PipelineSettings | None = None) -> ParallelPlan:
    """The plan of a mesh: its rules, its pipeline settings (kept only when mesh.stage > 1)
    and the platform of its devices."""
    return ParallelPlan(mesh=mesh, rules=rules, pipeline=pipeline)
