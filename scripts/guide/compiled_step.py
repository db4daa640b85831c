"""What XLA compiled for a config's train step: per-device memory and the collectives it inserted.

    python scripts/guide/compiled_step.py CONFIG [KEY=VALUE ...] [--vary KEY=V1,V2,...] [--time STEPS]

For each value of the `--vary` key (or once), builds the runtime exactly as `jaxinfra train`
does (jaxinfra/runtime.py: build_runtime), lowers and compiles the train step on abstract
inputs (nothing is allocated), and prints one row: XLA's `memory_analysis()` per device
(temporaries = activations kept for the backward plus scratch; arguments = the state and the
batch) and, per collective kind, how many ops the partitioned program holds and the bytes of
their results per device. `--time N` also runs N real steps on random tokens and prints the
median step time (on fake CPU devices all devices share the host's cores: compare ratios).

Counts are static: an op inside a loop body (the layer scan, a pipeline's tick loop) is
counted once however often the loop runs; `model.scan_layers=false` unrolls the layers so
that the counts are per step.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import numpy as np

from benchmarks.step_cpu import random_batch, time_runtime
from jaxinfra.config import Config, load_config
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.runtime import Runtime, build_runtime

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
            "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """{kind: (op count, result bytes per device)} of a partitioned HLO module's text."""
    found: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for line in hlo.splitlines():
        m = OP.search(line)
        if not m:
            continue
        size = sum(ITEMSIZE.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                   for dtype, dims in ARRAY.findall(m.group(1)))
        found[m.group(2)][0] += 1
        found[m.group(2)][1] += size
    return {kind: (count, size) for kind, (count, size) in found.items()}


def abstract_inputs(rt: Runtime) -> tuple:
    """ShapeDtypeStructs of the state and a batch, with the step's shardings."""
    from jaxinfra.state import abstract_state

    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract_state(rt.cfg.model, rt.tx), rt.state_shardings)
    b, t = rt.cfg.train.batch_size, rt.cfg.train.seq_len
    batch = {k: jax.ShapeDtypeStruct((b, t), np.int32, sharding=rt.batch_sharding)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    return state, batch


def median_step_s(rt: Runtime, steps: int) -> float:
    batch = rt.to_global(random_batch(rt.cfg, np.random.default_rng(0)))
    return time_runtime(rt, rt.init_state(), batch, steps)[1]


def measure(cfg: Config, steps: int) -> dict:
    rt = build_runtime(cfg, jax.devices())
    compiled = rt.lower_train_step(*abstract_inputs(rt)).compile()
    memory = compiled.memory_analysis()
    row = {"temp": memory.temp_size_in_bytes, "arguments": memory.argument_size_in_bytes,
           "collectives": collectives(compiled.as_text())}
    if steps:
        row["step_s"] = median_step_s(rt, steps)
    return row


def _cell(found: dict[str, tuple[int, int]], kind: str) -> str:
    count, size = found.get(kind, (0, 0))
    return f"{count} ({size / 2**20:.2f} MiB)" if count else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--vary", metavar="KEY=V1,V2", help="one row per value of this key")
    parser.add_argument("--time", type=int, default=0, metavar="STEPS", help="also time this many real steps")
    args = parser.parse_intermixed_args()  # KEY=VALUE overrides may follow the options
    key, _, values = (args.vary or "=").partition("=")
    results = []
    for value in values.split(",") if args.vary else [""]:
        cfg = load_config(args.config, [*args.overrides, *([f"{key}={value}"] if args.vary else [])])
        results.append((value or args.config, measure(cfg, args.time)))
    kinds = [k for k in KINDS if any(k in r["collectives"] for _, r in results)]  # leave out kinds never seen
    rows = [[name, f"{r['temp'] / 2**20:.2f}", f"{r['arguments'] / 2**20:.2f}",
             *(_cell(r["collectives"], k) for k in kinds), *([f"{r['step_s'] * 1e3:.1f}"] if args.time else [])]
            for name, r in results]
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}; {args.config} {' '.join(args.overrides)}".rstrip())
    columns = [Column(key or "config"), Column("temp MiB", align=">"), Column("args MiB", align=">"),
               *(Column(k) for k in kinds), *([Column("step ms", align=">")] if args.time else [])]
    print(format_table(rows, columns))

if __name__ == "__main__":
    main()
