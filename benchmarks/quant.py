"""Quantization, measured in one run: what each mode costs and what it changes.

    python benchmarks/quant.py [--sections train,weights,hf] [--out DIR] [--train-steps 300]
                               [--small-steps 300] [--small-run RUN]
    python benchmarks/quant.py --sections device      # the GPU checks (a tiny dry run on CPU)

train    `tiny` trained with quant.train = none, int8, fp8 (current and delayed scaling) for the
         same steps, seed and data: final eval loss (and its change vs none) and training tokens/s.
weights  a trained `small` run (trained here for --small-steps unless --small-run is given),
         quantized by `jaxinfra quantize` (per channel, and per group of 128): parameter bytes vs
         float32 and bfloat16 (scales included), held-out eval loss and mean per-token
         KL(float || int8), decode tokens/s at batch 1 vs the float weights, the compiled decode
         step's memory (no float copy of the weights), and the int8 KV cache: bytes vs bfloat16
         and greedy agreement with the float cache over 128 new tokens.
hf       the same weight checks on tests/fixtures/hf/llama through `jaxinfra hf import`.
device   1.1B Llama shape (benchmarks/step_device.py): training step tokens/s and loss with
         quant.train=fp8 vs bfloat16, and weight-only int8 decode tokens/s at batch 1 vs bfloat16.
         Without a GPU it runs tiny shapes (a dry run of the same code; its figures say nothing).

Ratios are within this run (the machine is shared and noisy). Results: stdout tables and
DIR/quant_results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfra.config import Config, load_config  # noqa: E402
from jaxinfra.data import make_eval_batches  # noqa: E402
from jaxinfra.infer import Generator, inference_model_config, load_model  # noqa: E402
from jaxinfra.metrics.table import format_table  # noqa: E402
from jaxinfra.quantize import quantize_checkpoint, quantize_loaded, tree_bytes  # noqa: E402
from jaxinfra.state import model_graphdef  # noqa: E402
from models import cache as kv_cache  # noqa: E402

QUIET = ["log.progress=false", "log.tensorboard=false", "mesh.data=1", "checkpoint.async_save=false"]


def one_device() -> list[jax.Device]:
    return jax.devices()[:1]


# ---------------------------------------------------------------- train


def train_section(out: pathlib.Path, steps: int) -> list[dict]:
    from jaxinfra.train import train

    fp8_extra = ["quant.fp8_emulation=true"] if jax.devices()[0].platform != "gpu" else []
    modes = [("none", []), ("int8", ["quant.train=int8"]),
             ("fp8 current", ["quant.train=fp8", *fp8_extra]),
             ("fp8 delayed", ["quant.train=fp8", "quant.scaling=delayed", *fp8_extra])]
    rows = []
    for name, extra in modes:
        cfg = load_config("tiny", [f"train.steps={steps}", f"train.eval_every={steps}", *QUIET, *extra])
        summary = train(cfg, out / f"tiny-{name.replace(' ', '-')}", devices=one_device())
        rows.append({"mode": name, "eval_loss": summary["final_eval_loss"], "tokens_per_s": summary["tokens_per_s"]})
    base = rows[0]
    for r in rows:
        r["loss_change"] = r["eval_loss"] / base["eval_loss"] - 1
        r["speed_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
    print(format_table([(r["mode"], f"{r['eval_loss']:.4f}", f"{r['loss_change']:+.2%}", f"{r['tokens_per_s']:.0f}",
                         f"{r['speed_ratio']:.2f}") for r in rows],
                       ["quant.train", "eval loss", "vs none", "tokens/s", "vs none"], style="markdown"))
    return rows


# ---------------------------------------------------------------- weights


def eval_and_kl(cfg: Config, params, qcfg: Config, qparams, batches: list[dict]) -> dict[str, float]:
    """Held-out CE of both models and the mean per-token KL(float || quantized), on one device."""
    g_float = model_graphdef(inference_model_config(cfg.model), cfg.quant)
    g_quant = model_graphdef(inference_model_config(qcfg.model), qcfg.quant)

    @jax.jit
    def sums(params, qparams, batch):
        lp = jax.nn.log_softmax(nnx.merge(g_float, params)(batch["inputs"], batch["positions"], batch["segment_ids"]))
        lq = jax.nn.log_softmax(nnx.merge(g_quant, qparams)(batch["inputs"], batch["positions"],
                                                            batch["segment_ids"]))
        mask = (batch["segment_ids"] > 0).astype(jnp.float32)
        ce = lambda lx: -jnp.sum(jnp.take_along_axis(lx, batch["targets"][..., None], -1)[..., 0] * mask)  # noqa: E731
        kl = jnp.sum(jnp.sum(jnp.exp(lp) * (lp - lq), -1) * mask)
        return jnp.stack([ce(lp), ce(lq), kl, jnp.sum(mask)])

    total = sum(np.asarray(sums(params, qparams, {k: jnp.asarray(v) for k, v in b.items()})) for b in batches)
    return {"eval_loss": total[0] / total[3], "eval_loss_int8": total[1] / total[3], "kl": total[2] / total[3],
            "tokens": int(total[3])}


def decode_rate(cfg: Config, params, prompts: list[list[int]], new: int, repeats: int = 3) -> tuple[float, list]:
    gen = Generator(cfg, params, devices=one_device())
    first = gen.generate(prompts, max_new_tokens=new)
    runs = [gen.generate(prompts, max_new_tokens=new) for _ in range(repeats)]
    return float(np.median([r.decode_tokens_per_s for r in runs])), first.tokens


def decode_memory(cfg: Config, params, prompt_len: int, new: int) -> dict[str, int]:
    """The compiled decode loop's argument and temporary bytes (memory_analysis, one device)."""
    gen = Generator(cfg, params, devices=one_device())
    _, decode = gen._compile(1, prompt_len, new, 8)
    m = decode.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes)}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same = [np.mean(np.asarray(x) == np.asarray(y)) for x, y in zip(a, b)]
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / len(x) for x, y in zip(a, b)]
    return {"positionwise": float(np.mean(same)), "before_first_difference": float(np.mean(prefix))}


def weight_checks(run: pathlib.Path, out: pathlib.Path, group_sizes: tuple[int, ...], new: int = 128) -> dict:
    cfg, params = load_model(run, devices=one_device())
    t = cfg.train
    batches = make_eval_batches(cfg.data, seq_len=t.seq_len, global_batch_size=t.batch_size,
                                vocab_size=cfg.model.vocab_size, seed=t.seed)
    prompts = [list(map(int, batches[0]["inputs"][i, :32])) for i in range(4)]
    float_bytes = tree_bytes(params)
    result = {"run": str(run), "float32_bytes": float_bytes, "variants": []}
    float_rate, float_tokens = decode_rate(cfg, params, prompts[:1], new)
    result["decode_tok_s_float"] = float_rate
    result["decode_memory_float"] = decode_memory(cfg, params, 32, new)
    for group in group_sizes:
        qdir = out / f"{run.name}-int8-g{group}"
        if not qdir.exists():
            quantize_checkpoint(run, qdir, "int8", group, devices=one_device())
        qcfg, qparams = load_model(qdir, devices=one_device())
        rate, _ = decode_rate(qcfg, qparams, prompts[:1], new)
        result["variants"].append({"group_size": group, "bytes": tree_bytes(qparams),
                                   "vs_float32": tree_bytes(qparams) / float_bytes,
                                   "vs_bfloat16": tree_bytes(qparams) / (float_bytes / 2),
                                   **eval_and_kl(cfg, params, qcfg, qparams, batches),
                                   "decode_tok_s": rate, "decode_speed_ratio": rate / float_rate,
                                   "decode_memory": decode_memory(qcfg, qparams, 32, new)})
    kv_cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, kv_cache="int8"))
    _, cached = decode_rate(cfg, params, prompts, new, repeats=0)
    _, cached_int8 = decode_rate(kv_cfg, params, prompts, new, repeats=0)
    result["kv_cache"] = {"bytes_per_token_int8": kv_cache.bytes_per_token(cfg.model, True),
                          "bytes_per_token_bfloat16": kv_cache.bytes_per_token(
                              dataclasses.replace(cfg.model, dtype="bfloat16")),
                          "greedy_agreement": agreement(cached, cached_int8), "new_tokens": new}
    result["kv_cache"]["vs_bfloat16"] = (result["kv_cache"]["bytes_per_token_int8"]
                                         / result["kv_cache"]["bytes_per_token_bfloat16"])
    print_weights(result)
    return result


def print_weights(r: dict) -> None:
    print(f"{r['run']}: float32 params {r['float32_bytes'] / 2**20:.2f} MiB, decode "
          f"{r['decode_tok_s_float']:.1f} tok/s, decode memory {r['decode_memory_float']}")
    rows = [(v["group_size"] or "channel", f"{v['vs_float32']:.3f}", f"{v['vs_bfloat16']:.3f}",
             f"{v['eval_loss']:.4f}", f"{v['eval_loss_int8']:.4f}", f"{v['eval_loss_int8'] / v['eval_loss'] - 1:+.3%}",
             f"{v['kl']:.5f}", f"{v['decode_tok_s']:.1f}", f"{v['decode_speed_ratio']:.2f}",
             f"{v['decode_memory']['argument_bytes'] / 2**20:.2f}", f"{v['decode_memory']['temp_bytes'] / 2**20:.2f}")
            for v in r["variants"]]
    print(format_table(rows, ["int8 per", "bytes/f32", "bytes/bf16", "eval float", "eval int8", "change", "KL",
                              "decode tok/s", "vs float", "args MiB", "temp MiB"], style="markdown"))
    kv = r["kv_cache"]
    print(f"int8 KV cache: {kv['bytes_per_token_int8']} vs {kv['bytes_per_token_bfloat16']} bytes/token in bfloat16 "
          f"({kv['vs_bfloat16']:.3f}); greedy agreement with the float cache over {kv['new_tokens']} tokens: "
          f"{kv['greedy_agreement']}")


def weights_section(out: pathlib.Path, steps: int, run: str | None) -> dict:
    from jaxinfra.train import train

    if run is None:
        path = out / "small"
        if not (path / "checkpoints").is_dir():
            cfg = load_config("small", [f"train.steps={steps}", f"train.eval_every={steps}",
                                        "data.eval_batches=4", *QUIET])
            train(cfg, path, devices=one_device())
        run = str(path)
    return weight_checks(pathlib.Path(run), out, (0, 128))


def hf_section(out: pathlib.Path) -> dict:
    from jaxinfra.hf.importer import import_hf

    path = out / "hf-llama"
    if not path.exists():
        import_hf(ROOT / "tests/fixtures/hf/llama", path, ["data.source=synthetic", "train.seq_len=64",
                                                           "train.batch_size=8", "data.eval_batches=4"])
    return weight_checks(path, out, (0, 16))


# ---------------------------------------------------------------- device (GPU)


def device_section(steps: int = 5) -> dict:
    """fp8 training step vs bfloat16 and int8 weight-only decode vs bfloat16 on the 1.1B shape."""
    from benchmarks.step_cpu import build_step, random_batch
    from benchmarks.step_device import DRY_OVERRIDES, GPU_OVERRIDES
    from jaxinfra.state import init_params

    dry = jax.devices()[0].platform == "cpu"
    base = DRY_OVERRIDES if dry else GPU_OVERRIDES
    result = {"dry_run": dry, "device": jax.devices()[0].device_kind, "train": [], "decode": []}
    for name, extra in (("bfloat16", []), ("fp8", ["quant.train=fp8"] + (["quant.fp8_emulation=true"] if dry else []))):
        cfg = load_config("tiny" if dry else "small", base + extra)
        rt, state = build_step(cfg)
        batch = rt.to_global(random_batch(cfg, np.random.default_rng(0)))
        state, metrics = rt.train_step(state, batch)
        jax.block_until_ready(metrics)
        times, losses = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = rt.train_step(state, batch)
            losses.append(float(jax.device_get(metrics["loss"])))
            times.append(time.perf_counter() - t0)
        result["train"].append({"mode": name, "tokens_per_s": cfg.train.batch_size * cfg.train.seq_len
                                / float(np.median(times)), "losses": losses})
        del rt, state, batch
    decode_cfg = load_config("tiny" if dry else "small", base + ["model.param_dtype=bfloat16"])
    params = jax.jit(init_params, static_argnums=0)(decode_cfg.model, jax.random.key(0))
    prompts = [list(range(1, 65))]
    rate, _ = decode_rate(decode_cfg, params, prompts, 128)
    result["decode"].append({"weights": "bfloat16", "tok_s": rate})
    qcfg, qparams = quantize_loaded(decode_cfg, params, "int8", 0, one_device())
    del params
    rate, _ = decode_rate(qcfg, qparams, prompts, 128)
    result["decode"].append({"weights": "int8", "tok_s": rate})
    t = result["train"]
    speedup = t[1]["tokens_per_s"] / t[0]["tokens_per_s"]
    print(f"device {result['device']}{' (DRY RUN: tiny shapes on CPU)' if dry else ''}: train tokens/s bf16 "
          f"{t[0]['tokens_per_s']:.0f}, fp8 {t[1]['tokens_per_s']:.0f} ({speedup:.2f}x), "
          f"final loss {t[0]['losses'][-1]:.4f} vs {t[1]['losses'][-1]:.4f}; decode batch 1 tok/s bf16 "
          f"{result['decode'][0]['tok_s']:.1f}, int8 {result['decode'][1]['tok_s']:.1f} "
          f"({result['decode'][1]['tok_s'] / result['decode'][0]['tok_s']:.2f}x)")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="train,weights,hf")
    ap.add_argument("--out", default="/tmp/jaxinfra-quant-bench")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--small-steps", type=int, default=300)
    ap.add_argument("--small-run", help="a trained run to quantize instead of training `small` here")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": jax.devices()[0].device_kind}
    for section in args.sections.split(","):
        t0 = time.perf_counter()
        print(f"== {section}", flush=True)
        if section == "train":
            results["train"] = train_section(out, args.train_steps)
        elif section == "weights":
            results["weights"] = weights_section(out, args.small_steps, args.small_run)
        elif section == "hf":
            results["hf"] = hf_section(out)
        elif section == "device":
            results["device"] = device_section()
        else:
            raise SystemExit(f"unknown section {section!r} (train, weights, hf, device)")
        print(f"== {section}: {time.perf_counter() - t0:.0f} s", flush=True)
        (out / "quant_results.json").write_text(json.dumps(results, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
