"""Decode tokens/s against batch size on this machine, next to the plan's roofline for the same batches.

    python scripts/guide/serving_batches.py [--preset small] [--batches 1,2,4,8,16] [--prompt-len 16]
                                            [--new-tokens 32] [--repeats 5] [KEY=VALUE ...]

Random weights (no checkpoint), greedy decoding, no stop id, so every row runs every step. For
each batch size: one compiling call, then the fastest of `--repeats` timed calls of
`jaxinfra.infer.Generator.generate` (what `jaxinfra generate` and benchmarks/decode.py run),
timed in rounds that visit every batch size and the probes once each (`measure`).
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
from jaxinfra.infer import Generator
from jaxinfra.infer.generation import GenerationResult
from jaxinfra.metrics import measure_matmul_flops
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan.devices import DeviceSpec, cpu_spec
from jaxinfra.plan.estimate import make_plan
from jaxinfra.state import init_params


def measure(gen: Generator, cfg: Config, batches: list[int], prompt_len: int, new_tokens: int,
            repeats: int) -> tuple[dict[int, GenerationResult], float, int, float]:
    """The fastest call per batch size, and the probes (parameter-read seconds, bytes, matmul FLOP/s).

    One compiling call per batch, then `repeats` rounds that time every batch and both probes
    once each. On a shared machine other jobs only ever add time, so each figure keeps its least
    disturbed measurement, and interleaving the rounds spreads a burst of load over every batch
    instead of landing on one."""
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, cfg.model.vocab_size, (b, prompt_len)).tolist() for b in batches}
    for b in batches:
        gen.generate(prompts[b], max_new_tokens=new_tokens)  # compile + warm-up (greedy)
    best: dict[int, GenerationResult] = {}
    stream_s, matmul, nbytes = float("inf"), 0.0, 0
    for _ in range(repeats):
        seconds, nbytes = param_stream_seconds(gen.params)
        stream_s, matmul = min(stream_s, seconds), max(matmul, measure_matmul_flops())
        for b in batches:
            run = gen.generate(prompts[b], max_new_tokens=new_tokens)
            if b not in best or run.decode_s < best[b].decode_s:
                best[b] = run
    return best, stream_s, nbytes, matmul


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
    batches = [int(b) for b in args.batches.split(",")]
    best, stream_s, nbytes, matmul = measure(gen, cfg, batches, args.prompt_len, args.new_tokens, args.repeats)
    spec = cpu_spec(1, matmul, nbytes / stream_s)
    print(f"{args.preset}: {nbytes / 2**20:.0f} MiB of parameters ({cfg.model.dtype}); read once in "
          f"{stream_s * 1e3:.2f} ms ({nbytes / stream_s / 1e9:.1f} GB/s); matmul probe "
          f"{spec.peak('float32') / 1e12:.3f} TFLOP/s x efficiency {spec.efficiency}; ridge "
          f"{spec.throughput('float32') / spec.memory_bandwidth:.1f} FLOP/byte")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, fastest of {args.repeats} rounds")
    positions = args.prompt_len + args.new_tokens
    rows = []
    for batch in batches:
        run = best[batch]
        est, bound = planned_step(args.preset, overrides, spec, batch, positions)
        rows.append((batch, run.prefill_tokens_per_s, run.decode_s / run.decode_steps * 1e3, run.decode_tokens_per_s,
                     run.decode_tokens_per_s / best[batches[0]].decode_tokens_per_s, est * 1e3, batch / est, bound))
    print(format_table(rows, [Column("batch"), Column("prefill tok/s", ",.0f"), Column("step ms", ".2f"),
                              Column("decode tok/s", ",.0f"),
                              Column("x batch 1", ".2f"), Column("plan step ms", ".2f"),
                              Column("plan tokens/s", ",.0f"), Column("plan bound")]))


if __name__ == "__main__":
    main()
