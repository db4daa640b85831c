"""`jaxinfra quantize`: a run's float params -> a weight-only int8 checkpoint. (The quant checks
that need to know the devices are the core's: jaxinfra/quant_checks.py, re-exported here.)

    jaxinfra quantize RUN_OR_CKPT OUT --weights int8 [--group-size N]

OUT is a params-only run directory (config.yaml with quant.weights=int8 and quant.group_size,
plus checkpoints/0) that `jaxinfra generate` and `jaxinfra eval` load like any run: every
projection weight (embeddings and the output projection included; the MoE router and the
norm and bias vectors stay float) becomes int8 values + float32 scales per output channel, or
per group of `group_size` consecutive inputs. The conversion runs under jit on the run's mesh,
each shard quantized on its device.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any, get_args

import jax
from flax import nnx

from jaxinfra.atomic import check_output
from jaxinfra.checkpoint import CheckpointError, restore_params, save_params_only
from jaxinfra.config import Config, ConfigError, load_config, validate
from jaxinfra.infer.loading import inference_mesh, resolve_checkpoint
from jaxinfra.quant_checks import FP8_GPU_CAPABILITY, check_backend, check_trainable, fp8_dots_native  # noqa: F401
from jaxinfra.state import abstract_params
from models.project import WeightScale
from models.quant import quantize_int8, quantize_int8_grouped
from models.quant_config import WeightStorage

# ---------------------------------------------------------------- the conversion


def int8_weight(w: jax.Array, contract: Sequence[int], group_size: int) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 scale) of a weight whose contracted dims are `contract` (negative axes)."""
    axes = tuple(sorted(a % w.ndim for a in contract))
    return quantize_int8_grouped(w, group_size, axes[-1]) if group_size else quantize_int8(w, axes)


def quantize_params(params: nnx.State, target: nnx.State, group_size: int) -> nnx.State:
    """Float params -> the int8-stored layout of `target` (an abstract quantized params State): each
    weight with a WeightScale sibling `<w>_scale` becomes int8 values + scales; the rest is copied.
    Amax histories of an fp8 delayed-scaling run are dropped (the target has none)."""
    source = dict(nnx.to_flat_state(params))
    wanted = dict(nnx.to_flat_state(target))
    out = []
    for path, var in wanted.items():
        scale_path = (*path[:-1], f"{path[-1]}_scale")
        if scale_path in wanted:  # an int8-stored weight: its values and its scale sibling
            scale_var = wanted[scale_path]
            values, scale = int8_weight(source[path][...], scale_var.get_metadata()["contract"], group_size)
            out += [(path, var.replace(values)), (scale_path, scale_var.replace(scale))]
        elif not isinstance(var, WeightScale):
            out.append((path, var.replace(source[path][...])))
    return nnx.from_flat_state(out)


def quantized_config(cfg: Config, weights: str, group_size: int, source: str) -> Config:
    """The config of the quantized checkpoint, or a one-line error for what cannot be quantized."""
    if weights not in get_args(WeightStorage) or weights == "none":
        raise ConfigError(f"--weights {weights!r} is not a weight quantization; choose int8")
    if cfg.quant.weights != "none":
        raise CheckpointError(f"{source} is already quantized (quant.weights={cfg.quant.weights}, "
                              f"group_size={cfg.quant.group_size}); quantize the float run it came from")
    if cfg.lora.enabled:
        raise CheckpointError(f"{source} holds LoRA adapters (lora.rank={cfg.lora.rank}); merge them first "
                              f"(jaxinfra lora merge), then quantize the merged run")
    if group_size < 0:
        raise ConfigError(f"--group-size {group_size} is invalid: must be >= 0 (0: per output channel)")
    quant = dataclasses.replace(cfg.quant, weights=weights, group_size=group_size, train="none")
    new = dataclasses.replace(cfg, quant=quant)
    try:
        validate(new)
    except ConfigError as e:
        raise ConfigError(str(e).replace("quant.group_size", "--group-size")) from None
    return new


def quantize_loaded(cfg: Config, params: nnx.State, weights: str = "int8", group_size: int = 0,
                    devices: Sequence[jax.Device] | None = None,
                    source: str = "the params") -> tuple[Config, nnx.State]:
    """(the quantized config, int8-stored params) from float params already on `cfg`'s mesh."""
    new = quantized_config(cfg, weights, group_size, source)
    mesh, rules = inference_mesh(cfg, devices)
    target = abstract_params(new.model, mesh, rules, new.quant)
    shardings = jax.tree.map(lambda a: a.sharding, target)
    with jax.set_mesh(mesh):
        return new, jax.jit(lambda p: quantize_params(p, target, group_size), out_shardings=shardings)(params)


def quantize_checkpoint(source: str | pathlib.Path, out: str | pathlib.Path, weights: str = "int8",
                        group_size: int = 0, devices: Sequence[jax.Device] | None = None,
                        overwrite: bool = False) -> dict[str, Any]:
    """Write OUT (params-only run dir, quant.weights=int8) from RUN_OR_CKPT; returns a small report."""
    run_dir, ckpt_dir, step = resolve_checkpoint(source)
    cfg = load_config(str(run_dir / "config.yaml"))
    quantized_config(cfg, weights, group_size, str(source))  # bad input fails before anything is read
    if pathlib.Path(out).resolve() == run_dir.resolve():
        raise CheckpointError(f"OUT {out} is the source run directory; choose a new directory")
    check_output(out, overwrite, directory=True, inputs=[run_dir])  # before the restore: a refusal costs nothing
    mesh, rules = inference_mesh(cfg, devices)
    step, params = restore_params(ckpt_dir, abstract_params(cfg.model, mesh, rules, cfg.quant), step=step,
                                  config=cfg.to_dict())
    new, qparams = quantize_loaded(cfg, params, weights, group_size, devices, str(source))
    meta = {"params_only": True, "quantized_from": str(pathlib.Path(source).absolute()), "source_step": step,
            "step": 0}
    path = save_params_only(out, new, qparams, meta, overwrite=overwrite, inputs=[run_dir])
    return {"checkpoint": str(path), "bytes": tree_bytes(qparams), "float_bytes": tree_bytes(params),
            "source_step": step}


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
