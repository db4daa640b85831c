"""Exit statuses of every jaxinfra command, in one place, and which errors are bad input.

    0   done
    2   bad input: a config, data, mesh, checkpoint or run-directory problem, or an output path that holds
        something already (jaxinfra/atomic.py: `--overwrite` replaces it), told in one line
    3   diverged: at a log step (every `log.every` steps), at least `train.max_bad_steps`
        consecutive steps were non-finite (flags are read only at log steps: no per-step sync)
    70  hung, or a peer process lost (the watchdog, a failed collective)
    74  a write failed: a checkpoint (disk full, no permission, an object-store error) or the run
        dir (disk full); one line names the step and the path. The previous committed
        checkpoint is intact; free space (or fix the path) and rerun the same command to resume
    75  preempted: SIGTERM/SIGINT, a checkpoint committed; rerun the same command to resume (with
        checkpoint.enabled=false nothing was saved, the line says so, and a rerun starts over)
    130 interrupted outside training (Ctrl-C)
    141 the reader of stdout went away (`jaxinfra info | head`), as a death by SIGPIPE reads in a shell

A multi-process run gives every process the same meaning: a bad config or checkpoint is
exit 2 in each of them, and 70 is kept for real hangs and dead peers.

Launchers that retry should rerun 75 and 70 and never 2, 3 or 74: 2 and 3 fail the same way
again, and so does 74 until someone frees space or fixes the path (BSD's EX_IOERR, sysexits.h).
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_HUNG = 70  # EX_SOFTWARE
EXIT_WRITE_FAILED = 74  # EX_IOERR: needs a person (space, permissions) before a rerun can succeed
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

    return (ConfigError, DataError, MeshError, DistributedError, CheckpointError, StorageError, OutputExistsError)


def write_errors() -> tuple[type[Exception], ...]:
    """The exception types that mean "a write failed" (exit EXIT_WRITE_FAILED with their one-line message).

    Lazy like `bad_input_errors`. A checkpoint that could not be written is `CheckpointWriteError`;
    `is_write_failure` covers the run dir's own small files (metrics, config.yaml) on a full disk.
    """
    from jaxinfra.checkpoint import CheckpointWriteError

    return (CheckpointWriteError,)


# errno values that say the storage refused a write, not that the input was wrong.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def is_write_failure(error: BaseException) -> bool:
    """An OSError from a full, read-only or failing disk (the run dir's files, not a checkpoint)."""
    return isinstance(error, OSError) and error.errno in _WRITE_ERRNOS


def write_failure_line(error: OSError) -> str:
    """The one line for `is_write_failure` errors (no traceback: the cause is the storage, not the code)."""
    where = f": {error.filename}" if error.filename else ""
    return (f"a write failed ({error.strerror or error}{where}); free space or fix the path, then rerun the same "
            f"command (a training run resumes from its last committed checkpoint)")
