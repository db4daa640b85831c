"""GRPO's measured recipe (docs/post-training.md, issue 29 acceptance 3): two-digit addition.

    python scripts/grpo_addition.py OUT [--sft-steps 900] [--grpo-steps 1000] [--kl-beta 0.04] [KEY=VALUE ...]

1. SFT `tiny-chat` from random weights on 3000 addition conversations (jaxinfra/sft/tasks.py),
   a checkpoint every 50 steps;
2. pick the first checkpoint whose sampled reward (temperature 1, as the rollouts) on 64 prompts
   is in [0.35, 0.5] (a model that sometimes adds right: GRPO has something to reinforce; step 550);
3. GRPO from it (`--restore SFT/checkpoints/N checkpoint.restore=params`) on addition prompts with
   the exact-sum reward below; prints the mean reward of the first and last 10% of the updates,
   the KL range, steps and time (JSON on the last line).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np

from jaxinfra.config import load_config
from jaxinfra.data.chat import encode_chat_prompt, end_of_turn_ids, load_chat_template
from jaxinfra.data.encode import make_encoder
from jaxinfra.infer import Generator, load_model
from jaxinfra.infer.generation import Sampling
from jaxinfra.sft.tasks import addition_chat, write_jsonl
from jaxinfra.train import train

REWARD = '''def exact_sum(prompts, completions, answers):
    """1 for exactly the sum (surrounding whitespace ignored), else 0."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]
'''
QUIET = ["log.progress=false", "log.tensorboard=false"]


def sft(out: pathlib.Path, steps: int) -> pathlib.Path:
    rows, _ = addition_chat(3000, seed=0, held_out=100)
    path = write_jsonl(rows, out / "sft.jsonl")
    cfg = load_config("tiny-chat", [f"data.paths={path}", f"train.steps={steps}", "checkpoint.every=50",
                                    "model.vocab_size=257",  # as measured (byte-level prompts need only 256 ids)
                                    "checkpoint.keep=100", "train.eval_every=0", "data.eval_batches=1", *QUIET])
    train(cfg, out / "sft", devices=jax.devices()[:1])
    return out / "sft"


def sampled_reward(run: pathlib.Path, step: int, prompts: list[dict], gen: Generator | None) -> tuple[float, Generator]:
    """Mean exact-sum reward of one temperature-1 completion per prompt, from checkpoint `step`."""
    cfg, params = load_model(run / "checkpoints" / str(step))
    gen = gen or Generator(cfg, params)
    template, encoder = load_chat_template("chatml", None), make_encoder(None)
    ids = [encode_chat_prompt(template, encoder, p["prompt"]).tolist() for p in prompts]
    eot = end_of_turn_ids(template, encoder).tolist()
    result = gen.generate(ids, max_new_tokens=16, sampling=Sampling(temperature=1.0, seed=step), params=params,
                          stop_ids=[encoder.eod_id], stop_sequence=eot)
    texts = [encoder.decode([i for i in r if i < 256]).split(template.end_of_turn, 1)[0] for r in result.tokens]
    return float(np.mean([t.strip() == p["answer"] for t, p in zip(texts, prompts, strict=True)])), gen


def prompt_rows(n: int, seed: int) -> list[dict]:
    rows, _ = addition_chat(n, seed=seed, held_out=100)
    return [{"prompt": r["messages"][:1], "answer": r["messages"][1]["content"]} for r in rows]


def pick(sft_run: pathlib.Path, low: float, high: float) -> tuple[int, dict[int, float]]:
    probe = prompt_rows(64, seed=7)
    steps = sorted(int(p.name) for p in (sft_run / "checkpoints").iterdir() if p.name.isdigit())
    rates, gen = {}, None
    for s in steps:
        rates[s], gen = sampled_reward(sft_run, s, probe, gen)
        print(f"sft step {s}: sampled reward {rates[s]:.3f}", flush=True)
        if low <= rates[s] <= high:
            return s, rates
    return max(steps, key=lambda s: -abs(rates[s] - (low + high) / 2)), rates


def grpo(out: pathlib.Path, start: pathlib.Path, steps: int, kl_beta: float, extra: list[str]) -> dict:
    write_jsonl(prompt_rows(3000, seed=1), out / "prompts.jsonl")
    (out / "rewards.py").write_text(REWARD)
    cfg = load_config("tiny-chat", [
        "data.source=prompts", f"data.paths={out / 'prompts.jsonl'}", f"grpo.reward={out / 'rewards.py'}:exact_sum",
        "grpo.group_size=8", "grpo.max_new_tokens=16", "grpo.temperature=1.0", f"grpo.kl_beta={kl_beta}",
        "train.batch_size=64", "train.seq_len=96", f"train.steps={steps}", "optimizer.lr=2e-4",
        "schedule.warmup_steps=5", "checkpoint.restore=params", "log.every=1", "train.eval_every=0", *QUIET, *extra])
    t0 = time.perf_counter()
    train(cfg, out / "grpo", devices=jax.devices()[:1], restore_from=start)
    seconds = time.perf_counter() - t0
    lines = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    rewards = [x["reward/mean"] for x in lines if "reward/mean" in x]
    kl = [x["kl"] for x in lines if "kl" in x]
    tenth = max(1, len(rewards) // 10)
    return {"steps": len(rewards), "first_10pct_reward": float(np.mean(rewards[:tenth])),
            "last_10pct_reward": float(np.mean(rewards[-tenth:])), "kl_min": min(kl), "kl_max": max(kl),
            "kl_finite": bool(np.all(np.isfinite(kl))), "seconds": round(seconds, 1)}


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--sft-steps", type=int, default=900)
    ap.add_argument("--grpo-steps", type=int, default=1000)
    ap.add_argument("--kl-beta", type=float, default=0.04)
    ap.add_argument("--sft-step", type=int, default=0, help="use this SFT checkpoint (skip the SFT and the pick)")
    ap.add_argument("overrides", nargs="*", help="extra GRPO config overrides")
    args = ap.parse_intermixed_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.sft_step:
        chosen, rates = args.sft_step, {}
    else:
        chosen, rates = pick(sft(out, args.sft_steps), 0.35, 0.5)
    sft_s = time.perf_counter() - t0
    figures = {"sft_step": chosen, "sft_rates": rates, "sft_s": round(sft_s, 1),
               **grpo(out, out / "sft" / "checkpoints" / str(chosen), args.grpo_steps, args.kl_beta, args.overrides)}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
