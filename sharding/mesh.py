"""Mesh sizes from the config, and the jax Mesh over the fixed axes.

Axes: data, stage, fsdp, expert, context, tensor (every axis present, size 1 where unused).
A multi-slice (multi-host over a slow network) mesh is ICI sizes x DCN sizes:
`mesh.<axis>` is the size inside one slice and `mesh.dcn_<axis>` the number of
slices along that axis, so the fast axes (tensor, fsdp) stay on neighbouring devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "expert", "context", "tensor")


class MeshError(ValueError):
    """Mesh sizes that cannot fit the devices; one line naming the axes."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Per-slice (ICI) axis sizes, one of which may be -1 (fill), and slice counts (DCN)."""

    data: int = -1
    stage: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1
    dcn_data: int = 1
    dcn_stage: int = 1
    dcn_fsdp: int = 1
    dcn_expert: int = 1
    dcn_context: int = 1
    dcn_tensor: int = 1

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


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with every axis present, built so neighbouring devices share the fast axes.

    Axes are `Auto` (GSPMD-style): the model states logical shardings and XLA
    inserts the collectives, which is what lets one model run under any layout.
    """
    devices = list(devices) if devices is not None else jax.devices()
    dcn = mesh_cfg.dcn_sizes()
    slices = math.prod(dcn.values())
    resolve_mesh_sizes(mesh_cfg, len(devices))  # validates
    ici = resolve_ici_sizes(mesh_cfg, len(devices) // slices)
    ici_shape = [ici[a] for a in MESH_AXES]
    if slices > 1:
        # A slice is a process (or a TPU slice) on platforms without slice metadata.
        granule_is_process = not hasattr(devices[0], "slice_index")
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, [dcn[a] for a in MESH_AXES], devices,
                                                    process_is_granule=granule_is_process)
    elif devices[0].platform == "cpu":
        grid = np.array(devices).reshape(ici_shape)  # no topology to respect
    else:
        grid = mesh_utils.create_device_mesh(ici_shape, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
