"""How large a trained model's logits are: log Z of the output softmax and the largest attention logit.

    python scripts/guide/logit_stats.py RUN_DIR [RUN_DIR ...]

For each run, its newest checkpoint (jaxinfra/infer/loading.py: load_model) runs the model's
own forward on the run's first held-out batch. Printed per run:

    log Z         mean and max over tokens of logsumexp(logits): what z-loss (weight x (log Z)^2) pulls to 0
    max |logit|   the largest output logit
    max |q.k|     the largest attention logit, |q . k| / sqrt(head_dim) over every causal pair,
                  head and layer: what QK-norm bounds (softmax saturates when one dominates a row)
    CE            cross-entropy of the batch, for scale

The attention logits are read by wrapping the attention call the model makes
(models/attention.py imports it as `context_attention`) with a function that records the
scores from the q and k it is given, then calls the original: the forward is the model's.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models.attention as attention_module
from jaxinfra.data import make_eval_batches
from jaxinfra.infer.loading import load_model
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.state import model_graphdef

_seen: list[float] = []  # max |q.k| of each attention call, appended by a host callback


def max_attention_logit(q: jax.Array, k: jax.Array, scale: float, segment_ids: jax.Array | None = None) -> jax.Array:
    """max over batch, heads and visible pairs (causal, same document) of |q . k| * scale; q [B,T,H,D],
    k [B,T,K,D] (GQA: query head h reads key head h // (H / K)), segment_ids [B,T] or None."""
    b, t, h, d = q.shape
    group = h // k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, k.shape[2], group, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
    visible = jnp.tril(jnp.ones((t, t), bool))[None]  # [1, T, T]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return jnp.max(jnp.where(visible[:, None, None], jnp.abs(s), 0.0))


def _recording(original):
    def attend(q, k, v, **kwargs):
        biggest = max_attention_logit(q, k, q.shape[-1] ** -0.5, kwargs.get("segment_ids"))
        jax.debug.callback(lambda x: _seen.append(float(x)), biggest)
        return original(q, k, v, **kwargs)
    return attend


def run_stats(run_dir: str) -> list:
    cfg, params = load_model(run_dir)
    t = cfg.train
    batch = make_eval_batches(cfg.data, seq_len=t.seq_len, global_batch_size=t.batch_size,
                              vocab_size=cfg.model.vocab_size, seed=t.seed)[0]
    model = nnx.merge(model_graphdef(cfg.model, cfg.quant, cfg.lora), params)
    _seen.clear()
    logits = jax.jit(lambda m, x, p, s: m(x, p, s))(model, batch["inputs"], batch["positions"],
                                                      batch["segment_ids"])
    jax.effects_barrier()
    log_z = jax.nn.logsumexp(logits, axis=-1)
    mask = np.asarray(batch["segment_ids"]) > 0
    target = jnp.take_along_axis(logits, jnp.asarray(batch["targets"])[..., None], axis=-1)[..., 0]
    ce = float(np.asarray(log_z - target)[mask].mean())
    lz = np.asarray(log_z)[mask]
    return [pathlib.Path(run_dir).name, f"{lz.mean():.3f}", f"{lz.max():.3f}",
            f"{float(jnp.max(jnp.abs(logits))):.2f}", f"{max(_seen):.2f}", f"{ce:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+")
    args = parser.parse_args()
    attention_module.context_attention = _recording(attention_module.context_attention)
    rows = [run_stats(r) for r in args.run_dirs]
    print(format_table(rows, [Column("run"), Column("mean log Z", align=">"), Column("max log Z", align=">"),
                              Column("max |logit|", align=">"), Column("max |q.k|", align=">"),
                              Column("CE", align=">")]))


if __name__ == "__main__":
    main()
