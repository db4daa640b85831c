"""Tests for the step profile (trace parsing, HLO classification), the batch-fit search and the
dry run of benchmarks/step_device.py.

The real-trace tests read what one in-process dry run of step_device.py wrote (a tiny model's
train step traced on XLA:CPU, and its HLO text): the same files a GPU run brings back. The GPU
trace layout (device streams, derived lines, host launch events) and GPU HLO (cuBLAS / cuDNN /
Triton custom calls, async collectives) are checked on hand-built inputs of that form.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

import pytest

from jaxinfra.metrics import hlo, trace
from jaxinfra.metrics.memory import largest_batch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is scripts, not an installed package

CAPACITY = 2 * 2**20  # the tiny step's estimate: ~1.5 MiB at batch 8, ~2.6 at 16
TINY = ["model.vocab_size=64", "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_dim=64",
        "train.seq_len=16", "train.batch_size=8"]


# ------------------------------------------------------------------ HLO text (GPU forms, hand-built)

GPU_HLO = """HloModule jit_train_step, is_scheduled=true

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/jvp()/while/body/dot_general"}
}

%fused_logits (p0.1: bf16[64,32], p1.1: bf16[32,128]) -> f32[64,128] {
  %p0.1 = bf16[64,32]{1,0} parameter(0)
  %p1.1 = bf16[32,128]{1,0} parameter(1)
  ROOT %dot.2 = f32[64,128]{1,0} dot(%p0.1, %p1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(loss_and_logits))/btd,dv->btv/dot_general"}
}

%fused_norm (p0.2: f32[64,32], p1.2: s32[]) -> f32[64,32] {
  %p0.2 = f32[64,32]{1,0} parameter(0)
  %p1.2 = s32[] parameter(1)
  %c = s32[] constant(1)
  %i = s32[] add(%p1.2, %c)
  %m = f32[64,32]{1,0} multiply(%p0.2, %p0.2), metadata={op_name="jit(train_step)/jvp()/mul"}
  ROOT %r = f32[64,32]{1,0} rsqrt(%m)
}

%fused_slice (p0.3: f32[2,64,32], p1.3: s32[]) -> f32[64,32] {
  %p0.3 = f32[2,64,32]{2,1,0} parameter(0)
  %p1.3 = s32[] parameter(1)
  %one = s32[] constant(1)
  %j = s32[] subtract(%one, %p1.3)
  %z = s32[] constant(0)
  %ds = f32[1,64,32]{2,1,0} dynamic-slice(%p0.3, %j, %z, %z), dynamic_slice_sizes={1,64,32}
  ROOT %b = f32[64,32]{1,0} bitcast(%ds)
}

%fused_adam (p0.4: f32[32,16], p1.4: f32[32,16]) -> f32[32,16] {
  %p0.4 = f32[32,16]{1,0} parameter(0)
  %p1.4 = f32[32,16]{1,0} parameter(1)
  ROOT %s = f32[32,16]{1,0} subtract(%p0.4, %p1.4), metadata={op_name="jit(train_step)/optimizer_update/sub"}
}

%ar_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b)
}

ENTRY %main.1 (x: bf16[64,32], w: bf16[32,16]) -> (f32[64,16], f32[]) {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %gemm_fusion.3 = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(train_step)/jvp()/while/body/dot_general"}
  %cublas-gemm.1 = (bf16[64,16]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/transpose(jvp())/dot_general"}
  %custom-call.7 = (bf16[8,16,4,8]{3,2,1,0}, f32[8,4,16]{2,1,0}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp()/pallas_call"}
  %cudnn-fmha.2 = (bf16[8,16,4,8]{3,2,1,0}, u8[0]{0}) custom-call(%x), custom_call_target="__cudnn$fmhaSoftmax"
  %loop_logits_fusion = f32[64,128]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_logits
  %loop_rsqrt_fusion.4 = f32[64,32]{1,0} fusion(%x, %i0), kind=kLoop, calls=%fused_norm
  %dynamic_slice_fusion = f32[64,32]{1,0} fusion(%x, %i0), kind=kLoop, calls=%fused_slice
  %loop_adam_fusion = f32[32,16]{1,0} fusion(%w, %w), kind=kLoop, calls=%fused_adam
  %all-reduce-start.1 = f32[] all-reduce-start(%y), replica_groups={}, to_apply=%ar_comp
  %all-reduce-done.1 = f32[] all-reduce-done(%all-reduce-start.1)
  %copy.5 = f32[64,16]{0,1} copy(%y)
  %while.2 = (s32[], f32[64,32]{1,0}) while(%t), condition=%cond, body=%body, metadata={op_name="jit(train_step)/jvp()/while"}
  ROOT %tuple.1 = (f32[64,16]{1,0}, f32[]) tuple(%copy.5, %all-reduce-done.1)
}
"""

EXPECTED_GPU = {
    "gemm_fusion.3": hlo.MATMUL, "cublas-gemm.1": hlo.MATMUL, "custom-call.7": hlo.ATTENTION,
    "cudnn-fmha.2": hlo.ATTENTION, "loop_logits_fusion": hlo.LOSS, "loop_rsqrt_fusion.4": hlo.ELEMENTWISE,
    "dynamic_slice_fusion": hlo.OTHER, "loop_adam_fusion": hlo.OPTIMIZER, "all-reduce-start.1": hlo.COLLECTIVES,
    "all-reduce-done.1": hlo.COLLECTIVES, "copy.5": hlo.OTHER, "while.2": hlo.OTHER, "no-such-op": hlo.OTHER,
}


def test_hlo_parse_reads_instructions_of_every_computation():
    module = hlo.parse_hlo(GPU_HLO)
    assert module.name == "jit_train_step"
    assert module.instructions["cublas-gemm.1"].opcode == "custom-call"  # after a tuple shape
    assert module.instructions["cublas-gemm.1"].target == "__cublas$lt$matmul"
    assert module.instructions["gemm_fusion.3"].calls == ("fused_dot",)
    assert module.instructions["while.2"].calls == ("cond", "body")
    assert module.instructions["i"].scalar and not module.instructions["m"].scalar
    assert "dot.2" in module.computations["fused_logits"]


@pytest.mark.parametrize("name", sorted(EXPECTED_GPU))
def test_classify_gpu_ops(name):
    assert hlo.classify(hlo.parse_hlo(GPU_HLO), name) == EXPECTED_GPU[name]


# ------------------------------------------------------------------ trace layout (GPU form, hand-built)

def _gpu_trace() -> list[dict]:
    """Two executions on one GPU stream, as xprof's trace viewer writes them: device and host
    processes, a derived 'XLA Ops' line repeating the kernels, host launch events carrying the same
    hlo_op, a cuBLAS kernel without op args, and an op of another program."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 200, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 701, "tid": 5, "name": "thread_name", "args": {"name": "python"}}]

    def op(tid, pid, ts, dur, name, run, module="jit_train_step"):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
                "args": {"hlo_op": name, "hlo_module": module, "run_id": run}}

    events = []
    for base, run in ((0.0, "1"), (100.0, "2")):  # each execution: 80 us of ops, a 10 us gap inside
        for ts, dur, name in ((0, 30, "gemm_fusion.3"), (30, 20, "loop_rsqrt_fusion.4"), (60, 20, "custom-call.7")):
            events += [op(13, 1, base + ts, dur, name, run), op(200, 1, base + ts, dur, name, run),
                       op(5, 701, base + ts - 5, 2, name, run)]
    events.append({"ph": "X", "pid": 1, "tid": 13, "ts": 52.0, "dur": 5.0, "name": "sm90_xmma_gemm_bf16"})
    events.append({"ph": "X", "pid": 1, "tid": 13, "ts": 300.0, "dur": 5.0, "name": "memcpy_after_the_window"})
    events.append(op(13, 1, 400.0, 50.0, "fusion.99", "9", module="jit_other"))
    return meta + events


def test_gpu_trace_reads_stream_kernels_once():
    events = trace.op_events(_gpu_trace(), "jit_train_step")
    assert len(events) == 7  # 2 x 3 named kernels on the stream + the unnamed cuBLAS kernel
    assert {e.run for e in events if e.named} == {"1", "2"}
    prof = trace.summarize(events, hlo.parse_hlo(GPU_HLO))
    # window 0..180 us (2 steps, 90 us each); busy (30+20+20) x 2 + 5 (cuBLAS) = 145; idle 35
    assert prof.steps == 2 and prof.step_us == pytest.approx(90.0)
    assert prof.categories[hlo.HOST_GAPS] == pytest.approx(35 / 180)
    assert prof.categories[hlo.MATMUL] == pytest.approx((60 + 5) / 180)  # the nameless gemm by its name
    assert prof.categories[hlo.ATTENTION] == pytest.approx(40 / 180)
    assert prof.between_steps_us == pytest.approx(20 / 2)  # run 1 ends at 80, run 2 starts at 100
    assert prof.unnamed_fraction == pytest.approx(5 / 145)
    assert sum(prof.categories.values()) == pytest.approx(1.0)


def test_overlapping_ops_share_the_busy_time():
    module = hlo.parse_hlo(GPU_HLO)
    events = [trace.OpEvent("gemm_fusion.3", 0.0, 10.0, "1"), trace.OpEvent("loop_rsqrt_fusion.4", 5.0, 15.0, "1"),
              trace.OpEvent("while.2", 0.0, 20.0, "1")]  # control flow: its body's container, skipped
    prof = trace.summarize(events, module)
    assert prof.busy_fraction == pytest.approx(1.0)  # ops 0..15 of a 0..15 window
    assert prof.categories[hlo.MATMUL] == pytest.approx(0.5) and prof.categories[hlo.ELEMENTWISE] == pytest.approx(0.5)


def test_trace_without_ops_of_the_module_is_an_error():
    with pytest.raises(ValueError, match="xprof_traceme"):
        trace.summarize(trace.op_events(_gpu_trace(), "jit_missing"), hlo.parse_hlo(GPU_HLO))
    host_only = [e for e in _gpu_trace() if e.get("pid") != 1]  # launches only: the device tracer recorded nothing
    with pytest.raises(ValueError, match="no device op events"):
        trace.op_events(host_only, "jit_train_step", device=True)


# ------------------------------------------------------------------ batch-fit search

@pytest.mark.parametrize("capacity", [5, 100, 1000, 12345])
@pytest.mark.parametrize("kind", ["linear", "quadratic", "jagged", "flat"])
def test_largest_batch_matches_brute_force(kind, capacity):
    bytes_at = {"linear": lambda b: 10 + 3 * b, "quadratic": lambda b: 50 + b * b,
                "jagged": lambda b: 100 * b + 7 * (b % 2), "flat": lambda b: 1000}[kind]
    calls = []
    fit = largest_batch(lambda b: calls.append(b) or bytes_at(b), capacity, 8, max_batch=4096)
    brute = max((b for b in range(1, 4097) if bytes_at(b) <= capacity), default=None)
    assert fit.complete and fit.largest == brute
    assert len(calls) == len(set(calls)) <= 14  # no batch compiled twice, and far fewer than a scan
    if brute is not None and brute < 4096:
        assert fit.smallest_failing == brute + 1


def test_largest_batch_respects_multiple_known_and_deadline():
    fit = largest_batch(lambda b: 10 * b, 205, 8, multiple=4, known={8: 80})
    assert (fit.largest, fit.smallest_failing) == (20, 24) and 8 in fit.probes
    cut = largest_batch(lambda b: 10 * b, 10**6, 8, deadline=0.0)  # time already up: one probe, a bracket
    assert not cut.complete and cut.describe() == ">= 8"


# ------------------------------------------------------------------ the dry run, and its real trace

@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One in-process dry run of step_device.py: base, the largest batch that fits a fake capacity
    (searched by compiling, in multiples of 8), a per-step sync and a pending variant, profiled.
    Two train-step programs compile (batch 8, and 16 to learn that it does not fit); every other
    row reuses batch 8's from the cache."""
    from benchmarks import step_device

    out = tmp_path_factory.mktemp("out")
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    mp = pytest.MonkeyPatch()
    mp.setenv("OUT", str(out))
    with redirect_stdout(buffer):
        code = step_device.main(["--impls", "xla", "--variants", "base,batch=fit,sync_each_step,fused_norm",
                                 "--profile", "--profile-steps", "2", "--steps", "2", "--fit-batch",
                                 "--fit-multiple", "8", "--capacity-gib", str(CAPACITY / 2**30), *TINY])
    mp.undo()
    return code, buffer.getvalue(), out / "step_profile"


def test_dry_run_prints_every_row_profile_and_memory(dry_run):
    code, text, folder = dry_run
    assert code == 0
    rows = json.loads((folder / "rows.json").read_text())
    assert [r["label"] for r in rows] == ["xla", "batch=8", "sync_each_step", "fused_norm"]
    base, fitted, synced, pending = rows
    probes = {int(b): n for b, n in base["fit"]["probes"].items()}
    assert sorted(probes) == [8, 16] and probes[8] <= CAPACITY < probes[16]  # batch 8 fits, 16 does not
    assert base["memory"]["peak_estimate"] == probes[8] == fitted["memory"]["peak_estimate"]
    assert (base["fit"]["largest"], base["fit"]["smallest_failing"], base["fit"]["describe"]) == (8, 16, "8")
    assert base["peak_bytes_in_use"] is None  # XLA:CPU keeps no allocator statistics
    assert synced["batch"] == 8 and "not built" in pending["note"] and "fit" not in fitted and "fit" not in synced
    for category in hlo.CATEGORIES:
        assert category in text
    assert "profile shares, before -> after:" in text and "peak GiB n/a: this backend keeps no allocator" in text
    assert "losses vs xla (max relative diff over 3 steps): batch=8 0.00e+00, sync_each_step 0.00e+00" in text
    assert sorted(p.name for p in folder.iterdir()) == [
        "after-batch-8.hlo.txt.gz", "after-batch-8.trace.json.gz", "before-xla.hlo.txt.gz",
        "before-xla.trace.json.gz", "rows.json"]  # after: the last improvement, not the sync check


def test_real_cpu_trace_maps_every_op_to_the_hlo(dry_run):
    _, _, folder = dry_run
    with gzip.open(folder / "before-xla.hlo.txt.gz", "rt") as f:
        text = f.read()
    module = hlo.parse_hlo(text)
    events = trace.op_events(trace.load_events(folder / "before-xla.trace.json.gz"), module.name)
    assert events and all(e.named and e.name in module.instructions for e in events)
    prof = trace.summarize(events, module)
    assert prof.steps == 2 and sum(prof.categories.values()) == pytest.approx(1.0)
    by_category = {}
    for name in {e.name for e in events}:
        by_category.setdefault(hlo.classify(module, name), set()).add(name)
    assert {hlo.MATMUL, hlo.ATTENTION, hlo.LOSS, hlo.OPTIMIZER, hlo.ELEMENTWISE, hlo.OTHER} <= set(by_category)
    # Independent of the classifier: the raw text. Every executed op whose own line or fused body
    # names the optimizer scope is an optimizer op; the logits matmul (einsum nd,vd->nv on [batch*length, d]) is loss.
    index = _raw_index(text)
    for name in by_category[hlo.OPTIMIZER]:
        assert _mentions(index, name, "optimizer_update")
    logits = [n for n in {e.name for e in events} if _mentions(index, n, "nd,vd->nv/dot_general")]
    assert logits and all(hlo.classify(module, n) == hlo.LOSS for n in logits)


def _raw_index(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction -> its line, computation -> its instructions) from the raw text by regex, not by
    the parser under test."""
    lines, bodies, current = {}, {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        inst = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = ", line)
        if head:
            current = bodies.setdefault(head.group(1), [])
        elif inst and current is not None:
            lines[inst.group(1)] = line
            current.append(inst.group(1))
    return lines, bodies


def _mentions(index: tuple[dict[str, str], dict[str, list[str]]], name: str, needle: str) -> bool:
    """Whether `needle` is on the line of `name` or of anything it calls (`calls=`, `to_apply=`), transitively."""
    lines, bodies = index
    todo, seen = [name], set()
    while todo:
        inst = todo.pop()
        if inst in seen or inst not in lines:
            continue
        seen.add(inst)
        if needle in lines[inst]:
            return True
        for comp in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", lines[inst]):
            todo += bodies.get(comp, [])
    return False


def test_row_process_protocol_round_trips_a_row(capsys):
    """--child: the JSON a parent sends in, one `ROW {json}` line out (a pending variant: no compile)."""
    from benchmarks import step_device
    from benchmarks.step_row import RowOptions, RowSpec

    spec = RowSpec("fused_optimizer", "xla", "none", ("fused_optimizer",))
    command = step_device._child_command(spec, RowOptions(overrides=tuple(TINY)))
    assert step_device.main(command[2:]) == 0
    row = json.loads(capsys.readouterr().out.removeprefix("ROW "))
    assert row["label"] == "fused_optimizer" and row["batch"] == 8 and "not built" in row["note"]


def test_bad_variant_is_one_line_exit_2(capsys):
    from benchmarks import step_device

    with pytest.raises(SystemExit) as stop:
        step_device.main(["--variants", "base,remat=bogus"])
    assert stop.value.code == 2 and "unknown variant 'remat=bogus'" in capsys.readouterr().err


@pytest.mark.slow
def test_device_script_step_section_dry_runs_on_cpu(tmp_path):
    """scripts/device_all.sh step, as the GPU session runs it (a process per row), on CPU."""
    import os
    import subprocess

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "STEP_BUDGET_S": "400"}
    done = subprocess.run(["bash", str(REPO / "scripts/device_all.sh"), "step"], env=env, capture_output=True,
                          text=True, timeout=900)
    log = (tmp_path / "device_all.log").read_text()
    assert done.returncode == 0 and "== step: exit 0" in log, log[-3000:]
    assert "DRY RUN" in log and "profile shares, before -> after:" in log
    rows = json.loads((tmp_path / "step_profile" / "rows.json").read_text())
    assert [r["label"] for r in rows][:2] == ["pallas_triton", "chunked_loss"]
    assert all("step_s" in r or "note" in r for r in rows)
