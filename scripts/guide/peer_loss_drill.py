"""A failure drill: two training processes, one killed mid-run; what the survivor does, and the restart.

    python scripts/guide/peer_loss_drill.py RUN_DIR [--kill-after-checkpoint 10] [--stop] [KEY=VALUE ...]

Starts `jaxinfra train tiny --run-dir RUN_DIR` as 2 processes of one fake device each (the
environment `jaxinfra launch` gives its children: jaxinfra/launch.py: child_env), waits
until the checkpoint of step `--kill-after-checkpoint` is committed, SIGKILLs process 1 (a dead
peer, as the OOM killer or a lost node would leave it) or, with `--stop`, SIGSTOPs it (a stuck
peer: the process and its sockets stay open, it just never reaches the next collective), and
prints the lines the survivor wrote from then on that start with `jaxinfra` (its Python stacks
are left out here), its exit status, and how long it took to notice. A stopped peer is killed
once the survivor has exited. Set `train.step_timeout_s` low (the default is 30 minutes).
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxinfra.exits import EXIT_HUNG
from jaxinfra.launch import child_env, free_port


def _collect(proc: subprocess.Popen, sink: list[str]) -> None:
    for line in proc.stdout:
        sink.append(line.rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--kill-after-checkpoint", type=int, default=10, metavar="STEP")
    parser.add_argument("--stop", action="store_true", help="SIGSTOP process 1 instead of SIGKILL")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_intermixed_args()  # KEY=VALUE overrides may follow the options
    port, outputs = free_port(), [[], []]
    command = [sys.executable, "-m", "jaxinfra", "train", "tiny", "--run-dir", args.run_dir, "mesh.data=2",
               *args.overrides]
    procs = [subprocess.Popen(command, env=child_env(i, 2, port, 1), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    readers = [threading.Thread(target=_collect, args=(p, out), daemon=True) for p, out in zip(procs, outputs)]
    for r in readers:
        r.start()
    marker = pathlib.Path(args.run_dir) / "checkpoints" / str(args.kill_after_checkpoint) / "commit_success.txt"
    deadline = time.monotonic() + args.timeout
    while not marker.exists():
        if time.monotonic() > deadline or procs[0].poll() is not None:
            procs[1].kill()
            raise SystemExit(f"drill: no checkpoint {args.kill_after_checkpoint} appeared\n" + "\n".join(outputs[0]))
        time.sleep(0.05)
    seen = len(outputs[0])
    killed_at = time.monotonic()
    how = signal.SIGSTOP if args.stop else signal.SIGKILL
    procs[1].send_signal(how)
    print(f"checkpoint {args.kill_after_checkpoint} committed; {'stopped' if args.stop else 'killed'} process 1 "
          f"({how.name})")
    try:
        status = procs[0].wait(timeout=args.timeout)
    finally:
        procs[1].kill()  # a stopped process ends on SIGKILL too
        procs[1].wait()
    readers[0].join(timeout=10)
    for line in outputs[0][seen:]:
        if line.startswith("jaxinfra"):
            print(f"process 0: {line}")
    print(f"process 0 exited with status {status} ({'hung / peer lost' if status == EXIT_HUNG else 'see above'}) "
          f"{time.monotonic() - killed_at:.0f}s after the signal")


if __name__ == "__main__":
    main()
