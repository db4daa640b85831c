"""Mesh sizes from the config, and the jax Mesh over the fixed axes.

Axes: data, stage, fsdp, expert, context, tensor (every axis present, size 1 where unused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "expert", "context", "tensor")


class MeshError(ValueError):
    """Mesh sizes that cannot fit the devices; one line naming the axes."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device-mesh axis sizes; their product is the device count, one may be -1 (fill)."""

    data: int = -1
    stage: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


def resolve_mesh_sizes(mesh: MeshConfig, device_count: int) -> dict[str, int]:
    """Axis sizes with the one -1 filled so that the product equals device_count."""
    sizes = mesh.sizes()
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise MeshError(f"mesh.{axis}={size} is invalid: must be a positive integer or -1 (fill)")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in fill)}")
    fixed = 1
    for size in sizes.values():
        fixed *= max(size, 1)
    if fill:
        if device_count % fixed:
            raise MeshError(f"mesh.{fill[0]}=-1 cannot fill {device_count} devices: the other axes' "
                            f"product is {fixed}")
        sizes[fill[0]] = device_count // fixed
    elif fixed != device_count:
        shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all axes 1"
        raise MeshError(f"mesh product {fixed} ({shown}) != device count {device_count}; "
                        f"set one axis to -1 to fill")
    return sizes


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with every axis present.

    Axes are `Auto` (GSPMD-style): the model states logical shardings and XLA
    inserts the collectives, which is what lets one model run under any layout.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_mesh_sizes(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
