"""`jaxinfra launch --local-processes N -- train ...`: N cooperating processes on this machine.

For testing multi-host code paths without a cluster: each child is
`python -m jaxinfra <command...>` with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID set, `--devices-per-process` fake CPU devices, and CPU collectives over
gloo. Output lines are prefixed with the process id. If one child fails, the others
are stopped, the launcher names the process that failed first on stderr and exits with
the most meaningful status (`most_meaningful_status`: never a stopped sibling's signal).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from jaxinfra.config import ConfigError
from jaxinfra.exits import EXIT_HUNG, EXIT_OK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(process_id: int, num_processes: int, port: int, devices_per_process: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env.update({
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": " ".join(flags),
        "PYTHONUNBUFFERED": "1",
    })
    return env


# A child killed by a signal (OOM killer, a node loss) cannot say why; its peers can (exit 70 once their
# collectives fail or their watchdog fires), so they get this long to report before they are stopped.
PEER_REPORT_GRACE_S = 60.0


def launch_local(command: list[str], num_processes: int, devices_per_process: int = 1,
                 timeout_s: float | None = None) -> int:
    """Run `python -m jaxinfra *command` as num_processes processes; returns the exit status."""
    for flag, n in (("--local-processes", num_processes), ("--devices-per-process", devices_per_process)):
        if n < 1:
            raise ConfigError(f"launch: {flag}={n} is invalid: must be >= 1")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxinfra", *command], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=child_env(i, num_processes, port, devices_per_process),
                              text=True)
             for i in range(num_processes)]
    ended, stopped, timed_out = _supervise(procs, timeout_s)
    failed = next(((i, s) for i, s in ended if s != EXIT_OK), None)
    if failed is not None:
        print(f"jaxinfra launch: process {failed[0]} failed first ({describe_status(failed[1])})"
              f"{'; stopped the others' if stopped else ''}", file=sys.stderr)
    status = most_meaningful_status([s for _, s in ended])
    return 124 if timed_out and status == EXIT_OK else status


def most_meaningful_status(statuses: Sequence[int]) -> int:
    """The launcher's exit status from the statuses of the processes that ended on their own (not
    stopped by the launcher), in the order they ended: the first real failure (2 stays 2);
    EXIT_HUNG only when no process said more, since a peer's loss follows another one's death;
    a death by signal (negative returncode) only when nothing else failed, as 128 + signal."""
    failures = [s for s in statuses if s > 0]
    first_real = next((s for s in failures if s != EXIT_HUNG), None)
    if first_real is not None:
        return first_real
    if failures:
        return EXIT_HUNG
    signals = [s for s in statuses if s < 0]
    return 128 - signals[0] if signals else EXIT_OK


def describe_status(status: int) -> str:
    """`exit 2`, or `killed by SIGKILL` for a negative returncode."""
    if status >= 0:
        return f"exit {status}"
    try:
        return f"killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"killed by signal {-status}"


def _supervise(procs: list[subprocess.Popen], timeout_s: float | None
               ) -> tuple[list[tuple[int, int]], set[int], bool]:
    """Relay the children's output, prefixed, until every stream closes; at the first failure stop
    the others (after PEER_REPORT_GRACE_S when the first was killed by a signal), so nobody waits
    forever on a dead peer. Returns ((process, status) of those that
    ended on their own, in the order seen; the processes stopped; whether the deadline passed)."""
    selector = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        selector.register(p.stdout, selectors.EVENT_READ, i)
    ended: list[tuple[int, int]] = []
    stopped: set[int] = set()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    open_streams, timed_out, grace_end = len(procs), False, 0.0
    while open_streams:
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            stopped |= _stop_running(procs)
            break
        for key, _ in selector.select(timeout=1.0):
            line = key.fileobj.readline()
            if not line:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            sys.stdout.write(f"[{key.data}] {line}")
        _record_ended(procs, ended, stopped)
        if not stopped and any(s > 0 for _, s in ended):
            stopped = _stop_running(procs)  # a child that said why it failed: nobody else need wait
        elif not stopped and any(s < 0 for _, s in ended):
            grace_end = grace_end or time.monotonic() + PEER_REPORT_GRACE_S
            if time.monotonic() > grace_end:
                stopped = _stop_running(procs)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    _record_ended(procs, ended, stopped)
    return ended, stopped, timed_out


def _record_ended(procs: list[subprocess.Popen], ended: list[tuple[int, int]], stopped: set[int]) -> None:
    seen = {i for i, _ in ended} | stopped
    ended.extend((i, p.returncode) for i, p in enumerate(procs) if i not in seen and p.poll() is not None)


def _stop_running(procs: list[subprocess.Popen]) -> set[int]:
    """SIGTERM to every child still running; their indices (their statuses then are the launcher's doing)."""
    running = {i for i, p in enumerate(procs) if p.poll() is None}
    for i in running:
        procs[i].terminate()
    return running
