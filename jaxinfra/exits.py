"""Exit statuses of every jaxinfra command, in one place, and which errors are bad input.

    0   done
    2   bad input: a config, data, mesh, checkpoint or run-directory problem, told in one line
    3   diverged: `train.max_bad_steps` consecutive non-finite steps
    70  hung, or a peer process lost (the watchdog, a failed collective)
    75  preempted: SIGTERM/SIGINT, a checkpoint committed; rerun the same command to resume
    130 interrupted outside training (Ctrl-C)
    141 the reader of stdout went away (`jaxinfra info | head`), as a death by SIGPIPE reads in a shell

A multi-process run gives every process the same meaning: a bad config or checkpoint is
exit 2 in each of them, and 70 is kept for real hangs and dead peers.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_HUNG = 70  # EX_SOFTWARE
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def bad_input_errors() -> tuple[type[Exception], ...]:
    """The exception types that mean "the user's input is wrong": exit 2 with their one-line message.

    Imported lazily so that `jaxinfra.exits` stays free of jax and the packages it would pull in.
    """
    from jaxinfra.checkpoint import CheckpointError
    from jaxinfra.config import ConfigError
    from jaxinfra.data import DataError
    from jaxinfra.distributed import DistributedError
    from sharding.mesh import MeshError

    return (ConfigError, DataError, MeshError, DistributedError, CheckpointError)
