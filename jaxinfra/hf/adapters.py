"""LoRA adapters <-> PEFT's format (`adapter_config.json` + `adapter_model.safetensors`).

Our adapters sit beside a targeted weight `w` (models/lora_config.py): `w_lora_a` [*batch, *contracted,
r] and `w_lora_b` [*batch, r, *output], with output = x @ w + (x @ A @ B) * alpha / r. PEFT keeps, per
HF Linear module `M` (weight [out, in]), `base_model.model.M.lora_A.weight` [r, in] and
`base_model.model.M.lora_B.weight` [out, r], with the same scale lora_alpha / r. The names and
layouts come from the base weight's own `Rule` (jaxinfra/hf/tensors.py), so adapters follow exactly
the tables the base export uses:

- the module name is the rule's HF tensor name without `.weight`, per (layer, expert) lead index;
- lora_A: HF flattens a Linear's inputs in our contracted dims' order (no rule permutes inputs), so
  A's slice [*contracted, r] -> reshape [in, r] -> transpose;
- lora_B: the rule's own `save` applied to B's slice [r, *output]: `save` treats the first axis as
  the input (linear) or the last as the output (out_linear), so B comes out [out, r] with every
  output permutation the weight has (DeepSeek's rope columns) applied to B's outputs too.

Import inverts `save` on an index array, so it needs no second table either.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import numpy as np

from jaxinfra.hf.families import HFError
from jaxinfra.hf.safetensors_io import ADAPTER_FILE, SafetensorsDir, write_safetensors
from jaxinfra.hf.tensors import Rule, rules
from models.config import ModelConfig

LORA_A, LORA_B = "_lora_a", "_lora_b"  # our suffixes beside a weight `w` (models/lora_config.py)
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the HF model
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", ADAPTER_FILE
# PEFT options that would make the adapter compute something our LoRA does not: (key, the value we model).
_PLAIN = (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False),
          ("use_qalora", False), ("layers_to_transform", None), ("layer_replication", None),
          ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}), ("target_parameters", None),
          ("trainable_token_indices", None))


def module_of(hf_weight: str) -> str:
    """The HF module of a Linear weight's tensor name (`model.layers.0.self_attn.q_proj`)."""
    if not hf_weight.endswith(".weight"):
        raise ValueError(f"{hf_weight} is not a Linear weight")
    return hf_weight[: -len(".weight")]


def peft_keys(module: str) -> tuple[str, str]:
    """PEFT's saved keys of module `module`'s lora_A and lora_B (the adapter name is not stored)."""
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def adapter_rules(cfg: ModelConfig, family: str, paths: Collection[str]) -> list[Rule]:
    """The base weights' rules whose weight carries adapters among our flat param `paths`."""
    return [r for r in rules(cfg, family) if r.path + LORA_A in paths]


def modules(rule: Rule) -> Iterator[tuple[tuple[int, ...], str]]:
    """(lead index, HF module) of every (layer, expert) slice of the rule's weight."""
    for idx in np.ndindex(*rule.lead):
        names = rule.names(*idx)
        if len(names) != 1:
            raise HFError(f"{rule.path}: adapters of a weight stored as {len(names)} HF tensors are not supported")
        yield tuple(int(i) for i in idx), module_of(names[0])


def to_peft(rule: Rule, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One (layer, expert) slice: our A [*contracted, r], B [r, *output] -> PEFT's lora_A [r, in], lora_B [out, r]."""
    r = a.shape[-1]
    (lora_b,) = rule.save(b)
    if lora_b.shape[1] != r:
        raise HFError(f"{rule.path}: B {b.shape} does not map to [out, {r}] (got {lora_b.shape})")
    return np.ascontiguousarray(a.reshape(-1, r).T), np.ascontiguousarray(lora_b)


def from_peft(rule: Rule, lora_a: np.ndarray, lora_b: np.ndarray, a_shape: tuple[int, ...],
              b_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `to_peft` for slices of shapes `a_shape`, `b_shape` (checked)."""
    want_a = (a_shape[-1], math.prod(a_shape[:-1]))
    (index,) = rule.save(np.arange(math.prod(b_shape)).reshape(b_shape))  # where each of our B's entries goes
    if lora_a.shape != want_a or lora_b.shape != index.shape:
        raise HFError(f"{rule.path}: PEFT lora_A {lora_a.shape} / lora_B {lora_b.shape}, expected {want_a} / "
                      f"{index.shape} for this model and rank")
    b = np.empty(math.prod(b_shape), lora_b.dtype)
    b[index.ravel()] = lora_b.ravel()
    return np.ascontiguousarray(lora_a.T.reshape(a_shape)), b.reshape(b_shape)


def target_modules(cfg: ModelConfig, family: str, targeted: Collection[str]) -> list[str]:
    """PEFT `target_modules` for exactly the HF modules `targeted`: a module's last name (`q_proj`) when
    every module of that name has adapters, otherwise those modules' full names (PEFT matches a
    target against the whole module name or its dotted suffix)."""
    by_suffix: dict[str, list[str]] = {}
    for rule in rules(cfg, family):
        for idx in np.ndindex(*rule.lead):
            for name in rule.names(*idx):
                if name.endswith(".weight"):
                    module = module_of(name)
                    by_suffix.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    out: list[str] = []
    for suffix, names in sorted(by_suffix.items()):
        hit = [m for m in names if m in targeted]
        out += [suffix] if len(hit) == len(names) else hit
    return out


def adapter_config(rank: int, alpha: float, dropout: float, init: str, targets: list[str]) -> dict[str, Any]:
    """adapter_config.json as PEFT (0.21) writes it for a plain LoRA on a causal LM; the base is the
    directory the config sits in (`jaxinfra hf export` writes both)."""
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": ".", "revision": None,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets,
        "exclude_modules": None, "use_rslora": False, "init_lora_weights": True if init == "kaiming" else init,
        "inference_mode": True, "auto_mapping": None, "megatron_config": None, "megatron_core": "megatron.core",
        "loftq_config": {}, "eva_config": None, "corda_config": None, "layers_pattern": None,
    }
    config.update(_PLAIN)
    return config


def read_adapter_config(adapter_dir: pathlib.Path) -> dict[str, Any]:
    """A PEFT adapter_config.json, refused by name where it asks for more than plain LoRA."""
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise HFError(f"{adapter_dir}: no {CONFIG_FILE} (is it a PEFT adapter directory?)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"{path}: invalid JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise HFError(f"{path}: peft_type={config.get('peft_type')!r}, only LORA adapters are supported")
    for key, plain in _PLAIN:
        value = config.get(key, plain)
        if value != plain and not (plain is None and value in ([], {})):
            raise HFError(f"{path}: {key}={value!r} is not supported (plain LoRA: {key}={plain!r})")
    return config


def scale_alpha(config: Mapping[str, Any]) -> float:
    """Our `alpha` (scale alpha / r) for PEFT's lora_alpha: rsLoRA scales by lora_alpha / sqrt(r)."""
    alpha, r = float(config["lora_alpha"]), int(config["r"])
    return alpha * math.sqrt(r) if config.get("use_rslora") else alpha


def _peft_specs(rule: Rule, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> list[tuple[str, tuple, tuple]]:
    """(PEFT key, HF shape, lead index) of both tensors of every slice, from our full shapes alone."""
    n = len(rule.lead)
    a_hf, b_hf = to_peft(rule, np.zeros(a_shape[n:], np.float32), np.zeros(b_shape[n:], np.float32))
    out = []
    for idx, module in modules(rule):
        key_a, key_b = peft_keys(module)
        out += [(key_a, a_hf.shape, idx), (key_b, b_hf.shape, idx)]
    return out


def write_adapters(out_dir: pathlib.Path, cfg: ModelConfig, family: str, shapes: Mapping[str, tuple[int, ...]],
                   fetch: Any, lora: Any) -> dict[str, Any]:
    """adapter_config.json + adapter_model.safetensors (float32) in `out_dir` for the adapters among our
    flat param `shapes`; `fetch(path, lead index)` gives one (layer, expert) slice of a param on the
    host; `lora` is the run's LoraConfig (rank, alpha, dropout, init)."""
    found = adapter_rules(cfg, family, shapes)
    if not found:
        raise HFError("--adapters: the checkpoint holds no LoRA adapters on weights the HF export maps")
    specs, where = [], {}
    for rule in found:
        for key, shape, idx in _peft_specs(rule, shapes[rule.path + LORA_A], shapes[rule.path + LORA_B]):
            specs.append((key, shape, np.dtype(np.float32)))
            where[key] = (rule, idx)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for key, _, _ in specs[::2]:  # A then B of one slice
            rule, idx = where[key]
            a = np.asarray(fetch(rule.path + LORA_A, idx), np.float32)
            b = np.asarray(fetch(rule.path + LORA_B, idx), np.float32)
            lora_a, lora_b = to_peft(rule, a, b)
            yield key, lora_a
            yield peft_keys(module_of(rule.names(*idx)[0]))[1], lora_b

    out_dir.mkdir(parents=True, exist_ok=True)
    size = write_safetensors(out_dir / WEIGHTS_FILE, specs, tensors())
    targeted = {module for rule in found for _, module in modules(rule)}
    config = adapter_config(lora.rank, float(lora.alpha), float(lora.dropout), lora.init,
                            target_modules(cfg, family, targeted))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")  # out_dir: export's build directory
    return {"adapter_tensors": len(specs), "adapter_bytes": size, "target_modules": config["target_modules"]}


def read_adapters(adapter_dir: str | pathlib.Path, cfg: ModelConfig, family: str,
                  shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """A PEFT adapter's tensors as our full LoRA params {path: array} for the adapters among our flat
    param `shapes` (a model built with the adapter's LoRA config); every PEFT tensor must land on one
    of them and every one of them must be in the file (HFError naming the first that does not)."""
    adapter_dir = pathlib.Path(adapter_dir)
    read_adapter_config(adapter_dir)
    if not (adapter_dir / WEIGHTS_FILE).is_file():
        raise HFError(f"{adapter_dir}: no {WEIGHTS_FILE}")
    files = SafetensorsDir(adapter_dir, only=WEIGHTS_FILE)
    out: dict[str, np.ndarray] = {}
    for rule in adapter_rules(cfg, family, shapes):
        a_shape, b_shape = shapes[rule.path + LORA_A], shapes[rule.path + LORA_B]
        a, b = np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)
        n = len(rule.lead)
        for idx, module in modules(rule):
            key_a, key_b = peft_keys(module)
            a[idx], b[idx] = from_peft(rule, files.read(key_a).astype(np.float32),
                                       files.read(key_b).astype(np.float32), a_shape[n:], b_shape[n:])
        out[rule.path + LORA_A], out[rule.path + LORA_B] = a, b
    unused = sorted(set(files.where) - files.used)
    if unused:
        raise HFError(f"{adapter_dir}: adapter tensor {unused[0]} has no LoRA target in this model "
                      f"({len(unused)} unused; check lora.targets)")
    return out


def projection_paths(cfg: ModelConfig) -> dict[str, str]:
    """Our flat weight path -> its projection name (models/quant_config.py PROJECTIONS), from the modules'
    own tables (the `PROJECTIONS` that models/project.py prepare_weights reads)."""
    from flax import nnx

    from models import Transformer

    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    out = {}
    for path, node in nnx.iter_graph(model):
        for attr, (name, _) in (getattr(type(node), "PROJECTIONS", None) or {}).items():
            if hasattr(node, attr):
                out["/".join(map(str, (*path, attr)))] = name
    return out


def lora_overrides(adapter_dir: str | pathlib.Path, cfg: ModelConfig, family: str) -> list[str]:
    """The `lora.*` KEY=VALUE overrides of a model that computes what the PEFT adapter in `adapter_dir`
    computes on this base: rank, alpha (rsLoRA folded in), dropout, init, and as targets the full
    projection names of the weights whose every (layer, expert) module has adapters."""
    adapter_dir = pathlib.Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    if not (adapter_dir / WEIGHTS_FILE).is_file():
        raise HFError(f"{adapter_dir}: no {WEIGHTS_FILE}")
    keys = set(SafetensorsDir(adapter_dir, only=WEIGHTS_FILE).where)
    names, targets = projection_paths(cfg), []
    for rule in rules(cfg, family):
        if rule.path not in names:
            continue
        have = [peft_keys(module)[0] in keys for _, module in modules(rule)]
        if any(have) and not all(have):
            raise HFError(f"{adapter_dir}: adapters on {sum(have)} of the {len(have)} modules of {rule.path} "
                          f"(our LoRA targets a projection in every layer)")
        if all(have):
            targets.append(names[rule.path])
    if not targets:
        raise HFError(f"{adapter_dir}: no adapter tensor belongs to a projection of this {family} model")
    init = "gaussian" if config.get("init_lora_weights") == "gaussian" else "kaiming"
    return [f"lora.rank={int(config['r'])}", f"lora.alpha={scale_alpha(config)!r}",
            f"lora.dropout={float(config.get('lora_dropout') or 0.0)!r}",
            f"lora.targets=[{','.join(dict.fromkeys(targets))}]", f"lora.init={init}"]
