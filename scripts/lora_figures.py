"""The figures of docs/post-training.md (LoRA): trainable parameters, optimizer and compiled step memory, step time and
the loss of full fine-tuning vs LoRA vs QLoRA (int8 base) on one config, plus the merge's logit error.

    python scripts/lora_figures.py [PRESET] [KEY=VALUE ...]     (default: tiny, rank 8 on q k v o)

Every figure comes from the stack's own functions: `abstract_state` (opt_state bytes), the compiled
train step's `memory_analysis()`, `quantize_loaded` (the int8 base `jaxinfra quantize` writes) and
`merge_variables` (what `jaxinfra lora merge` writes). The train step is passed the LoRA extension
explicitly (an editable install made before the `lora` entry point would not find it).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfra.config import load_config
from jaxinfra.lora.extension import Lora
from jaxinfra.lora.merge import merge_variables, merged_config
from jaxinfra.quantize import quantize_loaded
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_params, model_graphdef, model_state
from models.project import ADAPTERS, LoraB

STEPS = 20


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _batch(cfg, seed: int) -> dict:
    t = cfg.train
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones_like(tokens[:, 1:]),
            "positions": np.tile(np.arange(t.seq_len, dtype=np.int32), (t.batch_size, 1))}


def measure(name: str, cfg, state_fn=None) -> dict:
    """Compiled memory, time per step and losses of STEPS steps on one repeated batch."""
    rt = build_runtime(cfg, jax.devices()[:1], extensions=[Lora()] if cfg.lora.enabled else [])
    state = rt.init_state() if state_fn is None else state_fn(rt)
    batch = rt.to_global(_batch(cfg, 0))
    mem = rt.lower_train_step(state, batch).compile().memory_analysis()
    trained = nnx.split_state(state.params, ADAPTERS, ...)[0] if cfg.lora.enabled else state.params
    losses, start = [], None
    for i in range(STEPS):
        state, m = rt.train_step(state, batch)
        losses.append(float(m["loss"]))
        start = time.perf_counter() if i == 1 else start  # steps 3.. timed (compile and warm-up out)
    jax.block_until_ready(state)
    step_s = (time.perf_counter() - start) / (STEPS - 2)
    return {"run": name, "trainable": sum(x.size for x in jax.tree.leaves(trained)),
            "params_MiB": _bytes(state.params) / 2**20, "opt_state_MiB": _bytes(state.opt_state) / 2**20,
            "args_MiB": mem.argument_size_in_bytes / 2**20, "temp_MiB": mem.temp_size_in_bytes / 2**20,
            "step_ms": 1e3 * step_s, "loss_first": losses[0], "loss_last": losses[-1], "state": state, "rt": rt}


def merge_error(cfg, state) -> float:
    """max |merged - unmerged| / max |unmerged| of the logits, with B made non-zero (a trained adapter)."""
    variables = jax.tree.map(lambda v: v.replace(0.05 * jax.random.normal(jax.random.key(3), v.shape))
                             if isinstance(v, LoraB) else v, jax.device_get(model_state(state)),
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    plain = merged_config(cfg)
    merged = merge_variables(cfg, variables, abstract_params(plain.model, quant=plain.quant))
    tokens = jnp.asarray(_batch(cfg, 1)["inputs"][:2])
    want = nnx.merge(model_graphdef(cfg.model, cfg.quant, cfg.lora), variables)(tokens)
    got = nnx.merge(model_graphdef(plain.model, plain.quant), merged)(tokens)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def main(argv: list[str]) -> None:
    preset, overrides = (argv[0] if argv else "tiny"), argv[1:]
    base = load_config(preset, ["data.source=synthetic", "model.dtype=float32", "schedule.warmup_steps=0",
                                *overrides])
    lora = dataclasses.replace(base, lora=dataclasses.replace(base.lora, rank=8, alpha=16.0))
    full = measure("full fine-tune", base)
    adapters = measure("LoRA r=8 (q,k,v,o)", lora)
    float_base = nnx.split_state(model_state(full["state"]), ADAPTERS, ...)[1]
    qcfg, qbase = quantize_loaded(base, jax.device_get(float_base), devices=jax.devices()[:1])
    qlora = dataclasses.replace(qcfg, lora=lora.lora)

    def int8_base(rt):
        state = rt.init_state()
        return state.replace(params=nnx.merge_state(qbase, nnx.split_state(state.params, ADAPTERS, ...)[0]))

    q = measure("QLoRA r=8 (int8 base)", qlora, int8_base)
    cols = ("run", "trainable", "params_MiB", "opt_state_MiB", "args_MiB", "temp_MiB", "step_ms", "loss_first",
            "loss_last")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in (full, adapters, q):
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    print(f"int8 base / float32 base bytes: {_bytes(qbase) / _bytes(float_base):.3f}")
    print(f"merge: max |merged - unmerged| / max |logits| = {merge_error(lora, adapters['state']):.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
