"""`jaxinfra launch --local-processes N -- train ...`: N cooperating processes on this machine.

For testing multi-host code paths without a cluster: each child is
`python -m jaxinfra <command...>` with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID set, `--devices-per-process` fake CPU devices, and CPU collectives over
gloo. Output lines are prefixed with the process id. If one child fails, the others
are stopped, and the launcher exits with the first failure's status.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time


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


def launch_local(command: list[str], num_processes: int, devices_per_process: int = 1,
                 timeout_s: float | None = None) -> int:
    """Run `python -m jaxinfra *command` as num_processes processes; returns the exit status."""
    if num_processes < 1:
        raise ValueError(f"--local-processes={num_processes}: must be >= 1")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxinfra", *command], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=child_env(i, num_processes, port, devices_per_process),
                              text=True)
             for i in range(num_processes)]
    selector = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        selector.register(p.stdout, selectors.EVENT_READ, i)
    status = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    open_streams = len(procs)
    while open_streams:
        if deadline is not None and time.monotonic() > deadline:
            status = status or 124
            break
        for key, _ in selector.select(timeout=1.0):
            line = key.fileobj.readline()
            if not line:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            sys.stdout.write(f"[{key.data}] {line}")
        for p in procs:
            if p.poll() not in (None, 0) and not status:
                status = p.returncode  # first failure: stop the others so nobody waits forever
                for other in procs:
                    if other.poll() is None:
                        other.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        status = status or p.returncode
    return status
