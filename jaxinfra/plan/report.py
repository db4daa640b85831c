"""A plan as text: the memory table with the device's capacity and headroom, the step time with
its collectives, throughput, MFU, wall time and the bottleneck; and the one-line summary
`jaxinfra train` prints at start."""

from __future__ import annotations

from jaxinfra.metrics.table import Column, format_table
from jaxinfra.plan.estimate import FIT_MARGIN, Plan
from jaxinfra.plan.memory import PHASES


def size(n: float) -> str:
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def header(plan: Plan) -> str:
    lay = plan.layout
    mesh = " x ".join(f"{a}={s}" for a, s in lay.sizes.items() if s > 1) or "one device"
    t = lay.cfg.train
    return (f"plan: {lay.devices} x {plan.spec.kind} ({plan.spec.name}), mesh {mesh}, strategy "
            f"{lay.cfg.parallelism.strategy}, remat {lay.model.remat_policy}, batch {t.batch_size} x seq {t.seq_len}"
            + (f", {t.grad_accum_steps} accumulation steps" if t.grad_accum_steps > 1 else ""))


def memory_lines(plan: Plan, compiled: float | None = None) -> list[str]:
    mem, cap = plan.memory, plan.spec.memory_bytes
    order = {p: i for i, p in enumerate(PHASES)}
    rows = [(c.name, c.phase, size(c.bytes), c.note) for c in sorted(mem.components, key=lambda c: order[c.phase])]
    rollout = ", rollout" if mem.phase("rollout") else ""  # GRPO: the sampler's phase between steps
    head = ("memory per device (analytic, decoding)" if plan.inference else
            f"memory per device (analytic; total = resident + max(step + max(head, layer), update{rollout}))")
    table = format_table(rows, [Column("component"), Column("phase"), Column("bytes", align=">"), Column("note")])
    lines = [head, table, f"total {size(mem.total)} (peak in the {mem.peak_phase} phase) of {size(cap)} per device: "
             + verdict(plan)]
    byname = {c.name: c.bytes for c in mem.components}
    if "frozen params" in byname:  # LoRA: the split that decides what a fine-tune costs
        lines.append(f"params: frozen base {size(byname['frozen params'])} (no gradients, no optimizer state) + "
                     f"trained adapters {size(byname['params'])} (+ gradients {size(byname['gradients'])}, "
                     f"optimizer state {size(byname['optimizer state'])}) per device")
    if compiled is not None:
        lines.append(f"compiled (XLA memory_analysis: arguments + temporaries + outputs - aliased): {size(compiled)}; "
                     f"analytic / compiled = {mem.total / compiled:.3f}")
    return lines


def verdict(plan: Plan) -> str:
    """Whether the plan fits, in the words `jaxinfra train` acts on (Plan.refused: exit 2 beyond the margin)."""
    room, cap = plan.spec.memory_bytes - plan.memory.total, plan.spec.memory_bytes
    if room >= 0:
        return f"headroom {size(room)} ({room / cap:.0%})"
    if not plan.refused:
        return (f"over by {size(-room)} ({-room / cap:.0%}), within the estimate's {FIT_MARGIN - 1:.0%} margin "
                f"(`jaxinfra train` runs it)")
    return f"DOES NOT FIT by {size(-room)}"


def refusal(plan: Plan) -> str:
    """The one error line of a plan that does not fit (`jaxinfra plan` exits 2 with it unless --report)."""
    return (f"the plan does not fit: {size(plan.memory.total)} per device (analytic) exceeds the {plan.spec.kind} "
            f"device's {size(plan.spec.memory_bytes)} by more than {FIT_MARGIN - 1:.0%}, so `jaxinfra train` would "
            f"refuse it; --search finds layouts that fit, --report prints the plan with exit status 0")


def _compute_basis(plan: Plan) -> str:
    """What priced the compute: the probes by kind (jaxinfra/plan/probes.py), or peak x efficiency."""
    t = plan.time
    if plan.spec.rates:
        return "probed rates by kind: " + ", ".join(f"{k} {seconds(v)}" for k, v in t.compute_by_kind.items() if v)
    return f"peak {t.peak / 1e12:.4g} TFLOP/s x efficiency {plan.spec.efficiency}"


def time_lines(plan: Plan) -> list[str]:
    t = plan.time
    if plan.inference:
        return [f"decode step {seconds(t.step_s)} (one token for each of {plan.tokens_per_step} rows): "
                f"{plan.tokens_per_s:,.0f} tokens/s, MFU {plan.mfu:.3f}; bound by {plan.bottleneck}"]
    lines = [f"step time {seconds(t.step_s)}: compute {seconds(t.compute_s)} (" + _compute_basis(plan)
             + (f", shared by {plan.spec.shared_host} devices" if plan.spec.shared_host > 1 else "")
             + f"), bubble {seconds(t.bubble_s)}, optimizer update {seconds(t.update_s)}"
             + (f", gradient sums {seconds(t.accumulate_s)}" if t.accumulate_s else "") + ", exposed comm "
             f"{seconds(t.exposed_s)}, overlapped comm {seconds(t.overlapped_s)}"]
    if t.collectives:
        rows = [(c.what, "x".join(c.axes), c.op, size(c.size), f"{c.calls:g}", seconds(c.seconds),
                 "overlapped" if c.overlapped else "exposed") for c in t.collectives]
        lines.append(format_table(rows, [Column("collective"), Column("axes"), Column("op"),
                                         Column("bytes/call", align=">"), Column("calls", align=">"),
                                         Column("per step", align=">"), Column("")]))
    steps = plan.layout.cfg.train.steps
    lines.append(f"tokens/s {plan.tokens_per_s:,.0f}, MFU {plan.mfu:.3f}, {steps} steps (train.steps): "
                 f"{seconds(plan.wall_s)}; bottleneck: {plan.bottleneck}")
    return lines


def describe(plan: Plan, compiled: float | None = None) -> str:
    return "\n".join([header(plan), *memory_lines(plan, compiled), *time_lines(plan)])


def one_line(plan: Plan) -> str:
    """What `jaxinfra train` prints at start."""
    mem, cap = plan.memory.total, plan.spec.memory_bytes
    return (f"jaxinfra: plan: {size(mem)} per device analytic (of {size(cap)} {plan.spec.kind}, "
            f"{mem / cap:.0%}), ~{seconds(plan.time.step_s)}/step predicted, bottleneck {plan.bottleneck}")
