"""Failure paths: a run that fails inside a Python process leaves that process as it found it, and a
checkpoint the storage refuses ends the run in one line with exit 74, the last committed one intact.

In-process cases inject the failure (an OSError from Orbax's save, any error in the loop) or cap the
file size (RLIMIT_FSIZE, no root needed: Python ignores SIGXFSZ, so a write past it fails with
EFBIG in Orbax's background threads). The CLI case runs the run dir on a small tmpfs, as a user
would hit a full disk (root and mount(8) needed), and again under RLIMIT_FSIZE where it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import pathlib
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import uuid

import jax
import orbax.checkpoint as ocp
import pytest
from subprocs import cli_env, file_size_limit_restored

from jaxinfra.checkpoint import CheckpointWriteError, _DropLateWriteCallbacks, _write_reason
from jaxinfra.config import load_config
from jaxinfra.exits import EXIT_WRITE_FAILED
from jaxinfra.metrics import MetricsLogger
from jaxinfra.rundir import LOCK_NAME
from jaxinfra.train import Trainer, train

# tests/test_checkpoint.py's run (the compiled programs are shared through the persistent cache).
BASE = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=64",
        "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8",
        "train.eval_every=0", "log.every=1", "log.progress=false", "log.tensorboard=false", "mesh.data=1"]
TIMEOUT_S = 2.0  # the watchdog's limit in the in-process cases; each then outlives it


def cfg(*extra: str):
    return load_config("tiny", [*BASE, f"train.step_timeout_s={TIMEOUT_S}", *extra])


def _caller_handler(signum, frame) -> None:  # the handler an in-process caller (a sweep) had set
    pass


@pytest.fixture
def caller_handlers():
    """Install the caller's own SIGTERM/SIGINT handler; after the test put pytest's back."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, _caller_handler)
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _assert_left_clean(run_dir: pathlib.Path) -> None:
    """The trainer gave back all it took: handlers, watchdog, lock; and this process outlives the
    watchdog's timeout (an armed watchdog would os._exit(70) it, ending pytest mid-test)."""
    assert signal.getsignal(signal.SIGTERM) is _caller_handler
    assert signal.getsignal(signal.SIGINT) is _caller_handler
    assert not (run_dir / LOCK_NAME).exists()
    time.sleep(TIMEOUT_S + 1.5)
    assert not [t for t in threading.enumerate() if t.name == "jaxinfra-watchdog"]


def _disk_full_on_save(self, step, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory / str(step)))


def test_disk_full_at_the_first_checkpoint_raises_and_leaves_the_caller_intact(tmp_path, caller_handlers,
                                                                                monkeypatch):
    monkeypatch.setattr(ocp.CheckpointManager, "save", _disk_full_on_save)
    with pytest.raises(CheckpointWriteError) as caught:
        train(cfg("train.steps=3", "checkpoint.every=2"), tmp_path, jax.devices()[:1])
    e = caught.value
    assert (e.step, e.path, e.committed) == (2, tmp_path.absolute() / "checkpoints" / "2", None)
    assert e.reason == "No space left on device" and isinstance(e.__cause__, OSError)
    assert "checkpoint step 2 could not be written to" in str(e) and "\n" not in str(e)
    assert str(pickle.loads(pickle.dumps(e))) == str(e)  # sweeps' worker pools send errors back pickled
    _assert_left_clean(tmp_path)


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_an_error_in_the_loop_is_raised_as_is_and_everything_is_closed(tmp_path, caller_handlers, monkeypatch,
                                                                          error):
    """The original error reaches the caller even when a closer fails too (it becomes a note)."""
    def fail_at_step_2(self, loop, step, metrics):
        if step == 2:
            raise error

    closed = []
    monkeypatch.setattr(Trainer, "_log_point", fail_at_step_2)
    monkeypatch.setattr(MetricsLogger, "close", lambda self, *outcome: closed.append(self) or 1 / 0)
    with pytest.raises(type(error)) as caught:
        train(cfg("train.steps=4", "checkpoint.every=1"), tmp_path, jax.devices()[:1])
    assert caught.value is error and closed
    assert any("closing the metrics failed too: ZeroDivisionError" in n for n in caught.value.__notes__)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]  # step 1's save committed
    _assert_left_clean(tmp_path)


LIMIT = 200 * 1024  # bytes per file: a checkpoint's data file is ~400 KB; config.yaml and metrics lines fit



def test_an_async_write_failure_surfaces_at_the_next_save_naming_its_step(tmp_path, caller_handlers, monkeypatch):
    """Orbax writes in the background: step 2's failure is reported when step 4 is saved (first the
    step-2 save has to start, after the compile, so the limit is set there and not before)."""
    original = Trainer.save

    def save_under_limit(self, step, *args, **kwargs):
        if step == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(Trainer, "save", save_under_limit)
    with file_size_limit_restored(), pytest.raises(CheckpointWriteError) as caught:
        train(cfg("train.steps=4", "checkpoint.every=2", "checkpoint.keep=5"), tmp_path, jax.devices()[:1])
    assert (caught.value.step, caught.value.reason, caught.value.committed) == (2, "File too large", None)
    assert not list(tmp_path.glob("checkpoints/*"))  # no step listed, and the failed tmp dir removed
    _assert_left_clean(tmp_path)


@pytest.mark.parametrize("error, reason", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/2/x"), "No space left on device"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES)), "Permission denied"),
    (ValueError("RESOURCE_EXHAUSTED: Error writing ... Failed to write 386365 bytes to file 5: No space left on "
                "device [os_error_code='28']"), "No space left on device"),  # what tensorstore raises
    (RuntimeError("write failed"), "No space left on device"),  # chained: the OSError is the cause (below)
    (ConnectionError("503 Service Unavailable: gs://bucket/run/checkpoints/2\ndetails..."),
     "ConnectionError: 503 Service Unavailable: gs://bucket/run/checkpoints/2"),  # an object store's refusal
], ids=["oserror", "permission", "tensorstore", "chained", "object-store"])
def test_the_reason_is_what_the_storage_said(error, reason):
    if str(error) == "write failed":
        error.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert _write_reason(error) == reason


def test_late_write_callbacks_on_a_closed_loop_are_not_printed():
    """What tensorstore's remaining writes do after Orbax's loop closed on the first failure."""
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError) as late:
        loop.call_soon_threadsafe(print)
    other = RuntimeError("Event loop is closed")  # same text, raised elsewhere: still printed
    seen = []
    hook = _DropLateWriteCallbacks(seen.append)
    for error in (late.value, other):
        hook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=error, exc_traceback=error.__traceback__,
                                   err_msg=None, object=None))
    assert [u.exc_value for u in seen] == [other]


# ------------------------------------------------------------------ the CLI on a full disk

CLI = [*BASE, "checkpoint.every=5", "checkpoint.keep=5"]


# `python -m jaxinfra` with a file size cap set first (a preexec_fn would fork this threaded process).
CAPPED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({0}, {0})); "
          "sys.argv[0] = 'jaxinfra'; runpy.run_module('jaxinfra', run_name='__main__')")


def _cli(run_dir: pathlib.Path, steps: int, max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    python = [sys.executable, "-m", "jaxinfra"] if max_file_bytes is None else [
        sys.executable, "-c", CAPPED.format(max_file_bytes)]
    return subprocess.run([*python, "train", "tiny", "--run-dir", str(run_dir), *CLI, f"train.steps={steps}"],
                          env=cli_env(1), capture_output=True, text=True, timeout=600)


def _committed(run_dir: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _assert_fails_in_one_line(proc: subprocess.CompletedProcess, run_dir: pathlib.Path, reason: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == EXIT_WRITE_FAILED and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == (f"jaxinfra: error: checkpoint step 10 could not be written to {run_dir}/checkpoints/10 "
                        f"({reason}); the last committed checkpoint, step 5, is intact; free space or fix the "
                        f"path, then rerun the same command to resume")
    assert _committed(run_dir) == [5]  # step 10's partial write is in a tmp dir, never "latest"


def _resumes_from_5(run_dir: pathlib.Path) -> None:
    proc = _cli(run_dir, 10)
    assert proc.returncode == 0 and "resumed at step 5" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _committed(run_dir) == [5, 10]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]  # the rerun cleaned up


@contextlib.contextmanager
def small_filesystem(size: str):
    """A tmpfs of `size` mounted for the test; skips where this process may not mount."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root and mount(8); "
                    "test_cli_file_size_limit_fails_in_one_line_and_resumes covers the same without them")
    where = pathlib.Path("/tmp") / f"jaxinfra-full-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"mount not permitted here ({done.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


def _fill(where: pathlib.Path, leave: int) -> pathlib.Path:
    """Fill the filesystem but `leave` bytes (room for metrics lines, not for a checkpoint)."""
    filler = where / "filler"
    free = shutil.disk_usage(where).free - leave
    with open(filler, "wb") as f:
        f.write(b"\0" * max(free, 0))
    return filler


def test_cli_on_a_full_disk_fails_in_one_line_and_resumes_once_space_is_freed():
    with small_filesystem("8m") as fs:
        run_dir = fs / "run"
        assert _cli(run_dir, 5).returncode == 0 and _committed(run_dir) == [5]
        filler = _fill(fs, leave=128 * 1024)
        _assert_fails_in_one_line(_cli(run_dir, 10), run_dir, "No space left on device")
        filler.unlink()
        _resumes_from_5(run_dir)


def test_cli_file_size_limit_fails_in_one_line_and_resumes(tmp_path):
    """The same story without root: RLIMIT_FSIZE in the child makes every checkpoint write fail (EFBIG)."""
    run_dir = tmp_path / "run"
    assert _cli(run_dir, 5).returncode == 0 and _committed(run_dir) == [5]
    _assert_fails_in_one_line(_cli(run_dir, 10, max_file_bytes=LIMIT), run_dir, "File too large")
    _resumes_from_5(run_dir)


def test_orphan_write_futures_of_orbax_are_dropped_and_others_kept():
    """asyncio's "exception was never retrieved" pages for Orbax's other failed array writes (a Task or
    a _GatheringFuture, collected whenever) are noise once CheckpointWriteError is raised; others pass."""
    from jaxinfra.checkpoint import _DropOrphanWriteTasks

    try:
        raise ValueError("RESOURCE_EXHAUSTED: Error writing in OCDBT database at /r/10.orbax-checkpoint-tmp/")
    except ValueError as e:
        orbax_error = e
    cases = [("_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished>",
              (ValueError, orbax_error, orbax_error.__traceback__), False),
             ("Task exception was never retrieved\nfuture: <Task coro=<f() defined at /x/y.py>>",
              (ValueError, ValueError("mine"), None), True),
             ("Unclosed client session", None, True)]
    for message, exc_info, kept in cases:
        record = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, message, None, exc_info)
        assert _DropOrphanWriteTasks().filter(record) is kept, message
