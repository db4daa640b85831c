"""Low-rank adapters on the model's projections: the `lora` config section (jax-free).

It lives in models/ (like models/quant_config.py) so that models get it at construction and never
read the run config; jaxinfra/config.py embeds it as the `lora` section. With `rank > 0` every
targeted projection y = x W computes

    y = x W + dropout(x) A B * (alpha / rank)

with A [*batch dims, *contracted dims, rank] and B [*batch dims, rank, *output dims] (batch dims:
the experts of a routed-expert weight), W frozen (models/project.py, jaxinfra/lora/).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Literal, get_args

from models.config import ModelConfig
from models.quant_config import PROJECTIONS
from sharding.ranges import range_problems, ranged

LoraInit = Literal[
    "kaiming",  # PEFT's default (init_lora_weights=True): A kaiming-uniform(a=sqrt(5)) as torch nn.Linear
    "gaussian",  # PEFT's "gaussian": A ~ N(0, std 1/rank)
]
LORA_INITS: tuple[str, ...] = get_args(LoraInit)

# The projections adapters may target (never the unembedding or the router).
LORA_GROUPS: tuple[str, ...] = ("attention", "mla", "mlp", "experts")
LORA_PROJECTIONS: tuple[str, ...] = tuple(n for g in LORA_GROUPS for n in PROJECTIONS[g])
SHORT_NAMES: tuple[str, ...] = tuple(dict.fromkeys(n.split(".", 1)[1] for n in LORA_PROJECTIONS))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = ranged(0, 0, note="0: off")
    alpha: float = ranged(16.0, 0, lo_open=True)  # the adapters' output is scaled by alpha / rank
    dropout: float = ranged(0.0, 0, 1, hi_open=True)  # on the adapters' input only, in training
    # Short names (q k v o gate up down q_a q_b kv_a kv_b: every projection ending so) or full
    # projection names (attention.q, experts.up, ...; models/quant_config.py PROJECTIONS).
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    init: LoraInit = "kaiming"  # B starts at zero either way, so the adapted model starts as the base

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def problems(self) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out = range_problems(self)
        if not self.targets:
            out.append(("targets", list(self.targets), f"a non-empty list of {list(SHORT_NAMES)} or full names"))
        known = set(SHORT_NAMES) | set(LORA_PROJECTIONS)
        for name in self.targets:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                out.append(("targets", name, f"a projection name{hint}: one of {sorted(known)}"))
        if self.init not in LORA_INITS:
            out.append(("init", self.init, f"one of {list(LORA_INITS)}"))
        return out


NO_LORA = LoraConfig()


def resolve_target(name: str) -> tuple[str, ...]:
    """The projection names one `lora.targets` entry names (a short name: every group's)."""
    if name in LORA_PROJECTIONS:
        return (name,)
    return tuple(n for n in LORA_PROJECTIONS if n.split(".", 1)[1] == name)


def lora_targets(cfg: LoraConfig) -> tuple[str, ...]:
    """The projection names `cfg.targets` resolves to (empty when LoRA is off), in PROJECTIONS order."""
    if not cfg.enabled:
        return ()
    wanted = {n for t in cfg.targets for n in resolve_target(t)}
    return tuple(n for n in LORA_PROJECTIONS if n in wanted)


def projection_dims(model: ModelConfig) -> dict[str, list[tuple[int, int, int]]]:
    """Every adaptable projection the model has -> its instances as (d_in, d_out, count): input and
    output sizes (the products of the contracted and of the output dims) and how many such matrices
    the model holds (layers x experts). A projection the model lacks is absent."""
    m = model
    flags = m.moe_layer_flags()
    n_moe, n_dense = sum(flags), len(flags) - sum(flags)
    n_all = len(flags)
    d, h = m.d_model, m.num_heads
    out: dict[str, list[tuple[int, int, int]]] = {}
    if m.is_mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            out["mla.q"] = [(d, h * qk, n_all)]
        else:
            out["mla.q_a"] = [(d, m.q_lora_rank, n_all)]
            out["mla.q_b"] = [(m.q_lora_rank, h * qk, n_all)]
        out["mla.kv_a"] = [(d, m.kv_lora_rank + m.qk_rope_head_dim, n_all)]
        out["mla.kv_b"] = [(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), n_all)]
        out["mla.o"] = [(h * m.v_head_dim, d, n_all)]
    else:
        dh = m.resolved_head_dim
        out["attention.q"] = [(d, h * dh, n_all)]
        out["attention.k"] = out["attention.v"] = [(d, m.kv_heads * dh, n_all)]
        out["attention.o"] = [(h * dh, d, n_all)]
    widths = [(m.mlp_dim, n_dense)] if n_dense else []
    if n_moe and m.moe_shared_experts:
        widths.append((m.moe_shared_experts * m.expert_dim, n_moe))
    if widths:
        out["mlp.gate"] = out["mlp.up"] = [(d, f, n) for f, n in widths]
        out["mlp.down"] = [(f, d, n) for f, n in widths]
    if n_moe:
        e, f = m.moe_num_experts, m.expert_dim
        out["experts.gate"] = out["experts.up"] = [(d, f, n_moe * e)]
        out["experts.down"] = [(f, d, n_moe * e)]
    return out


def model_problems(model: ModelConfig, cfg: LoraConfig) -> list[tuple[str, object, str]]:
    """`lora.targets` entries naming no projection of this model, and a rank above a target's smallest
    dimension, as (key, value, what is allowed); empty when LoRA is off or fits."""
    if not cfg.enabled:
        return []
    dims = projection_dims(model)
    out: list[tuple[str, object, str]] = []
    for name in cfg.targets:
        if not any(n in dims for n in resolve_target(name)):
            out.append(("targets", name, f"a projection this model has: one of {sorted(dims)} "
                                         f"(or their short names)"))
    experts = [n for n in lora_targets(cfg) if n.startswith("experts.") and n in dims]
    if cfg.dropout and experts:  # the expert exchange's shard_maps take no dropout keys
        out.append(("dropout", cfg.dropout, f"0 when the targets include routed experts ({', '.join(experts)})"))
    for name in lora_targets(cfg):
        for d_in, d_out, _ in dims.get(name, []):
            if cfg.rank > min(d_in, d_out):
                out.append(("rank", cfg.rank, f"<= the smallest dimension of target {name} "
                                              f"(d_in={d_in}, d_out={d_out})"))
                return out
    return out


def adapter_param_count(model: ModelConfig, cfg: LoraConfig) -> int:
    """Trainable parameters: sum of rank * (d_in + d_out) over the targets' matrices (layers x experts)."""
    dims = projection_dims(model)
    return sum(cfg.rank * (d_in + d_out) * n for name in lora_targets(cfg) for d_in, d_out, n in dims.get(name, []))


def fan_in_bound(d_in: int) -> float:
    """kaiming_uniform_(a=sqrt(5)) of torch nn.Linear(d_in, r): U(-1/sqrt(d_in), 1/sqrt(d_in))."""
    return 1.0 / math.sqrt(d_in)
