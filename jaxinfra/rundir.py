"""The run directory: checked before anything compiles, and held by one live run at a time.

`check_run_dir` turns the ordinary mistakes (a path under a regular file, `checkpoints`
existing as a file) into one-line errors. `RunDirLock` is a lock file naming the host and
pid of the run that uses the directory: a second `jaxinfra train` on it is refused while
that process lives, and a lock left by a process that died (SIGKILL, OOM, a node loss on
this host) is taken over with a one-line note. Only process 0 of a multi-process run
takes it; the others trust process 0.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
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
