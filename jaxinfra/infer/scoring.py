"""Scoring: the mean next-token cross-entropy of token rows under a model (`jaxinfra eval`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.config import Config
from jaxinfra.infer.loading import InferenceError, _place_params, _sharding, inference_mesh, inference_model_config
from jaxinfra.loss import cross_entropy_sums
from jaxinfra.state import model_graphdef
from sharding.plan import plan_for


def score(cfg: Config, params: nnx.State, tokens: np.ndarray, batch_size: int = 8,
          devices: Sequence[jax.Device] | None = None) -> tuple[float, int]:
    """(mean next-token cross-entropy, prediction count) of token rows [N, T]: the training
    forward on each row, float32 log-softmax, every position predicting the next; N*(T-1)
    predictions. Rows go in batches of `batch_size` (the last one padded and masked)."""
    tokens = check_token_array(tokens, cfg.model.vocab_size)
    n, t = tokens.shape
    mesh, rules = inference_mesh(cfg, devices)
    plan = plan_for(mesh, rules)
    params = _place_params(params, mesh, rules)
    graphdef = model_graphdef(inference_model_config(cfg.model), cfg.quant, cfg.lora)
    batch_size = max(1, min(batch_size, n))

    def ce_sum(params: nnx.State, rows: jax.Array, mask: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(graphdef, params).forward(rows[:, :-1], plan=plan)
        keep = jnp.broadcast_to(mask[:, None], (rows.shape[0], t - 1))
        return cross_entropy_sums(logits, rows[:, 1:], keep)["ce_sum"]

    rows_sharding = _sharding(mesh, rules, ("batch", "length"), (batch_size, t))
    mask_sharding = _sharding(mesh, rules, ("batch",), (batch_size,))
    total = 0.0
    with jax.set_mesh(mesh):
        fn = jax.jit(ce_sum)
        for lo in range(0, n, batch_size):
            chunk = tokens[lo:lo + batch_size]
            mask = np.arange(batch_size) < len(chunk)
            chunk = np.concatenate([chunk, np.zeros((batch_size - len(chunk), t), np.int32)])
            total += float(fn(params, jax.device_put(chunk, rows_sharding), jax.device_put(mask, mask_sharding)))
    count = n * (t - 1)
    return total / count, count


def token_rows(tokens: Any, seq_len: int) -> tuple[np.ndarray, int]:
    """(rows [N, T], ids dropped) of a token file: a 2-D array as it is, a flat 1-D array of ids
    (the `data.source=tokens` format) cut into rows of seq_len + 1, the remainder dropped."""
    arr = np.asarray(tokens)
    if arr.ndim == 2:
        return arr, 0
    if arr.ndim != 1:
        raise InferenceError(f"tokens must be a 1-D array of ids or a 2-D array [batch, seq], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InferenceError(f"tokens must be integer token ids, got dtype {arr.dtype}")
    row = seq_len + 1  # seq_len predictions per row, as a training window
    n = len(arr) // row
    if n < 1:
        raise InferenceError(f"a 1-D token file needs at least seq_len + 1 = {row} ids for one row, got {len(arr)}")
    return arr[:n * row].reshape(n, row), len(arr) - n * row


def check_token_array(tokens: Any, vocab_size: int) -> np.ndarray:
    """A 2-D integer array [batch, seq >= 2] of ids in [0, vocab) as int32; InferenceError otherwise."""
    arr = np.asarray(tokens)
    if arr.ndim != 2:
        raise InferenceError(f"tokens must be a 2-D array [batch, seq], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InferenceError(f"tokens must be integer token ids, got dtype {arr.dtype}")
    if arr.shape[0] < 1 or arr.shape[1] < 2:
        raise InferenceError(f"tokens need at least 1 row and 2 columns (seq >= 2), got shape {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise InferenceError(f"token ids must be in [0, {vocab_size}) (model.vocab_size), found {lo if lo < 0 else hi}")
    return arr.astype(np.int32)


