"""`jaxinfra plan --compile`: XLA's own figures for the real train step, beside the analytic ones.

The step is the one `jaxinfra train` runs (jaxinfra/runtime.py build_runtime(...).lower_train_step),
lowered on abstract inputs (shapes and shardings only, nothing allocated) and compiled; no step
executes. `memory_analysis()` gives per-device argument, output, temporary and aliased bytes;
the peak is arguments + temporaries + outputs - aliased (the donated state is both an argument
and an output). `cost_analysis()` gives the per-device FLOPs XLA counts.

Devices: the real ones when there are enough; otherwise N fake CPU devices. Their count is an
XLA flag read when the CPU backend starts, so this process sets it before anything asks jax
for devices (jaxinfra/plan/cli.py), and when the backend already runs with fewer, the compile
runs in a child process (`python -m jaxinfra.plan.compiled CONFIG.yaml N`) that prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from jaxinfra.config import Config, ConfigError, load_config

FLAG = "--xla_force_host_platform_device_count"


def request_cpu_devices(count: int) -> None:
    """Ask for `count` fake CPU devices; effective only before the CPU backend starts."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FLAG)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{FLAG}={count}"])


def _devices(count: int) -> list | None:
    import jax

    real = jax.devices()
    if len(real) >= count:
        return real[:count]
    cpu = jax.devices("cpu")
    return cpu[:count] if len(cpu) >= count else None


def analyse(cfg: Config, devices: list) -> dict[str, Any]:
    """Lower and compile the train step on `devices`; XLA's per-device memory and FLOPs."""
    import jax
    import numpy as np

    from jaxinfra.runtime import build_runtime
    from jaxinfra.state import abstract_state

    rt = build_runtime(cfg, devices)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         abstract_state(cfg.model, rt.tx, cfg.quant), rt.state_shardings)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=rt.batch_sharding)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    batch |= _offline_logits(cfg, rt, shape)
    compiled = rt.lower_train_step(state, batch, *_distill_inputs(cfg, rt)).compile()
    mem = compiled.memory_analysis()
    figures = {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
               "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes}
    figures["total_bytes"] = (figures["argument_bytes"] + figures["temp_bytes"] + figures["output_bytes"]
                              - figures["alias_bytes"])
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    figures["flops"] = float(cost.get("flops", 0.0)) if cost else 0.0
    figures["platform"] = devices[0].platform
    return figures


def _distill_inputs(cfg: Config, rt) -> tuple:
    """The step's inputs after the batch, abstract: online distillation's teacher params (in
    teacher_dtype, with the shardings the runtime gives them) and the schedule knobs."""
    import jax

    from jaxinfra.state import abstract_params

    parts = rt.distill
    if parts is None:
        return ()
    knobs = jax.ShapeDtypeStruct(parts.knobs.shape, parts.knobs.dtype, sharding=parts.input_shardings[-1])
    if parts.teacher is None:
        return (knobs,)
    teacher = abstract_params(parts.teacher.compute_model(cfg.distill.teacher_dtype))
    teacher = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), teacher,
                           parts.input_shardings[0])
    return teacher, knobs


def _offline_logits(cfg: Config, rt, shape: tuple[int, int]) -> dict:
    """Offline distillation's batch entries (jaxinfra/distill/logits.py), abstract."""
    import jax
    import numpy as np

    if rt.distill is None or rt.distill.logits is None:
        return {}
    k = cfg.distill.top_k or rt.distill.logits.top_k
    ids = np.uint16 if cfg.model.vocab_size <= 2**16 else np.int32
    return {"teacher_ids": jax.ShapeDtypeStruct((*shape, k), ids, sharding=rt.batch_sharding),
            "teacher_values": jax.ShapeDtypeStruct((*shape, k), np.float32, sharding=rt.batch_sharding),
            "teacher_ce": jax.ShapeDtypeStruct(shape, np.float32, sharding=rt.batch_sharding)}


def compiled_figures(cfg: Config, count: int) -> dict[str, Any]:
    """`analyse` on `count` devices of this backend, in a child process when this one has too few."""
    devices = _devices(count)
    if devices is not None:
        return analyse(cfg, devices)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(cfg.to_yaml())
    env = dict(os.environ)
    flags = [x for x in env.get("XLA_FLAGS", "").split() if not x.startswith(FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{FLAG}={count}"])
    env["JAX_PLATFORMS"] = "cpu"
    try:
        out = subprocess.run([sys.executable, "-m", "jaxinfra.plan.compiled", f.name, str(count)], env=env,
                             capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"--compile: compiling the step on {count} fake CPU devices failed: {last[:300]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    cfg = load_config(argv[0])
    count = int(argv[1])
    devices = _devices(count)
    if devices is None:
        print(f"jaxinfra: error: fewer than {count} devices here, even with fake CPU devices", file=sys.stderr)
        return 2
    print(json.dumps(analyse(cfg, devices)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
