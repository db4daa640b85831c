"""Where a step's time goes: a `jax.profiler` trace read back and each op's share of the step.

`capture(run, log_dir)` traces `run()` (Python tracer off, so the file stays small) and returns the
trace-viewer file (`*.trace.json.gz`); `op_events(load_events(path), module)` picks the program's
op executions from it; `summarize(events, hlo, steps)` groups them into `hlo.CATEGORIES`.

Which events are ops: trace events whose args name the HLO op and module (`hlo_op`, `hlo_module`).
On a GPU those are the kernels on the device's stream lines (host-side launch events carry the
same args and are ignored; kernels without them, e.g. inside a command buffer, count by their
kernel name, and inside the traced window). On XLA:CPU they are the thunk executor's events
(compile with `xla_cpu_enable_xprof_traceme`), which nest inside while loops and run on several
threads at once, so control-flow ops (their bodies' containers) are skipped.

Shares: the window runs from the first op's start to the last op's end; `host gaps` is the part
of it with no op running (dispatch, host work between steps); the busy rest is divided among the
categories in proportion to their summed op time (ops that overlap, on two CPU threads or two GPU
streams, are counted once that way).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import itertools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax

from jaxinfra.metrics.hlo import ATTENTION, COLLECTIVES, CONTROL_FLOW, HOST_GAPS, MATMUL, OTHER, HloModule, classify

_DERIVED_LINES = frozenset({"XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code",
                            "XLA TraceMe", "TensorFlow Ops", "TensorFlow Name Scope", "Launch Stats"})
_KERNEL_HINTS = ((re.compile(r"nccl", re.I), COLLECTIVES),
                 (re.compile(r"fmha|sdpa|flash|attention", re.I), ATTENTION),
                 (re.compile(r"gemm|nvjet|cublas|xmma|cutlass", re.I), MATMUL))


@dataclasses.dataclass(frozen=True)
class OpEvent:
    name: str  # the HLO instruction, or the kernel's name when the event names none
    start: float  # microseconds
    end: float
    run: str = ""  # the program execution it belongs to ("" when the trace does not say)
    named: bool = True  # the event named its HLO op


@dataclasses.dataclass
class StepProfile:
    steps: int
    step_us: float  # traced window / steps
    busy_fraction: float  # of the window, some op running
    unnamed_fraction: float  # of the op time, events that named no HLO op (classified by kernel name)
    between_steps_us: float  # per step, idle between one execution's last op and the next one's first
    categories: dict[str, float]  # category -> share of the step (sums to 1 with host gaps)
    ops: list[tuple[str, str, float, float, float]]  # (op, category, calls per step, us per step, share)


def capture(run: Callable[[], Any], log_dir: str | Path) -> Path:
    """Trace `run()` (which must block until its work is done); the trace-viewer file written."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    before = set(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    with jax.profiler.trace(str(log_dir), profiler_options=options):
        run()
    new = sorted(set(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz")) - before)
    if not new:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {log_dir}")
    return new[-1]


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The trace events of a Chrome-trace JSON file (gzipped or not)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _names(events: Iterable[dict[str, Any]]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e.get("tid")] = e.get("args", {}).get("name", "")
    return processes, threads


def _device_lines(events: list[dict], processes: dict, threads: dict, module: str) -> set[tuple[Any, Any]]:
    """(pid, tid) of the device lines to read ops from: GPU streams, else TPU 'XLA Ops', else every
    non-derived line, of the device processes that ran the module; empty on XLA:CPU (host ops)."""
    carrying = {(e["pid"], e.get("tid")) for e in events if "hlo_op" in e.get("args", {})
                and _module_of(e) == module and processes.get(e.get("pid"), "").startswith("/device:")}
    pids = {pid for pid, _ in carrying}
    lines = {line: name for line, name in threads.items() if line[0] in pids}
    for pick in (lambda n: n.startswith("Stream"), lambda n: n == "XLA Ops",
                 lambda n: n not in _DERIVED_LINES and n != "XLA Ops"):
        chosen = {line for line, name in lines.items() if pick(name)}
        if chosen & carrying:
            return chosen
    return carrying


def _module_of(event: dict[str, Any]) -> str:
    module = event.get("args", {}).get("hlo_module", "")
    return module.split("(")[0] if isinstance(module, str) else ""


def op_events(events: list[dict[str, Any]], module: str, device: bool = False) -> list[OpEvent]:
    """Executions of the ops of HLO module `module` (e.g. `jit_train_step`) in a trace.

    device=True: the ops must come from a device's lines (an accelerator's trace); a trace whose only
    op events are the host's (launches: the device tracer, CUPTI on a GPU, did not record) is an error."""
    processes, threads = _names(events)
    lines = _device_lines(events, processes, threads, module)
    if device and not lines:
        raise ValueError(f"no device op events of {module} in the trace (did the device tracer, e.g. CUPTI, run?)")
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or (lines and (e["pid"], e.get("tid")) not in lines):
            continue
        args = e.get("args", {})
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if "hlo_op" in args and _module_of(e) == module:
            out.append(OpEvent(args["hlo_op"], start, end, str(args.get("run_id", ""))))
        elif lines and "hlo_op" not in args:
            out.append(OpEvent(e.get("name", ""), start, end, named=False))
    named = [ev for ev in out if ev.named]
    if not named:
        return []
    lo, hi = min(ev.start for ev in named), max(ev.end for ev in named)
    return [ev for ev in out if ev.named or (ev.start >= lo and ev.end <= hi)]


def event_category(module: HloModule, event: OpEvent) -> str:
    if event.named:
        return classify(module, event.name)
    for candidate in (event.name, re.sub(r"_(\d+)$", r".\1", event.name)):
        if candidate in module.instructions:
            return classify(module, candidate)
    return next((cat for pattern, cat in _KERNEL_HINTS if pattern.search(event.name)), OTHER)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            total += 0.0 if current_end is None else current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    return total + (0.0 if current_end is None else current_end - current_start)


def _between_steps(events: list[OpEvent]) -> float:
    spans = collections.defaultdict(lambda: [float("inf"), float("-inf")])
    for ev in events:
        if ev.run:
            span = spans[ev.run]
            span[0], span[1] = min(span[0], ev.start), max(span[1], ev.end)
    ordered = sorted(spans.values())
    return sum(max(0.0, b[0] - a[1]) for a, b in itertools.pairwise(ordered))


def summarize(events: list[OpEvent], module: HloModule, steps: int | None = None) -> StepProfile:
    """Category shares and per-op totals of `steps` executions (default: the executions the trace
    tells apart by run id)."""
    leaves = [ev for ev in events
              if module.instructions.get(ev.name) is None or module.instructions[ev.name].opcode not in CONTROL_FLOW]
    if not leaves:
        raise ValueError(f"no op of {module.name} in the trace (XLA:CPU needs xla_cpu_enable_xprof_traceme)")
    runs = {ev.run for ev in leaves if ev.run}
    steps = steps or len(runs) or 1
    window = max(ev.end for ev in leaves) - min(ev.start for ev in leaves)
    busy = _union_length([(ev.start, ev.end) for ev in leaves])
    per_op: dict[str, list] = {}
    for ev in leaves:
        entry = per_op.setdefault(ev.name, [0, 0.0, ev])
        entry[0] += 1
        entry[1] += ev.end - ev.start
    op_total = sum(t for _, t, _ in per_op.values()) or 1.0
    scale = busy / window / op_total if window else 0.0  # op time -> share of the window
    categories = {HOST_GAPS: 1.0 - busy / window if window else 0.0}
    ops = []
    for name, (calls, t, example) in per_op.items():
        cat = event_category(module, example)
        categories[cat] = categories.get(cat, 0.0) + t * scale
        ops.append((name, cat, calls / steps, t / steps, t * scale))
    ops.sort(key=lambda op: -op[3])
    unnamed = sum(ev.end - ev.start for ev in leaves if not ev.named) / op_total
    return StepProfile(steps, window / steps, busy / window if window else 0.0, unnamed,
                       _between_steps(leaves) / steps, categories, ops)


def format_profile(profile: StepProfile, top: int = 12) -> str:
    """The category table (every category, in `hlo.CATEGORIES` order) and the `top` ops by time."""
    from jaxinfra.metrics.hlo import CATEGORIES
    from jaxinfra.metrics.table import Column, format_table

    ms = profile.step_us / 1e3
    cats = [(c, profile.categories.get(c, 0.0) * ms, 100 * profile.categories.get(c, 0.0)) for c in CATEGORIES]
    head = (f"profile: {profile.steps} steps, {ms:.3f} ms/step traced, ops busy {100 * profile.busy_fraction:.1f}%"
            f", idle between steps {profile.between_steps_us / 1e3:.3f} ms/step, op time in events naming no "
            f"HLO op {100 * profile.unnamed_fraction:.1f}%")
    table = format_table(cats, (Column("category", width=22), Column("ms/step", ".3f", ">", 9),
                                Column("% of step", ".1f", ">", 9)), sep=" ")
    ops = [(name[:48], cat, calls, us / 1e3, 100 * share) for name, cat, calls, us, share in profile.ops[:top]]
    top_table = format_table(ops, (Column("op", width=30), Column("category", width=22), Column("calls", ".0f", ">", 5),
                                   Column("ms/step", ".3f", ">", 9), Column("%", ".1f", ">", 5)), sep=" ")
    return "\n".join((head, table, f"top {len(ops)} ops:", top_table))
