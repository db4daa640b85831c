"""Mesh and parallelism names and sizes, without jax: the run config embeds them, and loading a
config must not import jax (tests/test_layout.py checks it).

Axes: data, stage, fsdp, expert, context, tensor (every axis present, size 1 where unused).
A multi-slice (multi-host over a slow network) mesh is ICI sizes x DCN sizes:
`mesh.<axis>` is the size inside one slice and `mesh.dcn_<axis>` the number of
slices along that axis, so the fast axes (tensor, fsdp) stay on neighbouring devices.
`sharding/mesh.py` builds the jax Mesh from a MeshConfig; `sharding/rules.py` and
`sharding/pipeline.py` import the strategy, context and schedule names (and PipelineSettings) from here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from sharding.ranges import ranged

Strategy = Literal["dp", "zero1", "fsdp"]
ContextImpl = Literal["allgather", "ring"]
Schedule = Literal["gpipe", "circular", "1f1b"]

MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "expert", "context", "tensor")


class MeshError(ValueError):
    """Mesh sizes that cannot fit the devices; one line naming the axes."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Per-slice (ICI) axis sizes, one of which may be -1 (fill), and slice counts (DCN)."""

    data: int = ranged(-1, 1, also=(-1,), note="-1: fill")
    stage: int = ranged(1, 1, also=(-1,), note="-1: fill")
    fsdp: int = ranged(1, 1, also=(-1,), note="-1: fill")
    expert: int = ranged(1, 1, also=(-1,), note="-1: fill")
    context: int = ranged(1, 1, also=(-1,), note="-1: fill")
    tensor: int = ranged(1, 1, also=(-1,), note="-1: fill")
    dcn_data: int = ranged(1, 1)
    dcn_stage: int = ranged(1, 1)
    dcn_fsdp: int = ranged(1, 1)
    dcn_expert: int = ranged(1, 1)
    dcn_context: int = ranged(1, 1)
    dcn_tensor: int = ranged(1, 1)

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def dcn_sizes(self) -> dict[str, int]:
        return {axis: getattr(self, f"dcn_{axis}") for axis in MESH_AXES}


def resolve_ici_sizes(mesh: MeshConfig, devices_per_slice: int) -> dict[str, int]:
    """Per-slice axis sizes with the one -1 filled so that the product equals devices_per_slice."""
    sizes = mesh.sizes()
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise MeshError(f"mesh.{axis}={size} is invalid: must be a positive integer or -1 (fill)")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in fill)}")
    fixed = math.prod(max(s, 1) for s in sizes.values())
    if fill:
        if devices_per_slice % fixed:
            raise MeshError(f"mesh.{fill[0]}=-1 cannot fill {devices_per_slice} devices: the other axes' "
                            f"product is {fixed}")
        sizes[fill[0]] = devices_per_slice // fixed
    elif fixed != devices_per_slice:
        shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all axes 1"
        raise MeshError(f"mesh product {fixed} ({shown}) != device count {devices_per_slice}; "
                        f"set one axis to -1 to fill")
    return sizes


def resolve_mesh_sizes(mesh: MeshConfig, device_count: int) -> dict[str, int]:
    """Total axis sizes (ICI x DCN) for `device_count` devices."""
    dcn = mesh.dcn_sizes()
    for axis, size in dcn.items():
        if size < 1:
            raise MeshError(f"mesh.dcn_{axis}={size} is invalid: must be a positive integer")
    slices = math.prod(dcn.values())
    if device_count % slices:
        raise MeshError(f"{device_count} devices cannot form {slices} slices (product of mesh.dcn_*)")
    ici = resolve_ici_sizes(mesh, device_count // slices)
    return {a: ici[a] * dcn[a] for a in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """The schedule, microbatches per step (0: one per stage) and circular repeats."""

    schedule: Schedule = "gpipe"
    microbatches: int = 0
    repeats: int = 1

    def resolved(self, stages: int) -> tuple[int, int]:
        """(microbatches, repeats) for `stages` stages: the one place that resolves the defaults."""
        micro = self.microbatches or stages
        repeats = self.repeats if self.schedule == "circular" else 1
        return micro, repeats
