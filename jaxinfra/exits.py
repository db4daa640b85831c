"""Exit statuses of every jaxinfra command, in one place, and which errors are bad input.

    0   done
    2   bad input: a config, data, mesh, checkpoint or run-directory problem, an output path that holds
        something already (jaxinfra/atomic.py: `--overwrite` replaces it), or an input file that cannot
        be decoded (a garbage model.safetensors: `CorruptFileError`), told in one line
    3   diverged: at a log step (every `log.every` steps), at least `train.max_bad_steps`
        consecutive steps were non-finite (flags are read only at log steps: no per-step sync)
    70  hung, or a peer process lost (the watchdog, a failed collective)
    74  an I/O failure (BSD's EX_IOERR): the storage refused a write or a read.
        A checkpoint write (disk full, no permission, an object-store error: one line names the
        step and the path; the previous committed checkpoint is intact), the run dir's own files
        (read-only, a directory where a file belongs), no readable checkpoint in a run dir
        (nothing is moved: rerun once the storage is back, or `train --allow-fresh-start`).
        Fix the storage or the path, then rerun the same command (a training run resumes from its
        last committed checkpoint)
    75  preempted: SIGTERM/SIGINT, a checkpoint committed; rerun the same command to resume (with
        checkpoint.enabled=false nothing was saved, the line says so, and a rerun starts over)
    130 interrupted outside training (Ctrl-C)
    141 the reader of stdout went away (`jaxinfra info | head`), as a death by SIGPIPE reads in a shell

A multi-process run gives every process the same meaning: a bad config or checkpoint is
exit 2 in each of them, and 70 is kept for real hangs and dead peers.

Launchers that retry should rerun 75 and 70 and never 2, 3 or 74: 2 and 3 fail the same way
again, and so does 74 until someone frees space or fixes the path (sysexits.h).

Every command's errors end in `jaxinfra.cli.main`: bad input (`bad_input_errors`) is exit 2, and
`io_failure_line` is the one place that says which other errors are I/O failures (exit 74) and
what their one line is.
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_HUNG = 70  # EX_SOFTWARE
EXIT_IO_FAILED = 74  # EX_IOERR: needs a person (space, permissions, a damaged file) before a rerun can succeed
EXIT_WRITE_FAILED = EXIT_IO_FAILED  # the name it had when only writes were counted
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def bad_input_errors() -> tuple[type[Exception], ...]:
    """The exception types that mean "the user's input is wrong": exit 2 with their one-line message.

    Imported lazily so that `jaxinfra.exits` stays free of jax and the packages it would pull in.
    """
    from jaxinfra.atomic import OutputExistsError
    from jaxinfra.checkpoint import CheckpointError
    from jaxinfra.config import ConfigError
    from jaxinfra.data import DataError
    from jaxinfra.distributed import DistributedError
    from jaxinfra.storage import StorageError
    from sharding.mesh import MeshError

    return (ConfigError, DataError, MeshError, DistributedError, CheckpointError, StorageError, OutputExistsError,
            CorruptFileError)


def write_errors() -> tuple[type[Exception], ...]:
    """The exception types whose message is already the one line of an I/O failure (exit 74):
    a checkpoint that could not be written (`CheckpointWriteError`) or read (`CheckpointReadError`).

    Lazy like `bad_input_errors`; `io_failure_line` covers these and every other I/O failure."""
    from jaxinfra.checkpoint import CheckpointReadError, CheckpointWriteError

    return (CheckpointWriteError, CheckpointReadError)


# errno values that say the storage refused a write or a read, or a path is not what it must be
# (a directory where a file belongs): the storage or the path needs a person, the code is not wrong.
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES,
                             errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY,
                             errno.ENAMETOOLONG, errno.ESTALE, errno.EMFILE, errno.EXDEV})
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_PERMISSION = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_KIND = frozenset({errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY})


class CorruptFileError(Exception):
    """An input file that holds data its format library cannot decode (a garbage or truncated
    model.safetensors), named by its path: bad input (exit 2), like an input JSON, YAML or .npy file
    that does not parse; raise it `from` the library's error."""

    def __init__(self, path: object, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path} could not be read ({reason}); it is damaged or not in the expected format: "
                         f"replace it")


def is_write_failure(error: BaseException) -> bool:
    """An OSError from a full, read-only or refusing disk, or a path of the wrong kind (not a bug)."""
    return isinstance(error, OSError) and error.errno in _STORAGE_ERRNOS


def write_failure_line(error: OSError) -> str:
    """The one line for `is_write_failure` errors (no traceback: the cause is the storage, not the code)."""
    where = f": {error.filename}" if error.filename else ""
    if error.filename2:
        where += f" -> {error.filename2}"
    fix = ("free space" if error.errno in _FULL else
           "fix the permissions or choose a writable path" if error.errno in _PERMISSION else
           "move what is there aside or choose another path" if error.errno in _KIND else "fix the path or the storage")
    return (f"I/O failed ({error.strerror or error}{where}); {fix}, then rerun the same command (a training run "
            f"resumes from its last committed checkpoint, if it has one)")


def io_failure_line(error: BaseException) -> str | None:
    """The one line for an I/O failure (exit EXIT_IO_FAILED), or None if `error` is not one (a bug:
    its traceback is wanted). The one place that decides; `jaxinfra.cli.main` and multi-process
    training use it."""
    if isinstance(error, write_errors()):
        return str(error)
    if is_write_failure(error):
        return write_failure_line(error)  # type: ignore[arg-type]
    return None
