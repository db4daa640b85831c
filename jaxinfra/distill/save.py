"""`jaxinfra distill save-logits`: the teacher's top-k logits for the batches of training steps 1..N.

The teacher's own config.yaml plus the given overrides (data.*, train.seq_len / batch_size /
seed, mesh.*) fix the batches; the data pipeline is the one `jaxinfra train` builds from the same
settings, so entry s - 1 is the batch of step s of a student run with those settings. Each step
runs the teacher's forward on the mesh, takes the top-k of its float32 logits per token (per
sequence chunk when model.loss_chunk_size is set) and its cross-entropy on the target, and
writes them (jaxinfra/distill/logits.py). Rerunning an interrupted command continues it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.config import ConfigError, load_config
from jaxinfra.data import make_eval_batches, make_train_iterator
from jaxinfra.distill.config import DistillConfig
from jaxinfra.distill.logits import LogitsWriter, batch_identity
from jaxinfra.distill.teacher import load_teacher_params, resolve_teacher
from jaxinfra.runtime import Runtime, build_runtime
from jaxinfra.state import model_state

_ALLOWED = ("data.", "train.", "mesh.", "parallelism.", "model.loss_chunk_size=", "model.attention_impl=")


def _per_chunk(fn: Callable[..., tuple], chunk: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """fn over contiguous sequence chunks of [B, T, ...] arrays (lax.map), outputs joined along T."""
    t = arrays[0].shape[1]
    if not chunk or chunk >= t:
        return fn(*arrays)
    n = t // chunk
    pieces = tuple(jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0) for x in arrays)
    outs = jax.lax.map(lambda xs: fn(*xs), pieces)
    return tuple(jnp.moveaxis(o, 0, 1).reshape(o.shape[1], t, *o.shape[3:]) for o in outs)


def top_k_fn(rt: Runtime, top_k: int) -> Callable[[nnx.State, dict[str, jax.Array]], tuple[jax.Array, ...]]:
    """jit(params, batch) -> (values [B, T, k] float32, ids [B, T, k] int32, teacher CE [B, T] float32)."""
    graphdef, cfg, plan = rt.graphdef, rt.cfg.model, rt.plan

    def fn(params: nnx.State, batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        model = nnx.merge(graphdef, params)
        h, _ = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"], plan=plan)

        def one(h: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
            logits = model.logits(h, plan=plan)
            values, ids = jax.lax.top_k(logits, top_k)
            target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
            return values, ids, jax.nn.logsumexp(logits, axis=-1) - target

        return _per_chunk(one, cfg.loss_chunk_size, h, batch["targets"])

    return jax.jit(fn, in_shardings=(model_state(rt.state_shardings), rt.batch_sharding))


def _check_args(overrides: Sequence[str], top_k: int, steps: int, vocab_size: int) -> None:
    for item in overrides:
        if not item.startswith(_ALLOWED):
            raise ConfigError(f"save-logits --data {item}: only data.*, train.*, mesh.*, parallelism.*, "
                              f"model.loss_chunk_size and model.attention_impl may change (the teacher's "
                              f"model is its checkpoint's)")
    if not 1 <= top_k <= vocab_size:
        raise ConfigError(f"--top-k {top_k} is invalid: must be in [1, model.vocab_size={vocab_size}]")
    if steps < 1:
        raise ConfigError(f"--steps {steps} is invalid: must be a positive integer")
    if jax.process_count() > 1:
        raise ConfigError("save-logits runs in a single process (one host); give it that host's devices")


def save_logits(teacher: str, overrides: Sequence[str], out: str | os.PathLike, top_k: int, steps: int,
                teacher_dtype: str = "bfloat16", progress: bool = True,
                devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
    """Write `steps` steps of the teacher's top-k logits to `out`; returns a short report."""
    start = time.perf_counter()
    source = resolve_teacher(teacher, what="save-logits TEACHER")
    _check_args(overrides, top_k, steps, source.saved_model.vocab_size)
    cfg = load_config(str(source.run_dir / "config.yaml"), list(overrides))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(source.compute_model(teacher_dtype),
                                                             loss_chunk_size=cfg.model.loss_chunk_size,
                                                             attention_impl=cfg.model.attention_impl),
                              distill=DistillConfig(), train=dataclasses.replace(cfg.train, steps=steps))
    rt = build_runtime(cfg, devices)
    if rt.mesh.shape["stage"] > 1:
        raise ConfigError("save-logits does not run pipeline stages: set mesh.stage=1")
    teacher_step, params = load_teacher_params(source, teacher_dtype, rt.mesh, rt.rules)
    t = cfg.train
    meta = {**batch_identity(cfg), "top_k": top_k, "steps": steps,
            "ids_dtype": "uint16" if cfg.model.vocab_size <= 2**16 else "int32",
            "teacher": {"path": str(pathlib.Path(teacher).absolute()), "step": teacher_step, "dtype": teacher_dtype}}
    writer = LogitsWriter(out, meta)
    data_args = dict(seq_len=t.seq_len, global_batch_size=t.batch_size, vocab_size=cfg.model.vocab_size, seed=t.seed)
    batches = make_train_iterator(cfg.data, **data_args)
    fn = top_k_fn(rt, top_k)

    def compute(local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with jax.set_mesh(rt.mesh):
            values, ids, ce = jax.device_get(fn(params, rt.to_global(local)))
        if rt.sequence_order is not None:  # ring attention's balanced order -> the data's order
            back = np.argsort(rt.sequence_order)
            values, ids, ce = values[:, back], ids[:, back], ce[:, back]
        return {"ids": ids.astype(meta["ids_dtype"]), "values": values, "teacher_ce": ce}

    writer.write_batches(batches, steps, compute, progress)
    eval_batches = make_eval_batches(cfg.data, **data_args)
    ce_sum, tokens = rt.eval_sums(params, eval_batches)
    teacher_eval = ce_sum / tokens if eval_batches else None
    writer.finish(teacher_eval_loss=teacher_eval)
    size = sum(f.stat().st_size for f in pathlib.Path(out).iterdir())
    return {"out": str(out), "steps": steps, "top_k": top_k, "teacher_step": teacher_step,
            "teacher_eval_loss": teacher_eval, "bytes": size, "seconds": time.perf_counter() - start}
