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
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

from jaxinfra.config import Config, ConfigError, load_config
from jaxinfra.metrics.hlo import parse_hlo, skip_shape

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

    rt = build_runtime(cfg, devices)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         rt.abstract_state(), rt.state_shardings)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=rt.batch_sharding)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    for e in rt.extensions:  # e.g. offline distillation's saved logits
        batch |= {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rt.batch_sharding)
                  for k, v in e.batch_specs(shape).items()}
    # The extensions' frozen inputs, abstract (e.g. an online teacher's params, not loaded here).
    compiled = rt.lower_train_step(state, batch, tuple(e.abstract_inputs() for e in rt.extensions)).compile()
    mem = compiled.memory_analysis()
    figures = {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
               "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes}
    figures["total_bytes"] = (figures["argument_bytes"] + figures["temp_bytes"] + figures["output_bytes"]
                              - figures["alias_bytes"])
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    figures["flops"] = float(cost.get("flops", 0.0)) if cost else 0.0
    figures["platform"] = devices[0].platform
    figures["collectives"] = {f"{op} x{n}": [calls, size]
                              for (op, n), (calls, size) in collective_traffic(compiled.as_text()).items()}
    return figures


_ENTRY = re.compile(r"^ENTRY %([\w.\-]+) ", re.M)
_LINE = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$", re.M)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\]")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8}
COLLECTIVE_OPCODES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _result_bytes(rest: str) -> int:
    """Bytes of an instruction's result: its leading shape (an array or a tuple of arrays)."""
    shape = rest[:len(rest) - len(skip_shape(rest))]
    return sum(_ITEM_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(shape))


def _group_size(rest: str) -> int:
    """Devices in one replica group: `{{0,1},{2,3}}`, the iota form `[groups,size]<=[...]`, or the
    mesh form `mesh['axis_0'=2,...] {'axis_0'}`; for a collective-permute, its source-target pairs."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", rest):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]", rest):
        return int(m.group(2))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rest):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    if m := re.search(r"source_target_pairs=\{(.*?)\}\}", rest):
        return m.group(1).count("{")
    return 1


def collective_traffic(hlo_text: str) -> dict[tuple[str, int], tuple[float, float]]:
    """What a compiled program's collectives move per execution of it, per device:
    {(opcode, devices per group): (executions, bytes)}, each collective weighted by the trip counts
    of the while loops around it. Bytes are the whole buffer (a reduce-scatter's result times its
    group), the plan's `Collective.size` convention. An unknown trip count counts once."""
    module = parse_hlo(hlo_text)
    rests = dict(_LINE.findall(hlo_text))
    entry = _ENTRY.search(hlo_text)
    weight, todo = {entry.group(1): 1.0} if entry else {}, [entry.group(1)] if entry else []
    while todo:  # computations in call order from the entry: a callee weighs its caller's weight
        comp = todo.pop()
        for name in module.computations.get(comp, []):
            inst = module.instructions[name]
            trips = _TRIPS.search(rests[name]) if inst.opcode == "while" else None
            for callee in inst.calls:
                if callee not in weight and callee in module.computations:
                    weight[callee] = weight[comp] * (int(trips.group(1)) if trips else 1)
                    todo.append(callee)
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for comp, w in weight.items():
        for name in module.computations[comp]:
            opcode = module.instructions[name].opcode
            if opcode in COLLECTIVE_OPCODES:
                rest = rests[name]
                group = _group_size(rest)
                size = _result_bytes(rest) * (group if opcode == "reduce-scatter" else 1)
                calls, total = out.get((opcode, group), (0.0, 0.0))
                out[opcode, group] = (calls + w, total + w * size)
    return out


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
