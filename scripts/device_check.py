"""One command for a machine with an NVIDIA GPU: numerics of every attention implementation
against the float32 reference, a determinism check, then forward / backward TFLOP/s.

    python scripts/device_check.py              # GPU: full check, < 5 minutes on an H200
    python scripts/device_check.py --dry-run    # tiny shapes, interpret mode on CPU
    scripts/device_check.sh [args]              # the same with PYTHONPATH and a compile cache

Without a GPU it dry-runs automatically: the same code path (the Pallas Triton kernels in
interpret mode), tiny shapes, the same tables; its timings say nothing about a GPU.

1. Numerics: pallas_triton, pallas_mosaic_gpu, cudnn and xla against the float32 HIGHEST
   reference (float32 cases included): output, log-sum-exp and dq/dk/dv, as max |error| /
   max |reference|; each implementation run twice and compared bitwise (determinism). An
   implementation that cannot take a case says why ("n/a ..."). Any failure -> exit 1.
2. Timing (bf16): H16 D128, H32 D64, GQA 32/8 D128, MLA 192/128 at T 4096, 1024, 16384
   (16384 tokens per call), causal and not, for ours (Triton, Mosaic GPU), cuDNN and XLA, in
   that priority order until `--budget-s` is spent (later rows say "skipped"). FLOPs as in
   benchmarks/attention.py (causal counts half). The summary compares bf16 D128 causal T4096
   against the targets: Triton forward >= 400 / backward >= 330 TFLOP/s, Mosaic GPU >= 550 / 400.

`--out DIR` (or $OUT) also writes the rows as JSON: DIR/attention_numerics.json, DIR/attention_timing.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from benchmarks import attention as bench
from kernels import attention_with_lse, flash_mosaic_gpu, reference_attention

IMPLS = ("pallas_triton", "pallas_mosaic_gpu", "cudnn", "xla")
TARGETS = {"pallas_triton": (400.0, 330.0), "pallas_mosaic_gpu": (550.0, 400.0)}  # TFLOP/s, bf16 D128 causal


@dataclasses.dataclass(frozen=True)
class NumericsCase:
    name: str
    b: int
    tq: int
    tkv: int
    hq: int
    hkv: int
    dqk: int
    dv: int
    dtype: str
    causal: bool = True
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    segments: str = "none"  # pair: (q, kv) ids with query rows that see no key; packed: one array, runs
    sinks: bool = False  # gpt-oss attention sinks, one logit per query head (cudnn refuses them)


def numerics_cases(dry: bool) -> list[NumericsCase]:
    t, t2 = (40, 56) if dry else (1000, 1536)  # not block multiples
    return [  # in priority order (a numerics budget skips the last ones)
        NumericsCase("causal D128 GQA4", 2, t, t, 8, 2, 128, 128, "bfloat16"),
        NumericsCase("causal D128 GQA4 f32", 2, t, t, 8, 2, 128, 128, "float32"),
        NumericsCase("packed causal GQA2", 2, t, t, 4, 2, 128, 128, "bfloat16", segments="packed"),
        NumericsCase("full D64 Tq!=Tkv f32", 2, t, t2, 4, 4, 64, 64, "float32", causal=False),
        NumericsCase("MLA 192/128", 1, t, t, 4, 4, 192, 128, "bfloat16"),
        NumericsCase("segments+window", 2, t, t, 4, 1, 128, 128, "bfloat16", window=(t // 3, 0), segments="pair"),
        NumericsCase("softcap D96 f32", 1, t, t, 2, 2, 96, 96, "float32", softcap=20.0),
        NumericsCase("sinks+segments+window", 2, t, t, 8, 2, 128, 128, "bfloat16", window=(t // 3, 0),
                     segments="pair", sinks=True),
    ]


def _segments(case: NumericsCase):
    if case.segments == "packed":  # documents of 3/8, 1/4, 1/4 of the row, then a padding run
        cuts = np.cumsum([3 * case.tq // 8, case.tq // 4, case.tq // 4])
        row = np.searchsorted(cuts, np.arange(case.tq), side="right") + 1
        row[row == 4] = 0
        return jnp.asarray(np.stack([row, np.ones_like(row)])[:case.b], jnp.int32)
    q_seg = np.repeat(np.arange(4), -(-case.tq // 4))[None, :case.tq].repeat(case.b, 0)
    kv_seg = np.repeat(np.arange(4), -(-case.tkv // 4))[None, :case.tkv].repeat(case.b, 0)
    q_seg[:, :3] = 9  # rows whose id has no key: 0 output, finite gradients
    return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def _inputs(case: NumericsCase):
    rng = np.random.default_rng(0)
    dt = jnp.dtype(case.dtype)
    q = jnp.asarray(rng.standard_normal((case.b, case.tq, case.hq, case.dqk)), dt)
    k = jnp.asarray(rng.standard_normal((case.b, case.tkv, case.hkv, case.dqk)), dt)
    v = jnp.asarray(rng.standard_normal((case.b, case.tkv, case.hkv, case.dv)), dt)
    do = jnp.asarray(rng.standard_normal((case.b, case.tq, case.hq, case.dv)), jnp.float32)
    return q, k, v, do, None if case.segments == "none" else _segments(case)


def _run(case: NumericsCase, impl: str, q, k, v, do, seg):
    sinks = jnp.linspace(0.0, 8.0, case.hq, dtype=jnp.float32) if case.sinks else None  # ~log(T): a real share
    kw = dict(causal=case.causal, window=case.window, softcap=case.softcap, segment_ids=seg, sinks=sinks)

    def fwd(q, k, v):
        if impl == "reference":
            return reference_attention(q, k, v, return_lse=True, out_dtype=jnp.float32, **kw)
        if impl == "cudnn":
            return kernels.attention(q, k, v, impl="cudnn", **kw), None
        return attention_with_lse(q, k, v, impl=impl, **kw)

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v)[0].astype(jnp.float32) * do)

    out, lse = fwd(q, k, v)
    return out, lse, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite):
        return float("inf")
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-30)
    return float(np.max(np.abs(got[finite] - want[finite]), initial=0.0)) / scale


def _not_applicable(case: NumericsCase, impl: str, dry: bool) -> str | None:
    """Why an implementation does not take this case here (None: it does)."""
    if impl == "pallas_mosaic_gpu":
        if dry:
            return "n/a (dry run: tests/test_mosaic_gpu.py -m slow runs it under the GPU interpreter)"
        cc = getattr(jax.devices()[0], "compute_capability", None)
        reason = flash_mosaic_gpu.unsupported(jnp.dtype(case.dtype), case.dqk, case.dv, "gpu", cc)
        return None if reason is None else f"n/a (falls back to pallas_triton: {reason})"
    if impl == "cudnn" and not bench.has_gpu():
        return "n/a (no GPU)"
    return None


def _numerics_row(case: NumericsCase, impl: str, args, ref) -> dict:
    fn = jax.jit(lambda *a, c=case, i=impl: _run(c, i, *a))
    try:
        got = jax.device_get(fn(*args))
        again = jax.device_get(fn(*args))
    except ValueError as e:  # what an implementation refuses, in one line
        return {"note": f"n/a ({str(e).removeprefix('attention: ')[:90]})"}
    except Exception as e:  # noqa: BLE001 - report every case
        return {"note": f"error: {type(e).__name__}: {str(e).splitlines()[0][:90]}", "ok": False}
    errs = [_rel_err(got[0], ref[0]), None if got[1] is None else _rel_err(got[1], ref[1])]
    errs += [_rel_err(g, r) for g, r in zip(got[2], ref[2])]
    deterministic = all(np.array_equal(np.asarray(a), np.asarray(b))
                        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)))
    tol = 2e-5 if case.dtype == "float32" else 2e-2
    return {"errors": errs, "deterministic": deterministic, "tol": tol,
            "ok": all(e is None or e <= tol for e in errs) and deterministic}


def check_numerics(dry: bool, impls, case_names, budget_s: float) -> tuple[bool, list[dict]]:
    print("== numerics vs float32 reference (max |err| / max |ref|); two runs compared bitwise ==")
    print(f"{'case':<22} {'impl':<18} {'dtype':<9} {'out':>8} {'lse':>8} {'dq':>8} {'dk':>8} {'dv':>8}  verdict")
    deadline = time.monotonic() + budget_s
    ok, rows = True, []
    for case in numerics_cases(dry):
        if case_names and case.name not in case_names:
            continue
        args = _inputs(case)
        ref = None
        for impl in impls:
            row = {"case": case.name, "impl": impl, "dtype": case.dtype}
            row["note"] = _not_applicable(case, impl, dry)
            if row["note"] is None and time.monotonic() > deadline:
                row["note"] = "skipped (time budget)"
            if row["note"] is None:
                if ref is None:
                    ref = jax.device_get(jax.jit(lambda *a, c=case: _run(c, "reference", *a))(*args))
                row.update(_numerics_row(case, impl, args, ref))
            rows.append(row)
            ok &= row.get("ok", True)
            print(_numerics_line(row), flush=True)
    return ok, rows


def _numerics_line(row: dict) -> str:
    head = f"{row['case']:<22} {row['impl']:<18} {row['dtype']:<9}"
    if "errors" not in row:
        return f"{head} {row['note']}"
    cells = " ".join(format("-" if e is None else f"{e:.1e}", ">8") for e in row["errors"])
    verdict = ("ok" if row["ok"] else "FAIL") + ("" if row["deterministic"] else " (not bitwise deterministic)")
    return f"{head} {cells}  {verdict} (tol {row['tol']:g})"


def check_timing(dry: bool, impls, shape_names, seq_lens, causal_modes, budget_s: float,
                 reps: int) -> list[bench.Row]:
    table = bench.DRY_SHAPES if dry else bench.SHAPES
    shapes = {name: table[name] for name in shape_names}
    note = "dry run: tiny shapes, interpret mode; not GPU speed" if dry else f"{bench.TOKENS_PER_CALL} tokens per call"
    print(f"\n== timing, bfloat16 ({note}) ==", flush=True)
    deadline = time.monotonic() + budget_s
    rows = [bench.measure(s, c, impl, "bfloat16", reps, deadline=deadline)
            for s, c, impl in bench.rows_for(shapes, None if dry else seq_lens, causal_modes, impls)]
    print(bench.format_table(rows))
    if dry:
        print("\ntargets (bf16 D128 causal T4096) are not measured in a dry run")
        return rows
    for impl, (fwd_target, bwd_target) in TARGETS.items():
        ours = next((r for r in rows if r.shape == "H16 D128 T4096" and r.causal and r.impl == impl), None)
        if ours is not None and ours.fwd_tflops is not None:
            print(f"{impl}, bf16 D128 causal T4096: forward {_verdict(ours.fwd_tflops, fwd_target)}, "
                  f"backward {_verdict(ours.bwd_only_tflops, bwd_target)} TFLOP/s")
    return rows


def _verdict(x: float | None, target: float) -> str:
    return "-" if x is None else f"{x:.1f} ({'meets' if x >= target else 'below'} {target:.0f})"


def _write(out_dir: str | None, name: str, header: dict, rows: list) -> None:
    if not out_dir:
        return
    path = Path(out_dir) / f"attention_{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**header, name: rows}, indent=1))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes in interpret mode (forced without a GPU)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--cases", default="", help="numerics case names, comma separated (default: all)")
    parser.add_argument("--shapes", default=",".join(bench.SHAPES))
    parser.add_argument("--seq-lens", default="4096,1024,16384", help="timing lengths, in priority order")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--numerics-budget-s", type=float, default=math.inf, help="skip later numerics rows after")
    parser.add_argument("--budget-s", type=float, default=180.0, help="time for the timing section")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip-numerics", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="write attention_check.json here")
    args = parser.parse_args(argv)
    dry = args.dry_run or not bench.has_gpu()
    start = time.monotonic()
    devices = jax.devices()
    print(f"device: {devices[0].device_kind} x{len(devices)} ({jax.default_backend()}), jax {jax.__version__}"
          + ("; DRY RUN" if dry else ""))
    impls = args.impls.split(",")
    ok, header = True, {"device": devices[0].device_kind, "jax": jax.__version__, "dry_run": dry}
    if not args.skip_numerics:
        ok, rows = check_numerics(dry, impls, [c for c in args.cases.split(",") if c], args.numerics_budget_s)
        _write(args.out, "numerics", header, rows)
    if not args.skip_timing:
        causal = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
        rows = check_timing(dry, impls, args.shapes.split(","), [int(t) for t in args.seq_lens.split(",")], causal,
                            args.budget_s, 3 if dry else args.reps)
        _write(args.out, "timing", header, [dataclasses.asdict(r) for r in rows])
    print(f"\ntotal {time.monotonic() - start:.0f} s; numerics {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
