"""Loading a model for inference: a checkpoint path -> (Config, params) on the training mesh."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxinfra import storage
from jaxinfra.checkpoint import CheckpointError, restore_params
from jaxinfra.config import Config, ConfigError, load_config, validate
from jaxinfra.quant_checks import check_backend
from jaxinfra.state import abstract_params, sharding_rules, tree_shardings
from models import ModelConfig
from sharding.mesh import make_mesh, resolve_mesh_sizes
from sharding.rules import ShardingRules, logical_to_mesh


class InferenceError(ConfigError):
    """Bad inference input (prompt, token file, sampling options): one line, CLI exit status 2."""


def resolve_checkpoint(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, int | None]:
    """(run dir, checkpoints dir, step or None for the newest) for a run dir or RUN/checkpoints/<step>
    (local, or a gs:// / s3:// URL: then epath.Paths)."""
    if storage.is_url(path):
        storage.check_bucket(str(path), "checkpoint")
    path = storage.as_path(path)
    if (path / "config.yaml").is_file():
        return path, path / "checkpoints", None
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        if not path.name.isdigit():
            raise CheckpointError(f"{path} is not a checkpoint step directory (RUN/checkpoints/<step>)")
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at {path}")
        return path.parent.parent, path.parent, int(path.name)
    raise CheckpointError(f"{path} is neither a run directory (with config.yaml) nor RUN/checkpoints/<step>")


def inference_model_config(model: ModelConfig) -> ModelConfig:
    """The model config inference runs: dropless MoE routing (exact per token), no remat."""
    return dataclasses.replace(model, moe_dispatch="dropless", remat_policy="none")


def inference_devices(cfg: Config, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices a config's mesh spans: all of them when an axis is -1 (fill), else the first
    product-of-axes devices (so `mesh.data=1` runs on one device of many)."""
    devices = list(devices) if devices is not None else jax.devices()
    sizes = [s for s in (*cfg.mesh.sizes().values(), *cfg.mesh.dcn_sizes().values())]
    if -1 in sizes:
        return devices
    need = math.prod(sizes)
    if need > len(devices):
        raise ConfigError(f"mesh needs {need} devices but {len(devices)} are available; "
                          f"set the mesh.* sizes (e.g. mesh.data=-1) for this machine")
    return devices[:need]


def inference_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, ShardingRules]:
    """The training mesh and sharding rules for a config (pipeline stages are not supported)."""
    devices = inference_devices(cfg, devices)
    check_backend(cfg.quant, devices)
    sizes = resolve_mesh_sizes(cfg.mesh, len(devices))
    if sizes["stage"] != 1:
        raise ConfigError(f"inference does not run pipeline stages: set mesh.stage=1 (got {sizes['stage']})")
    # The training batch does not matter here: check the rest against a batch the mesh divides (and
    # that holds whole GRPO groups, so a GRPO run's config passes too).
    batch = sizes["data"] * sizes["fsdp"] * sizes["expert"] * cfg.grpo.group_size
    validate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch, grad_accum_steps=1)),
             len(devices))
    return make_mesh(cfg.mesh, devices), sharding_rules(cfg.parallelism)


def load_model(path: str | pathlib.Path, overrides: Sequence[str] = (),
               devices: Sequence[jax.Device] | None = None) -> tuple[Config, nnx.State]:
    """(Config, params) from a run directory (newest readable checkpoint) or RUN/checkpoints/<step>.

    The config is the run's config.yaml plus `overrides` (e.g. `mesh.tensor=2`); the params are
    restored straight into the training shardings of that config's mesh (a partial restore of
    the Orbax `state` item's `params`, so checkpoints with or without optimizer state load)."""
    run_dir, ckpt_dir, step = resolve_checkpoint(path)
    cfg = load_config(str(run_dir / "config.yaml"), list(overrides))
    mesh, rules = inference_mesh(cfg, devices)
    target = abstract_params(cfg.model, mesh, rules, cfg.quant, cfg.lora)  # int8 weights + scales when quantized
    _, params = restore_params(ckpt_dir, target, step=step, config=cfg.to_dict())
    return cfg, params


def _place_params(params: nnx.State, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """Params in the training shardings of this mesh (a no-op for load_model's output)."""
    shardings = tree_shardings(params, mesh, rules.params)
    return jax.device_put(params, shardings)


def _sharding(mesh: Mesh, rules: ShardingRules, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_mesh(names, rules.activations, mesh, shape))
