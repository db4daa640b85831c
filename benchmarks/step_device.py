"""Training-step throughput, MFU, memory and profile on an accelerator, per attention implementation,
then a chain of candidate improvements measured one after the other in the same call.

    python benchmarks/step_device.py [--impls pallas_triton,pallas_mosaic_gpu,cudnn,xla] [--policies none]
        [--variants base,chunked_loss,remat=save_dots_no_batch,batch=fit,host_batches]
        [--profile] [--fit-batch] [--isolate] [--budget-s 240] [--cpu-preset small] [KEY=VALUE ...]

The default model is Llama-shaped, ~1.1B parameters (d_model 2048, 16 layers, 16 heads of 128,
8 KV heads, SwiGLU 8192, vocab 32768, untied), seq 4096, global batch 8, bfloat16 compute with
float32 parameters and AdamW: the same jitted step `jaxinfra train` runs.

First one row per (attention impl, remat policy); then, on the fastest implementation, one row per
`--variants` entry, each applied on top of the previous row (benchmarks/step_row.py lists them), so
each row measures one change against the version before it. Per row: compile time, step time,
tokens/s, model TFLOP/s, MFU (PaLM's count, what `metrics.jsonl` logs; and with causal attention
halved), the ratio to a `jnp.dot` measured in the same call, the device's `peak_bytes_in_use`, the
compiled program's memory estimate and (--fit-batch) the largest batch that fits, found by
compiling only. --profile traces a few steps per row and prints where the time goes
(jaxinfra/metrics/trace.py), then a table of every profiled row's shares side by side; the traces
and HLO of the fastest implementation's base row and of the last improvement, and all rows as JSON,
go to $OUT/step_profile/. docs/profiling.md explains the figures.

--isolate runs each row in its own process: the allocator's peak is then the row's own, and an
out-of-memory row cannot disturb the next. Without an accelerator it runs a tiny config on CPU (a
dry run of the same code; its figures say nothing about a GPU), or with --cpu-preset a preset as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from benchmarks.step_row import LOOP_VARIANTS, BadVariant, RowOptions, RowSpec, check_variant, measure, slug
from jaxinfra.metrics.hlo import CATEGORIES
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.metrics.trace import StepProfile, format_profile

GIB = 2**30
COLUMNS = (Column("row", width=24), Column("attention", width=13), Column("remat", width=18),
           Column("chunk", align=">", width=5), Column("batch", align=">", width=5), Column("compile s", ".1f", ">", 9),
           Column("step s", ".3f", ">", 7), Column("tokens/s", ".0f", ">", 8), Column("TFLOP/s", ".1f", ">", 7),
           Column("MFU", ".3f", ">", 5), Column("MFU causal", ".3f", ">", 10), Column("/matmul", ".2f", ">", 7),
           Column("peak GiB", align=">", width=8), Column("est GiB", ".3f", ">", 7),
           Column("fits batch", align=">", width=10))
MAX_OUT_FILE = 16 * 2**20  # what the device tool brings back per file
ROW_GRACE_S = 90.0  # --isolate: a row still running this long after the budget is stopped


def _cells(r: dict[str, Any], matmul: float | None) -> list[Any]:
    """One value per COLUMNS entry; None (printed '-') where the row has no figure."""
    cells = [r["label"], r["impl"], r["remat"], str(r["chunk"]), str(r["batch"]), r.get("compile_s")]
    if "step_s" in r:
        tps = r["tokens"] / r["step_s"]
        achieved = tps * r["fpt"]
        cells += [r["step_s"], tps, achieved / 1e12, achieved / r["peak_flops"],
                  tps * r["fpt_causal"] / r["peak_flops"], achieved / matmul if matmul else None]
    else:
        cells += [None] * 6
    peak = r.get("peak_bytes_in_use")
    estimate = r.get("memory", {}).get("peak_estimate")
    return cells + ["n/a" if peak is None and "step_s" in r else None if peak is None else f"{peak / GIB:.2f}",
                    None if estimate is None else estimate / GIB, r.get("fit", {}).get("describe")]


def format_row(r: dict[str, Any], matmul: float | None) -> str:
    """One table line under COLUMNS; a row without figures (skipped, failed, pending) carries its note."""
    columns = COLUMNS + ((Column("note"),) if "note" in r else ())
    line = format_table([_cells(r, matmul) + ([r["note"]] if "note" in r else [])], columns, sep=" ", header=False)
    return line + (f"  (loss {r['losses'][-1]:.4f})" if r.get("losses") else "")


def plan_line(r: dict[str, Any]) -> str | None:
    """The plan's prediction beside the measured row: analytic memory vs peak_bytes_in_use (GPU/TPU;
    XLA:CPU keeps no allocator statistics) and predicted vs measured step time."""
    plan = r.get("plan")
    if plan is None or "step_s" not in r:
        return None
    peak = r.get("peak_bytes_in_use")
    memory = (f"peak_bytes_in_use {peak / GIB:.2f} GiB, analytic/measured {plan['memory_bytes'] / peak:.3f}"
              if peak else "no peak_bytes_in_use here")
    return (f"    plan ({plan['kind']}): analytic memory {plan['memory_bytes'] / GIB:.3f} GiB ({memory}); step "
            f"{plan['step_s']:.3f} s predicted vs {r['step_s']:.3f} s measured, ratio "
            f"{plan['step_s'] / r['step_s']:.3f}; bottleneck {plan['bottleneck']}")


def _child_command(spec: RowSpec, opts: RowOptions) -> list[str]:
    payload = {"spec": dataclasses.asdict(spec), "opts": dataclasses.asdict(opts)}
    return [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(payload)]


def _run_child(spec: RowSpec, opts: RowOptions, timeout: float) -> dict[str, Any]:
    """The row measured in a fresh process (its JSON line), or a row carrying the failure."""
    try:
        done = subprocess.run(_child_command(spec, opts), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"note": f"error: row process ran past {timeout:.0f} s"}
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    for line in done.stdout.splitlines():
        if not line.startswith("ROW "):
            print(f"  [{spec.label}] {line}")
    if rows:
        return json.loads(rows[-1])
    tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
    return {"note": f"error: row process exit {done.returncode}: {tail[0][:160]}"}


def _measure_here(spec: RowSpec, opts: RowOptions) -> dict[str, Any]:
    try:
        return measure(spec, opts)
    except Exception as e:  # noqa: BLE001 - one row per failure, keep going
        return {"note": f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"}


def _child(payload: str) -> int:
    data = json.loads(payload)
    spec, opts = RowSpec(**{**data["spec"], "variants": tuple(data["spec"]["variants"])}), data["opts"]
    opts = RowOptions(**{**opts, "overrides": tuple(opts["overrides"])})
    print("ROW " + json.dumps(_measure_here(spec, opts)), flush=True)
    return 0


def _header(r: dict[str, Any], args: argparse.Namespace) -> str:
    cpu = r["platform"] == "cpu"
    mode = f"; CPU, preset {args.cpu_preset} (xla only)" if cpu and args.cpu_preset else "; DRY RUN (xla only)"
    return (f"device: {r['device_kind']} ({r['platform']}), jax {r['jax']}{mode if cpu else ''}\n"
            f"model: {r['params'] / 1e9:.3f}B params, {r['fpt'] / 1e9:.3f} GFLOP/token (PaLM); peak "
            f"{r['peak_flops'] / 1e12:.3f} TFLOP/s ({r['peak_source']}); jnp.dot "
            f"{'f32 2048' if cpu else 'bf16 8192'}^3: {r.get('matmul_flops', 0) / 1e12:.3f} TFLOP/s; "
            f"impls {args.impls}")


def _profiles_table(rows: list[dict[str, Any]]) -> str:
    """Every profiled row's category shares side by side (percent of its step)."""
    prof = [r for r in rows if "profile" in r]
    cells = [[c] + [100 * r["profile"]["categories"].get(c, 0.0) for r in prof] for c in CATEGORIES]
    cells.append(["step ms"] + [r["profile"]["step_us"] / 1e3 for r in prof])
    cols = [Column("% of step", width=22)] + [Column(r["label"][:18], ".1f", ">", 8) for r in prof]
    return format_table(cells, cols, sep=" ")


def _loss_agreement(rows: list[dict[str, Any]], specs: list[RowSpec]) -> str | None:
    """Max relative difference of each row's losses from the first row's, over rows that train on the
    same batches (same batch size, no host_batches): implementations and numerics-preserving variants
    must agree."""
    base = next((r for r in rows if r.get("losses")), None)
    if base is None:
        return None
    parts = []
    for r, spec in zip(rows, specs, strict=True):
        same = r.get("losses") and len(r["losses"]) == len(base["losses"]) and r["batch"] == base["batch"]
        if r is not base and same and "host_batches" not in spec.variants:
            diff = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(r["losses"], base["losses"], strict=True))
            parts.append(f"{r['label']} {diff:.2e}")
    return f"losses vs {base['label']} (max relative diff over {len(base['losses'])} steps): " + ", ".join(parts) \
        if parts else None


def _before_after(rows: list[dict[str, Any]], specs: list[RowSpec], best: RowSpec | None) -> dict[str, dict]:
    """The profiled rows to keep: the fastest implementation's base row and the last improvement
    after it (loop checks such as host_batches are not improvements)."""
    prof = [(r, s) for r, s in zip(rows, specs, strict=True) if "profile" in r]
    if not prof:
        return {}
    before = next((r for r, s in prof if s == best), prof[0][0])
    improved = [r for r, s in prof if not any(v in LOOP_VARIANTS for v in s.variants)]
    return {"before": before, "after": (improved or [prof[-1][0]])[-1]}


def _write_out(rows: list[dict[str, Any]], keep: dict[str, dict], out: str) -> list[str]:
    """$OUT/step_profile/: rows.json, and the trace + HLO of the `keep` rows (before, after)."""
    folder = Path(out) / "step_profile"
    folder.mkdir(parents=True, exist_ok=True)
    notes = []
    for tag, r in keep.items():
        for key, suffix in (("trace", "trace.json.gz"), ("hlo", "hlo.txt.gz")):
            src = Path(r["profile"][key])
            if src.stat().st_size > MAX_OUT_FILE:
                notes.append(f"{tag} {key} not kept: {src.stat().st_size / 2**20:.1f} MiB > 16 MiB")
                continue
            shutil.copyfile(src, folder / f"{tag}-{slug(r['label'])}.{suffix}")
    (folder / "rows.json").write_text(json.dumps(rows, indent=1))
    return notes + [f"wrote {', '.join(sorted(p.name for p in folder.iterdir()))} under {folder}"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default="pallas_triton,pallas_mosaic_gpu,cudnn,xla")
    p.add_argument("--policies", default="none")
    p.add_argument("--variants", default="base", help="comma-separated chain (benchmarks/step_row.py)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row, after one warm-up step")
    p.add_argument("--profile", action="store_true", help="trace --profile-steps steps per row")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--fit-batch", action="store_true", help="search the largest batch that fits, per row")
    p.add_argument("--fit-budget-s", type=float, default=90.0, help="per row, for the batch search")
    p.add_argument("--fit-multiple", type=int, default=1, help="search batches that are multiples of this")
    p.add_argument("--capacity-gib", type=float, help="device memory to fit in (default: the allocator's "
                   "bytes_limit; the CPU dry run: 32 MiB)")
    p.add_argument("--isolate", action="store_true", help="one process per row")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no row after this; with --isolate, "
                   f"stop a running row {ROW_GRACE_S:.0f} s after it")
    p.add_argument("--docs-per-row", type=int, default=1, help="documents packed per row (segment ids)")
    p.add_argument("--preset", default="small", help="preset under the 1.1B overrides (accelerator only)")
    p.add_argument("--cpu-preset", default="", help="on CPU, measure this preset as it is instead of the dry run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        for token in args.variants.split(","):
            check_variant(token)
    except BadVariant as e:
        p.error(str(e))
    return args


class _Runner:
    """Runs rows in order under the budget and prints each as it lands."""

    def __init__(self, args: argparse.Namespace, work: str):
        self.args, self.start = args, time.monotonic()
        self.deadline = self.start + args.budget_s
        capacity = None if args.capacity_gib is None else int(args.capacity_gib * GIB)
        self.opts = RowOptions(preset=args.preset, cpu_preset=args.cpu_preset, overrides=tuple(args.overrides),
                               steps=args.steps,
                               profile_steps=args.profile_steps if args.profile else 0, work_dir=work,
                               fit=args.fit_batch, fit_multiple=args.fit_multiple, capacity=capacity,
                               docs_per_row=args.docs_per_row)
        self.rows: list[dict[str, Any]] = []
        self.specs: list[RowSpec] = []
        self.matmul: float | None = None
        self.header = False

    def skip(self, spec: RowSpec, note: str) -> None:
        self._add(spec, {"note": note})

    def run(self, spec: RowSpec) -> dict[str, Any]:
        now = time.monotonic()
        if now > self.deadline:
            return self._add(spec, {"note": "skipped: budget spent"})
        opts = dataclasses.replace(self.opts, measure_matmul=self.matmul is None,
                                   fit_deadline=min(now + self.args.fit_budget_s, self.deadline))
        return self._add(spec, _run_child(spec, opts, self.deadline + ROW_GRACE_S - now) if self.args.isolate
                         else _measure_here(spec, opts))

    def _add(self, spec: RowSpec, r: dict[str, Any]) -> dict[str, Any]:
        r = {"label": spec.label, "impl": spec.impl, "remat": spec.policy, "chunk": "-", "batch": "-", **r}
        if not self.header and "device_kind" in r:
            print(_header(r, self.args))
            print(format_table([], COLUMNS, sep=" "))
            self.header = True
        self.matmul = self.matmul or r.get("matmul_flops")
        self.rows.append(r)
        self.specs.append(spec)
        print(format_row(r, self.matmul), flush=True)
        if plan_line(r):
            print(plan_line(r), flush=True)
        if "profile" in r:
            p = r["profile"]
            print(format_profile(StepProfile(p["steps"], p["step_us"], p["busy"], p["unnamed"],
                                             p["between_steps_us"], p["categories"], p["ops"]), top=8))
        return r


def _best_spec(runner: _Runner) -> RowSpec | None:
    timed = [(r["step_s"], s) for r, s in zip(runner.rows, runner.specs, strict=True) if "step_s" in r]
    return min(timed, key=lambda t: t[0])[1] if timed else None


def _variant_chain(runner: _Runner, best: RowSpec, variants: list[str]) -> None:
    chain: list[str] = []
    for token in variants:
        if token == "base":
            continue
        if token == "batch=fit":
            fitted = next((r["fit"]["largest"] for r in reversed(runner.rows) if r.get("fit", {}).get("largest")), None)
            if fitted is None:
                runner.skip(RowSpec(token, best.impl, best.policy), "skipped: no row before it found a fitting "
                            "batch (--fit-batch)")
                continue
            token = f"batch={fitted}"
        chain.append(token)
        runner.run(RowSpec(label=token, impl=best.impl, policy=best.policy, variants=tuple(chain)))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child:
        return _child(args.child)
    work = tempfile.mkdtemp(prefix="step_device-")
    runner = _Runner(args, work)
    for impl in args.impls.split(","):
        for policy in args.policies.split(","):
            if runner.rows and runner.rows[0].get("platform") == "cpu" and impl != args.impls.split(",")[0]:
                continue  # the dry run runs xla only: another impl would repeat the same row
            label = impl if "," not in args.policies else f"{impl}/{policy}"
            runner.run(RowSpec(label=label, impl=impl, policy=policy))
    best = _best_spec(runner)
    if best is not None:
        _variant_chain(runner, best, args.variants.split(","))
    if any("profile" in r for r in runner.rows):
        print("profile shares, before -> after:")
        print(_profiles_table(runner.rows))
    timed = [r for r in runner.rows if "step_s" in r]
    if any(r.get("peak_bytes_in_use") is None for r in timed):
        print("peak GiB n/a: this backend keeps no allocator statistics (XLA:CPU's memory_stats() is None); "
              "est GiB is the compiled program's estimate (arguments + outputs - donated + temporaries)")
    if timed:
        top = max(timed, key=lambda r: r["tokens"] / r["step_s"] * r["fpt"] / r["peak_flops"])
        print(f"best MFU (PaLM): {top['label']} {top['tokens'] / top['step_s'] * top['fpt'] / top['peak_flops']:.3f} "
              f"of {top['peak_flops'] / 1e12:.1f} TFLOP/s ({top['peak_source']})")
    agreement = _loss_agreement(runner.rows, runner.specs)
    if agreement:
        print(agreement)
    if os.environ.get("OUT"):
        for note in _write_out(runner.rows, _before_after(runner.rows, runner.specs, best), os.environ["OUT"]):
            print(note)
    shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.monotonic() - runner.start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
