"""The sampler-vs-trainer log-prob gap on every test model family, float32 and bfloat16 (CPU).

    python scripts/logprob_gap.py [--new 24] [--markdown]

For each family (dense MHA, GQA, MLA, MoE as deepseek-tiny sets it: capacity dispatch, factor
1.5; once more with a skewed router, so that
training drops tokens) and dtype, a tiny random model draws completions with the KV-cache sampler (greedy,
temperature 1 and temperature 0.7) and `policy_token_logps` recomputes each generated token's
log-prob with the training forward; prints max and mean |sampler - trainer| over the completion
tokens (docs/post-training.md "Sampler and trainer log-probs", tests/test_logprobs.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from logprob_models import FAMILIES, PROMPTS, SAMPLINGS, make

from jaxinfra.infer import Generator
from jaxinfra.infer.logprobs import sampler_and_trainer_logps
from jaxinfra.metrics.table import Column, format_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=24, help="new tokens per prompt")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows = []
    # the last row: a random router bias, so that training's capacity dispatch drops tokens
    cases = [(f, f, False) for f in FAMILIES] + [("MoE, skewed router (drops)", "MoE", True)]
    for label, family, skewed in cases:
        for dtype in ("float32", "bfloat16"):
            t0 = time.perf_counter()
            cfg, params = make(family, dtype, skewed_router=skewed)
            gen = Generator(cfg, params)
            for name, sampling in SAMPLINGS.items():
                a, b = sampler_and_trainer_logps(cfg, params, gen, PROMPTS, sampling, args.new)
                d = abs(a - b)
                rows.append((label, dtype, name, f"{d.max():.2e}", f"{d.mean():.2e}", len(d)))
            print(f"{label} {dtype}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print(format_table(rows, [Column("family"), Column("dtype"), Column("sampling"), Column("max |Δ|", align=">"),
                              Column("mean |Δ|", align=">"), Column("tokens", align=">")],
                       style="markdown" if args.markdown else "plain"))


if __name__ == "__main__":
    main()
