"""One compiled forward per length bucket: per-token log-probs and greedy matches of padded rows.

lm-eval's requests arrive as (input ids, target ids) of many lengths; compiling per length would
compile per request. Rows are right-padded to a power-of-two bucket (at least MIN_BUCKET, at most
the model's max length) and batches to a fixed row count, so a whole task compiles a handful of
programs, kept between calls (and across `update_params` during training: same shapes and shardings).
The program is the inference forward (jaxinfra/infer/loading.py inference_model_config) with the
output projection applied per sequence chunk (the run's model.loss_chunk_size), so no [B, T, vocab]
float32 buffer is ever whole on a large vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxinfra.config import Config
from jaxinfra.infer.loading import _place_params, _sharding, inference_mesh, inference_model_config
from jaxinfra.loss import target_logps
from jaxinfra.state import model_graphdef, sharding_rules
from sharding.plan import plan_for

MIN_BUCKET = 16


def no_ambient_mesh() -> Any:
    """A context without the caller's mesh: building an abstract model (nnx.eval_shape with logical
    sharding names) under a training loop's `jax.set_mesh` fails, and nothing here should depend on it."""
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def bucket(length: int, max_length: int) -> int:
    """The padded width of a row of `length` ids: the next power of two >= MIN_BUCKET, capped at max_length."""
    return min(max(MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(length, 1))))), max(max_length, length))


class TokenScorer:
    """Scores batches of rows on one mesh; the params may be replaced (same shapes) without recompiling."""

    def __init__(self, cfg: Config, params: nnx.State, *, batch_size: int = 8, mesh: Mesh | None = None,
                 devices: Sequence[jax.Device] | None = None):
        if mesh is None:
            self.mesh, self.rules = inference_mesh(cfg, devices)
        else:  # a training run's own mesh: its params are already in these shardings
            self.mesh, self.rules = mesh, sharding_rules(cfg.parallelism)
        self.plan = plan_for(self.mesh, self.rules)
        self.model_cfg = inference_model_config(cfg.model)
        with no_ambient_mesh():
            self.graphdef = model_graphdef(self.model_cfg, cfg.quant, cfg.lora)
        shards = math.prod(self.mesh.shape[a] for a in ("data", "fsdp", "expert"))
        self.batch = -(-max(1, batch_size) // shards) * shards  # rows split evenly over the batch shards
        self.params = _place_params(params, self.mesh, self.rules)
        self._fn = jax.jit(self._score)

    def update_params(self, params: nnx.State) -> None:
        self.params = _place_params(params, self.mesh, self.rules)

    def _score(self, params: nnx.State, inputs: jax.Array, targets: jax.Array,
               lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        segment_ids = (positions < lengths[:, None]).astype(jnp.int32)  # padding: its own segment, routes nothing
        model = nnx.merge(self.graphdef, params)
        h, _ = model.hidden(inputs, positions, segment_ids, plan=self.plan)

        def chunk_scores(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            logits = model.logits(xs[0], plan=self.plan)
            return target_logps(logits, xs[1]), jnp.argmax(logits, axis=-1) == xs[1]

        t, chunk = inputs.shape[1], self.model_cfg.loss_chunk_size
        if not chunk or chunk >= t or t % chunk:
            return chunk_scores((h, targets))
        n = t // chunk
        split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)  # noqa: E731
        logps, greedy = jax.lax.map(chunk_scores, (split(h), split(targets)))  # [n, B, chunk]
        join = lambda x: jnp.moveaxis(x, 0, 1).reshape(inputs.shape[0], t)  # noqa: E731
        return join(logps), join(greedy)

    def score(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
              width: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row (inputs, targets) of equal length <= width, at most `self.batch` rows: (float32
        log-prob of each target, whether each target is the argmax), unpadded."""
        inputs = np.zeros((self.batch, width), np.int32)
        targets = np.zeros((self.batch, width), np.int32)
        lengths = np.ones((self.batch,), np.int32)
        for i, (inp, tgt) in enumerate(rows):
            inputs[i, :len(inp)], targets[i, :len(tgt)], lengths[i] = inp, tgt, len(inp)
        m, r = self.mesh, self.rules
        put = lambda x: jax.device_put(x, _sharding(m, r, ("batch", "length")[:x.ndim], x.shape))  # noqa: E731
        with jax.set_mesh(m):
            logps, greedy = self._fn(self.params, put(inputs), put(targets), put(lengths))
        logps, greedy = jax.device_get((logps, greedy))
        return [(logps[i, :len(inp)], greedy[i, :len(inp)]) for i, (inp, _) in enumerate(rows)]
