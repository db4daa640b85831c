"""`jaxinfra hf export RUN_OR_CKPT OUT_DIR`: a run's params -> HF config.json + safetensors.

The source is a run directory (its newest readable checkpoint) or one checkpoint step
directory (`RUN/checkpoints/N`); the config comes from the run's config.yaml (or the
checkpoint's own meta). Params are restored FSDP-sharded over this host's devices, then fetched
to the host one HF tensor at a time (one layer / expert slice of a stacked parameter) and appended to the
safetensors file, whose header is computed up front from the shapes. Above `max_shard_bytes`
the tensors are split over several files with a `model.safetensors.index.json`, as
transformers does.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jaxinfra.atomic import atomic_dir, check_output
from jaxinfra.checkpoint import CheckpointError, restore_params
from jaxinfra.config import Config, load_config
from jaxinfra.config_sections import chat_data
from jaxinfra.hf.families import HFError, hf_family, to_hf
from jaxinfra.hf.safetensors_io import plan_shards, write_safetensors
from jaxinfra.hf.tensors import Rule, rules

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
MAX_SHARD_BYTES = 5 * 2**30


def _source_config(source: pathlib.Path) -> Config:
    """The config of a run dir, or of a checkpoint step dir (RUN/checkpoints/N)."""
    for candidate in (source / "config.yaml", source.parent.parent / "config.yaml"):
        if candidate.is_file():
            return load_config(str(candidate))
    meta = source / "meta" / "metadata"  # a bare checkpoint step dir: its meta records the config
    if meta.is_file() and json.loads(meta.read_text()).get("config"):
        import yaml

        from jaxinfra.config import from_dict, validate

        cfg = from_dict(Config, yaml.safe_load(json.loads(meta.read_text())["config"]), "")
        validate(cfg)
        return cfg
    raise CheckpointError(f"{source}: no config.yaml (expected a jaxinfra run directory or RUN/checkpoints/N)")


def _flat(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in leaves}


def _specs(rule: Rule, shapes: list[tuple[int, ...]], dtype: np.dtype) -> list[tuple[str, tuple[int, ...], np.dtype,
                                                                                    tuple]]:
    """(HF name, shape, dtype, our lead index) for every HF tensor a rule makes, from shapes alone (`shapes`: its
    param's and those of the params it joins)."""
    out = []
    dummies = [np.zeros(s[len(rule.lead):], np.float32) for s in shapes]  # layouts depend on shapes only
    hf_shapes = [t.shape for t in rule.save(*dummies)]
    for idx in itertools.product(*(range(n) for n in rule.lead)):
        for name, hf_shape in zip(rule.names(*idx), hf_shapes, strict=True):
            out.append((name, tuple(hf_shape), dtype, idx))
    return out


def _check_lora(cfg: Config, source: pathlib.Path, adapters: bool) -> None:
    """--adapters needs a LoRA run; a LoRA run without it would silently lose its fine-tune: both refused."""
    lora = getattr(cfg, "lora", None)
    enabled = bool(lora is not None and lora.enabled)
    if adapters and not enabled:
        raise HFError(f"--adapters: {source} is not a LoRA run (lora.rank=0); export it without --adapters")
    if enabled and not adapters:
        raise HFError(f"{source} is a LoRA run (lora.rank={lora.rank}): pass --adapters for the base + a PEFT "
                      f"adapter, or export the output of `jaxinfra lora merge {source} OUT`")


def _restore(source: pathlib.Path, cfg: Config) -> tuple[int, dict[str, Any]]:
    """(step, our flat params) restored FSDP-sharded over this host's devices (whatever mesh the run
    trained on), so that no device needs the whole model; slices are then gathered one at a time."""
    from jaxinfra.config import ParallelismConfig
    from jaxinfra.state import abstract_params, sharding_rules
    from sharding.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=1, fsdp=-1), jax.local_devices())
    lora = getattr(cfg, "lora", None)
    extra = {"lora": lora} if lora is not None and lora.enabled else {}
    target = abstract_params(cfg.model, mesh, sharding_rules(ParallelismConfig(strategy="fsdp")), cfg.quant, **extra)
    step, params = restore_params(source, target)
    return step, _flat(params)


def _fetch(flat: dict[str, Any], path: str, idx: tuple) -> np.ndarray:
    """One (layer, expert) slice of a param, on the host, in float32."""
    value = flat[path].get_raw_value()
    return np.asarray(jax.device_get(value[idx] if idx else value)).astype(np.float32)


def export_hf(source: str | pathlib.Path, out_dir: str | pathlib.Path, dtype: str = "float32",
              max_shard_bytes: int = MAX_SHARD_BYTES, adapters: bool = False, overwrite: bool = False
              ) -> dict[str, Any]:
    """Write config.json and model*.safetensors for the newest params under `source`; with `adapters`
    (a LoRA run) also PEFT's adapter_config.json + adapter_model.safetensors (the base unmerged).

    OUT is built whole in a temporary sibling and renamed into place (jaxinfra/atomic.py): an existing
    OUT is refused unless `overwrite`, and then replaced as a whole, so no shard, index or config of an
    earlier export survives beside the new files, and an interrupted export leaves the old OUT as it was."""
    source = pathlib.Path(source)
    if not source.exists():
        raise CheckpointError(f"no run directory or checkpoint at {source}")
    cfg = _source_config(source)
    if cfg.quant.weights != "none":
        raise HFError(f"{source} holds int8 weights (quant.weights={cfg.quant.weights}); export the float run it "
                      f"was quantized from")
    family = hf_family(cfg.model)
    if dtype not in DTYPES:
        raise HFError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    _check_lora(cfg, source, adapters)
    check_output(out_dir, overwrite, directory=True, inputs=[source])  # before the restore: a refusal costs nothing
    with atomic_dir(out_dir, replace=overwrite, inputs=[source]) as tmp:
        step, flat = _restore(source, cfg)
        report = _write_weights(tmp, cfg, family, flat, dtype, max_shard_bytes)
        # plain writes from here on: everything lands in the build directory, renamed into place whole
        (tmp / "config.json").write_text(json.dumps(to_hf(cfg.model, dtype), indent=2))
        report |= {"family": family, "step": step, "out_dir": str(out_dir),
                   "tokenizer_files": export_tokenizer_files(cfg, _run_dir(source), tmp)}
        if adapters:
            from jaxinfra.hf.adapters import write_adapters

            shapes = {path: tuple(v.shape) for path, v in flat.items()}
            report |= write_adapters(tmp, cfg.model, family, shapes, lambda p, i: _fetch(flat, p, i), cfg.lora)
    return report


def _write_weights(out_dir: pathlib.Path, cfg: Config, family: str, flat: dict[str, Any], dtype: str,
                   max_shard_bytes: int) -> dict[str, Any]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + their index, into `out_dir`."""
    np_dtype = DTYPES[dtype]
    specs = []
    for rule in (r for r in rules(cfg.model, family) if r.exported):
        # DeepSeek-V3 keeps its router in float32 (HF: _keep_in_fp32_modules_strict), whatever the rest is.
        keep32 = family == "deepseek_v3" and rule.path.endswith(("router/w", "router/bias"))
        shapes = [flat[p].shape for p in (rule.path, *rule.joins)]
        specs += [(rule, *s) for s in _specs(rule, shapes, DTYPES["float32"] if keep32 else np_dtype)]
    dtype_of = {s[1]: s[3] for s in specs}

    def tensors(chunk: list) -> Iterator[tuple[str, np.ndarray]]:
        # One (layer, expert) slice to the host at a time; its HF tensors are yielded in order.
        cache: tuple[Any, list[np.ndarray]] | None = None
        for rule, name, _, _, idx in chunk:
            key = (rule.path, idx)
            if cache is None or cache[0] != key:
                slices = [_fetch(flat, p, idx) for p in (rule.path, *rule.joins)]
                cache = (key, dict(zip(rule.names(*idx), rule.save(*slices), strict=True)))
            yield name, cache[1][name].astype(dtype_of[name])

    shards = plan_shards([(name, shape, dt) for _, name, shape, dt, _ in specs], max_shard_bytes)
    by_name = {s[1]: s for s in specs}
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total, weight_map = 0, {}
    for fname, shard in zip(files, shards, strict=True):
        total += write_safetensors(out_dir / fname, shard, tensors([by_name[s[0]] for s in shard]))
        weight_map.update({s[0]: fname for s in shard})
    if len(files) > 1:
        data_bytes = sum(int(np.prod(shape)) * dt.itemsize for _, _, shape, dt, _ in specs)
        index = {"metadata": {"total_size": data_bytes}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"files": files, "tensors": len(specs), "bytes": total}


def _run_dir(source: pathlib.Path) -> pathlib.Path | None:
    """The run directory of a run dir or RUN/checkpoints/N (None for a bare checkpoint step dir)."""
    for candidate in (source, source.parent.parent):
        if (candidate / "config.yaml").is_file():
            return candidate
    return None


def export_tokenizer_files(cfg: Config, run_dir: pathlib.Path | None, out_dir: pathlib.Path) -> list[str]:
    """The run's tokenizer beside the weights, as transformers loads it: tokenizer.json and
    tokenizer_config.json (the run's own, or a minimal one) whose `chat_template` is the template
    the run trained with (chat data). Byte-level runs have no tokenizer.json (no HF tokenizer maps
    bytes to these ids); a byte-level chat run writes its template as chat_template.jinja. The other
    files an `hf import` carried (jaxinfra/hf/tokenizer_files.py: generation_config.json,
    special_tokens_map.json, the template files when the run kept that template) are copied back,
    and every file whose content is unchanged is copied byte for byte."""
    from jaxinfra.data.chat import load_chat_template
    from jaxinfra.infer.chat import run_file

    data = cfg.data
    tokenizer = run_file(data.tokenizer, run_dir) if data.tokenizer is not None else None
    template = None
    if chat_data(cfg):
        spec = data.chat_template if data.chat_template in ("chatml", "tokenizer") else run_file(data.chat_template,
                                                                                                  run_dir)
        template = load_chat_template(spec, tokenizer).source
    folders = [p for p in (pathlib.Path(tokenizer).parent if tokenizer else None, run_dir) if p is not None]
    if tokenizer is None:
        written = []
        if template is not None:
            (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
            written.append("chat_template.jinja")
        return written + _carried_back(folders, out_dir, template, written)
    shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    beside = pathlib.Path(tokenizer).parent / "tokenizer_config.json"
    config = json.loads(beside.read_text(encoding="utf-8")) if beside.is_file() else {}
    jinja = pathlib.Path(tokenizer).parent / "chat_template.jinja"
    kept = template is None or template == config.get("chat_template") or (
        jinja.is_file() and jinja.read_text(encoding="utf-8") == template)
    if beside.is_file() and kept:  # the stored template is the run's: the file as it was
        shutil.copyfile(beside, out_dir / "tokenizer_config.json")
    else:
        if template is not None:
            config["chat_template"] = template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                       encoding="utf-8")
    written = ["tokenizer.json", "tokenizer_config.json"]
    return written + _carried_back(folders, out_dir, template if not kept else None, written)


def _carried_back(folders: list[pathlib.Path], out_dir: pathlib.Path, template: str | None,
                  written: list[str]) -> list[str]:
    """Copies the other carried files found in `folders` (first wins); the template files only when the
    run did not replace the template (`template` None), so transformers never finds a stale one."""
    from jaxinfra.hf.tokenizer_files import CARRIED, copy_carried

    names = []
    for name in CARRIED:
        stale = template is not None and name in ("chat_template.jinja", "additional_chat_templates")
        if name in written or name in ("tokenizer.json", "tokenizer_config.json") or stale:
            continue
        found = next((f for f in folders if (f / name).exists()), None)
        if found is not None:
            names += copy_carried(found, out_dir, [name])
    return names
