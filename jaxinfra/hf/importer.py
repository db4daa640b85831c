"""`jaxinfra hf import HF_DIR OUT`: an HF checkpoint -> a jaxinfra run directory.

    OUT/config.yaml          complete resolved Config (model mapped from config.json)
    OUT/checkpoints/0/       Orbax, checkpoint.py's layout: `state` = {"params": ...} only,
                             `meta` = {"params_only": true, "imported_from": ..., ...}

Streaming: each of our parameters is built with `jax.make_array_from_callback` straight in
its target sharding (from the config's mesh and the sharding rules); a device's callback
reads only the HF tensors of the (layer, expert) slices its shard covers, converts them
and slices out its part. So the host never holds more than one shard plus the HF tensors
of one slice, beyond what the devices themselves hold (on the CPU backend device buffers
are host memory too, so there RSS includes the model once).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import re
import resource
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxinfra.atomic import check_output
from jaxinfra.checkpoint import save_params_only
from jaxinfra.config import Config, apply_overrides, from_dict, validate
from jaxinfra.hf.families import HFError, from_hf, rope_interleaved
from jaxinfra.hf.safetensors_io import SafetensorsDir
from jaxinfra.hf.tensors import Rule, ignored, rules
from models.config import ModelConfig

STEP = 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_hf_config(hf_dir: pathlib.Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise HFError(f"{hf_dir}: no config.json (is it a Hugging Face model directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"{path}: invalid JSON ({e})") from None


def build_config(model: ModelConfig, overrides: Sequence[str] = (), device_count: int | None = None,
                 data: dict[str, Any] | None = None) -> Config:
    """Config(model=mapped) + `data` keys (the HF tokenizer's, jaxinfra/hf/tokenizer_files.py) + KEY=VALUE
    overrides, validated. Without `data` the data section stays the default unless its vocabulary does not
    fit the model (tiny test models): then synthetic tokens, to be overridden."""
    from jaxinfra.data import vocab_size_of

    tree = Config(model=model).to_dict()
    if data:
        tree["data"].update(data)
    elif vocab_size_of(Config().data) > model.vocab_size:
        tree["data"]["source"] = "synthetic"
        tree["data"]["synthetic_vocab"] = min(64, model.vocab_size)
    cfg = from_dict(Config, apply_overrides(tree, list(overrides)), "")
    validate(cfg, device_count)
    return cfg


def _flat(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in leaves}


def _callback(rule: Rule, files: SafetensorsDir, shape: tuple[int, ...], dtype: np.dtype):
    """make_array_from_callback's callback for one parameter: build only the requested shard."""
    lead = len(rule.lead)

    def one(index: tuple[int, ...], rest: tuple[slice, ...]) -> np.ndarray:
        """The (layer, expert) slice at `index`, cut to `rest`; a rule whose slices hold all experts reads only
        the experts in `rest` (gpt-oss: each MXFP4 layer tensor is dequantized in part, per device shard)."""
        names, want = rule.names(*index), shape[lead:]
        if rule.expert_rows:
            rows, rest = rest[0], (slice(None), *rest[1:])
            want = (len(range(*rows.indices(shape[lead]))), *shape[lead + 1:])
            got = rule.load([files.read_experts(n, rows) for n in names])
        else:
            got = rule.load([files.read(n) for n in names])
        if got.shape != want:
            raise HFError(f"tensor {', '.join(names)} has a shape that gives {rule.path} slice {got.shape}; the "
                          f"config says {want}")
        return got[rest]

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        ranges = [range(*index[k].indices(shape[k])) for k in range(lead)]
        rest = index[lead:]
        if not lead:
            return one((), rest).astype(dtype)
        out = None  # filled slice by slice: the shard plus one HF tensor, never a list of slices
        for pos, idx in zip(itertools.product(*(range(len(r)) for r in ranges)), itertools.product(*ranges)):
            piece = one(idx, rest)
            if out is None:
                out = np.empty((*(len(r) for r in ranges), *piece.shape), dtype)
            out[pos] = piece
        return out

    return callback


def load_params(cfg: Config, family: str, interleaved: bool, files: SafetensorsDir,
                devices: Sequence[jax.Device] | None = None, adapter: pathlib.Path | None = None) -> Any:
    """Our params (an nnx.State of jax.Arrays on the config's mesh) built from the HF tensors; with a PEFT
    `adapter` dir (and the config's matching lora section) its adapters too (jaxinfra/hf/adapters.py)."""
    from jaxinfra.state import abstract_params, sharding_rules
    from sharding.mesh import make_mesh

    check_complete(files, cfg.model, family, interleaved)
    mesh = make_mesh(cfg.mesh, list(devices) if devices is not None else jax.devices())
    abstract = abstract_params(cfg.model, mesh, sharding_rules(cfg.parallelism), lora=cfg.lora)
    by_path = {r.path: r for r in rules(cfg.model, family, interleaved)}
    flat = _flat(abstract)
    extra = {}
    if adapter is not None:
        from jaxinfra.hf.adapters import read_adapters

        extra = read_adapters(adapter, cfg.model, family, {p: tuple(v.shape) for p, v in flat.items()})
    if set(flat) != set(by_path) | set(extra):  # a model feature without a mapping is a bug here, not bad input
        raise AssertionError(f"unmapped params: {sorted(set(flat) ^ (set(by_path) | set(extra)))}")
    values = {}
    for path, var in flat.items():
        target = var.get_raw_value()
        if path in extra:  # adapters are small: placed whole
            values[path] = jax.device_put(extra[path].astype(target.dtype), target.sharding)
            continue
        values[path] = jax.make_array_from_callback(target.shape, target.sharding,
                                                    _callback(by_path[path], files, target.shape, target.dtype))

    def fill(path, var):
        return var.replace(values["/".join(str(k.key) for k in path)])

    return jax.tree_util.tree_map_with_path(fill, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def check_complete(files: SafetensorsDir, cfg: ModelConfig, family: str, interleaved: bool) -> None:
    """Every HF tensor the family's rules read is there, checked by name before any data is read: the first
    missing one in model order (embeddings, layer by layer, final norm, head) is named, with how many more."""
    missing, blocks_seen = [], False  # (layer, name): -1 before the layers, a large number after them
    for rule in rules(cfg, family, interleaved):
        blocks_seen = blocks_seen or bool(rule.lead)
        for index in itertools.product(*(range(n) for n in rule.lead)):
            for name in rule.names(*index):
                if not files.has(name):
                    layer = _LAYER.search(name)
                    where = int(layer.group(1)) if layer else index[0] if index else 1 << 30 if blocks_seen else -1
                    missing.append((where, name))
    missing = [name for _, name in sorted(missing, key=lambda x: x[0])]  # stable: rule order within a layer
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise HFError(f"missing tensor {missing[0]}{more} in {files.describe()}")


def check_unused(files: SafetensorsDir, cfg: ModelConfig, family: str) -> None:
    extra = sorted(k for k in files.where if k not in files.used and not ignored(k, cfg, family))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise HFError(f"unexpected tensor {extra[0]}{more} in {files.describe()} (a feature this importer does "
                      f"not map)")


def import_hf(hf_dir: str | pathlib.Path, out: str | pathlib.Path, overrides: Sequence[str] = (),
              devices: Sequence[jax.Device] | None = None, adapter: str | pathlib.Path | None = None,
              overwrite: bool = False) -> dict[str, Any]:
    """Convert and save; returns a report (family, params, bytes on disk, peak RSS, seconds). With a PEFT
    `adapter` dir the run is a LoRA run: the lora section from its adapter_config.json, its adapters loaded."""
    start = time.perf_counter()
    hf_dir, out = pathlib.Path(hf_dir), pathlib.Path(out)
    hf = read_hf_config(hf_dir)
    check_output(out, overwrite, directory=True, inputs=[hf_dir])  # before reading any tensor
    family, model = from_hf(hf)
    devices = list(devices) if devices is not None else jax.devices()
    if adapter is not None:
        from jaxinfra.hf.adapters import lora_overrides

        adapter = pathlib.Path(adapter)
        overrides = [*lora_overrides(adapter, model, family), *overrides]
    from jaxinfra.hf.tokenizer_files import carried_files, copy_carried, data_defaults

    data = data_defaults(hf_dir, overrides, model.vocab_size)
    cfg = build_config(model, overrides, len(devices), data)
    if cfg.lora.enabled and adapter is None:
        raise HFError("hf import with lora.rank > 0 needs --adapter PEFT_DIR; to start new adapters, import the "
                      "base and train it with lora.* set (train --restore OUT)")
    files = SafetensorsDir(hf_dir)
    params = load_params(cfg, family, rope_interleaved(hf, family), files, devices, adapter)
    check_unused(files, cfg.model, family)
    meta = {"params_only": True, "imported_from": str(hf_dir.absolute()), "hf_family": family,
            "hf_architectures": hf.get("architectures"), "step": STEP}
    if adapter is not None:
        meta["peft_adapter"] = str(adapter.absolute())
    meta["hf_files"] = carried_files(hf_dir)  # tokenizer, template, generation: copied into OUT's build dir
    if data and cfg.data.tokenizer == data["tokenizer"]:  # the run reads the copy in OUT, not the source dir
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str((out / "tokenizer.json")
                                                                                        .absolute())))
    path = save_params_only(out, cfg, params, meta, STEP, overwrite=overwrite, inputs=[hf_dir],
                            extra_files=lambda tmp: copy_carried(hf_dir, tmp, meta["hf_files"]))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return {"family": family, "checkpoint": str(path), "params": count, "bytes_on_disk": files.bytes_on_disk(),
            "peak_rss_bytes": peak_rss_bytes(), "seconds": time.perf_counter() - start, "hf_files": meta["hf_files"]}
