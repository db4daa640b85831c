"""Model sizes for a sweep: a width/depth rule, or an explicit list.

The rule ties every shape to the depth L, so one number walks a whole family:

    d_model   = head_dim * max(1, round(aspect_ratio * L / head_dim))   (width ~ aspect_ratio x depth)
    num_heads = d_model / head_dim                                       (fixed head width)
    kv_heads  = the largest divisor of num_heads <= num_heads / gqa_group (1: MHA)
    mlp_dim   = multiple_of * ceil(mlp_ratio * d_model / multiple_of)    (SwiGLU hidden width)

Fixed aspect ratio, head width and MLP ratio is the usual way to build a scaling family
(Kaplan et al. 2020 find loss depends only weakly on shape at fixed N; Hoffmann et al.
2022, table A9, list the Chinchilla family's shapes). Sizes can also be asked for by
target non-embedding parameter count: the rule's depth whose model comes closest (in
log space) is taken.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxinfra.config import ConfigError
from jaxinfra.metrics.flops import param_counts
from models.config import ModelConfig

MAX_DEPTH = 256
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


@dataclasses.dataclass(frozen=True)
class SizeRule:
    """The width/depth rule (see the module docstring)."""

    aspect_ratio: float = 32.0  # d_model / num_layers
    head_dim: int = 32
    mlp_ratio: float = 4.0  # mlp_dim / d_model before rounding
    multiple_of: int = 32  # mlp_dim is rounded up to a multiple of this
    gqa_group: int = 1  # query heads per kv head (1: MHA)

    def problems(self) -> list[tuple[str, object, str]]:
        out: list[tuple[str, object, str]] = []
        for key in ("aspect_ratio", "mlp_ratio"):
            if getattr(self, key) <= 0:
                out.append((key, getattr(self, key), "> 0"))
        for key in ("head_dim", "multiple_of", "gqa_group"):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "a positive integer"))
        if self.head_dim % 2:
            out.append(("head_dim", self.head_dim, "an even number (RoPE rotates pairs)"))
        return out


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """One member of the family: a name, the model fields it sets, and an optional lr."""

    name: str
    model: dict[str, Any]
    lr: float | None = None


def shape_for_depth(rule: SizeRule, num_layers: int) -> dict[str, int]:
    """The model fields the rule gives for depth `num_layers`."""
    if num_layers < 1:
        raise ConfigError(f"sizes.depths: {num_layers} is invalid: depths must be positive integers")
    heads = max(1, round(rule.aspect_ratio * num_layers / rule.head_dim))
    d_model = heads * rule.head_dim
    kv = max(k for k in range(1, heads + 1) if heads % k == 0 and k <= max(1, heads // rule.gqa_group))
    mlp_dim = rule.multiple_of * math.ceil(rule.mlp_ratio * d_model / rule.multiple_of)
    return {"num_layers": num_layers, "d_model": d_model, "num_heads": heads, "num_kv_heads": kv,
            "head_dim": rule.head_dim, "mlp_dim": mlp_dim}


def size_name(model: dict[str, Any]) -> str:
    return f"L{model['num_layers']}-d{model['d_model']}"


def sizes_from_depths(rule: SizeRule, depths: tuple[int, ...]) -> list[ModelSize]:
    out = []
    for depth in depths:
        shape = shape_for_depth(rule, depth)
        out.append(ModelSize(size_name(shape), shape))
    return out


def sizes_from_targets(rule: SizeRule, targets: tuple[float, ...], base: ModelConfig) -> list[ModelSize]:
    """For each target non-embedding parameter count, the rule's depth that comes closest."""
    candidates = []
    for depth in range(1, MAX_DEPTH + 1):
        shape = shape_for_depth(rule, depth)
        n = param_counts(dataclasses.replace(base, **shape))["non_embedding"]
        candidates.append((n, shape))
    out: list[ModelSize] = []
    chosen: dict[str, float] = {}
    for target in targets:
        if target <= 0:
            raise ConfigError(f"sizes.params: {target!r} is invalid: targets must be positive parameter counts")
        n, shape = min(candidates, key=lambda c: abs(math.log(c[0] / target)))
        name = size_name(shape)
        if name in chosen:
            raise ConfigError(f"sizes.params: targets {chosen[name]:.3g} and {target:.3g} both give {name} "
                              f"({n:.3g} non-embedding params); spread the targets or use sizes.depths")
        chosen[name] = target
        out.append(ModelSize(name, shape))
    return out


def sizes_from_list(entries: Any) -> list[ModelSize]:
    """Explicit sizes: a list of mappings of model fields, each with optional `name` and `lr`."""
    if not isinstance(entries, (list, tuple)):
        raise ConfigError("sizes.models: expected a list of mappings of model fields")
    out: list[ModelSize] = []
    for i, entry in enumerate(entries):
        key = f"sizes.models[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{key}: expected a mapping of model fields, got {entry!r}")
        entry = dict(entry)
        name = entry.pop("name", None)
        lr = entry.pop("lr", None)
        for field in entry:
            if field not in _MODEL_FIELDS:
                raise ConfigError(f"unknown key '{key}.{field}'; allowed: name, lr, {', '.join(sorted(_MODEL_FIELDS))}")
        if lr is not None:
            try:
                lr = float(lr)
            except (TypeError, ValueError):
                raise ConfigError(f"{key}.lr: expected a number, got {lr!r}") from None
        if name is None:
            if "num_layers" not in entry or "d_model" not in entry:
                raise ConfigError(f"{key}: give a name, or both num_layers and d_model")
            name = size_name(entry)
        out.append(ModelSize(str(name), entry, lr))
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"sizes.models: names must be unique, repeated: {', '.join(dup)}")
    return out
