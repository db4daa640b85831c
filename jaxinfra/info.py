"""`jaxinfra info`: devices, versions, and where a config's parameters would live."""

from __future__ import annotations

import importlib.metadata
import math

import jax
import numpy as np
from flax import nnx

from jaxinfra.config import Config, validate
from jaxinfra.metrics import flops_per_token, param_counts
from jaxinfra.state import init_params
from sharding.mesh import make_mesh
from sharding.rules import logical_to_mesh, rules_for

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _shard_bytes(shape: tuple[int, ...], dtype, spec, mesh) -> int:
    """Bytes one device holds for an array of `shape` sharded by `spec`."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    for axes in spec:
        for axis in (axes if isinstance(axes, tuple) else (axes,)):
            if axis is not None:
                n //= mesh.shape[axis]
    return n


def describe(cfg: Config | None = None) -> str:
    devices = jax.devices()
    lines = [
        "versions: " + ", ".join(f"{p} {_version(p)}" for p in PACKAGES),
        f"backend: {jax.default_backend()}, processes: {jax.process_count()} (this is {jax.process_index()})",
        f"devices: {len(devices)} x {devices[0].device_kind} ({jax.local_device_count()} local)",
    ]
    if cfg is None:
        return "\n".join(lines)
    validate(cfg, len(devices))
    mesh = make_mesh(cfg.mesh, devices)
    rules = rules_for(cfg.parallelism.strategy)
    counts = param_counts(cfg.model)
    lines.append(f"mesh: {dict(mesh.shape)}  strategy: {cfg.parallelism.strategy} (ZeRO-3: params, grads and "
                 f"optimizer state sharded over fsdp)")
    lines.append(f"params: {counts['total']:,} ({counts['non_embedding']:,} non-embedding); "
                 f"train FLOPs/token at seq {cfg.train.seq_len}: {flops_per_token(cfg.model, cfg.train.seq_len):.4g}")
    abstract = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    rows = [("parameter", "shape", "logical axes", "mesh spec", "bytes/device")]
    total = 0
    for path, var in nnx.to_flat_state(abstract):
        names = var.get_metadata().get("out_sharding") or ()
        spec = logical_to_mesh(names, rules, mesh)
        nbytes = _shard_bytes(var.shape, var.dtype, spec, mesh)
        total += nbytes
        rows.append(("/".join(map(str, path)), str(tuple(var.shape)), str(tuple(names)), str(tuple(spec)),
                     f"{nbytes:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    # AdamW keeps two float32 moments per parameter, sharded like the parameter (ZeRO-3).
    opt = sum(2 * _shard_bytes(v.shape, np.float32, logical_to_mesh(v.get_metadata().get("out_sharding") or (),
                                                                      rules, mesh), mesh)
              for _, v in nnx.to_flat_state(abstract))
    lines.append(f"per device: params {total / 2**20:.2f} MiB, grads {total / 2**20:.2f} MiB, "
                 f"optimizer state {opt / 2**20:.2f} MiB")
    return "\n".join(lines)
