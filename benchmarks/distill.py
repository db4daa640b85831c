"""Does distillation help? A `small`-shaped teacher, then `tiny` students trained for the same
steps on the same batches: (a) from scratch, (b) online-distilled, (c) from saved top-k logits;
and an MLA student (the teacher is MHA, the tiny student GQA) from scratch and from the logits.
Distilled students use alpha 0.7 -> 0 (linear) at T = 1; three more runs show constant alpha = 0.5
over the whole run and over half the steps (when the teacher is still ahead of the student).

    python benchmarks/distill.py --out runs/distill-bench [--steps 300] [--teacher-steps 400]
                                 [--plot docs/distillation.png] [--memory]
    python benchmarks/distill.py --memory-only      # compiled peak memory, chunked vs whole logits

Every run is `jaxinfra train` on the default byte-level text (the Python standard library's .py
files), seq 128, global batch 8, seed 0, 1 device; a finished run dir is reused on a rerun.
Prints a markdown table (final eval losses, wall times) and writes the eval-loss curves as a PNG.
--memory compiles the online distillation step at a large vocabulary with model.loss_chunk_size
0 and 256 and prints XLA's temporary bytes (memory_analysis), without running it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax

from jaxinfra.config import load_config
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.train import train

DATA = ["data.source=text", "train.seq_len=128", "train.batch_size=8", "train.seed=0", "data.eval_batches=4"]
LOG = ["log.progress=false", "log.tensorboard=false", "log.every=25", "mesh.data=1"]
# small's shape (6 x 512, 8 heads of 64 (MHA), SwiGLU 2048) on the byte-level vocabulary.
TEACHER = ["model.vocab_size=256", "schedule.warmup_steps=30", "optimizer.lr=2e-3", "train.eval_every=100"]
MLA = ["model.attention_type=mla", "model.num_kv_heads=null", "model.q_lora_rank=64", "model.kv_lora_rank=32",
       "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=16", "model.v_head_dim=32"]
# The soft loss weight falls from 0.7 to 0 over the run: the labels take over once the student
# nears the teacher (with a constant alpha = 0.5 a student that passes the teacher is held back).
DISTILL = ["distill.alpha=0.7", "distill.alpha_end=0.0", "distill.temperature=1.0"]
CONSTANT = ["distill.alpha=0.5", "distill.temperature=1.0"]


def run(name: str, preset: str, overrides: list[str], out: pathlib.Path) -> dict:
    """Train one run into out/name (reused when it finished before); returns its summary."""
    run_dir = out / name
    summary_path = run_dir / "summary.json"
    if summary_path.is_file() and json.loads(summary_path.read_text()).get("exit_code") == 0:
        print(f"{name}: reusing {run_dir}", flush=True)
        return json.loads(summary_path.read_text())
    print(f"{name}: jaxinfra train {preset} {' '.join(overrides)} --run-dir {run_dir}", flush=True)
    summary = train(load_config(preset, overrides), run_dir, jax.devices()[:1])
    print(f"{name}: final eval_loss {summary['final_eval_loss']:.4f} in {summary['wall_s']:.0f}s", flush=True)
    return summary


def save_logits_once(out: pathlib.Path, steps: int, top_k: int) -> float:
    from jaxinfra.distill.save import save_logits

    logits = out / "logits"
    meta = logits / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()).get("complete"):
        return 0.0
    print(f"logits: jaxinfra distill save-logits {out / 'teacher'} --data {' '.join(DATA)} --out {logits} "
          f"--top-k {top_k} --steps {steps}", flush=True)
    report = save_logits(str(out / "teacher"), [*DATA, "mesh.data=1"], logits, top_k, steps, progress=False,
                         devices=jax.devices()[:1])
    print(f"logits: {report['bytes'] / 2**20:.0f} MiB in {report['seconds']:.0f}s", flush=True)
    return report["seconds"]


def eval_curve(run_dir: pathlib.Path) -> list[tuple[int, float, float | None]]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x["eval_loss"], x.get("teacher_eval_loss")) for x in lines if "eval_loss" in x]


def experiment(args: argparse.Namespace) -> None:
    out, s = pathlib.Path(args.out), args.steps
    student = [*DATA, *LOG, f"train.steps={s}", "train.eval_every=25"]
    summaries = {"teacher": run("teacher", "small", [*TEACHER, *DATA, *LOG, f"train.steps={args.teacher_steps}"],
                                out)}
    logits_s = save_logits_once(out, s, args.top_k)
    runs = {"scratch": ("tiny", student),
            "online": ("tiny", [*student, *DISTILL, f"distill.teacher={out / 'teacher'}"]),
            "offline": ("tiny", [*student, *DISTILL, f"distill.logits={out / 'logits'}"]),
            "mla-scratch": ("tiny", [*student, *MLA]),
            "mla-offline": ("tiny", [*student, *MLA, *DISTILL, f"distill.logits={out / 'logits'}"]),
            # constant alpha = 0.5, offline: over the whole run, and over half as many steps
            "offline-constant": ("tiny", [*student, *CONSTANT, f"distill.logits={out / 'logits'}"]),
            "scratch-half": ("tiny", [*student, f"train.steps={s // 2}"]),
            "offline-constant-half": ("tiny", [*student, f"train.steps={s // 2}", *CONSTANT,
                                               f"distill.logits={out / 'logits'}"])}
    for name, (preset, overrides) in runs.items():
        summaries[name] = run(name, preset, overrides, out)
    curves = {name: eval_curve(out / name) for name in runs}
    rows = [(name, summaries[name]["params"]["total"] / 1e6, summaries[name]["steps"],
             summaries[name]["first_eval_loss"], summaries[name]["final_eval_loss"], summaries[name]["wall_s"])
            for name in summaries]
    print(format_table(rows, ["run", Column("params (M)", ".2f"), "steps", Column("eval_loss step 0", ".4f"),
                              Column("final eval_loss", ".4f"), Column("wall s", ".0f")], style="markdown"))
    print(f"save-logits: {logits_s:.0f}s (0: reused); teacher_eval_loss on the students' eval batches: "
          f"{curves['online'][0][2]:.4f}")
    (out / "results.json").write_text(json.dumps({"summaries": summaries, "curves": curves}, indent=1))
    if args.plot:
        plot(curves, summaries, pathlib.Path(args.plot))


def plot(curves: dict, summaries: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    labels = {"scratch": "(a) tiny from scratch", "online": "(b) tiny, online-distilled",
              "offline": "(c) tiny, from saved top-64 logits", "mla-scratch": "MLA tiny from scratch",
              "mla-offline": "MLA tiny, from saved logits"}
    for name, label in labels.items():
        steps, losses = [c[0] for c in curves[name]], [c[1] for c in curves[name]]
        ax.plot(steps, losses, label=label, linestyle="--" if name.startswith("mla") else "-", marker=".")
    ax.axhline(curves["online"][0][2], color="gray", linewidth=0.8, label="teacher (small-shaped), eval loss")
    ax.set_xlabel("training step (8 x 128 tokens each)")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_ylim(top=min(3.2, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("Distillation on the stdlib text: student eval loss")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"plot: {path}")


def _step_memory(overrides: list[str], batch: int, seq: int) -> tuple[float, float]:
    """(temporary MiB, compile s) of the compiled train step of a tiny-based config, not run."""
    from jaxinfra.checkpoint import abstract_with_shardings
    from jaxinfra.runtime import build_runtime

    cfg = load_config("tiny", [f"train.seq_len={seq}", f"train.batch_size={batch}", "mesh.data=1",
                               "data.source=synthetic", *overrides])
    rt = build_runtime(cfg, jax.devices()[:1])
    state = abstract_with_shardings(rt.abstract_state(), rt.state_shardings)
    ids = jax.ShapeDtypeStruct((batch, seq), jax.numpy.int32, sharding=rt.batch_sharding)
    start = time.perf_counter()
    inputs = tuple(e.abstract_inputs() for e in rt.extensions)  # e.g. the teacher's params, not loaded
    analysis = rt.lower_train_step(state, {k: ids for k in ("inputs", "targets", "segment_ids", "positions")},
                                   inputs).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20, time.perf_counter() - start


def memory(vocab: int = 32768, seq: int = 1024, batch: int = 4) -> None:
    """Temporary bytes of the compiled online distillation step, whole vs chunked logits, beside the
    plain step's (whose floor is the student's own activations, e.g. attention scores)."""
    import tempfile

    teacher_cfg = load_config("tiny", [f"model.vocab_size={vocab}", "model.d_model=256", "model.num_layers=4",
                                       "model.mlp_dim=768", "model.num_kv_heads=4"])
    rows = []
    with tempfile.TemporaryDirectory() as teacher:
        (pathlib.Path(teacher) / "config.yaml").write_text(teacher_cfg.to_yaml())
        (pathlib.Path(teacher) / "checkpoints").mkdir()
        for what, extra in (("plain", []), ("distill, full vocab", [f"distill.teacher={teacher}"]),
                            ("distill, top_k 64", [f"distill.teacher={teacher}", "distill.top_k=64"])):
            for chunk in (0, 256, 64):
                temp, seconds = _step_memory([f"model.vocab_size={vocab}", f"model.loss_chunk_size={chunk}", *extra],
                                             batch, seq)
                rows.append((what, chunk, temp, batch * seq * vocab * 4 / 2**20, seconds))
                print(rows[-1], flush=True)
    print(format_table(rows, ["step", "loss_chunk_size", Column("temp MiB", ".0f"),
                              Column("one [B,T,V] f32 logits MiB", ".0f"), Column("compile s", ".1f")],
                       style="markdown"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/distill-bench")
    parser.add_argument("--steps", type=int, default=300, help="student steps (and saved logits)")
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--plot", help="PNG of the eval-loss curves")
    parser.add_argument("--memory", action="store_true", help="also the compiled-memory comparison")
    parser.add_argument("--memory-only", action="store_true")
    args = parser.parse_args()
    if not args.memory_only:
        experiment(args)
    if args.memory or args.memory_only:
        memory()


if __name__ == "__main__":
    main()
