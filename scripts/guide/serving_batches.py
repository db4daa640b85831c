"""Decode tokens/s against batch size on this machine, next to the plan's roofline for the same batches.

    python scripts/guide/serving_batches.py [--preset small] [--batches 1,2,4,8,16] [--prompt-len 16]
                                            [--new-tokens 32] [--repeats 5] [KEY=VALUE ...]

Random weights (no checkpoint), greedy decoding, no stop id, so every row runs every step. For
each batch size: one compiling call, then the fastest of `--repeats` timed calls of
`jaxinfra.infer.Generator.generate` (what `jaxinfra generate` and benchmarks/decode.py run).
The estimate is jaxinfra/plan/inference.py `decode_time` for the same rows and positions, on
this host described by two probes measured in this process: the time to read every parameter
once (benchmarks/decode.py `param_stream_seconds`, the bandwidth a decode step needs) and a
float32 matmul (the compute peak, at the plan's CPU efficiency).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import numpy as np

from benchmarks.decode import param_stream_seconds
from jaxinfra.config import Config, load_config
from jaxinfra.infer import Generator, Sampling
from jaxinfra.metrics import measure_matmul_flops
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan.devices import DeviceSpec, cpu_spec
from jaxinfra.plan.estimate import make_plan
from jaxinfra.state import init_params


def measure(gen: Generator, cfg: Config, batch: int, prompt_len: int, new_tokens: int,
            repeats: int) -> tuple[float, float, float]:
    """(decode step seconds, decode tokens/s, prefill tokens/s) for `batch` random prompts: the fastest of
    `repeats` calls (on a shared machine other jobs only ever add time: the fastest is the least disturbed)."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.model.vocab_size, (batch, prompt_len)).tolist()
    greedy = Sampling()
    gen.generate(prompts, max_new_tokens=new_tokens, sampling=greedy)  # compile + warm-up
    runs = [gen.generate(prompts, max_new_tokens=new_tokens, sampling=greedy) for _ in range(repeats)]
    best = min(runs, key=lambda r: r.decode_s)
    prefill = max(r.prefill_tokens_per_s for r in runs)
    return best.decode_s / best.decode_steps, best.decode_tokens_per_s, prefill


def planned_step(preset: str, overrides: list[str], spec: DeviceSpec, batch: int,
                 positions: int) -> tuple[float, str]:
    """The plan's decode step (seconds) for `batch` rows of `positions` cached positions, and its bound."""
    cfg = load_config(preset, [*overrides, f"train.batch_size={batch}", f"train.seq_len={positions}"])
    plan = make_plan(cfg, 1, spec, inference=True)
    return plan.time.step_s, "memory" if plan.time.bottleneck.startswith("memory") else "compute"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    overrides = ["mesh.data=1", *args.overrides]
    cfg = load_config(args.preset, overrides)
    params = jax.jit(init_params, static_argnums=0)(cfg.model, jax.random.key(0))
    gen = Generator(cfg, params, devices=jax.devices()[:1])
    # Probes, like the decode calls, keep their least disturbed figure: the best of three medians
    # for the parameter read, the best of ten runs for the matmul.
    stream_s, nbytes = min(param_stream_seconds(gen.params) for _ in range(3))
    spec = cpu_spec(1, measure_matmul_flops(repeats=10), nbytes / stream_s)
    print(f"{args.preset}: {nbytes / 2**20:.0f} MiB of parameters ({cfg.model.dtype}); read once in "
          f"{stream_s * 1e3:.2f} ms ({nbytes / stream_s / 1e9:.1f} GB/s); matmul probe "
          f"{spec.peak('float32') / 1e12:.3f} TFLOP/s x efficiency {spec.efficiency}; ridge "
          f"{spec.throughput('float32') / spec.memory_bandwidth:.1f} FLOP/byte")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, fastest of {args.repeats} calls")
    positions = args.prompt_len + args.new_tokens
    rows, base = [], None
    for batch in [int(b) for b in args.batches.split(",")]:
        step, tok_s, prefill = measure(gen, cfg, batch, args.prompt_len, args.new_tokens, args.repeats)
        est, bound = planned_step(args.preset, overrides, spec, batch, positions)
        base = base or tok_s / batch
        rows.append((batch, prefill, step * 1e3, tok_s, tok_s / base, est * 1e3, batch / est, bound))
    print(format_table(rows, [Column("batch"), Column("prefill tok/s", ",.0f"), Column("step ms", ".2f"),
                              Column("decode tok/s", ",.0f"),
                              Column("x batch 1", ".2f"), Column("plan step ms", ".2f"),
                              Column("plan tokens/s", ",.0f"), Column("plan bound")]))


if __name__ == "__main__":
    main()
