"""The training loop: config -> mesh -> sharded state -> data -> jitted steps -> metrics, checkpoints.

The host touches device values only every `log.every` steps (and at evaluation and
checkpoints); otherwise the loop only dispatches, so the next batch is prepared while
the device runs the current step.

Exits (`summary["exit_code"]`, also the CLI's status): 0 done; 75 preempted (SIGTERM /
SIGINT: the current step finished, a checkpoint committed, rerun the same command to
resume); 3 diverged (see below); 70 hung
(the watchdog, see jaxinfra/watchdog.py). A checkpoint that cannot be written raises
`CheckpointWriteError` (the CLI: one line, exit 74) at the first step boundary after Orbax
reports it (no step runs on after a save is known lost), with summary.json written if the run
dir takes it; the previous committed one is kept. A run dir none of whose checkpoints can be
read raises `CheckpointReadError` (exit 74) and moves nothing, unless `allow_fresh_start`.

Every way out of `Trainer.run` (the end, an exception, a stop signal, Ctrl-C) goes through
`Trainer._close`: the watchdog stops, the caller's SIGTERM/SIGINT handlers come back, and the
checkpoint manager, data workers and metric writers close, without hiding the original error
(in-process callers such as sweeps, notebooks and benchmarks survive a failed run).

The divergence rule (exit 3): a step whose loss, gradients or updates are not finite is skipped on
the device; the host reads the steps' non-finite flags only at log steps (every `log.every` steps
and the last), so the run stops at the first log step at which at least `train.max_bad_steps`
consecutive steps were bad, up to `log.every - 1` steps after the limit was reached. Reading the
flag every step would force a host sync per step and stall dispatch (the host runs ahead of the
device on an accelerator); every skipped step's update was discarded, so stopping late loses nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxinfra import compile_cache, storage
from jaxinfra.atomic import atomic_write_text
from jaxinfra.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointReadError,
    abstract_with_shardings,
    exchange_json,
    is_params_only,
    peer_lost,
    restore_params,
    set_aside_only,
)
from jaxinfra.checkpoint import (
    CheckpointWriteError as CheckpointWriteError,  # re-exported: train() raises it
)
from jaxinfra.config import Config, ConfigError
from jaxinfra.data import make_eval_sets, make_train_iterator, row_states, set_row_states
from jaxinfra.exits import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_HUNG,
    EXIT_IO_FAILED,
    EXIT_OK,
    EXIT_PREEMPTED,
    bad_input_errors,
    io_failure_line,
)
from jaxinfra.extensions import HostContext, StepExtension, batch_feeder
from jaxinfra.metrics import (
    MetricsLogger,
    ProgressBar,
    flops_per_token,
    mfu,
    param_counts,
    peak_flops_per_device,
    write_summary,
)
from jaxinfra.metrics.run_profile import ProfileWindow
from jaxinfra.metrics.trackers import missing_package, open_trackers
from jaxinfra.optim import all_finite
from jaxinfra.resume import changes as resume_changes
from jaxinfra.resume import check_resume
from jaxinfra.rundir import (
    LOCK_NAME,
    ObjectLock,
    RunDirError,
    RunDirLock,
    check_run_dir,
    created_by_run,
    remove_empty,
)
from jaxinfra.runtime import build_runtime
from jaxinfra.state import TrainState, bytes_per_device, model_state, split_model_state
from jaxinfra.watchdog import Watchdog
from models.project import ADAPTERS


@dataclasses.dataclass
class _Loop:
    """What the training loop carries from step to step on the host."""

    start_step: int
    step: int
    state: TrainState
    first_eval: float | None = None
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    pending_flags: list[jax.Array] = dataclasses.field(default_factory=list)  # non-finite flags since the last sync
    bad_in_a_row: int = 0
    skipped: int = 0
    started: float = 0.0
    first_step_s: float | None = None  # the first step's run (dispatch to done), its compile not included
    compile_times: compile_cache.CompileTimes | None = None  # the train step's trace, lower and XLA seconds
    compile_events: compile_cache.CacheEvents | None = None  # what the persistent cache did for that compile
    window_start: float = 0.0
    window_steps: int = 0
    last: dict[str, float] = dataclasses.field(default_factory=dict)  # the newest metrics line
    step_rates: list[float] = dataclasses.field(default_factory=list)
    exit_code: int = EXIT_OK
    saved_at: int | None = None


class Trainer:
    """A runtime (mesh, state, jitted steps) plus data, checkpoints and logging; `run()` trains."""

    def __init__(self, cfg: Config, run_dir: str | os.PathLike, devices: Sequence[jax.Device] | None = None,
                 restore_from: str | os.PathLike | None = None, extensions: Sequence[StepExtension] | None = None,
                 restart_data: bool = False, allow_fresh_start: bool = False):
        """`extensions` join the train step (jaxinfra/extensions.py); None: those the config asks for.
        `restart_data`: resume a checkpoint written for another data stream, the data from its beginning.
        `allow_fresh_start`: when no checkpoint of the run dir can be read, set them aside and start at
        step 0 (metrics.jsonl kept under another name) instead of refusing (CheckpointReadError)."""
        self.cfg = cfg
        self.restart_data = restart_data
        self.allow_fresh_start = allow_fresh_start
        self.requested_extensions = extensions
        if problem := missing_package(cfg.log.wandb, cfg.log.mlflow):  # one line; nothing written or compiled
            raise ConfigError(problem)
        self._open_store(run_dir, restore_from)  # a bucket that is missing or refuses us: one line, nothing written
        self.is_main = jax.process_index() == 0
        # What _close() releases, present from the start so that any exit path closes what exists.
        self.ckpt: Checkpointer | None = None
        self.train_iter: Any = None
        self.logger: MetricsLogger | None = None
        self.bar: ProgressBar | None = None
        self.watchdog = Watchdog(0)
        self.window: ProfileWindow | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._take_lock()  # before the Checkpointer, which cleans up temporary directories of a live run
        try:
            self._build(devices, restore_from)
        except BaseException as error:
            self._close(error)
            raise

    def _open_store(self, run_dir: str | os.PathLike, restore_from: str | os.PathLike | None) -> None:
        """`run_dir` holds the run's files, `run_root` its checkpoints: the same local directory, or for a
        run dir on a bucket a local staging directory (mirrored by `store`) and the bucket URL."""
        if restore_from is not None and storage.is_url(restore_from):
            storage.check_bucket(str(restore_from), "--restore")
        if restore_from is not None and not storage.is_url(restore_from) and not pathlib.Path(restore_from).exists():
            # Before the run dir is made: a Checkpointer there would create the missing directory to find nothing.
            # (A bucket has no directories to create; check_bucket above named a missing bucket.)
            raise CheckpointError(f"--restore {restore_from}: no such run directory or checkpoint")
        self.store = storage.RunStaging(str(run_dir)) if storage.is_url(run_dir) else None
        self.created: pathlib.Path | None = None
        if self.store is None:
            self.run_dir = check_run_dir(run_dir)  # ordinary path mistakes fail here, before anything compiles
            self.created = created_by_run(self.run_dir)  # removed again, if still empty, when the start fails
            self.run_root, self.lock = self.run_dir, RunDirLock(self.run_dir)
            return
        storage.check_bucket(self.store.url, "--run-dir")
        self.run_dir, self.run_root = self.store.local, storage.as_path(self.store.url)
        self.lock = ObjectLock(self.store.url)

    def _push(self, force: bool = False) -> None:
        """Process 0 of a run dir on a bucket: upload the staged files (at checkpoints, at the end, and at
        log points every storage.PUSH_EVERY_S); a lock another run took over stops this one."""
        if self.store is None or not self.is_main:
            return
        if force or time.monotonic() - self.store.last_push >= storage.PUSH_EVERY_S:
            self.store.push()
        if self.lock.lost:
            raise RunDirError(f"{self.lock.lost}; stopping ({_kept(self.cfg, 'the last committed')})")

    def _take_lock(self) -> None:
        """Process 0 takes the run dir's lock; in a multi-process run every process learns the outcome,
        so a refusal is the same one-line error (exit 2) everywhere instead of a peer left waiting."""
        refusal = ""
        if self.is_main:
            try:
                self.lock.acquire()
                if self.store is not None:  # the bucket's files are the truth: metrics.jsonl continues from them
                    self.store.pull(skip=(LOCK_NAME,))
            except RunDirError as e:
                refusal = str(e)
        if jax.process_count() > 1:
            refusal = exchange_json({"refusal": refusal} if self.is_main else {})["refusal"]
        if refusal:
            raise RunDirError(refusal)

    def _build(self, devices: Sequence[jax.Device] | None, restore_from: str | os.PathLike | None) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.devices = list(devices) if devices is not None else jax.devices()
        self.cache_dir = compile_cache.configure(cfg)  # before anything compiles
        self.window = ProfileWindow(self.run_dir, cfg.log.profile_steps, enabled=self.is_main)
        self.rt = build_runtime(cfg, self.devices, self.requested_extensions)
        self.mesh = self.rt.mesh
        self.restore_from = restore_from
        self.local_rows = t.batch_size // jax.process_count()
        self.first_row = jax.process_index() * self.local_rows
        data_args = dict(seq_len=t.seq_len, global_batch_size=t.batch_size, vocab_size=cfg.model.vocab_size,
                         seed=t.seed, process_index=jax.process_index(), process_count=jax.process_count(),
                         train_on=cfg.sft.train_on)  # chat data refuses conversations with nothing to train on
        self.feeder = batch_feeder(self.rt.extensions)  # e.g. GRPO: rollouts replace the data pipeline
        self.train_iter = None if self.feeder else make_train_iterator(cfg.data, **data_args)
        self.eval_sets = {} if self.feeder else make_eval_sets(cfg.data, **data_args)  # per mixture source
        self.eval_batches = [b for batches in self.eval_sets.values() for b in batches]
        self.ckpt = Checkpointer(self.run_root / "checkpoints", cfg.checkpoint) if cfg.checkpoint.enabled else None
        self.state: TrainState | None = None
        self._signal: int | None = None
        self.watchdog = Watchdog(0)

    # ------------------------------------------------------------ pieces

    def host_context(self) -> HostContext:
        return HostContext(self.rt, self.eval_batches, self.first_row, self.local_rows, self.run_dir,
                           self.restore_from, lambda: self.state)

    def start_extensions(self, meta: dict[str, Any]) -> list[str]:
        """Each extension's `start` (e.g. a teacher's params loaded); returns notes for the log."""
        host = self.host_context()
        return [note for e in self.rt.extensions for note in e.start(host, meta)]

    def batches(self, first_step: int = 1) -> Iterator[dict[str, jax.Array]]:
        """Global batches of steps first_step, first_step + 1, ..., forever (an extension's own, e.g.
        GRPO's rollouts, when one feeds them)."""
        rows = self.feeder.batches(self.host_context(), first_step) if self.feeder else self.train_iter
        for step, local in enumerate(rows, first_step):
            for e in self.rt.extensions:  # extra batch fields (e.g. offline distillation's saved logits)
                local = {**local, **e.host_batch(local, step)}
            yield self.rt.to_global(local)

    def eval_metrics(self, state: TrainState) -> dict[str, float]:
        """`eval_loss` over all held-out batches, and with a mixture `eval_loss/<name>` per source."""
        variables = model_state(state)
        sums = {name: self.rt.eval_sums(variables, batches) for name, batches in self.eval_sets.items()}
        ce, tokens = sum(c for c, _ in sums.values()), sum(n for _, n in sums.values())
        line = {"eval_loss": ce / max(tokens, 1.0)}
        line.update({f"eval_loss/{name}": c / max(n, 1.0) for name, (c, n) in sums.items() if name})
        return line

    def _target(self) -> TrainState:
        return abstract_with_shardings(self.rt.abstract_state(), self.rt.state_shardings)

    def initial_state(self) -> tuple[int, TrainState, dict[str, Any]]:
        """(completed steps, state, saved meta): resume this run, restore from elsewhere, or start fresh."""
        if self.ckpt is not None and self.ckpt.steps():
            if is_params_only(self.run_root):  # the run dir is an import itself (hf import OUT; train --run-dir OUT)
                return self._from_params(self.run_root, "the run directory")
            try:
                return self._resume(*self.ckpt.restore_latest(self._target(), self.cfg.to_dict()))
            except CheckpointReadError:
                if not self.allow_fresh_start:
                    raise  # nothing moved: a rerun once the storage is back resumes
            self._set_aside_for_fresh_start(self.ckpt.set_aside_all())
        elif self.ckpt is not None and (aside := set_aside_only(self.ckpt.directory)):
            if not self.allow_fresh_start:
                raise CheckpointReadError(
                    f"the checkpoints under {self.ckpt.directory} were all set aside as unreadable "
                    f"({', '.join(aside[:3])}); refusing to train from step 0 over them: rerun with "
                    f"--allow-fresh-start to do so")
            self._set_aside_for_fresh_start(aside)
        if self.restore_from is not None:
            return self._from_elsewhere()
        return 0, self.rt.init_state(), {}

    def _set_aside_for_fresh_start(self, aside: list[str]) -> None:
        """--allow-fresh-start over unreadable checkpoints: metrics.jsonl keeps its history under another name."""
        if self.is_main and (metrics := self.run_dir / "metrics.jsonl").is_file():
            kept = metrics.with_name(f"metrics.before-fresh-start-{int(time.time())}.jsonl")
            metrics.rename(kept)
            aside = [*aside, kept.name]
        self._say_warning(f"jaxinfra: warning: --allow-fresh-start: no checkpoint under {self.ckpt.directory} could "
                          f"be read; training from step 0 (kept aside: {', '.join(aside)})")

    def _from_elsewhere(self) -> tuple[int, TrainState, dict]:
        """--restore: another run's checkpoint (only read: nothing there is moved or cleaned up)."""
        if self.cfg.checkpoint.restore == "params":
            return self._from_params(self.restore_from)
        if is_params_only(self.restore_from):
            return self._from_params(self.restore_from, f"--restore {self.restore_from}")
        source = storage.as_path(self.restore_from)
        other = Checkpointer(source / "checkpoints" if (source / "checkpoints").is_dir() else source,
                             self.cfg.checkpoint, read_only=True)
        try:
            found = other.restore_latest(self._target(), self.cfg.to_dict())
        except CheckpointReadError:
            raise CheckpointError(f"--restore {self.restore_from}: no readable checkpoint there") from None
        finally:
            other.close()
        if found is None:
            raise CheckpointError(f"--restore {self.restore_from}: no committed checkpoint there")
        return self._resume(*found)

    def _from_params(self, source: str | os.PathLike, params_only: str | None = None) -> tuple[int, TrainState, dict]:
        """Params from `source`, a fresh optimizer, step 0 (checkpoint.restore=params, or a params-only
        checkpoint such as an HF import, named by `params_only` in a one-line note)."""
        if params_only is not None and jax.process_index() == 0:
            print(f"jaxinfra: {params_only} holds params only (e.g. an HF import); starting from them with a "
                  f"fresh optimizer at step 0 (as checkpoint.restore=params)", flush=True)
        target = self._target()
        # LoRA over a base saved without adapters: the base is restored by name, the adapters start fresh.
        _, variables = restore_params(source, model_state(target), config=self.cfg.to_dict(), optional=ADAPTERS)
        fresh = self.rt.init_state()
        params, stats = split_model_state(variables)
        if not jax.tree.leaves(nnx.split_state(params, ADAPTERS, ...)[0]):
            params = nnx.merge_state(params, nnx.split_state(fresh.params, ADAPTERS, ...)[0])
        return 0, fresh.replace(params=params, stats=stats), {}

    def _resume(self, step: int, state: TrainState, data: dict, meta: dict) -> tuple[int, TrainState, dict]:
        """Continue from a checkpoint; what changed since it is listed, a changed data stream refused unless
        --restart-data (jaxinfra/resume.py: the one rule for what a resume may change)."""
        found = resume_changes(meta, self.cfg.to_dict())
        note = check_resume(step, found, self.restart_data, feeds_own_batches=self.train_iter is None)
        if note and jax.process_index() == 0:
            print(note, flush=True)
        if self.train_iter is not None and not found.stream:  # an extension that feeds batches keeps its own
            set_row_states(self.train_iter, data, self.first_row, self.local_rows)
        return step, state, meta

    def save(self, step: int, state: TrainState, meta: dict[str, Any], metrics: dict | None = None) -> float | None:
        """Start an async checkpoint; returns the seconds the loop was blocked, or None if the params are
        not finite (the step guard should make that impossible; a poisoned state is never saved)."""
        start = time.perf_counter()
        if not all_finite((state.params, state.stats, state.ext)):
            self._say_warning(f"jaxinfra: warning: step {step}: the params hold NaN or inf; no checkpoint written, "
                              f"the last good one is kept")
            return None
        meta = {**meta, "step": step, "global_batch": self.cfg.train.batch_size, "seq_len": self.cfg.train.seq_len,
                "process_count": jax.process_count(), "config": self.cfg.to_yaml()}
        for e in self.rt.extensions:  # e.g. which teacher (and step), never its params
            if e_meta := e.checkpoint_meta():
                meta[e.name] = e_meta
        data = row_states(self.train_iter, self.first_row) if self.train_iter is not None else {}
        self.ckpt.save(step, state, data, meta, metrics)
        return time.perf_counter() - start

    def _say_warning(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT ask the loop to stop at the next step; the caller's handlers are kept to be
        put back by _close (signal handlers can only be set from the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, _frame):
            self._signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, request_stop)

    def _restore_signal_handlers(self) -> None:
        handlers, self._previous_handlers = self._previous_handlers, {}
        for sig, handler in handlers.items():
            # None: a handler set outside Python, which cannot be put back; the default is the closest.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

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
        """Train from the initial state to `train.steps` (or a stop); returns the run summary.

        Raises CheckpointWriteError when a checkpoint cannot be written (the previous committed one
        is kept). Whatever ends the run, _close releases what it holds before this returns or raises."""
        try:
            summary = self._run()
        except BaseException as error:
            self._close(error)
            raise
        self._close(None)
        return summary

    def _close(self, error: BaseException | None) -> None:
        """Release everything the run holds; safe to call twice (the normal end already closed most).

        The watchdog goes first: an armed one would end the calling process (os._exit) once the loop
        stops reporting progress. A closer that fails never hides `error` (its failure becomes a note
        on it) nor keeps the later closers from running; with no `error`, the first failure is raised."""
        closers = [("watchdog", self.watchdog.close), ("signal handlers", self._restore_signal_handlers),
                   ("profiler", self.window.close if self.window else None),
                   ("checkpoints", self._checkpoint_closer(error)),
                   ("data workers", getattr(self.train_iter, "close", None)),
                   ("progress bar", self.bar.close if self.bar else None),
                   ("metrics", functools.partial(self.logger.close, _outcome(error)) if self.logger else None),
                   ("run-dir upload", functools.partial(self._push, True) if self.store else None),
                   ("run-dir lock", self.lock.release),
                   # A refused start (bad data.paths, a failed --restore) leaves no empty run dir behind.
                   ("empty run dir", functools.partial(remove_empty, self.created)
                    if error is not None and self.created is not None and self.is_main else None)]
        first: BaseException | None = None
        for name, close in closers:
            if close is None:
                continue
            try:
                close()
            except BaseException as e:  # noqa: BLE001 - even Ctrl-C here must not skip the lock's release
                if error is None and first is None:
                    first = e
                else:
                    (error or first).add_note(f"jaxinfra: closing the {name} failed too: {type(e).__name__}: {e}")
        if first is not None:
            raise first

    def _checkpoint_closer(self, error: BaseException | None) -> Callable[[], None] | None:
        """How to close the checkpointer: wait for the pending save, except that a failing multi-process
        run does not wait on its peers (see Checkpointer.close_within): none when one is known to be
        gone, at most train.step_timeout_s otherwise."""
        if self.ckpt is None:
            return None
        if error is None or jax.process_count() == 1:
            return self.ckpt.close
        timeout_s = 0.0 if peer_lost(error) else self.cfg.train.step_timeout_s or None
        return functools.partial(self.ckpt.close_within, timeout_s)

    def _run(self) -> dict[str, Any]:
        with compile_cache.watch() as startup:  # init, restore and evaluation programs: bad cache entries replaced
            start_step, state, meta = self.initial_state()  # before anything is written: a refusal changes nothing
            self.state = state  # host.current_state() in `start` (e.g. a reference taken from the start)
            notes = self.start_extensions(meta)
            self._open_outputs(start_step)
            loop = _Loop(start_step=start_step, step=start_step, state=state)
            self.state = state
            self._header(start_step)
            for note in notes:
                self._say(note)
            self._first_eval(loop, meta)
        for note in startup.notes:
            self._say(note)
        self._install_signal_handlers()
        self.watchdog = Watchdog(self.cfg.train.step_timeout_s, process_index=jax.process_index())
        batches = self.batches(start_step + 1)
        loop.started = time.perf_counter()
        try:
            for step in range(start_step + 1, self.cfg.train.steps + 1):
                self._stop_after_a_failed_save()  # before loop.step moves on: the summary counts done steps
                loop.step = step
                if not self._train_one_step(loop, step, batches):
                    break
            return self._finish(loop)
        except CheckpointWriteError as error:
            loop.exit_code = EXIT_IO_FAILED
            self._summary_after_failure(loop, error)
            raise

    def _stop_after_a_failed_save(self) -> None:
        """CheckpointWriteError at the first step boundary after an async save failed, not at the next
        save: no step runs on after its checkpoint is known lost. One process only: in a multi-process
        run each would learn it at its own step, so they learn it together at the next save."""
        if self.ckpt is not None and jax.process_count() == 1:
            self.ckpt.raise_if_failed()

    def _summary_after_failure(self, loop: _Loop, error: Exception) -> None:
        """summary.json (exit_code 74, the error's line) when a save failed, if the run dir still takes it;
        never hides the error."""
        if self.is_main:
            with contextlib.suppress(Exception):
                summary = self._summary(loop, time.perf_counter() - loop.started)
                write_summary(self.run_dir, {**summary, "error": str(error)})

    def _open_outputs(self, start_step: int) -> None:
        """config.yaml, metrics.jsonl (cut back to the resumed step), TensorBoard and the trackers (a resume
        continues their runs), process 0 only."""
        self.logger = None
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", self.cfg.to_yaml(), replace=True)
            log = self.cfg.log  # W&B / MLflow, fed by the one writer
            trackers = open_trackers(log.wandb, log.mlflow, self.cfg.to_dict(), self.run_dir, start_step,
                                     name=self.run_root.name)  # a bucket run: its URL's name, not the staging dir's
            try:
                self.logger = MetricsLogger(self.run_dir, tensorboard=log.tensorboard, resume_step=start_step,
                                            trackers=trackers)
            except BaseException:
                if trackers is not None:  # their runs are open: end them as failed
                    trackers.close("failed")
                raise
        self.bar = ProgressBar(self.cfg.train.steps, initial=start_step, enabled=self.cfg.log.progress and self.is_main)

    def _say(self, text: str) -> None:
        if self.is_main:
            self.bar.write(text)

    def _say_error(self, text: str) -> None:
        """An error line: stderr, like every `jaxinfra: error:` line (stdout is the run's log)."""
        if self.is_main:
            self.bar.write(text, error=True)

    def _log(self, step: int, line: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(step, line)

    def _header(self, start_step: int) -> None:
        cfg = self.cfg
        self.fpt = flops_per_token(cfg.model, cfg.train.seq_len)
        override = cfg.log.peak_tflops * 1e12 if cfg.log.peak_tflops else None
        self.peak, self.peak_source = peak_flops_per_device(self.devices[0], cfg.model.dtype, override)
        self.counts = param_counts(cfg.model)
        self._say(f"jaxinfra: {self.counts['total'] / 1e6:.2f}M params, mesh {dict(self.mesh.shape)}, "
                  f"{len(self.devices)} x {self.devices[0].device_kind}, peak {self.peak / 1e12:.3g} TFLOP/s/device "
                  f"({self.peak_source}), run dir {self.run_root}"
                  + (f", resumed at step {start_step}" if start_step else ""))

    def _first_eval(self, loop: _Loop, meta: dict[str, Any]) -> None:
        self.has_eval = bool(self.eval_batches)  # data.eval_batches=0: no held-out evaluation at all
        if loop.start_step == 0 and self.has_eval:
            self._record_eval(loop, 0)
        loop.first_eval = meta.get("first_eval_loss", loop.evals[0][1] if loop.evals else None)

    def _record_eval(self, loop: _Loop, step: int) -> None:
        line = self.eval_metrics(loop.state)
        eval_loss = line["eval_loss"]
        loop.evals.append((step, eval_loss))
        self._log(step, {**line, **{k: v for e in self.rt.extensions for k, v in e.eval_fields().items()}})
        per_source = "".join(f", {k.split('/', 1)[1]} {v:.4f}" for k, v in line.items() if "/" in k)
        self._say(f"step {step}: eval_loss {eval_loss:.4f}{per_source}")

    def _train_one_step(self, loop: _Loop, step: int, batches: Iterator[dict[str, jax.Array]]) -> bool:
        """Dispatch one step, then its log point, evaluation and checkpoint; False ends the loop."""
        t, watchdog = self.cfg.train, self.watchdog
        watchdog.progress(step, "data")
        batch = next(batches)
        if loop.first_step_s is None:
            self._compile_step(loop, batch)
        self.window.before(step, loop.state)
        watchdog.progress(step, "step")
        dispatched = time.perf_counter()
        loop.state, metrics = self.rt.train_step(loop.state, batch)
        self.state = loop.state  # what host.current_state() gives the next batch (the old one was donated)
        loop.pending_flags.append(metrics["nonfinite"])
        loop.window_steps += 1
        if loop.first_step_s is None:  # the first step runs the program compiled just before
            jax.block_until_ready((loop.state, metrics))
            self._first_step_ran(loop, time.perf_counter() - dispatched)
        profiled = self.window.after(step, (loop.state, metrics))
        if profiled:
            self._say(profiled)
        log_now = step % self.cfg.log.every == 0 or step == t.steps
        if log_now:
            self._log_point(loop, step, metrics)
            if loop.bad_in_a_row >= t.max_bad_steps:
                self._say_error(f"jaxinfra: error: the last {loop.bad_in_a_row} consecutive steps had non-finite "
                                f"loss, gradients or updates, at least train.max_bad_steps={t.max_bad_steps} (checked "
                                f"at log steps, every log.every={self.cfg.log.every}); stopping at step {step}; "
                                f"updates from those steps were skipped and {_kept(self.cfg, 'the last good')}")
                loop.exit_code = EXIT_DIVERGED
                return False
        if self.has_eval and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
            watchdog.progress(step, "eval")
            self._record_eval(loop, step)
        self._host_metrics(step)
        return self._checkpoint_or_stop(loop, step, sync=log_now)

    def _host_metrics(self, step: int) -> None:
        """The extensions' host metrics after step `step` (e.g. lm-eval scores), one line at that step when
        any returns some; each extension decides when it touches the device, so {} costs no sync."""
        self.watchdog.progress(step, "host metrics")
        host = self.host_context()
        line = {k: v for e in self.rt.extensions for k, v in e.host_metrics(host, step).items()}
        if line:
            self._log(step, line)
            shown = ", ".join(f"{k} {float(v):.4g}" for k, v in line.items() if isinstance(v, (int, float)))
            self._say(f"step {step}: {shown or ', '.join(line)}")

    def _compile_step(self, loop: _Loop, batch: dict[str, jax.Array]) -> None:
        """Compile the train step before its first call (the call reuses it), each phase timed and the
        compile checked against the persistent cache (said in the startup line after the first step)."""
        self.watchdog.progress(loop.step, "compile")
        with compile_cache.watch() as loop.compile_events:
            compiled, loop.compile_times = self.rt.compile_train_step(loop.state, batch)
        self.window.keep_program(compiled)  # a profile window classifies its ops from this program's HLO
        for note in loop.compile_events.notes:
            self._say(note)

    def _first_step_ran(self, loop: _Loop, seconds: float) -> None:
        """The startup line, once: the compile's phases and the first step's run, which only now is known
        (one line rather than two; a bad cache entry's warning came at the compile). Step times of later
        log points count from here, and the watchdog's step timeout starts."""
        loop.first_step_s = seconds
        self._say("jaxinfra: " + compile_cache.describe(loop.compile_times, loop.compile_events, self.cache_dir,
                                                        seconds))
        loop.window_start, loop.window_steps = time.perf_counter(), 0
        self.watchdog.arm()

    def _log_point(self, loop: _Loop, step: int, metrics: dict[str, jax.Array]) -> None:
        """The loop's host sync: count skipped steps and write one metrics line."""
        self.watchdog.progress(step, "sync (device step / collectives)")
        host, flags = jax.device_get((metrics, loop.pending_flags))
        loop.pending_flags = []
        for flag in flags:
            loop.bad_in_a_row = loop.bad_in_a_row + 1 if flag else 0
            loop.skipped += int(flag)
        now = time.perf_counter()
        step_time = (now - loop.window_start) / loop.window_steps if loop.window_steps else loop.first_step_s
        loop.window_start, loop.window_steps = now, 0
        line = self._metrics_line(host, step_time, loop.skipped)
        if step_time != loop.first_step_s:
            loop.step_rates.append(line["tokens_per_s"])
        self._log(step, line)
        self.bar.update(step, line)
        loop.last = line
        self._push()

    def _metrics_line(self, host: dict[str, Any], step_time: float, skipped: int) -> dict[str, float]:
        n_dev = len(self.devices)
        tps = self.cfg.train.batch_size * self.cfg.train.seq_len / step_time
        line = {
            "loss": float(host["loss"]), "lr": float(host["lr"]), "grad_norm": float(host["grad_norm"]),
            "tokens_per_s": tps, "tflops_per_device": tps / n_dev * self.fpt / 1e12,
            "mfu": mfu(tps / n_dev, self.fpt, self.peak), "step_time_s": step_time, "skipped_steps": skipped,
        }
        if self.cfg.model.z_loss_weight:
            line["z_loss"] = float(host["z_loss"])
        names = {n for e in self.rt.extensions for n in e.metric_names}  # e.g. distillation's losses
        line.update({k: float(v) for k, v in host.items() if k.startswith("moe_") or k in names})  # + router stats
        return line

    def _checkpoint_or_stop(self, loop: _Loop, step: int, sync: bool) -> bool:
        """Save when due (periodic, last step, or a stop request); False when a signal asks to stop."""
        ckpt_cfg = self.cfg.checkpoint
        stop = self._stop_requested(sync=sync)
        periodic = self.ckpt is not None and ckpt_cfg.every and step % ckpt_cfg.every == 0
        if self.ckpt is not None and (periodic or stop or step == self.cfg.train.steps):
            self.watchdog.progress(step, "checkpoint")
            metrics_for_best = {"eval_loss": loop.evals[-1][1]} if loop.evals and loop.evals[-1][0] == step else None
            blocked = self.save(step, loop.state, {"first_eval_loss": loop.first_eval}, metrics_for_best)
            if blocked is not None:
                loop.saved_at = step
                self._log(step, {"checkpoint_block_s": blocked})
            self._push(force=True)
        if stop:
            loop.exit_code = EXIT_PREEMPTED
            self._say(f"jaxinfra: stopping at step {step} on signal {self._signal}; {self._after_stop(loop, step)}")
        return not stop

    def _after_stop(self, loop: _Loop, step: int) -> str:
        """What a rerun of a stopped run does, as it is: it resumes only from a committed checkpoint."""
        if self.ckpt is None:
            return ("no checkpoint (checkpoint.enabled=false): nothing was saved, a rerun of the same command starts "
                    "over from step 0")
        if loop.saved_at == step:
            return "checkpoint committing; rerun the same command to resume"
        return (f"no checkpoint written at step {step} (the params were not finite); a rerun resumes from the last "
                f"committed checkpoint, if any, else starts over")

    def _finish(self, loop: _Loop) -> dict[str, Any]:
        """Wait for the last checkpoint, close the outputs, write and return the summary."""
        self.watchdog.progress(loop.step, "checkpoint (waiting for commit)")
        if self.ckpt is not None:
            self.ckpt.close()
        self.watchdog.close()
        self.bar.close()
        self.state = loop.state
        summary = self._summary(loop, time.perf_counter() - loop.started)
        if self.is_main:
            write_summary(self.run_dir, summary)
            self.logger.log_summary(loop.step, summary)
            self.logger.close(_EXIT_OUTCOMES.get(loop.exit_code, "failed"))
        first, final = summary["first_eval_loss"], summary["final_eval_loss"]
        if loop.exit_code == EXIT_OK and first is not None and final is not None:
            drop = summary["eval_loss_drop"]  # negative when it rose (DPO pushes the rejected replies' loss up)
            change = f"{drop:.0%} lower" if drop >= 0 else f"{-drop:.0%} higher"
            self._say(f"done: {loop.step} steps in {summary['wall_s']:.1f}s, eval_loss {first:.4f} -> {final:.4f} "
                      f"({change}), {summary['tokens_per_s'] or 0:.0f} tokens/s")
        return summary

    def _summary(self, loop: _Loop, wall: float) -> dict[str, Any]:
        first_eval, final_eval = loop.first_eval, loop.evals[-1][1] if loop.evals else None
        return {
            "steps": loop.step,
            "exit_code": loop.exit_code,
            "resumed_from_step": loop.start_step,
            "final_loss": loop.last.get("loss"),
            "first_eval_loss": first_eval,
            "final_eval_loss": final_eval,
            "eval_loss_drop": (1 - final_eval / first_eval) if first_eval and final_eval else None,
            "skipped_steps": loop.skipped,
            "tokens_per_s": float(np.median(loop.step_rates)) if loop.step_rates else loop.last.get("tokens_per_s"),
            "mfu": loop.last.get("mfu"),
            "flops_per_token": self.fpt,
            "peak_flops_per_device": self.peak,
            "peak_source": self.peak_source,
            **_compile_fields(loop, self.cache_dir),
            "wall_s": wall,
            "params": self.counts,
            "param_bytes_per_device": bytes_per_device(loop.state.params),
            "opt_state_bytes_per_device": bytes_per_device(loop.state.opt_state),
            "mesh": dict(self.mesh.shape),
            "devices": len(self.devices),
        }


def _compile_fields(loop: _Loop, cache_dir: str | None) -> dict[str, Any]:
    """summary.json's account of the train step's compile (None: no step ran)."""
    times, events = loop.compile_times, loop.compile_events
    if times is None:
        return {key: None for key in ("compile_s", "compile_trace_s", "compile_lower_s", "compile_xla_s",
                                      "compile_cache_hit", "first_step_s")} | {"compile_cache": cache_dir}
    return {"compile_s": times.total_s,  # trace + lower + XLA; the first step's run is first_step_s
            "compile_trace_s": times.trace_s, "compile_lower_s": times.lower_s, "compile_xla_s": times.xla_s,
            "compile_cache": cache_dir, "compile_cache_hit": bool(events.hits), "first_step_s": loop.first_step_s}


def train(cfg: Config, run_dir: str | os.PathLike, devices: Sequence[jax.Device] | None = None,
          restore_from: str | os.PathLike | None = None, extensions: Sequence[StepExtension] | None = None,
          restart_data: bool = False, allow_fresh_start: bool = False) -> dict[str, Any]:
    """Train (or resume) from a validated config; returns the run summary (also written to summary.json).
    `extensions`: the train step's (jaxinfra/extensions.py); None: those the config asks for. `restart_data`:
    a resume may change the data stream (jaxinfra/resume.py), the data then starts from its beginning.
    `allow_fresh_start`: see Trainer (the CLI's --allow-fresh-start)."""
    if jax.process_count() == 1:
        return Trainer(cfg, run_dir, devices, restore_from, extensions, restart_data, allow_fresh_start).run()
    trainer = None
    try:
        trainer = Trainer(cfg, run_dir, devices, restore_from, extensions, restart_data, allow_fresh_start)
        return trainer.run()
    except bad_input_errors() as e:
        # Every process reads the same config and checkpoint, so each one says the same line.
        _leave(EXIT_BAD_INPUT, f"jaxinfra: error: {e}", peers_alive=True)
    except Exception as e:  # noqa: BLE001 - anything else here is most likely a lost peer
        if (line := io_failure_line(e)) is not None:  # peers may be waiting in the save's barrier: leave alone
            _leave(EXIT_IO_FAILED, f"jaxinfra: error: process {jax.process_index()}: {line}")
        step, phase = (trainer.watchdog_step, trainer.watchdog_phase) if trainer else (0, "start")
        _leave(EXIT_HUNG, f"jaxinfra: error: process {jax.process_index()} failed at step {step}, phase '{phase}': "
                          f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]} (a peer process may have "
                          f"died); " + (f"the last committed checkpoint is in {_shown(run_dir)}/checkpoints"
                                        if cfg.checkpoint.enabled else _kept(cfg, "")))


def _kept(cfg: Config, which: str) -> str:
    """What a stopped run leaves to resume from, as it is: with checkpoint.enabled=false, nothing."""
    if cfg.checkpoint.enabled:
        return f"{which} checkpoint is kept".strip()
    return "no checkpoint exists (checkpoint.enabled=false): a rerun starts over from step 0"


_EXIT_OUTCOMES = {EXIT_OK: "finished", EXIT_PREEMPTED: "killed"}  # how the trackers' runs end (else failed)


def _outcome(error: BaseException | None) -> str:
    """A tracker run's end when the loop did not finish normally: Ctrl-C is killed, an error failed."""
    return "killed" if isinstance(error, KeyboardInterrupt) else "failed" if error is not None else "finished"


def _shown(run_dir: str | os.PathLike) -> str:
    """The run dir as the user gave it (a URL stays a URL; pathlib would make s3://b/x into s3:/b/x)."""
    return str(run_dir) if storage.is_url(run_dir) else str(pathlib.Path(run_dir))


def _leave(status: int, line: str, peers_alive: bool = False) -> NoReturn:
    """Exit a multi-process run now: jax's exit hook would wait for peers that may be gone or stuck.

    With `peers_alive` (bad input: every process raised the same error) they leave the process
    group together first, so process 0, which hosts the coordination service, does not vanish
    under a peer that is still connected (it would abort with a page of gRPC errors)."""
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    if peers_alive:
        with contextlib.suppress(Exception):
            jax.distributed.shutdown()
    os._exit(status)
