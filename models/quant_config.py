"""How the model's matmuls, stored weights and KV cache are quantized: the `quant` config section.

It lives in models/ (like ModelConfig) so that models never import the runtime;
jaxinfra/config.py embeds it as the `quant` section of the run config.

Every weight matmul of the model is one named projection (models/project.py); `exclude`
names projections (or whole groups: `attention`, `mla`, `mlp`, `experts`) that keep the
compute dtype under `train`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Literal, get_args

from models.config import ModelConfig
from sharding.ranges import range_problems, ranged

TrainMode = Literal[
    "none",  # matmuls in the compute dtype
    "int8",  # symmetric int8 operands, per-channel / per-token scales, int32 accumulation (fwd + bwd)
    "fp8",  # float8_e4m3 forward operands, float8_e5m2 gradients, per-tensor scales
]
Fp8Scaling = Literal[
    "current",  # scale from this step's absmax of each operand
    "delayed",  # scale from the max of the last `amax_history` steps' absmax (Transformer Engine style)
]
WeightStorage = Literal["none", "int8"]  # int8: a `jaxinfra quantize` checkpoint (inference only)
KvCacheStorage = Literal["none", "int8"]
TRAIN_MODES: tuple[str, ...] = get_args(TrainMode)

# Every projection name the model uses, by group (the group name excludes all of its members).
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "attention": ("attention.q", "attention.k", "attention.v", "attention.o"),
    "mla": ("mla.q", "mla.q_a", "mla.q_b", "mla.kv_a", "mla.kv_b", "mla.o"),
    "mlp": ("mlp.gate", "mlp.up", "mlp.down"),  # dense MLPs, MoE shared experts included
    "experts": ("experts.gate", "experts.up", "experts.down"),  # routed experts (capacity and dropless)
    "unembed": ("unembed",),  # the output projection (the embedding table when tied)
    "router": ("router",),
}
PROJECTION_NAMES: tuple[str, ...] = tuple(n for names in PROJECTIONS.values() for n in names)


@dataclasses.dataclass(frozen=True)
class MatmulQuant:
    """What one projection does (static: part of the model's graph definition)."""

    name: str
    mode: TrainMode = "none"
    delayed: bool = False  # fp8 delayed scaling: the projection keeps an amax history


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    train: TrainMode = "none"
    scaling: Fp8Scaling = "current"  # fp8 only
    amax_history: int = ranged(16, 1)  # fp8 delayed scaling: steps of absmax kept per operand
    exclude: tuple[str, ...] = ("unembed", "router")  # projections kept in the compute dtype by `train`
    # Set by `jaxinfra quantize` in the config of the checkpoint it writes: int8 values + float32
    # scales per output channel (group_size 0) or per group of group_size inputs.
    weights: WeightStorage = "none"
    group_size: int = ranged(0, 0, note="0: per output channel")
    kv_cache: KvCacheStorage = "none"  # int8: the decode cache as int8 + per-token-per-head scales
    # fp8 on a backend without fp8 dots (XLA:CPU, GPUs before compute capability 8.9): XLA upcasts the
    # operands and runs the dot in float32 (exact, no speed-up). Refused unless this is true.
    fp8_emulation: bool = False

    def excluded(self, name: str) -> bool:
        return any(name == e or name.startswith(e + ".") for e in self.exclude)

    def matmul(self, name: str) -> MatmulQuant:
        """The training-time behaviour of projection `name`. Routed experts never keep a history
        (their matmuls run inside the expert-parallel shard_map; see docs/quantization.md)."""
        if self.train == "none" or self.excluded(name) or name not in PROJECTION_NAMES:  # e.g. "embed" (a lookup)
            return MatmulQuant(name)
        delayed = self.train == "fp8" and self.scaling == "delayed" and not name.startswith("experts.")
        return MatmulQuant(name, self.train, delayed)

    def stores_int8(self, name: str) -> bool:
        """Whether weight `name` is stored as int8 (every projection weight but the router)."""
        return self.weights == "int8" and name != "router"

    def problems(self) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out = range_problems(self)
        known = set(PROJECTIONS) | set(PROJECTION_NAMES)
        for name in self.exclude:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                out.append(("exclude", name, f"a projection or group name{hint}: one of {sorted(known)}"))
        if self.group_size and self.weights == "none":
            out.append(("group_size", self.group_size, "0 unless quant.weights=int8"))
        return out


def input_dims(model: ModelConfig) -> dict[str, int]:
    """The size of the last contracted dim of each kind of weight (what a weight group splits)."""
    m = model
    dims = {"model.d_model": m.d_model, "model.mlp_dim": m.mlp_dim}
    if m.is_mla:
        dims["model.v_head_dim"] = m.v_head_dim
        dims["model.kv_lora_rank"] = m.kv_lora_rank
        if m.q_lora_rank is not None:
            dims["model.q_lora_rank"] = m.q_lora_rank
    else:
        dims["model.head_dim"] = m.resolved_head_dim
    if m.is_moe:
        dims["model.moe_mlp_dim"] = m.expert_dim
        if m.moe_shared_experts:
            dims["model.moe_shared_experts x moe_mlp_dim"] = m.moe_shared_experts * m.expert_dim
    return dims


def group_size_problem(model: ModelConfig, quant: QuantConfig) -> list[tuple[str, object, str]]:
    """quant.group_size must divide every weight's input dimension (the last contracted dim)."""
    if not quant.group_size:
        return []
    for name, size in input_dims(model).items():
        if size % quant.group_size:
            return [("group_size", quant.group_size, f"a divisor of the input dimension {name}={size}")]
    return []


NO_QUANT = QuantConfig()  # float matmuls, float weights, float cache
