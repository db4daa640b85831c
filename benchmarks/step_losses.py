"""Per-step losses (exact float hex) of a few configs, to compare two trees bit for bit.

    PYTHONPATH=TREE python benchmarks/step_losses.py OUT.json [NAME ...]

Runs on one CPU device with a fixed random batch per step (benchmarks/step_cpu.py random_batch).
Works against trees before and after the step-extension seam (issue 27): the distillation setup
takes whichever API the tree has.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import numpy as np

from jaxinfra.config import Config, load_config
from jaxinfra.runtime import build_runtime

TINY = ["model.vocab_size=256", "train.seq_len=64", "train.batch_size=8", "mesh.data=1"]
CASES = {
    "small": ("small", ["mesh.data=1"], 20),
    "moe_bias": ("deepseek-tiny", ["train.seq_len=64", "train.batch_size=8", "mesh.data=1"], 10),
    "fp8_delayed": ("tiny", [*TINY, "quant.train=fp8", "quant.scaling=delayed", "quant.amax_history=4",
                             "quant.fp8_emulation=true"], 10),
    "fp8_delayed_accum2": ("tiny", [*TINY, "quant.train=fp8", "quant.scaling=delayed", "quant.amax_history=4",
                                    "quant.fp8_emulation=true", "train.grad_accum_steps=2"], 10),
    "distill_online": ("tiny", [*TINY, "distill.alpha=0.5", "distill.temperature=2.0",
                                "distill.teacher_dtype=float32", "model.loss_chunk_size=16"], 10),
    "distill_offline": ("tiny", [*TINY, "distill.alpha=0.5", "distill.temperature=2.0", "model.loss_chunk_size=16",
                                 "data.source=synthetic", "data.synthetic_vocab=256"], 10),
}
DATA = ["data.source=synthetic", "data.synthetic_vocab=256", "train.seq_len=64", "train.batch_size=8"]


def random_batch(cfg: Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    b, t = cfg.train.batch_size, cfg.train.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()}


def _teacher(cfg: Config) -> str:
    """A params-only teacher (the student's architecture, another seed) written by this tree."""
    from jaxinfra.checkpoint import save_params_only
    from jaxinfra.state import init_params

    out = tempfile.mkdtemp(prefix="teacher-")
    params = jax.jit(lambda k: init_params(cfg.model, k))(jax.random.key(7))
    save_params_only(out, Config(model=cfg.model), params, {"params_only": True, "step": 0})
    return out


def _start_teacher(rt):
    """The tree's distillation host object, started: (host_batch(local, step) -> the full local batch)."""
    try:
        from jaxinfra.extensions import HostContext

        ext = rt.extension("distill")
        ext.start(HostContext(rt, [], 0, rt.cfg.train.batch_size), {})
        return lambda local, step: {**local, **ext.host_batch(local, step)}
    except ImportError:  # the tree before the seam
        from jaxinfra.distill.run import DistillRun

        run = DistillRun(rt, [], 0, rt.cfg.train.batch_size)
        run.start({})
        return run.host_batch


def _offline_config(preset: str, overrides: list[str], steps: int) -> Config:
    """Save the teacher's top-k logits of `steps` synthetic batches (this tree's save-logits)."""
    from jaxinfra.distill.save import save_logits

    cfg = load_config(preset, [*overrides, f"train.steps={steps}"])
    out = tempfile.mkdtemp(prefix="logits-") + "/logits"
    save_logits(_teacher(cfg), DATA, out, top_k=8, steps=steps, teacher_dtype="float32", progress=False,
                devices=jax.devices()[:1])
    return load_config(preset, [*overrides, f"train.steps={steps}", f"distill.logits={out}"])


def _batches(cfg: Config, name: str, steps: int):
    if name != "distill_offline":
        rng = np.random.default_rng(0)
        return (random_batch(cfg, rng) for _ in range(steps))
    from jaxinfra.data import make_train_iterator

    t = cfg.train
    it = make_train_iterator(cfg.data, seq_len=t.seq_len, global_batch_size=t.batch_size,
                             vocab_size=cfg.model.vocab_size, seed=t.seed, process_index=0, process_count=1)
    return (next(it) for _ in range(steps))


def losses(name: str) -> dict[str, list[str]]:
    preset, overrides, steps = CASES[name]
    cfg = load_config(preset, [*overrides, f"train.steps={steps}"])
    if name == "distill_online":
        cfg = load_config(preset, [*overrides, f"train.steps={steps}", f"distill.teacher={_teacher(cfg)}"])
    elif name == "distill_offline":
        cfg = _offline_config(preset, overrides, steps)
    rt = build_runtime(cfg, jax.devices()[:1])
    host_batch = _start_teacher(rt) if name.startswith("distill") else (lambda local, step: local)
    state = rt.init_state()
    out: dict[str, list[str]] = {}
    for step, local in enumerate(_batches(cfg, name, steps), 1):
        state, m = rt.train_step(state, rt.to_global(host_batch(local, step)))
        for k, v in jax.device_get(m).items():
            if np.ndim(v) == 0:
                out.setdefault(k, []).append(float(v).hex())
    return out


if __name__ == "__main__":
    names = sys.argv[2:] or list(CASES)
    result = {n: losses(n) for n in names}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({n: float.fromhex(r["loss"][-1]) for n, r in result.items()}))
