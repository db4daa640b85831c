"""The run directory: checked before anything compiles, and held by one live run at a time.

`check_run_dir` turns the ordinary mistakes (a path under a regular file, `checkpoints`
existing as a file) into one-line errors. `RunDirLock` is a lock file naming the host and
pid of the run that uses the directory: a second `jaxinfra train` on it is refused while
that process lives, and a lock left by a process that died (SIGKILL, OOM, a node loss on
this host) is taken over with a one-line note. Only process 0 of a multi-process run
takes it; the others trust process 0. A run dir on a bucket gets `ObjectLock` instead (an object
refreshed while the run lives, taken over once stale).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import threading
import time
from typing import Any

from jaxinfra.config import ConfigError

LOCK_NAME = "jaxinfra.lock"


class RunDirError(ConfigError):
    """The run directory cannot be used (bad path, or another live run holds it)."""


def check_run_dir(run_dir: str | os.PathLike) -> pathlib.Path:
    """The run dir as a Path, or RunDirError if it, a parent or `checkpoints/` is a regular file."""
    run_dir = pathlib.Path(run_dir)
    for path in (run_dir, *run_dir.parents):
        if path.exists() and not path.is_dir():
            what = "the run directory" if path == run_dir else f"a parent of --run-dir {run_dir}"
            raise RunDirError(f"{path} is a regular file, not a directory ({what}); choose another --run-dir")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists() and not checkpoints.is_dir():
        raise RunDirError(f"{checkpoints} exists and is not a directory; move it aside or choose another --run-dir")
    return run_dir


def created_by_run(run_dir: str | os.PathLike) -> pathlib.Path | None:
    """What a run in `run_dir` would be the first to create: the topmost missing one of the run dir and its
    parents, else a missing `checkpoints/`; None when both exist. A failed start removes it again when it
    holds no file (`remove_empty`), so a refusal leaves no empty run dir behind and never touches one the
    user had."""
    run_dir = pathlib.Path(run_dir)
    missing = None
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            break
        missing = path
    if missing is None and not (run_dir / "checkpoints").exists():
        missing = run_dir / "checkpoints"
    return missing


def remove_empty(root: pathlib.Path) -> None:
    """Remove `root` and the directories under it, deepest first, each only if empty: a file anywhere
    keeps its directory and every one above it (os.rmdir refuses a non-empty directory)."""
    for directory, _, _ in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (Linux), so a recycled pid is not taken for the owner."""
    try:
        return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(owner: dict[str, Any]) -> bool:
    pid = int(owner.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    ticks = owner.get("start_ticks")
    return ticks is None or _start_ticks(pid) in (None, ticks)


class RunDirLock:
    """`run_dir/jaxinfra.lock` while a run uses the directory; `release()` removes it (idempotent)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = pathlib.Path(run_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        while not self._create(me):
            owner = self._read()
            if owner is None:
                continue  # released between our attempt and the read: try again
            if owner.get("pid") == os.getpid() and owner.get("host") == me["host"]:
                break  # this process already holds it (a second Trainer in the same process)
            if owner.get("pid") and owner.get("host") != me["host"]:
                raise RunDirError(f"{self.path.parent} is in use by pid {owner.get('pid')} on host {owner.get('host')} "
                                  f"since {owner.get('since')}; if that run is gone, delete {self.path}")
            if owner.get("pid") and _alive(owner):
                raise RunDirError(f"{self.path.parent} is in use by a live run (pid {owner.get('pid')} on this host, "
                                  f"since {owner.get('since')}); wait for it or choose another --run-dir")
            print(f"jaxinfra: note: {self.path} was left by pid {owner.get('pid')}, which is gone; taking it over",
                  flush=True)
            self.path.unlink(missing_ok=True)
        self.held = True

    def _create(self, me: dict[str, Any]) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return True

    def _read(self) -> dict[str, Any] | None:
        try:
            owner = json.loads(self.path.read_text() or "{}")
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            owner = {}
        return owner if isinstance(owner, dict) else {}

    def release(self) -> None:
        if self.held:
            owner = self._read() or {}
            if owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


class ObjectLock:
    """The run-dir lock of a run dir on a bucket (gs://, s3://): an object `RUN/jaxinfra.lock` naming the
    host, pid and start of the run, its `refreshed` time rewritten every `REFRESH_S` by a thread.

    A lock of this host's live process is refused at once. Another host's lock is watched: refreshed
    while we watch, its run is alive and we are refused (one line); not refreshed for `STALE_S` (its run
    was killed or its node lost; by its own clock, or failing that over our own watch, so clock skew
    between hosts cannot take a live lock) it is taken over with a one-line note. So a run requeued on
    another node after a node loss waits at most `STALE_S` and starts. An object store has no
    create-if-absent that every backend offers: this is read-then-write, and two runs started at the
    same moment on two hosts can both start; the one that then reads the other's lock at its next
    refresh stops with an error."""

    REFRESH_S = 30.0
    STALE_S = 90.0  # three missed refreshes

    def __init__(self, url: str):
        from jaxinfra import storage

        self.path = storage.as_path(url) / LOCK_NAME
        self.held = False
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # set by the refresher when another run took the lock

    def acquire(self) -> None:
        owner = self._read()
        if owner and not self._mine(owner):
            self._wait_until_stale(owner)
        self._write()
        self.held = True
        self._thread = threading.Thread(target=self._refresh, name="jaxinfra-lock-refresh", daemon=True)
        self._thread.start()

    def _wait_until_stale(self, owner: dict[str, Any]) -> None:
        """Return once `owner`'s lock is stale (noted in one line); RunDirError while its run lives."""
        here = owner.get("host") == self.me["host"]
        alive = here and _alive(owner)  # this host's process table answers at once
        age = time.time() - float(owner.get("refreshed", 0))
        watched = 0.0
        while not here and not alive and age < self.STALE_S and watched < self.STALE_S:
            if not watched:
                print(f"jaxinfra: note: {self.path} is held by pid {owner.get('pid')} on host {owner.get('host')} "
                      f"(refreshed {age:.0f}s ago); waiting up to {self.STALE_S - age:.0f}s to see whether that run "
                      f"is alive", flush=True)
            step = min(self.REFRESH_S / 3, self.STALE_S - watched)
            time.sleep(step)
            watched += step
            now = self._read()
            if not now:
                return  # released meanwhile
            alive = now.get("refreshed") != owner.get("refreshed") or now.get("pid") != owner.get("pid")
            age += step
        if alive:
            raise RunDirError(f"{self.path.parent} is in use by pid {owner.get('pid')} on host {owner.get('host')} "
                              f"since {owner.get('since')}; wait for it, choose another --run-dir, or delete "
                              f"{self.path} if that run is gone")
        print(f"jaxinfra: note: {self.path} was left by pid {owner.get('pid')} on host {owner.get('host')}, which "
              f"is gone (its lock was not refreshed for {self.STALE_S:.0f}s); taking it over", flush=True)

    def _mine(self, owner: dict[str, Any]) -> bool:
        return owner.get("host") == self.me["host"] and owner.get("pid") == self.me["pid"]

    def _write(self) -> None:
        self.path.write_text(json.dumps({**self.me, "refreshed": time.time()}))

    def _read(self) -> dict[str, Any] | None:
        for attempt in range(3):
            try:
                owner = json.loads(self.path.read_text() or "{}")
                break
            except FileNotFoundError:
                return None
            except ValueError:
                owner = {}
                break
            except OSError:  # s3fs FileExpired: the object was rewritten (refreshed) between its HEAD and GET
                if attempt == 2:
                    raise
                time.sleep(0.2)
        return owner if isinstance(owner, dict) else {}

    def _refresh(self) -> None:
        while not self._stop.wait(self.REFRESH_S):
            try:
                owner = self._read()
                if owner and not self._mine(owner):
                    self.lost = f"another run (pid {owner.get('pid')} on host {owner.get('host')}) took {self.path}"
                    return
                self._write()
            except Exception:  # noqa: BLE001 - a failed refresh is retried; the run itself reports storage errors
                continue

    def release(self) -> None:
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        owner = self._read() or {}
        if self._mine(owner):
            self.path.unlink(missing_ok=True)
        self.held = False
