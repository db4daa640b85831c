"""MHA, GQA, MQA and MLA on one model: attention parameters and KV-cache bytes per token, from the stack itself.

    python scripts/guide/attention_variants.py [CONFIG] [KEY=VALUE ...] [--context 32768]

Each variant is the config with a few `model.*` overrides (printed in the table). The
attention parameters per layer are summed from the model's own abstract parameters
(jaxinfra/state.py: abstract_params, the `layers/attn/*` arrays, nothing allocated); the
cache bytes per token come from models/cache.py: bytes_per_token in the config's compute
dtype (`model.dtype`); the last column is the cache of one sequence of `--context` tokens.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flax import nnx

from jaxinfra.config import load_config
from jaxinfra.metrics import param_counts
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.state import abstract_params
from models import cache

VARIANTS = {
    "MHA": ["model.num_kv_heads=null"],
    "GQA": [],  # the config's own num_kv_heads
    "MQA": ["model.num_kv_heads=1"],
    "MLA": ["model.attention_type=mla", "model.num_kv_heads=null", "model.q_lora_rank=1536",
            "model.kv_lora_rank=512", "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64",
            "model.v_head_dim=128"],  # DeepSeek-V3's ranks and head dims
}


def attention_params_per_layer(model_cfg) -> int:
    params = nnx.to_flat_state(abstract_params(model_cfg))
    attn = sum(math.prod(v.shape) for path, v in params if path[0] == "layers" and path[1] == "attn")
    return attn // model_cfg.num_layers


def rows(config: str, overrides: list[str], context: int) -> list[list]:
    out = []
    for name, extra in VARIANTS.items():
        cfg = load_config(config, [*overrides, *extra]).model
        per_token = cache.bytes_per_token(cfg)
        kv = "latent" if cfg.is_mla else str(cfg.kv_heads)
        cached = (f"{cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}" if cfg.is_mla
                  else f"2 x {cfg.kv_heads} x {cfg.resolved_head_dim}")
        out.append([name, kv, cached, attention_params_per_layer(cfg), param_counts(cfg)["total"], per_token,
                    per_token * context / 2**30])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="llama3-8b")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--context", type=int, default=32768, help="tokens of one sequence for the last column")
    args = parser.parse_intermixed_args()  # KEY=VALUE overrides may follow the options
    base = load_config(args.config, args.overrides).model
    print(f"{args.config}: d_model {base.d_model}, {base.num_layers} layers, {base.num_heads} query heads, "
          f"cache dtype {base.dtype}")
    columns = [Column("variant"), Column("KV heads"), Column("cached per layer, token"),
               Column("attn params/layer", ",", ">"), Column("total params", ",", ">"),
               Column("KV bytes/token", ",", ">"),
               Column(f"GiB at {args.context:,} tokens", ".2f", ">")]
    print(format_table(rows(args.config, args.overrides, args.context), columns))
    for name, extra in VARIANTS.items():
        print(f"{name}: {' '.join(extra) or '(the config as it is)'}")


if __name__ == "__main__":
    main()
