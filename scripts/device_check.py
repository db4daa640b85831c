"""One command for a machine with an NVIDIA GPU: numerics of our attention kernels against
the float32 reference, then forward / forward+backward TFLOP/s of ours, cuDNN and XLA.

    python scripts/device_check.py              # GPU: full check, designed for < 5 minutes
    python scripts/device_check.py --dry-run    # tiny shapes, interpret mode on CPU
    scripts/device_check.sh [args]              # the same with PYTHONPATH and a compile cache

Without a GPU it dry-runs automatically: the same code path (the Pallas Triton kernels in
interpret mode), tiny shapes, the same table; its timings say nothing about a GPU.

1. Numerics: `pallas_triton` (and `cudnn` where it applies) against the float32 HIGHEST
   reference: output, log-sum-exp and dq/dk/dv, as max |error| / max |reference|; plus two
   runs compared bitwise (determinism). Any failure -> exit status 1.
2. Timing (bf16): B4 T4096, H16 D128 / H32 D64 / GQA 32-8 D128 / MLA 192-128, causal and
   not, for pallas_triton, cudnn and xla. FLOPs as in benchmarks/attention.py (causal
   counts half). Targets on H100/H200: forward >= 400 TFLOP/s, backward >= 330 (bf16,
   D128, causal); the summary line compares ours against them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from benchmarks import attention as bench
from kernels import attention_with_lse, reference_attention

TARGET_FWD, TARGET_BWD = 400.0, 330.0  # TFLOP/s, bf16 D128 causal, H100/H200


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
    segments: bool = False  # (q, kv) ids, with query rows that see no key


def numerics_cases(dry: bool) -> list[NumericsCase]:
    t, t2 = (40, 56) if dry else (1000, 1536)  # not block multiples
    return [
        NumericsCase("causal D128 GQA4", 2, t, t, 8, 2, 128, 128, "bfloat16"),
        NumericsCase("full D64 Tq!=Tkv", 2, t, t2, 4, 4, 64, 64, "float32", causal=False),
        NumericsCase("MLA 192/128", 1, t, t, 4, 4, 192, 128, "bfloat16"),
        NumericsCase("segments+window", 2, t, t, 4, 1, 128, 128, "bfloat16", window=(t // 3, 0), segments=True),
        NumericsCase("softcap D96", 1, t, t, 2, 2, 96, 96, "float32", softcap=20.0),
    ]


def _inputs(case: NumericsCase):
    rng = np.random.default_rng(0)
    dt = jnp.dtype(case.dtype)
    q = jnp.asarray(rng.standard_normal((case.b, case.tq, case.hq, case.dqk)), dt)
    k = jnp.asarray(rng.standard_normal((case.b, case.tkv, case.hkv, case.dqk)), dt)
    v = jnp.asarray(rng.standard_normal((case.b, case.tkv, case.hkv, case.dv)), dt)
    do = jnp.asarray(rng.standard_normal((case.b, case.tq, case.hq, case.dv)), jnp.float32)
    seg = None
    if case.segments:
        q_seg = np.repeat(np.arange(4), -(-case.tq // 4))[None, :case.tq].repeat(case.b, 0)
        kv_seg = np.repeat(np.arange(4), -(-case.tkv // 4))[None, :case.tkv].repeat(case.b, 0)
        q_seg[:, :3] = 9  # rows whose id has no key: 0 output, finite gradients
        seg = (jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))
    return q, k, v, do, seg


def _run(case: NumericsCase, impl: str, q, k, v, do, seg):
    kw = dict(causal=case.causal, window=case.window, softcap=case.softcap, segment_ids=seg)

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


def check_numerics(dry: bool) -> bool:
    print("== numerics vs float32 reference (max |err| / max |ref|) ==")
    print(f"{'case':<20} {'impl':<14} {'dtype':<9} {'out':>8} {'lse':>8} {'dq':>8} {'dk':>8} {'dv':>8}  verdict")
    ok = True
    for case in numerics_cases(dry):
        args = _inputs(case)
        ref = jax.device_get(jax.jit(lambda *a, c=case: _run(c, "reference", *a))(*args))
        tol = 2e-5 if case.dtype == "float32" else 2e-2
        impls = ["pallas_triton"]
        if bench.has_gpu() and not case.segments and case.softcap is None and case.dqk == case.dv \
                and case.dtype == "bfloat16" and case.tq == case.tkv:
            impls.append("cudnn")
        for impl in impls:
            fn = jax.jit(lambda *a, c=case, i=impl: _run(c, i, *a))
            try:
                got = jax.device_get(fn(*args))
                again = jax.device_get(fn(*args))
            except Exception as e:  # noqa: BLE001 - report every case
                print(f"{case.name:<20} {impl:<14} {case.dtype:<9} error: {type(e).__name__}: {str(e)[:80]}")
                ok = False
                continue
            errs = [_rel_err(got[0], ref[0]), None if got[1] is None else _rel_err(got[1], ref[1])]
            errs += [_rel_err(g, r) for g, r in zip(got[2], ref[2])]
            deterministic = all(np.array_equal(np.asarray(a), np.asarray(b))
                                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)))
            passed = all(e is None or e <= tol for e in errs) and deterministic
            ok &= passed
            cells = " ".join(format("-" if e is None else f"{e:.1e}", ">8") for e in errs)
            verdict = ("ok" if passed else "FAIL") + ("" if deterministic else " (not bitwise deterministic)")
            print(f"{case.name:<20} {impl:<14} {case.dtype:<9} {cells}  {verdict} (tol {tol:g})")
    return ok


def check_timing(dry: bool, budget_s: float, reps: int) -> None:
    shapes = bench.DRY_SHAPES if dry else bench.SHAPES
    print(f"\n== timing, bfloat16{' (dry run: tiny shapes, interpret mode; not GPU speed)' if dry else ''} ==")
    deadline = time.monotonic() + budget_s
    rows = []
    for shape in shapes.values():
        for causal in (True, False):
            for impl in ("pallas_triton", "cudnn", "xla"):
                rows.append(bench.measure(shape, causal, impl, "bfloat16", reps, deadline=deadline))
    print(bench.format_table(rows))
    ours = next((r for r in rows if r.shape == shapes["h16d128"].name and r.causal and r.impl == "pallas_triton"),
                None)
    if dry:
        print(f"\ntargets (H100/H200, bf16 D128 causal: forward >= {TARGET_FWD:.0f}, backward >= {TARGET_BWD:.0f} "
              "TFLOP/s) are not measured in a dry run")
    elif ours is not None and ours.fwd_tflops is not None:
        def verdict(x, target):
            return "-" if x is None else f"{x:.1f} ({'meets' if x >= target else 'below'} {target:.0f})"

        print(f"\nours, bf16 D128 causal: forward {verdict(ours.fwd_tflops, TARGET_FWD)} TFLOP/s, "
              f"backward {verdict(ours.bwd_only_tflops, TARGET_BWD)} TFLOP/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes in interpret mode (forced without a GPU)")
    parser.add_argument("--budget-s", type=float, default=180.0, help="time for the timing section")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip-numerics", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args(argv)
    dry = args.dry_run or not bench.has_gpu()
    start = time.monotonic()
    devices = jax.devices()
    print(f"device: {devices[0].device_kind} x{len(devices)} ({jax.default_backend()}), jax {jax.__version__}"
          + ("; DRY RUN" if dry else ""))
    ok = True
    if not args.skip_numerics:
        ok = check_numerics(dry)
    if not args.skip_timing:
        check_timing(dry, args.budget_s, 3 if dry else args.reps)
    print(f"\ntotal {time.monotonic() - start:.0f} s; numerics {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
