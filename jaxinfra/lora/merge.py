"""`jaxinfra lora merge RUN OUT`: the adapters folded into their base weights, as a plain params-only run.

Each target becomes W + A B * alpha/rank (in float32, then the model's param dtype); OUT's config.yaml
is RUN's with lora.rank=0, so `generate`, `eval`, `hf export` and `train --restore` take OUT as any
float run. An int8 base (QLoRA over a `jaxinfra quantize` output) is dequantized first and OUT is float
(quant.weights=none), every weight of it: merging into int8 would re-round the base.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxinfra.atomic import check_output
from jaxinfra.checkpoint import CheckpointError, restore_params, save_params_only
from jaxinfra.config import Config, load_config
from jaxinfra.infer.loading import inference_mesh, resolve_checkpoint
from jaxinfra.state import abstract_params
from models.layers import DTYPES
from models.project import Adapted, Int8Weight, LoraA, LoraB, WeightScale, float_weight


def merged_config(cfg: Config) -> Config:
    """RUN's config without adapters and with float weights."""
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0),
                               quant=dataclasses.replace(cfg.quant, weights="none", group_size=0))


def merged_values(variables: nnx.State, scale: float, dtype: Any) -> dict[tuple, jax.Array]:
    """{path: float array} of every variable but the adapters and int8 scales: each weight with
    adapters merged (W + A B * scale), each int8 one dequantized, the rest as they are."""
    flat = dict(nnx.to_flat_state(variables))
    out = {}
    for path, var in flat.items():
        if isinstance(var, (LoraA, LoraB, WeightScale)):
            continue
        sibling = lambda suffix: flat.get((*path[:-1], f"{path[-1]}{suffix}"))  # noqa: E731
        w, s, a = var[...], sibling("_scale"), sibling("_lora_a")
        if s is not None:
            w = Int8Weight(w, s[...])
        if a is not None:
            w = Adapted(w, a[...], sibling("_lora_b")[...] * scale)
        out[path] = float_weight(w, dtype) if (s is not None or a is not None) else w
    return out


def merge_variables(cfg: Config, variables: nnx.State, target: nnx.State) -> nnx.State:
    """The merged model's variables, laid out as `target` (the merged config's abstract params)."""
    values = merged_values(variables, cfg.lora.scale, DTYPES[cfg.model.param_dtype])
    return nnx.from_flat_state([(p, v.replace(values[p])) for p, v in nnx.to_flat_state(target)])


def merge_lora(run: str, out: str, devices: Sequence[jax.Device] | None = None, overwrite: bool = False
               ) -> pathlib.Path:
    """Write OUT (config.yaml with lora.rank=0 + a params-only checkpoint) from RUN's newest checkpoint
    (or RUN/checkpoints/N); returns the checkpoint step directory written."""
    run_dir, ckpt_dir, step = resolve_checkpoint(run)
    cfg = load_config(str(run_dir / "config.yaml"))
    if not cfg.lora.enabled:
        raise CheckpointError(f"{run} holds no LoRA adapters (lora.rank=0): nothing to merge")
    if pathlib.Path(out).resolve() == run_dir.resolve():
        raise CheckpointError(f"OUT {out} is the source run directory; choose a new directory")
    check_output(out, overwrite, directory=True, inputs=[run_dir])  # before the restore: a refusal costs nothing
    mesh, rules = inference_mesh(cfg, devices)
    step, variables = restore_params(ckpt_dir, abstract_params(cfg.model, mesh, rules, cfg.quant, cfg.lora),
                                     step=step, config=cfg.to_dict())
    new = merged_config(cfg)
    target = abstract_params(new.model, mesh, rules, new.quant)
    shardings = jax.tree.map(lambda a: a.sharding, target)
    with jax.set_mesh(mesh):
        params = jax.jit(lambda v: merge_variables(cfg, v, target), out_shardings=shardings)(variables)
    meta = {"params_only": True, "merged_from": str(pathlib.Path(run).absolute()), "source_step": step, "step": 0,
            "lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets)}}
    return save_params_only(out, new, params, meta, overwrite=overwrite, inputs=[run_dir])
