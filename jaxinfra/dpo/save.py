"""`jaxinfra dpo save-reference`: the reference's log-prob of every target of the batches of steps 1..N.

CONFIG and its overrides are the DPO run's own (data.*, train.seq_len / batch_size / seed fix the
batches: the data pipeline is the one `jaxinfra train` builds from them, so entry s - 1 is the batch
of step s). The reference is what the run would use: dpo.reference when it names a model, else
--restore (the checkpoint the run starts from; with LoRA that is the base, the adapters off).
Each step runs the reference's forward on the run's mesh and writes its per-token log-probs
(jaxinfra/dpo/saved.py); a DPO run given the directory as dpo.reference needs no reference model.
Rerunning an interrupted command continues it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxinfra.config import Config, ConfigError, load_config, validate
from jaxinfra.data import make_train_iterator
from jaxinfra.distill.logits import batch_identity
from jaxinfra.distill.save import _per_chunk
from jaxinfra.dpo.saved import ReferenceWriter, is_saved_reference
from jaxinfra.extensions import HostContext
from jaxinfra.loss import target_logps
from jaxinfra.reference import ReferencePolicy, check_no_stages
from models.lora_config import LoraConfig


def _reference_path(cfg: Config, restore: str | None) -> str:
    """The model the run's reference is: dpo.reference, else --restore; one line otherwise."""
    if cfg.data.source != "preference":
        raise ConfigError(f"dpo save-reference needs the DPO run's config (data.source=preference), got "
                          f"data.source={cfg.data.source}")
    if jax.process_count() > 1:
        raise ConfigError("dpo save-reference runs in a single process (one host); give it that host's devices")
    path = cfg.dpo.reference or restore
    if path is None:
        raise ConfigError("dpo save-reference: dpo.reference is null and no --restore was given: name the "
                          "checkpoint the DPO run starts from (--restore RUN) or set dpo.reference")
    if is_saved_reference(path):
        raise ConfigError(f"dpo.reference={path} already holds saved log-probs; name a model (a run or checkpoint)")
    return path


def _runtime(cfg: Config, devices: Sequence[jax.Device]) -> Any:
    """The run's mesh, rules and plan (what the reference and its forward need; no train step)."""
    from jaxinfra.runtime import batch_sharding
    from jaxinfra.state import sharding_rules
    from sharding.mesh import make_mesh
    from sharding.plan import plan_for

    validate(cfg, len(devices))
    mesh = make_mesh(cfg.mesh, devices)
    check_no_stages(mesh, "dpo save-reference")
    if mesh.shape["context"] > 1:
        raise ConfigError("dpo save-reference: set mesh.context=1 (the saved log-probs do not depend on the layout)")
    rules = sharding_rules(cfg.parallelism)
    return SimpleNamespace(mesh=mesh, rules=rules, plan=plan_for(mesh, rules),
                           batch_sharding=batch_sharding(mesh, rules))


def reference_logps_fn(ref: ReferencePolicy, rt: Any) -> Any:
    """jit(params, batch) -> [B, T] float32 the reference's log-prob of each target (per loss chunk)."""
    chunk, plan = ref.model.loss_chunk_size, rt.plan

    def fn(params: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        model = nnx.merge(ref.graphdef, params)
        h, _ = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"], plan=plan)
        return _per_chunk(lambda h, y: (target_logps(model.logits(h, plan=plan), y),), chunk, h, batch["targets"])[0]

    return jax.jit(fn, in_shardings=(ref.shardings, rt.batch_sharding))


def save_reference(config: str | None, overrides: Sequence[str], out: str, restore: str | None = None,
                   steps: int | None = None, progress: bool = True,
                   devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
    """Write the reference log-probs of steps 1..steps (default train.steps) to `out`; a short report."""
    start = time.perf_counter()
    cfg = load_config(config, list(overrides))
    path = _reference_path(cfg, restore)
    steps = cfg.train.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"--steps {steps} is invalid: must be a positive integer")
    base = dataclasses.replace(cfg, lora=LoraConfig())  # with LoRA the reference is the base alone
    rt = _runtime(base, list(devices) if devices is not None else jax.devices())
    t = cfg.train
    ref = ReferencePolicy(base, path, "dpo.reference")
    ref.setup(rt)
    ref.start(HostContext(rt, [], 0, t.batch_size), {})
    meta = {**batch_identity(cfg), "steps": steps,
            "reference": {"path": str(pathlib.Path(path).absolute()), "step": ref.step}}
    writer = ReferenceWriter(out, meta)
    batches = make_train_iterator(cfg.data, seq_len=t.seq_len, global_batch_size=t.batch_size,
                                  vocab_size=cfg.model.vocab_size, seed=t.seed)
    fn = reference_logps_fn(ref, rt)

    def compute(local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        glob = {k: jax.make_array_from_process_local_data(rt.batch_sharding, v) for k, v in local.items()}
        with jax.set_mesh(rt.mesh):
            return {"ref_logps": jax.device_get(fn(ref.params, glob))}

    writer.write_batches(batches, steps, compute, progress)
    writer.finish()
    size = sum(f.stat().st_size for f in pathlib.Path(out).iterdir())
    return {"out": str(out), "steps": steps, "reference": meta["reference"], "bytes": size,
            "seconds": time.perf_counter() - start}
