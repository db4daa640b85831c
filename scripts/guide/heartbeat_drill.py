"""The JAX coordination service's heartbeat: what a survivor of a dead peer sees when no collective fails.

    python scripts/guide/heartbeat_drill.py [--heartbeat-timeout 5]

Starts 2 plain JAX processes on this machine joined by `jax.distributed.initialize` (process 0
hosts the coordination service), with `heartbeat_timeout_seconds` set low (jax's default is
100 s). Process 1 is killed with SIGKILL; process 0 then just waits, the way a survivor blocked
inside an NCCL all-reduce waits (over gloo, the CPU collectives, a dead peer's closed socket fails
the survivor's collective at once instead, see page 15). The script prints how long process 0
lived after the kill, its exit status and the last line it wrote: the coordination service's
verdict.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfra.launch import free_port


def child(port: int, process_id: int, heartbeat_s: int) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               heartbeat_timeout_seconds=heartbeat_s, cluster_detection_method="deactivate")
    print("ready", flush=True)
    time.sleep(3600)  # the survivor's stand-in for a collective that never returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heartbeat-timeout", type=int, default=5)
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.heartbeat_timeout)
    import inspect

    import jax

    default = inspect.signature(jax.distributed.initialize).parameters["heartbeat_timeout_seconds"].default
    print(f"jax {jax.__version__}: jax.distributed.initialize(heartbeat_timeout_seconds={default}) by default")
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--heartbeat-timeout", str(args.heartbeat_timeout),
                               "--child", str(port), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:  # both have joined the service
        assert p.stdout.readline().strip() == "ready"
    killed_at = time.monotonic()
    procs[1].kill()
    print(f"both processes joined (heartbeat_timeout_seconds={args.heartbeat_timeout}); killed process 1 (SIGKILL)")
    try:
        out, _ = procs[0].communicate(timeout=args.heartbeat_timeout * 10 + 30)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        raise SystemExit("process 0 is still waiting: no heartbeat verdict") from None
    lines = [ln for ln in out.splitlines() if ln.strip()]
    print(f"process 0 ended {time.monotonic() - killed_at:.0f}s after the kill, exit status {procs[0].returncode}")
    at = next((i for i, ln in enumerate(lines) if "Terminating process" in ln), None)
    if at is None:
        print("process 0:", lines[-1] if lines else "(no output)")
        return
    for ln in lines[at:at + 3]:  # the verdict, the unhealthy task (its process id) and the advice
        print("process 0:", ln[ln.find("Terminating"):] if "Terminating" in ln else ln.strip())


if __name__ == "__main__":
    main()
