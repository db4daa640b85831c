"""Checkpoints: the train state, the data position and the config, saved together by Orbax.

One checkpoint (a step directory under `run_dir/checkpoints/`) holds
- `state`: the TrainState (params, optimizer state, step), restored into whatever
  shardings the current mesh wants (resharding on restore);
- `data`: each batch row slot's grain iterator state, keyed by global slot index, so
  a restart on a different process count resumes every row exactly;
- `meta`: the loop step, the resolved config (YAML) and the batch geometry.

Saves are asynchronous: `save()` returns after the device-to-host copy and Orbax
commits in the background. Only committed checkpoints are listed and restored: a step
directory counts as committed by Orbax's markers (`COMMIT_MARKERS`), never by its name, so a
save killed mid-flight or a copied directory never becomes "latest". Reading paths (inference,
export, quantize, `--restore`) ignore an uncommitted one with one warning line; a run's own
Checkpointer moves it to `<step>.uncommitted-<time>` before Orbax lists it.

Before any restore, the checkpoint's array shapes (Orbax metadata) are compared with the
target's: a checkpoint written for another model is refused with one line naming the
config keys that differ (`CheckpointFitError`, exit 2) and nothing on disk changes. Only a
checkpoint that fails to *read* (truncated or corrupted files, unreadable metadata) counts
as damaged: the previous one is tried, and once one restores the newer damaged ones are
reported in one line each and moved aside (`<step>.unreadable-<time>`). When none restores,
nothing moves: `CheckpointReadError` (exit 74), because a read error may be the storage's
(an NFS hiccup), and a rerun once it is back resumes. A run dir whose checkpoints were all set
aside is not trained from step 0 either, unless the user says so (`train --allow-fresh-start`).

A save that fails (disk full, no permission, an object-store error) raises
`CheckpointWriteError` naming the step and its path, wherever Orbax lets the error out: at
that save, at the next one, or at the final wait. Orbax writes into `<step>.orbax-checkpoint-tmp`
and renames it only once every item is written, so a failed step is never listed; the previous
committed checkpoint stays intact, and the next run removes the temporary directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from jaxinfra import atomic, storage
from jaxinfra.config import CheckpointConfig
from jaxinfra.distributed import exchange_json  # multi-host utility; re-exported for callers
from jaxinfra.state import TrainState, split_model_state


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was required; one line naming the path."""


class CheckpointFitError(CheckpointError):
    """The checkpoint is intact but was written for other shapes (another config): refused, never moved."""


class CheckpointWriteError(RuntimeError):
    """Checkpoint `step` could not be written to `path` (`reason`, e.g. "No space left on device").

    Not a CheckpointError: that is bad input (exit 2); this is the storage (exit 74, jaxinfra/exits.py).
    `committed` is the newest step that did commit (None if none), which a rerun resumes from; the
    original error is the `__cause__`.
    """

    def __init__(self, step: int, path: pathlib.Path, reason: str, committed: int | None):
        self.step, self.path, self.reason, self.committed = step, path, reason, committed
        kept = (f"the last committed checkpoint, step {committed}, is intact" if committed is not None
                else "no checkpoint of this run committed yet")
        super().__init__(f"checkpoint step {step} could not be written to {path} ({reason}); {kept}; free space "
                         f"or fix the path, then rerun the same command to resume")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable: sweeps run trainings in pools that send errors back
        return type(self), (self.step, self.path, self.reason, self.committed)


class CheckpointReadError(RuntimeError):
    """Checkpoints exist but none could be read (a storage fault or damage): an I/O failure, exit 74.

    Not a CheckpointError (bad input, exit 2), and never a reason to start afresh on its own: nothing
    is moved, so a rerun once the storage is back resumes; `train --allow-fresh-start` sets them aside."""


def _write_reason(error: BaseException) -> str:
    """What the storage said, in a few words: the OS error's text when one is in the chain or in
    tensorstore's message (`[os_error_code='28']`), else the error's first line."""
    seen: BaseException | None = error
    visited: set[int] = set()  # chains can loop (an error set as its own context's cause)
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        code = re.search(r"os_error_code='?(\d+)|\[Errno (\d+)\]", str(seen))
        if code:
            number = int(code.group(1) or code.group(2))
            return os.strerror(number) if number in errno.errorcode else f"OS error {number}"
        seen = seen.__cause__ or seen.__context__
    return f"{type(error).__name__}: {_reason(error)}" if isinstance(error, Exception) else type(error).__name__


# A collective that fails because another process is gone (Gloo, the coordination service's
# barriers): the save's own cross-process steps hit it first. That is a lost peer (exit 70, rerun
# resumes), never a storage failure (exit 74, not retried).
_PEER_LOST = re.compile(r"Gloo|Connection (closed|reset) by peer|coordination service|DEADLINE_EXCEEDED|"
                        r"[Bb]arrier|heartbeat", re.S)


def peer_lost(error: BaseException) -> bool:
    """Whether `error` (or an error it came from) says another process is gone."""
    seen: BaseException | None = error
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if _PEER_LOST.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# What tensorstore's own errors say (its futures are awaited bare, so no Orbax frame is in their
# traceback): array reads and writes go through Orbax alone in this stack.
_TENSORSTORE_ERROR = re.compile(r"OCDBT database|\"zarr3?\" driver|tensorstore|os_error_code")


class _DropOrphanWriteTasks(logging.Filter):
    """asyncio logs "<Task|_GatheringFuture> exception was never retrieved" for Orbax's array writes
    or reads that failed after the first one (asyncio.gather reported only that one), whenever the
    task or future is collected: a page of traceback each. The failure itself is reported in one
    line (CheckpointWriteError, an unreadable checkpoint); records from anything else pass through."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exception was never retrieved" not in message:
            return True
        error = record.exc_info[1] if record.exc_info else None
        trace = "".join(traceback.format_exception(error)) if error is not None else ""
        return "orbax" not in message + trace and not _TENSORSTORE_ERROR.search(message + trace)

    @classmethod
    def install(cls) -> None:
        """Once per process (the tasks are collected after the save is over)."""
        logger = logging.getLogger("asyncio")
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


class _DropOrbaxErrors(logging.Filter):
    """Orbax logs each failed background write with its traceback (several pages for one full disk),
    from its own threads; the error itself reaches the train loop, which reports it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Orbax warns (absl) about metadata files it does not need here, and logs each failed read's
    traceback; the caller reports every failure in one line of its own."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        absl_logger.setLevel(level)


def _reason(error: Exception) -> str:
    """The first informative line of an error, short enough for a one-line warning."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return first.split(" See full")[0][:160]


# What Orbax writes into a step directory when, and only when, it commits it (checked on the pinned
# orbax-checkpoint 0.12: both, on a local disk and on a bucket). A step directory without them is
# an interrupted or copied write, whatever its name says.
COMMIT_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")
UNREADABLE = ".unreadable-"  # `<step>.unreadable-<time>`: a checkpoint set aside because it could not be read


def is_committed(step_dir: Any) -> bool:
    """Whether `step_dir` (RUN/checkpoints/<step>) holds Orbax's commit markers."""
    return all((step_dir / name).exists() for name in COMMIT_MARKERS)


def _step_dirs(directory: Any) -> list[Any]:
    """RUN/checkpoints/<digits> directories, committed or not."""
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]


def committed_steps(directory: Any, warn: bool = False) -> list[int]:
    """The committed steps under a checkpoints directory, oldest first; with `warn`, one line per
    uncommitted step directory (never restored from)."""
    steps = []
    for path in _step_dirs(directory):
        if is_committed(path):
            steps.append(int(path.name))
        elif warn:
            print(f"jaxinfra: warning: {path} has no Orbax commit markers ({', '.join(COMMIT_MARKERS)}): an "
                  f"interrupted or copied write, ignored", flush=True)
    return sorted(steps)


def set_aside_uncommitted(directory: Any) -> None:
    """Rename step directories without commit markers to `<step>.uncommitted-<time>` (one warning line
    each): Orbax would list them as steps, delete them as old ones, or refuse to save over them. A local
    run dir under its lock only (on a bucket Orbax's own listing already needs the marker file)."""
    if jax.process_index() == 0 and not storage.is_url(directory):
        for path in _step_dirs(directory):
            if not is_committed(path):
                aside = directory / f"{path.name}.uncommitted-{int(time.time())}"
                path.rename(aside)
                print(f"jaxinfra: warning: {path} has no Orbax commit markers ({', '.join(COMMIT_MARKERS)}): an "
                      f"interrupted or copied write, never restored; moved to {aside}", flush=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxinfra-checkpoint-uncommitted")


def set_aside_checkpoints(directory: Any) -> list[str]:
    """Every committed step directory renamed `<step>.unreadable-<time>` (a fresh start the user asked
    for, after none could be read); returns the new names. Process 0 renames, the others wait."""
    stamp = int(exchange_json({"t": int(time.time())} if jax.process_index() == 0 else {})["t"])
    names = [f"{step}{UNREADABLE}{stamp}" for step in committed_steps(directory)]
    if jax.process_index() == 0:
        for name in names:
            (directory / name.split(".")[0]).rename(directory / name)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxinfra-checkpoint-set-aside")
    return names


def set_aside_only(directory: Any) -> list[str]:
    """The names of checkpoints set aside as unreadable when no committed one is left (else [])."""
    if not directory.is_dir() or committed_steps(directory):
        return []
    return sorted(p.name for p in directory.iterdir() if UNREADABLE in p.name and p.name.split(".")[0].isdigit())


def _silence_async_noise() -> None:
    """Orbax's reads and writes fail in asyncio tasks and tensorstore callbacks that outlive them: the
    failure is reported in one line by the caller; the pages asyncio and Python print about those
    leftovers (late callbacks on a closed loop, futures never retrieved) are dropped, once per process."""
    _DropLateWriteCallbacks.install()
    _DropOrphanWriteTasks.install()


def _storage_error(error: BaseException, path: Any) -> BaseException:
    """The OSError behind a failed Orbax write (in the chain, or in tensorstore's `[os_error_code='28']`
    text), for jaxinfra/exits.py's one line; `error` itself when the storage did not refuse anything."""
    seen: BaseException | None = error
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        code = re.search(r"os_error_code='?(\d+)", str(seen))
        if code:
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path))
        seen = seen.__cause__ or seen.__context__
    return error


@contextlib.contextmanager
def _orbax_write(path: Any, close: Any, shown: Any = None) -> Iterator[None]:
    """An Orbax write to `path` outside training (export-params, hf import, quantize, lora merge). On
    failure its threads are closed first (`close`: else they print pages at exit), Orbax's logged
    tracebacks and asyncio's leftovers are dropped, and the storage's OSError (naming `shown`, default
    `path`) is raised: one line, exit 74."""
    _silence_async_noise()
    quiet = _DropOrbaxErrors()
    logging.getLogger("absl").addFilter(quiet)
    try:
        yield
    except Exception as e:
        with contextlib.suppress(Exception):
            close()
        if not storage.is_url(path):  # the partial write (a full disk gets its space back)
            for partial in pathlib.Path(path).parent.glob(f"{pathlib.Path(path).name}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        cause = _storage_error(e, path if shown is None else shown)
        if cause is e:
            raise
        raise cause from e
    finally:
        logging.getLogger("absl").removeFilter(quiet)


def abstract_with_shardings(abstract: TrainState, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs that carry the target shardings: Orbax restores straight into them."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _saved_shapes(step_dir: pathlib.Path, item: str = "state") -> dict[str, tuple[int, ...]]:
    """Flat 'a/b/c' -> shape of every array in a saved item, from Orbax's metadata (no array is read)."""
    from etils import epath

    with _quiet_orbax():
        tree = ocp.StandardCheckpointHandler().metadata(epath.Path(step_dir / item))
    return {k: tuple(v.shape) for k, v in ocp.tree.to_flat_dict(getattr(tree, "tree", tree), sep="/").items()}


def _saved_config(step_dir: pathlib.Path) -> dict[str, Any]:
    """The resolved config stored in a checkpoint's meta ({} if it holds none, e.g. an old or imported one)."""
    import yaml

    path = step_dir / "meta" / "metadata"
    if not path.is_file():
        return {}
    text = json.loads(path.read_text()).get("config")
    return yaml.safe_load(text) or {} if text else {}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any], sections: tuple[str, ...]) -> list[str]:
    """'key: saved -> current' for each differing key of `sections` (nested config dicts)."""
    old, new = _flat({k: saved.get(k, {}) for k in sections}), _flat({k: current.get(k, {}) for k in sections})
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def check_fits(step_dir: pathlib.Path, target: Any, current_config: dict[str, Any] | None,
               item_prefix: str | tuple[str, ...] = "") -> None:
    """CheckpointFitError if the arrays saved in `step_dir` do not have the target's names and shapes.

    `target` is a tree of ShapeDtypeStructs (the whole TrainState, or a part of it: then
    `item_prefix` names the subtrees compared, e.g. ("params/", "stats/"); a str prefixes the
    target's names). I/O and format errors propagate: the caller counts them as damage.
    """
    saved = _saved_shapes(step_dir)
    prefix = item_prefix if isinstance(item_prefix, str) else ""
    wanted = {prefix + k: tuple(v.shape) for k, v in ocp.tree.to_flat_dict(target, sep="/").items()}
    if item_prefix:
        keep = (item_prefix,) if isinstance(item_prefix, str) else tuple(item_prefix)
        saved = {k: v for k, v in saved.items() if k.startswith(keep)}
    bad = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    if not bad:
        return
    saved_config = _saved_config(step_dir) if current_config else {}
    changes = config_changes(saved_config, current_config, ("model",)) if saved_config else []
    first = bad[0]
    detail = (f"config keys {'; '.join(changes[:6])}" if changes else
              f"{len(bad)} arrays differ, e.g. {first}: saved {saved.get(first, 'absent')}, wanted "
              f"{wanted.get(first, 'absent')}")
    raise CheckpointFitError(
        f"checkpoint {step_dir} was written for another model ({detail}); nothing was changed: rerun with the "
        f"config it was written with, or choose a new --run-dir")


class _DropLateWriteCallbacks:
    """sys.unraisablehook minus one kind of noise. When one array write fails, Orbax's asyncio.gather
    raises and its event loop closes while tensorstore still completes the other writes; each of
    their completion callbacks then fails on the closed loop (`call_soon_threadsafe`), and Python
    prints that, unraisable, as a page of tracebacks, at any time up to the process's exit. The
    failure itself is reported as CheckpointWriteError; every other unraisable passes through."""

    def __init__(self, hook: Any):
        self.hook = hook

    def __call__(self, unraisable: Any) -> None:
        error, trace = unraisable.exc_value, unraisable.exc_traceback
        while trace is not None and trace.tb_next is not None:
            trace = trace.tb_next
        late = (isinstance(error, RuntimeError) and str(error) == "Event loop is closed" and trace is not None
                and trace.tb_frame.f_code.co_name == "_check_closed")
        if not late:
            self.hook(unraisable)

    @classmethod
    def install(cls) -> None:
        """Wrap the current hook once (kept for the process: the callbacks come after the save is over)."""
        if not isinstance(sys.unraisablehook, cls):
            sys.unraisablehook = cls(sys.unraisablehook)


class Checkpointer:
    """Async save every `cfg.every` steps (and on demand), keep the newest `cfg.keep`.

    A failed write raises `CheckpointWriteError` for the step it belongs to, at whichever call
    Orbax reports it (`save` of that step or of the next one, `wait`, `close`)."""

    def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig, read_only: bool = False):
        """`read_only`: another run's checkpoints (`--restore`): nothing there is written, moved or cleaned."""
        self.directory = _absolute(directory)
        self.read_only = read_only
        _silence_async_noise()
        self._quiet = _DropOrbaxErrors()
        logging.getLogger("absl").addFilter(self._quiet)  # removed by close(): Orbax's threads log until then
        self._pending: int | None = None  # the step whose async write has not been confirmed yet
        self._keep = cfg.keep
        self._failed = False
        try:
            if read_only:
                committed_steps(self.directory, warn=jax.process_index() == 0)  # a line per uncommitted dir
            else:
                set_aside_uncommitted(self.directory)  # before Orbax lists them as steps
            with _quiet_orbax():  # read_only=True makes Orbax log "Given directory is read only"
                self.manager = ocp.CheckpointManager(self.directory, options=self._options(cfg),
                                                     item_names=("state", "data", "meta"))
        except BaseException:
            logging.getLogger("absl").removeFilter(self._quiet)
            raise

    def _options(self, cfg: CheckpointConfig) -> ocp.CheckpointManagerOptions:
        if self.read_only:
            return ocp.CheckpointManagerOptions(read_only=True, create=False)
        policies: list[Any] = [ocp.checkpoint_managers.LatestN(n=cfg.keep)]
        if cfg.keep_best:
            policies.append(ocp.checkpoint_managers.BestN(
                get_metric_fn=lambda m: m["eval_loss"], reverse=False, n=1, keep_checkpoints_without_metrics=False))
        return ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True, create=True,
            **storage.orbax_options(self.directory))

    def steps(self) -> list[int]:
        """The committed steps, oldest first (Orbax lists any step-named directory; only these restore)."""
        self.manager.reload()  # another process (or an earlier run) may have written since
        return [s for s in sorted(self.manager.all_steps()) if is_committed(self.directory / str(s))]

    def set_aside_all(self) -> list[str]:
        """Every committed checkpoint moved to `<step>.unreadable-<time>` (a fresh start the user asked for
        after none could be read); returns the new names."""
        names = set_aside_checkpoints(self.directory)
        self.manager.reload()
        return names

    def raise_if_failed(self) -> None:
        """CheckpointWriteError now if the pending save already ended without committing; never blocks
        (the train loop calls it at every step, so no step runs after a failed save is known)."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def save(self, step: int, state: TrainState, data_states: dict[str, Any], meta: dict[str, Any],
             metrics: dict[str, float] | None = None) -> None:
        """Start an async save of `state` at loop step `step`; returns once device arrays are copied.

        Raises CheckpointWriteError for the previous save if it failed in the background (first,
        so the error names the step it belongs to), or for this one if it cannot start."""
        data = exchange_json({str(k): v for k, v in data_states.items()})
        self.wait()
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data), meta=ocp.args.JsonSave(meta)),
                metrics=metrics, force=True)
        except Exception as e:  # a failure to start a write is the storage's (or Orbax's) refusal
            if peer_lost(e):
                raise
            raise self._write_error(step, e) from e
        self._pending = step

    def wait(self) -> None:
        """Block until the pending save has committed; CheckpointWriteError if it did not."""
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # tensorstore / OS / object-store errors from the write threads
            if peer_lost(e):
                raise
            raise self._write_error(step, e) from e
        # Orbax skips finalizing a step whose items reported errors late with only a log line (which
        # _DropOrbaxErrors hides): the listing of committed steps is the ground truth. Process 0
        # commits; with keep=0 a committed step may already be gone.
        if self._keep >= 1 and jax.process_index() == 0 and step not in self.steps():
            raise self._write_error(step, RuntimeError("the write ended without committing the step"))

    def _write_error(self, step: int, error: BaseException) -> CheckpointWriteError:
        self._failed = True
        try:
            committed = max((s for s in self.steps() if s != step), default=None)
        except Exception:  # noqa: BLE001 - listing may fail on the same storage: then name no step
            committed = None
        return CheckpointWriteError(step, self.directory / str(step), _write_reason(error), committed)

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict[str, Any], dict[str, Any]]:
        with _quiet_orbax():
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["data"]), dict(out["meta"])

    def restore_latest(self, target: TrainState, config: dict[str, Any] | None = None,
                       ) -> tuple[int, TrainState, dict[str, Any], dict[str, Any]] | None:
        """Newest checkpoint that restores, or None if there is none.

        One that does not fit the target (another model) raises CheckpointFitError before anything
        moves. Unreadable ones are skipped for the previous one; once one restores, the newer unreadable
        ones are reported and moved aside (not in a read-only Checkpointer). If none restores, nothing
        is moved and CheckpointReadError is raised: a storage fault must not turn into a fresh start.
        """
        failed: list[tuple[int, Exception]] = []
        for step in reversed(self.steps()):
            try:
                found = self._restore_checked(step, target, config)
            except CheckpointFitError:
                raise
            except Exception as e:  # noqa: BLE001 - tensorstore / json / metadata errors: the files are damaged
                failed.append((step, e))
                continue
            for bad, error in failed:
                self._report_unreadable(bad, error)
            return found
        if failed:
            step, error = failed[0]
            raise CheckpointReadError(
                f"no checkpoint under {self.directory} could be read ({len(failed)} tried; step {step}: "
                f"{_reason(error)}); nothing was moved: rerun the same command once the storage is back, or "
                f"rerun with --allow-fresh-start to set them aside and train from step 0")
        return None

    def _restore_checked(self, step: int, target: TrainState, config: dict[str, Any] | None
                         ) -> tuple[int, TrainState, dict[str, Any], dict[str, Any]]:
        step_dir = self.directory / str(step)
        legacy = _pre_stats_target(step_dir, target)
        if legacy is None:
            check_fits(step_dir, target, config)
            return (step, *self.restore(step, target))
        return (step, *self._restore_pre_stats(step, target, legacy))

    def _report_unreadable(self, step: int, error: Exception) -> None:
        where = self.directory / str(step)
        if self.read_only:
            print(f"jaxinfra: warning: checkpoint {where} is unreadable ({_reason(error)}); used the previous one",
                  flush=True)
            return
        aside = self._move_aside(step)
        print(f"jaxinfra: warning: checkpoint {where} is unreadable ({_reason(error)}); moved to {aside}, used "
              f"the previous one", flush=True)

    def _restore_pre_stats(self, step: int, target: TrainState, legacy: dict[str, Any]
                           ) -> tuple[TrainState, dict[str, Any], dict[str, Any]]:
        """A checkpoint written before Stats left the params: its `params/` hold them too, and its
        optimizer state has moments for them, which are dropped (the step never used them)."""
        with _quiet_orbax():  # a manager of its own: this one's `state` item stays bound to StandardSave
            reader = ocp.CheckpointManager(self.directory, item_names=("state", "data", "meta"),
                                           options=ocp.CheckpointManagerOptions(read_only=True, create=False))
            out = reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=legacy, partial_restore=True,
                    restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), legacy)),
                data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        reader.close()
        old = out["state"]
        params, stats = split_model_state(old["params"])
        state = TrainState(step=old["step"], params=params, opt_state=old["opt_state"], stats=stats, ext=target.ext)
        return state, dict(out["data"]), dict(out["meta"])

    def _move_aside(self, step: int) -> pathlib.Path:
        """Keep the evidence, but out of the way: it must not be 'latest' or block a new save of that step.
        Every process computes the same name from process 0's clock; returns the new path."""
        stamp = int(exchange_json({"t": int(time.time())} if jax.process_index() == 0 else {})["t"])
        aside = self.directory / f"{step}.unreadable-{stamp}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxinfra-checkpoint-aside-{step}")
        self.manager.reload()
        return aside

    def close_within(self, timeout_s: float) -> None:
        """close() for a multi-process run that is failing: a pending save commits only once every
        process reaches Orbax's barriers, so with a peer gone close() would block until the
        coordination service gives up on it (~90 s). Give it `timeout_s`, then leave the save
        uncommitted (the last committed step is kept; restore never picks an uncommitted one)."""
        failure: list[BaseException] = []

        def close() -> None:
            try:
                self.close()
            except BaseException as e:  # noqa: BLE001 - reported from the caller's thread
                failure.append(e)

        closer = threading.Thread(target=close, name="jaxinfra-checkpoint-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            raise TimeoutError(f"the checkpoint being saved did not commit within {timeout_s:g}s (a peer process is "
                               f"likely gone); it is left uncommitted and the last committed step is kept")
        if failure:
            raise failure[0]

    def close(self) -> None:
        """Wait for the pending save (CheckpointWriteError if it failed), then release Orbax's threads
        and files; safe to call again, and after a failure (the manager is closed all the same)."""
        try:
            self.wait()
        finally:
            if self.manager is not None:
                manager, self.manager = self.manager, None
                try:
                    manager.close()
                except Exception:  # after a failed write Orbax re-raises it here; reported above
                    if not self._failed:
                        raise
                finally:
                    logging.getLogger("absl").removeFilter(self._quiet)
                    self._remove_failed_writes()

    def _remove_failed_writes(self) -> None:
        """After a failed save, its `<step>.orbax-checkpoint-tmp` (a full disk gets the space back). One
        local process only, its threads closed; elsewhere (and if a late write races this) the next
        start's cleanup removes it."""
        if self._failed and not self.read_only and jax.process_count() == 1 and not storage.is_url(self.directory):
            for partial in pathlib.Path(self.directory).glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)


def _absolute(directory: str | os.PathLike) -> Any:
    """An absolute local path (Orbax refuses relative ones), or an epath.Path for a gs:// / s3:// URL
    (absolute() would make it a local path under the working directory)."""
    if storage.is_url(directory):
        storage.install_orbax_s3()  # before any manager is made on it
        return storage.as_path(directory)
    return pathlib.Path(directory).absolute()


def _checkpoints_dir(directory: str | pathlib.Path) -> tuple[pathlib.Path, int | None]:
    """(checkpoints directory, one step or None) for a run dir, its checkpoints/, or one step dir.

    Absolute: Orbax refuses relative paths (`jaxinfra generate runs/x` read none and called them unreadable)."""
    directory = _absolute(directory)
    if (directory / "checkpoints").is_dir():
        return directory / "checkpoints", None
    if directory.name.isdigit() and (directory / "state").is_dir():  # RUN/checkpoints/N
        return directory.parent, int(directory.name)
    return directory, None


def is_params_only(directory: str | pathlib.Path) -> bool:
    """Whether the newest checkpoint under `directory` holds params alone (e.g. an HF import: its
    meta says params_only), so a full restore cannot work and a params restore is what is meant."""
    root, step = _checkpoints_dir(directory)
    steps = [step] if step is not None else sorted(committed_steps(root), reverse=True)
    for s in steps:
        meta = root / str(s) / "meta" / "metadata"
        if meta.is_file():
            try:
                return bool(json.loads(meta.read_text()).get("params_only", False))
            except (OSError, ValueError):
                return False
    return False


def restore_params(directory: str | pathlib.Path, target_params: Any, step: int | None = None,
                   config: dict[str, Any] | None = None, optional: Any = None) -> tuple[int, Any]:
    """The model's variables (params and stats, jaxinfra/state.py model_state) only, from the newest
    readable checkpoint under `directory` (a run dir, its checkpoints/, or one step directory
    RUN/checkpoints/N), or from checkpoint `step` alone.

    Like `Checkpointer.restore_latest`: params of other shapes raise CheckpointFitError (naming the
    differing keys of `config`, the current resolved config as a dict); an unreadable checkpoint is
    reported and the previous one tried (left in place: this path only reads).

    `optional`: an nnx filter of variables the checkpoint may lack altogether (LoRA adapters over a base
    saved without them): when none of them is saved they are left out of the result, for the caller to
    initialise; when some are, every one must fit like the rest."""
    directory, only_step = _checkpoints_dir(directory)  # absolute: Orbax refuses relative paths
    step = only_step if step is None else step
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    _silence_async_noise()
    with _quiet_orbax():  # read_only=True makes Orbax log "Given directory is read only" even when it is not
        manager = ocp.CheckpointManager(directory, item_names=("state", "data", "meta"),
                                        options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    steps = sorted(committed_steps(directory, warn=step is None), reverse=True)
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"no committed checkpoint {step} under {directory} (have: {sorted(steps)})")
        steps = [step]
    failed: Exception | None = None
    for step in steps:
        try:
            item = _model_items(directory / str(step), _present(directory / str(step), target_params, optional))
            check_fits(directory / str(step), item, config, item_prefix=("params/", "stats/"))
            with _quiet_orbax():
                restored = manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=item,
                        restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), item),
                        partial_restore=True)))
            return step, nnx.merge_state(*restored["state"].values())
        except CheckpointFitError:
            raise
        except Exception as e:  # noqa: BLE001 - any read error: this checkpoint is damaged, try the previous
            print(f"jaxinfra: warning: checkpoint {directory / str(step)} is unreadable ({_reason(e)}); "
                  f"trying the previous one", flush=True)
            failed = failed or e
    if not steps:
        raise CheckpointError(f"no committed checkpoint under {directory}")
    # Bad input here (exit 2), unlike a training run's own checkpoints (CheckpointReadError, exit 74): a
    # reading command was given a checkpoint it cannot use, and nothing of the user's is at stake.
    raise CheckpointError(f"no readable checkpoint under {directory} ({len(steps)} tried; newest: "
                          f"{_reason(failed)}); nothing was changed")


def _present(step_dir: pathlib.Path, variables: Any, optional: Any) -> Any:
    """`variables` without those matching `optional` when the checkpoint holds none of them."""
    if optional is None:
        return variables
    maybe, rest = nnx.split_state(variables, optional, ...)
    if not jax.tree.leaves(maybe):
        return variables
    saved = _saved_shapes(step_dir)
    names = [f"params/{k}" for k in ocp.tree.to_flat_dict(maybe, sep="/")]
    return variables if any(n in saved for n in names) else rest


def _pre_stats_target(step_dir: pathlib.Path, target: TrainState) -> dict[str, Any] | None:
    """The restore target in the layout before Stats (router bias, amax histories) left the params,
    when `step_dir` holds that layout and it fits the target but for the Stats' optimizer moments;
    None otherwise (a current checkpoint, or one that does not fit: `check_fits` says why)."""
    stats = ocp.tree.to_flat_dict(target.stats, sep="/")
    if not stats or jax.tree.leaves(target.ext):
        return None
    saved = _saved_shapes(step_dir)
    if any(k.startswith("stats/") for k in saved):
        return None
    legacy = {"step": target.step, "params": nnx.merge_state(target.params, target.stats),
              "opt_state": target.opt_state}
    wanted = {k: tuple(v.shape) for k, v in ocp.tree.to_flat_dict(legacy, sep="/").items()}
    if any(saved.get(k) != v for k, v in wanted.items()):
        return None
    extra = [k for k in saved if k not in wanted]
    if not all(k.startswith("opt_state/") and k.endswith(tuple("/" + s for s in stats)) for k in extra):
        return None
    return legacy


def _model_items(step_dir: pathlib.Path, variables: Any) -> dict[str, Any]:
    """The saved items holding a model's variables: `params` and `stats` (models/stat.py), or, in a
    checkpoint written before Stats left the params (router bias, amax histories under `params/`),
    `params` alone with every variable."""
    params, stats = split_model_state(variables)
    if not jax.tree.leaves(stats):
        return {"params": params}
    if any(k.startswith("stats/") for k in _saved_shapes(step_dir)):
        return {"params": params, "stats": stats}
    return {"params": variables}


def export_params(run_dir: str | pathlib.Path, out: str | pathlib.Path, dtype: str | None = None,
                  overwrite: bool = False) -> pathlib.Path:
    """Write the newest readable checkpoint's params alone (optionally cast) to `out`, for inference.

    The run's own config.yaml gives the shapes; arrays are restored unsharded onto one
    device. The result is a plain Orbax PyTree checkpoint of the params' nnx.State, built beside
    `out` and renamed into place (jaxinfra/atomic.py): an existing `out` is refused unless `overwrite`.
    """
    import jax.numpy as jnp

    from jaxinfra.config import load_config
    from jaxinfra.state import abstract_params
    from sharding.mesh import MeshConfig, make_mesh

    run_dir = pathlib.Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise CheckpointError(f"{run_dir} has no config.yaml: is it a jaxinfra run directory?")
    cfg = load_config(str(cfg_path))
    out = pathlib.Path(out).absolute()
    atomic.check_output(out, overwrite, directory=True, inputs=[run_dir])  # before the restore
    target = abstract_params(cfg.model, make_mesh(MeshConfig(), jax.local_devices()[:1]), quant=cfg.quant,
                             lora=cfg.lora)
    _, params = restore_params(run_dir, target)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
    with atomic.atomic_dir(out, replace=overwrite, inputs=[run_dir]) as tmp:
        checkpointer = ocp.StandardCheckpointer()
        with _orbax_write(tmp, checkpointer.close, shown=out):
            checkpointer.save(tmp, params, force=True)  # force: `tmp` is ours, made empty by atomic_dir
            checkpointer.wait_until_finished()
        checkpointer.close()
    return out


def save_params_only(out: str | pathlib.Path, cfg: Any, params: Any, meta: dict[str, Any], step: int = 0, *,
                     overwrite: bool = False, inputs: Sequence[Any] = (),
                     extra_files: Callable[[Any], None] | None = None) -> pathlib.Path:
    """OUT/config.yaml and OUT/checkpoints/<step>: a params-only run directory (an HF import, a
    `jaxinfra quantize` output) in this module's item layout; `meta` should say params_only.

    OUT is built in a temporary sibling and renamed into place whole (jaxinfra/atomic.py): an existing
    OUT is refused unless `overwrite`, and must not be or hold one of the command's `inputs`.
    `extra_files(dir)` writes the output's other files (an import's tokenizer) into the build directory."""
    with atomic.atomic_dir(out, replace=overwrite, inputs=inputs) as tmp:
        if extra_files is not None:
            extra_files(tmp)
        _write_params_only(tmp, cfg, params, meta, step)
    return _absolute(out) / "checkpoints" / str(step)


def _write_params_only(out: Any, cfg: Any, params: Any, meta: dict[str, Any], step: int) -> None:
    """Into `out`, the build directory of save_params_only (renamed into place whole, so plain writes)."""
    ckpt_dir = _absolute(out / "checkpoints")
    (out / "config.yaml").write_text(cfg.to_yaml())
    # Orbax copies arrays to the host before writing them; by default all at once (a full host copy
    # of the model). Bounding the copies in flight to the largest parameter (at least 256 MiB) keeps
    # the host to about one tensor at a time. Same PyTree format as StandardSave.
    params, stats = split_model_state(params)  # the items a TrainState has (Stats beside the params)
    items = {"params": params, **({"stats": stats} if jax.tree.leaves(stats) else {})}
    largest = max(x.nbytes for x in jax.tree.leaves(params))
    budget = (max(largest, 2**28) + 2**20) / 10**9  # the limiter refuses a single array above its budget
    handler = ocp.PyTreeCheckpointHandler(save_device_host_concurrent_gb=budget, save_concurrent_gb=budget)
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(create=True,
                                                                               **storage.orbax_options(ckpt_dir)),
                                    item_names=("state", "data", "meta"), item_handlers={"state": handler})
    with _orbax_write(ckpt_dir / str(step), manager.close):
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(items),
                                                   meta=ocp.args.JsonSave({**meta, "config": cfg.to_yaml()})))
        manager.wait_until_finished()
    manager.close()
