"""Which dtype each part of a training step uses, read from the stack's own state and traced step.

    python scripts/guide/precision_map.py [CONFIG] [KEY=VALUE ...]     # default: tiny model.dtype=bfloat16

Nothing runs: the train state is abstract (jaxinfra/state.py: abstract_state) and the loss's
forward and backward are traced to a jaxpr (jaxinfra/step.py: loss_fn under jax.grad). The
script prints the dtypes of the parameters and the optimizer state, then counts the traced
operations by kind and dtype: matmuls (dot_general) as `inputs -> output`, the exp / log of
the softmaxes and the loss, the rsqrt of the RMSNorms, and the adds that carry the residual stream.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxinfra.config import load_config
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.optim import make_optimizer, make_schedule
from jaxinfra.state import abstract_state, model_graphdef
from jaxinfra.step import loss_fn

KINDS = {"dot_general": "matmul", "exp": "exp (softmax, loss)", "log": "log (loss)",
         "rsqrt": "rsqrt (RMSNorm)", "logistic": "sigmoid (SwiGLU)"}


def dtype_counts(tree) -> collections.Counter:
    return collections.Counter(str(x.dtype) for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _subjaxprs(eqn) -> list:
    out = []
    for p in eqn.params.values():
        for x in p if isinstance(p, (list, tuple)) else (p,):
            if isinstance(x, jcore.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                out.append(x)
    return out


def op_counts(jaxpr, counts: collections.Counter | None = None) -> collections.Counter:
    """(kind, dtypes) -> number of traced equations, through scans, remat and custom VJPs."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in KINDS:
            ins = ",".join(str(v.aval.dtype) for v in eqn.invars)
            out = str(eqn.outvars[0].aval.dtype)
            counts[(KINDS[name], f"{ins} -> {out}" if name == "dot_general" else out)] += 1
        for sub in _subjaxprs(eqn):
            op_counts(sub, counts)
    return counts


def trace(cfg) -> tuple:
    """(abstract train state, op_counts of the loss's forward + backward) for a config."""
    m = cfg.model
    tx = make_optimizer(cfg.optimizer, make_schedule(cfg.schedule, cfg.optimizer.lr, cfg.train.steps))
    state = abstract_state(m, tx, cfg.quant)
    b, t = 2, 16
    batch = {"inputs": jnp.zeros((b, t), jnp.int32), "targets": jnp.zeros((b, t), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(t), (b, t)), "segment_ids": jnp.ones((b, t), jnp.int32)}
    grad = jax.grad(loss_fn(model_graphdef(m, cfg.quant), m))
    return state, op_counts(jax.make_jaxpr(grad)(state.params, batch).jaxpr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="tiny")
    parser.add_argument("overrides", nargs="*", default=["model.dtype=bfloat16"])
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    state, counts = trace(cfg)
    m = cfg.model
    print(f"model.param_dtype={m.param_dtype}  model.dtype={m.dtype}  quant.train={cfg.quant.train}")
    print(f"parameters:      {dict(dtype_counts(state.params))} (arrays by dtype)")
    print(f"optimizer state: {dict(dtype_counts(state.opt_state))}")
    rows = [[kind, dtypes, n] for (kind, dtypes), n in sorted(counts.items())]
    print("forward + backward of the loss, traced operations by dtype (a scanned layer counts once):")
    print(format_table(rows, [Column("operation"), Column("dtypes"), Column("count", align=">")]))


if __name__ == "__main__":
    main()
