"""The training loop: config -> mesh -> sharded state -> data -> jitted steps -> metrics, checkpoints.

The host touches device values only every `log.every` steps (and at evaluation and
checkpoints); otherwise the loop only dispatches, so the next batch is prepared while
the device runs the current step.

Exits (`summary["exit_code"]`, also the CLI's status): 0 done; 75 preempted (SIGTERM /
SIGINT: the current step finished, a checkpoint committed, rerun the same command to
resume); 3 diverged (`train.max_bad_steps` consecutive non-finite steps); 70 hung
(the watchdog, see jaxinfra/watchdog.py).
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxinfra.checkpoint import (Checkpointer, CheckpointError, abstract_with_shardings, is_params_only,
                                 restore_params)
from jaxinfra.config import Config
from jaxinfra.data import make_eval_batches, make_train_iterator, row_states, set_row_states
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
from jaxinfra.state import TrainState, abstract_state, bytes_per_device
from jaxinfra.exits import EXIT_DIVERGED, EXIT_HUNG, EXIT_OK, EXIT_PREEMPTED
from jaxinfra.watchdog import Watchdog


class Trainer:
    """A runtime (mesh, state, jitted steps) plus data, checkpoints and logging; `run()` trains."""

    def __init__(self, cfg: Config, run_dir: str | os.PathLike, devices: Sequence[jax.Device] | None = None,
                 restore_from: str | os.PathLike | None = None):
        self.devices = list(devices) if devices is not None else jax.devices()
        self.rt = build_runtime(cfg, self.devices)
        self.cfg = cfg
        self.run_dir = pathlib.Path(run_dir)
        self.mesh = self.rt.mesh
        self.restore_from = restore_from
        t = cfg.train
        self.local_rows = t.batch_size // jax.process_count()
        self.first_row = jax.process_index() * self.local_rows
        data_args = dict(seq_len=t.seq_len, global_batch_size=t.batch_size, vocab_size=cfg.model.vocab_size,
                         seed=t.seed, process_index=jax.process_index(), process_count=jax.process_count())
        self.train_iter = make_train_iterator(cfg.data, **data_args)
        self.eval_batches = make_eval_batches(cfg.data, **data_args)
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint) if cfg.checkpoint.enabled else None
        self.state: TrainState | None = None
        self._signal: int | None = None
        self.watchdog = Watchdog(0)

    # ------------------------------------------------------------ pieces

    def batches(self) -> Iterator[dict[str, jax.Array]]:
        """Global batches, forever."""
        for local in self.train_iter:
            yield self.rt.to_global(local)

    def evaluate(self, state: TrainState) -> float:
        """Token-weighted mean cross-entropy over the held-out batches."""
        ce, tokens = self.rt.eval_sums(state.params, self.eval_batches)
        return ce / max(tokens, 1.0)

    def _target(self) -> TrainState:
        return abstract_with_shardings(abstract_state(self.cfg.model, self.rt.tx), self.rt.state_shardings)

    def initial_state(self) -> tuple[int, TrainState, dict[str, Any]]:
        """(completed steps, state, saved meta): resume this run, restore from elsewhere, or start fresh."""
        if self.ckpt is not None and self.ckpt.steps():
            if is_params_only(self.run_dir):  # the run dir is an import itself (hf import OUT; train --run-dir OUT)
                return self._from_params(self.run_dir, "the run directory")
            found = self.ckpt.restore_latest(self._target())
            if found is None:
                raise CheckpointError(f"every checkpoint under {self.ckpt.directory} is unreadable; move them "
                                      f"aside to start afresh")
            return self._resume(*found)
        if self.restore_from is not None:
            if self.cfg.checkpoint.restore == "params":
                return self._from_params(self.restore_from)
            if is_params_only(self.restore_from):
                return self._from_params(self.restore_from, f"--restore {self.restore_from}")
            source = pathlib.Path(self.restore_from)
            other = Checkpointer(source / "checkpoints" if (source / "checkpoints").is_dir() else source,
                                 self.cfg.checkpoint)
            found = other.restore_latest(self._target())
            other.close()
            if found is None:
                raise CheckpointError(f"--restore {self.restore_from}: no readable checkpoint there")
            return self._resume(*found)
        return 0, self.rt.init_state(), {}

    def _from_params(self, source: str | os.PathLike, params_only: str | None = None) -> tuple[int, TrainState, dict]:
        """Params from `source`, a fresh optimizer, step 0 (checkpoint.restore=params, or a params-only
        checkpoint such as an HF import, named by `params_only` in a one-line note)."""
        if params_only is not None and jax.process_index() == 0:
            print(f"jaxinfra: {params_only} holds params only (e.g. an HF import); starting from them with a "
                  f"fresh optimizer at step 0 (as checkpoint.restore=params)", flush=True)
        _, params = restore_params(source, self._target().params)
        state = self.rt.init_state()
        return 0, TrainState(step=state.step, params=params, opt_state=state.opt_state), {}

    def _resume(self, step: int, state: TrainState, data: dict, meta: dict) -> tuple[int, TrainState, dict]:
        if meta.get("global_batch") != self.cfg.train.batch_size or meta.get("seq_len") != self.cfg.train.seq_len:
            print(f"jaxinfra: warning: checkpoint step {step} was written with batch {meta.get('global_batch')} x "
                  f"seq {meta.get('seq_len')}; the data position cannot carry over, data restarts", flush=True)
        else:
            set_row_states(self.train_iter, data, self.first_row, self.local_rows)
        return step, state, meta

    def save(self, step: int, state: TrainState, meta: dict[str, Any], metrics: dict | None = None) -> float:
        """Start an async checkpoint; returns the seconds the loop was blocked."""
        start = time.perf_counter()
        meta = {**meta, "step": step, "global_batch": self.cfg.train.batch_size, "seq_len": self.cfg.train.seq_len,
                "process_count": jax.process_count(), "config": self.cfg.to_yaml()}
        self.ckpt.save(step, state, row_states(self.train_iter, self.first_row), meta, metrics)
        return time.perf_counter() - start

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, _frame):
            self._signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def _stop_requested(self, sync: bool) -> bool:
        """A signal reached this process, or (at sync points) any process: all stop at the same step."""
        local = self._signal is not None
        if jax.process_count() == 1:
            return local
        if not sync:
            return False
        return bool(multihost_utils.process_allgather(np.int32(local)).max())

    @property
    def watchdog_step(self) -> int:
        return self.watchdog.step

    @property
    def watchdog_phase(self) -> str:
        return self.watchdog.phase

    # ------------------------------------------------------------ loop

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
        counts = param_counts(cfg.model)

        logger = MetricsLogger(self.run_dir, tensorboard=cfg.log.tensorboard) if is_main else None
        start_step, state, meta = self.initial_state()
        bar = ProgressBar(t.steps, initial=start_step, enabled=cfg.log.progress and is_main)
        say = bar.write if is_main else (lambda _: None)
        log = logger.log if logger is not None else (lambda *_: None)
        say(f"jaxinfra: {counts['total'] / 1e6:.2f}M params, mesh {dict(self.mesh.shape)}, "
            f"{n_dev} x {self.devices[0].device_kind}, peak {peak / 1e12:.3g} TFLOP/s/device ({peak_source}), "
            f"run dir {self.run_dir}" + (f", resumed at step {start_step}" if start_step else ""))

        evals: list[tuple[int, float]] = []
        has_eval = bool(self.eval_batches)  # data.eval_batches=0: no held-out evaluation at all
        if start_step == 0 and has_eval:
            evals.append((0, self.evaluate(state)))
            log(0, {"eval_loss": evals[0][1]})
            say(f"step 0: eval_loss {evals[0][1]:.4f}")
        first_eval = meta.get("first_eval_loss", evals[0][1] if evals else None)

        self._install_signal_handlers()
        watchdog = self.watchdog = Watchdog(t.step_timeout_s, process_index=jax.process_index())
        batches = self.batches()
        start = time.perf_counter()
        compile_s = None
        window_start, window_steps = time.perf_counter(), 0
        last: dict[str, float] = {}
        step_rates: list[float] = []
        pending_flags: list[jax.Array] = []
        bad_in_a_row = skipped = 0
        exit_code, step = EXIT_OK, start_step
        saved_at = None
        for step in range(start_step + 1, t.steps + 1):
            watchdog.progress(step, "data")
            batch = next(batches)
            watchdog.progress(step, "step")
            state, metrics = self.rt.train_step(state, batch)
            pending_flags.append(metrics["nonfinite"])
            window_steps += 1
            if compile_s is None:  # the first step compiles; time the rest from its end
                jax.block_until_ready(metrics)
                compile_s = time.perf_counter() - start
                window_start, window_steps = time.perf_counter(), 0
                watchdog.arm()
            log_now = step % cfg.log.every == 0 or step == t.steps
            if log_now:
                watchdog.progress(step, "sync (device step / collectives)")
                host, flags = jax.device_get((metrics, pending_flags))
                pending_flags = []
                for flag in flags:
                    bad_in_a_row = bad_in_a_row + 1 if flag else 0
                    skipped += int(flag)
                now = time.perf_counter()
                step_time = (now - window_start) / window_steps if window_steps else compile_s
                window_start, window_steps = now, 0
                tps = tokens_per_step / step_time
                line = {
                    "loss": float(host["loss"]), "lr": float(host["lr"]), "grad_norm": float(host["grad_norm"]),
                    "tokens_per_s": tps, "tflops_per_device": tps / n_dev * fpt / 1e12,
                    "mfu": mfu(tps / n_dev, fpt, peak), "step_time_s": step_time, "skipped_steps": skipped,
                }
                if cfg.model.z_loss_weight:
                    line["z_loss"] = float(host["z_loss"])
                line.update({k: float(v) for k, v in host.items() if k.startswith("moe_")})  # MoE router stats
                if step_time != compile_s:
                    step_rates.append(tps)
                log(step, line)
                bar.update(step, line)
                last = line
                if bad_in_a_row >= t.max_bad_steps:
                    say(f"jaxinfra: error: {bad_in_a_row} consecutive steps had non-finite loss or gradients "
                        f"(train.max_bad_steps={t.max_bad_steps}); stopping at step {step}; updates from those "
                        f"steps were skipped and the last good checkpoint is kept")
                    exit_code = EXIT_DIVERGED
                    break
            if has_eval and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
                watchdog.progress(step, "eval")
                eval_loss = self.evaluate(state)
                evals.append((step, eval_loss))
                log(step, {"eval_loss": eval_loss})
                say(f"step {step}: eval_loss {eval_loss:.4f}")
            stop = self._stop_requested(sync=log_now)
            periodic = self.ckpt is not None and cfg.checkpoint.every and step % cfg.checkpoint.every == 0
            if self.ckpt is not None and (periodic or stop or step == t.steps):
                watchdog.progress(step, "checkpoint")
                metrics_for_best = {"eval_loss": evals[-1][1]} if evals and evals[-1][0] == step else None
                blocked = self.save(step, state, {"first_eval_loss": first_eval}, metrics_for_best)
                saved_at = step
                log(step, {"checkpoint_block_s": blocked})
            if stop:
                exit_code = EXIT_PREEMPTED
                say(f"jaxinfra: stopping at step {step} on signal {self._signal}; checkpoint "
                    f"{'committing' if saved_at == step else 'disabled'}; rerun the same command to resume")
                break
        watchdog.progress(step, "checkpoint (waiting for commit)")
        if self.ckpt is not None:
            self.ckpt.close()
        watchdog.close()
        bar.close()
        self.state = state
        wall = time.perf_counter() - start
        final_eval = evals[-1][1] if evals else None
        summary = {
            "steps": step,
            "exit_code": exit_code,
            "resumed_from_step": start_step,
            "final_loss": last.get("loss"),
            "first_eval_loss": first_eval,
            "final_eval_loss": final_eval,
            "eval_loss_drop": (1 - final_eval / first_eval) if first_eval and final_eval else None,
            "skipped_steps": skipped,
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
        if exit_code == EXIT_OK and first_eval is not None and final_eval is not None:
            say(f"done: {step} steps in {wall:.1f}s, eval_loss {first_eval:.4f} -> {final_eval:.4f} "
                f"({summary['eval_loss_drop']:.0%} lower), {summary['tokens_per_s'] or 0:.0f} tokens/s")
        return summary


def train(cfg: Config, run_dir: str | os.PathLike, devices: Sequence[jax.Device] | None = None,
          restore_from: str | os.PathLike | None = None) -> dict[str, Any]:
    """Train (or resume) from a validated config; returns the run summary (also written to summary.json)."""
    trainer = Trainer(cfg, run_dir, devices, restore_from)
    if jax.process_count() == 1:
        return trainer.run()
    try:
        return trainer.run()
    except Exception as e:
        # A failed collective (a peer died) leaves this process unable to shut down cleanly: jax's
        # exit hook would wait for the dead peer. Report in one line and leave now.
        print(f"jaxinfra: error: process {jax.process_index()} failed at step {trainer.watchdog_step}, phase "
              f"'{trainer.watchdog_phase}': {type(e).__name__}: {str(e).strip().splitlines()[0][:300]} "
              f"(a peer process may have died); the last committed checkpoint is in {trainer.run_dir}/checkpoints",
              file=sys.stderr, flush=True)
        os._exit(EXIT_HUNG)
