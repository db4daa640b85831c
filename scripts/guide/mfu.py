"""The FLOPs per token and MFU of a config, term by term, as jaxinfra counts them.

    python scripts/guide/mfu.py CONFIG [KEY=VALUE ...] [--device-kind h100 --devices 8 --tokens-per-s 67651]

Prints the matmul parameters N (`jaxinfra.metrics.flops.param_counts`), the two terms of the
training FLOPs per token at the config's `train.seq_len` T, weights (6 N: a multiply-add per
matmul parameter forward, twice that backward) and attention (3 x 2 H (d_qk + d_v) keys, summed
over the layers: 12 L d T for plain attention with H * head_dim = d), their sum, and
`flops_per_token` itself, which must equal it. With `--tokens-per-s` (over all devices) it then
computes MFU the way metrics.jsonl and `jaxinfra plan` do: tokens/s per device x FLOPs per token
/ the device's dense peak FLOP/s for the model's dtype (`jaxinfra/metrics/peak.py`).
Nothing is allocated: full-size presets work on a laptop.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxinfra.config import load_config
from jaxinfra.metrics.flops import _attention_dims, attention_keys, flops_per_token, param_counts
from jaxinfra.metrics.writers import mfu
from jaxinfra.plan.devices import device_spec
from models.config import ModelConfig


def terms(model: ModelConfig, seq_len: int) -> dict[str, float]:
    """The training FLOPs per token split as the guide writes it: 6 N + the attention term."""
    n = param_counts(model)["matmul"]
    d_qk, d_v = _attention_dims(model)
    attention = 3 * 2 * model.num_heads * (d_qk + d_v) * attention_keys(model, seq_len)
    return {"N": float(n), "6N": 6.0 * n, "attention": attention, "sum": 6.0 * n + attention,
            "flops_per_token": flops_per_token(model, seq_len)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--device-kind")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tokens-per-s", type=float, help="achieved tokens/s over all devices")
    args = parser.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    m, seq = cfg.model, cfg.train.seq_len
    t = terms(m, seq)
    print(f"{args.config}: L={m.num_layers} d_model={m.d_model} heads={m.num_heads} T={seq}")
    print(f"N (matmul parameters)          {t['N']:.4e}")
    print(f"6 N (weights, fwd + bwd)       {t['6N']:.4e}")
    mha = 12 * m.num_layers * m.d_model * seq
    print(f"attention (12 L d T for MHA)   {t['attention']:.4e}   (12 L d T = {mha:.4e})")
    print(f"6 N + attention                {t['sum']:.4e}")
    print(f"flops_per_token                {t['flops_per_token']:.4e}")
    if args.tokens_per_s and args.device_kind:
        peak = device_spec(args.device_kind).peak(m.dtype)
        per_device = args.tokens_per_s / args.devices
        print(f"MFU = {per_device:,.0f} tokens/s/device x {t['flops_per_token']:.4e} FLOPs/token "
              f"/ {peak:.4g} FLOP/s ({args.device_kind}, {m.dtype} dense peak) = "
              f"{mfu(per_device, t['flops_per_token'], peak):.3f}")


if __name__ == "__main__":
    main()
