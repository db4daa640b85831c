"""Serving arithmetic: concurrent sequences per device from the KV cache, and speculative decoding's expectation.

    python scripts/guide/serving_capacity.py sequences [--seq-len 8192] [--devices h100,h200] [SPEC ...]
    python scripts/guide/serving_capacity.py speculative [--acceptance 0.6,0.8,0.9] [--draft 1,2,4,8]
                                                         [--cost 0.05] [--trials 200000]

`sequences`: for each SPEC (a preset, optionally `:KEY=VALUE,...` overrides) with bfloat16 weights,
how many rows of `--seq-len` positions fit on one device beside the weights:

    rows = floor((device memory - weight bytes) / cache bytes of one row)

with the weight bytes of `jaxinfra plan --inference` (jaxinfra/plan/memory.py) and the cache bytes
of models/cache.py `cache_bytes` (what `jaxinfra info --inference` prints; sliding-window layers
keep only their window). Activations and the prefill's workspace are left out: a real server
keeps some memory back for them. Then the plan's decode step (jaxinfra/plan/inference.py
`decode_time`) at that many rows, and the batch from which a step is compute-bound.

`speculative`: a draft proposes k tokens, the target checks them in one forward pass and keeps
the longest accepted prefix plus one token of its own. With each draft token accepted
independently with probability a (Leviathan et al. 2023), tokens per target pass are

    E = (1 - a^(k+1)) / (1 - a)

next to a Monte-Carlo draw of the same process, and the speed-up E / (c k + 1) when a draft
step costs c target steps and a verify pass costs one target step.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from jaxinfra.config import Config, load_config
from jaxinfra.metrics import param_counts
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan.devices import DEVICES, DeviceSpec
from jaxinfra.plan.estimate import Plan, make_plan
from models import cache as kv_cache

GIB = 2**30


# ---------------------------------------------------------------- concurrent sequences


def row_bytes(cfg: Config, seq_len: int) -> int:
    """KV-cache bytes of one sequence of `seq_len` positions, in the config's cache dtype."""
    return kv_cache.cache_bytes(cfg.model, 1, seq_len, cfg.quant.kv_cache == "int8")


def max_rows(memory_bytes: float, weight_bytes: float, per_row: float) -> int:
    """Sequences whose caches fit beside the weights (0 when the weights alone do not fit)."""
    return max(0, math.floor((memory_bytes - weight_bytes) / per_row))


def compute_bound_from(weight_bytes: float, per_row: float, matmul_params: int, spec: DeviceSpec,
                       dtype: str) -> float:
    """The batch B at which a decode step's compute, 2 N B / (peak x efficiency), reaches its memory
    time, (weights + B x row cache) / bandwidth (inf: never, the cache read grows faster)."""
    compute_per_row = 2 * matmul_params / spec.throughput(dtype)
    read_per_row = per_row / spec.memory_bandwidth
    if compute_per_row <= read_per_row:
        return math.inf
    return weight_bytes / spec.memory_bandwidth / (compute_per_row - read_per_row)


def decode_plan(preset: str, overrides: list[str], spec: DeviceSpec, rows: int, seq_len: int) -> Plan:
    """`jaxinfra plan --inference` for `rows` rows of `seq_len` positions on one device of `spec`."""
    cfg = load_config(preset, [*overrides, "mesh.data=1", f"train.batch_size={max(rows, 1)}",
                               f"train.seq_len={seq_len}"])
    return make_plan(cfg, 1, spec, inference=True)


def weight_bytes(plan: Plan) -> float:
    return next(c.bytes for c in plan.memory.components if c.name == "params")


def attention_name(cfg: Config) -> str:
    m = cfg.model
    if m.attention_type == "mla":
        name = f"MLA r={m.kv_lora_rank}"
    else:
        name = "MHA" if m.kv_heads == m.num_heads else f"GQA {m.num_heads}/{m.kv_heads}"
    name += " +window" if kv_cache.has_sliding(m) else ""
    return name + (" int8" if cfg.quant.kv_cache == "int8" else "")


def sequences_table(specs: list[str], kinds: list[str], seq_len: int) -> str:
    rows = []
    for text in specs:
        preset, _, rest = text.partition(":")
        overrides = ["model.param_dtype=bfloat16", *(o for o in rest.split(",") if o)]
        cfg = load_config(preset, [*overrides, "mesh.data=1"])
        per_row = row_bytes(cfg, seq_len)
        weights = weight_bytes(decode_plan(preset, overrides, DEVICES[kinds[0]], 1, seq_len))
        per_token = kv_cache.bytes_per_token(cfg.model, cfg.quant.kv_cache == "int8")
        row = [text, attention_name(cfg), weights / GIB, per_token, per_row / GIB]
        for kind in kinds:
            spec = DEVICES[kind]
            n = max_rows(spec.memory_bytes, weights, per_row)
            tok_s = f"{n / decode_plan(preset, overrides, spec, n, seq_len).time.step_s:,.0f}" if n else "-"
            crossover = compute_bound_from(weights, per_row, param_counts(cfg.model)["matmul"], spec, cfg.model.dtype)
            row += [n, tok_s, "-" if not n else "never" if math.isinf(crossover) else f"{crossover:,.0f}"]
        rows.append(row)
    columns = [Column("model"), Column("attention"), Column("weights GiB", ".1f"), Column("KV bytes/token", ","),
               Column(f"GiB/row at {seq_len:,}", ".3f")]
    for kind in kinds:
        columns += [Column(f"{kind} rows", ","), Column(f"{kind} tok/s", align=">"),
                    Column(f"{kind} compute-bound at", align=">")]
    return format_table(rows, columns)


# ---------------------------------------------------------------- speculative decoding


def expected_tokens(acceptance: float, draft: int) -> float:
    """Tokens per target pass when each of `draft` proposals is accepted with probability `acceptance`:
    (1 - a^(k+1)) / (1 - a), the accepted prefix plus the target's own token (k + 1 when a = 1)."""
    if acceptance == 1:
        return draft + 1.0
    return (1 - acceptance ** (draft + 1)) / (1 - acceptance)


def simulated_tokens(acceptance: float, draft: int, trials: int, seed: int = 0) -> float:
    """The same expectation by drawing: accept each proposal with probability a, stop at the first
    rejection, and add the one token the target always contributes."""
    accepted = np.random.default_rng(seed).random((trials, draft)) < acceptance
    prefix = np.cumprod(accepted, axis=1).sum(axis=1)  # accepted proposals before the first rejection
    return float(np.mean(prefix + 1))


def speedup(acceptance: float, draft: int, cost: float) -> float:
    """Walltime speed-up over plain decoding when a draft step costs `cost` target steps and a verify
    pass of k + 1 tokens costs one target step (memory-bound: the weights are read once either way)."""
    return expected_tokens(acceptance, draft) / (cost * draft + 1)


def speculative_table(acceptances: list[float], drafts: list[int], cost: float, trials: int) -> str:
    rows = [(a, k, expected_tokens(a, k), simulated_tokens(a, k, trials), speedup(a, k, cost))
            for a in acceptances for k in drafts]
    return format_table(rows, [Column("acceptance a", ".2f"), Column("draft k"), Column("E formula", ".3f"),
                               Column(f"E simulated ({trials:,} draws)", ".3f"),
                               Column(f"speed-up at c={cost:g}", ".2f")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    seq = sub.add_parser("sequences")
    seq.add_argument("--seq-len", type=int, default=8192)
    seq.add_argument("--devices", default="h100,h200")
    seq.add_argument("specs", nargs="*", default=["llama3-8b", "llama3-8b:quant.kv_cache=int8", "olmo2-7b",
                                                  "gemma3-27b", "deepseek-v3"])
    spec = sub.add_parser("speculative")
    spec.add_argument("--acceptance", default="0.6,0.8,0.9")
    spec.add_argument("--draft", default="1,2,4,8")
    spec.add_argument("--cost", type=float, default=0.05)
    spec.add_argument("--trials", type=int, default=200_000)
    args = ap.parse_args()
    if args.what == "sequences":
        kinds = args.devices.split(",")
        for kind in kinds:
            d = DEVICES[kind]
            print(f"{kind}: {d.name}, {d.memory_bytes / GIB:.1f} GiB, {d.memory_bandwidth / 1e12:.2f} TB/s, "
                  f"bf16 {d.peak('bfloat16') / 1e12:.0f} TFLOP/s x efficiency {d.efficiency}: ridge "
                  f"{d.throughput('bfloat16') / d.memory_bandwidth:.0f} FLOP/byte (jaxinfra/plan/devices.py)")
        print(sequences_table(args.specs, kinds, args.seq_len))
    else:
        print(speculative_table([float(a) for a in args.acceptance.split(",")],
                                [int(k) for k in args.draft.split(",")], args.cost, args.trials))


if __name__ == "__main__":
    main()
