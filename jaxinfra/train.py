"""The training loop: config -> mesh -> sharded state -> data -> jitted steps -> metrics.

The host touches device values only every `log.every` steps (and at evaluation);
otherwise the loop only dispatches, so the next batch is prepared while the
device runs the current step.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxinfra.config import Config
from jaxinfra.data import make_eval_batches, make_train_iterator
from jaxinfra.metrics import (
    MetricsLogger,
    ProgressBar,
    flops_per_token,
    mfu,
    param_counts,
    peak_flops_per_device,
    write_summary,
)
from jaxinfra.runtime import build_runtime
from jaxinfra.state import TrainState, bytes_per_device


class Trainer:
    """A runtime (mesh, state, jitted steps) plus data and logging; `run()` trains."""

    def __init__(self, cfg: Config, run_dir: str | os.PathLike, devices: Sequence[jax.Device] | None = None):
        self.devices = list(devices) if devices is not None else jax.devices()
        self.rt = build_runtime(cfg, self.devices)
        self.cfg = cfg
        self.run_dir = pathlib.Path(run_dir)
        self.mesh = self.rt.mesh
        self.state = self.rt.init_state()
        t = cfg.train
        data_args = dict(seq_len=t.seq_len, global_batch_size=t.batch_size, vocab_size=cfg.model.vocab_size,
                         seed=t.seed, process_index=jax.process_index(), process_count=jax.process_count())
        self.train_iter = make_train_iterator(cfg.data, **data_args)
        self.eval_batches = make_eval_batches(cfg.data, **data_args)

    def batches(self):
        """Global batches, forever."""
        for local in self.train_iter:
            yield self.rt.to_global(local)

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        return self.rt.train_step(state, batch)

    def evaluate(self, state: TrainState) -> float:
        """Token-weighted mean cross-entropy over the held-out batches."""
        ce, tokens = self.rt.eval_sums(state.params, self.eval_batches)
        return ce / max(tokens, 1.0)

    def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        is_main = jax.process_index() == 0
        if is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        n_dev = len(self.devices)
        fpt = flops_per_token(cfg.model, t.seq_len)
        override = cfg.log.peak_tflops * 1e12 if cfg.log.peak_tflops else None
        peak, peak_source = peak_flops_per_device(self.devices[0], cfg.model.dtype, override)
        tokens_per_step = t.batch_size * t.seq_len

        logger = MetricsLogger(self.run_dir, tensorboard=cfg.log.tensorboard) if is_main else None
        bar = ProgressBar(t.steps, enabled=cfg.log.progress and is_main)
        say = bar.write if is_main else (lambda _: None)
        counts = param_counts(cfg.model)
        say(f"jaxinfra: {counts['total'] / 1e6:.2f}M params, mesh {dict(self.mesh.shape)}, "
            f"{n_dev} x {self.devices[0].device_kind}, peak {peak / 1e12:.3g} TFLOP/s/device ({peak_source}), "
            f"run dir {self.run_dir}")

        def log(step: int, metrics: dict[str, float]) -> None:
            if logger is not None:
                logger.log(step, metrics)

        first_eval = self.evaluate(self.state)
        log(0, {"eval_loss": first_eval})
        say(f"step 0: eval_loss {first_eval:.4f}")
        evals = [(0, first_eval)]

        state = self.state
        self.state = None  # donated below; keep no stale reference
        batches = self.batches()
        start = time.perf_counter()
        compile_s = None
        window_start, window_steps = None, 0
        last = {}
        step_rates = []
        for step in range(1, t.steps + 1):
            state, metrics = self.step(state, next(batches))
            window_steps += 1
            if compile_s is None:  # the first step compiles; time the rest from its end
                jax.block_until_ready(metrics)
                compile_s = time.perf_counter() - start
                window_start, window_steps = time.perf_counter(), 0
            if step % cfg.log.every == 0 or step == t.steps:
                host = jax.device_get(metrics)
                now = time.perf_counter()
                step_time = (now - window_start) / window_steps if window_steps else compile_s
                window_start, window_steps = now, 0
                tps = tokens_per_step / step_time
                line = {
                    "loss": float(host["loss"]), "lr": float(host["lr"]), "grad_norm": float(host["grad_norm"]),
                    "tokens_per_s": tps, "tflops_per_device": tps / n_dev * fpt / 1e12,
                    "mfu": mfu(tps / n_dev, fpt, peak), "step_time_s": step_time,
                }
                if cfg.model.z_loss_weight:
                    line["z_loss"] = float(host["z_loss"])
                if step_time != compile_s:
                    step_rates.append(tps)
                log(step, line)
                bar.update(step, line)
                last = line
            if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                eval_loss = self.evaluate(state)
                evals.append((step, eval_loss))
                log(step, {"eval_loss": eval_loss})
                say(f"step {step}: eval_loss {eval_loss:.4f}")
        bar.close()
        self.state = state
        wall = time.perf_counter() - start
        summary = {
            "steps": t.steps,
            "final_loss": last.get("loss"),
            "first_eval_loss": evals[0][1],
            "final_eval_loss": evals[-1][1],
            "eval_loss_drop": 1 - evals[-1][1] / evals[0][1],
            "tokens_per_s": float(np.median(step_rates)) if step_rates else last.get("tokens_per_s"),
            "mfu": last.get("mfu"),
            "flops_per_token": fpt,
            "peak_flops_per_device": peak,
            "peak_source": peak_source,
            "compile_s": compile_s,
            "wall_s": wall,
            "params": counts,
            "param_bytes_per_device": bytes_per_device(state.params),
            "opt_state_bytes_per_device": bytes_per_device(state.opt_state),
            "mesh": dict(self.mesh.shape),
            "devices": n_dev,
        }
        if is_main:
            write_summary(self.run_dir, summary)
            logger.close()
        say(f"done: {t.steps} steps in {wall:.1f}s, eval_loss {evals[0][1]:.4f} -> {evals[-1][1]:.4f} "
            f"({summary['eval_loss_drop']:.0%} lower), {summary['tokens_per_s']:.0f} tokens/s")
        return summary


def train(cfg: Config, run_dir: str | os.PathLike, devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
    """Train from a validated config; returns the run summary (also written to summary.json)."""
    return Trainer(cfg, run_dir, devices).run()
