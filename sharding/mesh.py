"""The jax Mesh over the fixed axes, from a MeshConfig (sizes and their checks: sharding/config.py).

A multi-slice mesh is ICI sizes x DCN sizes: `mesh.<axis>` is the size inside one slice and
`mesh.dcn_<axis>` the number of slices along that axis, so the fast axes (tensor, fsdp) stay on
neighbouring devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# The jax-free half (names, sizes, their checks) lives in sharding/config.py; re-exported here.
from sharding.config import MESH_AXES, MeshConfig, MeshError, resolve_ici_sizes, resolve_mesh_sizes

__all__ = ["MESH_AXES", "MeshConfig", "MeshError", "make_mesh", "resolve_ici_sizes", "resolve_mesh_sizes"]


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
