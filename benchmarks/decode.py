"""KV-cache decoding throughput on CPU for the `small` preset (random weights), batch 1 and 8.

    python benchmarks/decode.py [--batches 1,8] [--prompt-len 64] [--new-tokens 128] [--repeats 3]
                                [--temperature T --top-k K --top-p P] [KEY=VALUE ...]

For each batch size: prefill tokens/s, decode tokens/s (batch x steps / decode time) and the
decode step time, next to a roofline-ish reference measured in the same process: the time
to stream every parameter once (a jitted sum over all parameter arrays). Decoding at small
batch is memory-bound: each step must read all weights (plus the cache), so
"stream/step" = param-stream time / decode step time is the fraction of that bound reached
(1.0 = a step costs no more than reading the weights once). Greedy decoding by default (or
the given sampling settings), no stop id, so every row runs all steps. Figures are medians over
`--repeats` timed calls after a warm-up.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfra.config import load_config
from jaxinfra.infer import Generator, Sampling
from jaxinfra.metrics import measure_matmul_flops, param_counts
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.state import init_params
from models import cache as kv_cache


def param_stream_seconds(params, repeats: int = 10) -> tuple[float, int]:
    """(median seconds to read every parameter once, bytes read)."""
    leaves = jax.tree.leaves(params)
    total = jax.jit(lambda xs: sum(jnp.sum(x.astype(jnp.float32)) for x in xs))
    jax.block_until_ready(total(leaves))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(total(leaves))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), sum(x.size * x.dtype.itemsize for x in leaves)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    cfg = load_config("small", ["mesh.data=1", *args.overrides])
    params = jax.jit(init_params, static_argnums=0)(cfg.model, jax.random.key(0))
    gen = Generator(cfg, params, devices=jax.devices()[:1])
    stream_s, nbytes = param_stream_seconds(gen.params)
    counts = param_counts(cfg.model)
    matmul = measure_matmul_flops(4096, jnp.float32)
    print(f"small: {counts['total'] / 1e6:.1f}M params ({nbytes / 2**20:.0f} MiB), cache "
          f"{kv_cache.bytes_per_token(gen.model_cfg) / 1024:.0f} KiB/token; param stream {stream_s * 1e3:.2f} ms "
          f"({nbytes / stream_s / 1e9:.1f} GB/s); matmul {matmul / 1e12:.3f} TFLOP/s")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    print(f"sampling: {sampling}")
    columns = ("batch", "prompt", "new", Column("prefill tok/s", ".0f"), Column("decode tok/s", ".1f"),
               Column("step ms", ".2f"), Column("stream/step", ".2f"), Column("decode TFLOP/s", ".3f"),
               Column("/matmul", ".2f"), Column("compile s", ".1f"))
    print(format_table([], columns, style="markdown"))
    rng = np.random.default_rng(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(0, cfg.model.vocab_size, (batch, args.prompt_len)).tolist()
        first = gen.generate(prompts, max_new_tokens=args.new_tokens, sampling=sampling)  # compile + warm-up
        runs = [gen.generate(prompts, max_new_tokens=args.new_tokens, sampling=sampling) for _ in range(args.repeats)]
        prefill = float(np.median([r.prefill_tokens_per_s for r in runs]))
        decode = float(np.median([r.decode_tokens_per_s for r in runs]))
        step_s = float(np.median([r.decode_s / r.decode_steps for r in runs]))
        flops = 2 * counts["matmul"] * batch / step_s  # weight matmuls only (2 N per token)
        row = (batch, args.prompt_len, args.new_tokens, prefill, decode, step_s * 1e3, stream_s / step_s,
               flops / 1e12, flops / matmul, first.compile_s)
        print(format_table([row], columns, style="markdown", header=False))


if __name__ == "__main__":
    main()
