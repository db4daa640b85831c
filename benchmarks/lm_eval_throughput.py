"""lm-eval log-likelihood throughput of the `jaxinfra` model vs `jaxinfra eval --tokens`, same tokens, one run.

    python benchmarks/lm_eval_throughput.py [--rows 64] [--continuation 32] [--batch-size 8] [--repeats 3]
                                            [KEY=VALUE ...]

`small` preset (random weights), one device by default (mesh.data=1). Each of `--rows` random rows of
train.seq_len + 1 ids is one loglikelihood request to the adapter (context: all but the last
`--continuation` ids; the request's forward covers the whole row, as lm-eval feeds context +
continuation minus the last id), and one row of `jaxinfra.infer.scoring.score` (what `jaxinfra eval
--tokens` runs). Both at --batch-size rows per forward, after a warm-up call; score() jits a new
closure per call, so its timed call includes a compile served from the persistent cache
(JAX_COMPILATION_CACHE_DIR) as the CLI's would be. Figures: medians over --repeats; ratio =
adapter requests/s over eval --tokens rows/s (issue 32's target: >= 0.8).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxinfra.config import load_config
from jaxinfra.harness import require_lm_eval
from jaxinfra.infer.scoring import score
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.state import init_params


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--continuation", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    require_lm_eval("benchmarks/lm_eval_throughput.py")
    from jaxinfra.harness.model import JaxinfraLM

    cfg = load_config("small", ["mesh.data=1", *args.overrides])
    params = jax.jit(init_params, static_argnums=0)(cfg.model, jax.random.key(0))
    t = cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (args.rows, t + 1)).astype(np.int32)
    lm = JaxinfraLM.from_memory(cfg, params, batch_size=args.batch_size)
    k = args.continuation
    requests = [(None, list(r[:-k]), list(r[-k:])) for r in tokens]
    adapter_s = _median_seconds(lambda: lm._loglikelihood_tokens(requests), args.repeats)
    devices = list(lm.scorer.mesh.devices.flat)
    score_s = _median_seconds(lambda: score(cfg, params, tokens, args.batch_size, devices), args.repeats)
    # the same numbers both ways: row 0 as one request whose continuation is every id after the first,
    # against score's mean cross-entropy x predictions on that row
    got = lm._loglikelihood_tokens([(None, list(tokens[0, :1]), list(tokens[0, 1:]))])[0][0]
    want = -score(cfg, params, tokens[:1], 1, devices)[0] * t
    rows = [("jaxinfra model (lm-eval)", args.rows / adapter_s, adapter_s),
            ("eval --tokens (score)", args.rows / score_s, score_s)]
    print(format_table(rows, [Column("path"), Column("requests/s", ".1f", ">"), Column("seconds", ".3f", ">")]))
    print(f"ratio adapter / eval --tokens: {score_s / adapter_s:.2f} ({args.rows} rows of {t + 1} ids, batch "
          f"{args.batch_size}, {jax.devices()[0].platform} x {len(devices)}); row 0's log-likelihood: adapter "
          f"{got:.4f}, eval --tokens {want:.4f}")


if __name__ == "__main__":
    main()
