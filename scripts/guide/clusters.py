"""Page 22 of the guide (clusters and storage): what each exit status makes each engine do, read from
the code and scripts that decide it, and a listing of a run directory in a bucket.

    python scripts/guide/clusters.py exits          # the exit-status table of docs/clusters.md, from the code
    python scripts/guide/clusters.py ls URL         # the objects under an s3:// or gs:// prefix, with sizes

`exits` reads each column from its source: the meanings from jaxinfra/exits.py's docstring, the
sweep's retry set from jaxinfra/cluster/attempts.py, the statuses `scripts/slurm/train.sbatch`
requeues from its requeue test, and the Job and JobSet rules from jaxinfra/cluster/jobset.py.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from jaxinfra import exits
from jaxinfra.cluster.attempts import RETRYABLE
from jaxinfra.cluster.jobset import failure_policy, pod_failure_policy
from jaxinfra.metrics.table import Column, format_table

REPO = pathlib.Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
STATUSES = (exits.EXIT_OK, exits.EXIT_BAD_INPUT, exits.EXIT_DIVERGED, exits.EXIT_HUNG, exits.EXIT_WRITE_FAILED,
            exits.EXIT_PREEMPTED)


def meanings() -> dict[int, str]:
    """status -> the first line of its meaning in jaxinfra/exits.py's docstring."""
    out = {}
    for line in (exits.__doc__ or "").splitlines():
        m = re.match(r"\s{4}(\d+)\s+(.*)", line)
        if m:
            out[int(m.group(1))] = re.split(r"[:(]", m.group(2))[0].strip()
    return out


def sbatch_requeued(text: str) -> set[int]:
    """The statuses train.sbatch requeues: those tested on the line that decides a requeue."""
    for line in text.splitlines():
        if line.startswith("if ") and "RESTARTS" in line:
            return {int(s) for s in re.findall(r'"\$STATUS" = (\d+)', line)}
    raise ValueError(f"{SBATCH}: no requeue test found")


def jobset_action(status: int) -> str:
    """What the generated JobSet does when a pod ends with `status` (the Job's rule, then the set's)."""
    if status == 0:
        return "completes"
    reason = "BackoffLimitExceeded"  # a counted failure with backoffLimit 0 (no rule, or a Count rule)
    for rule in pod_failure_policy()["rules"]:
        if status in rule["onExitCodes"]["values"] and rule["action"] == "FailJob":
            reason = "PodFailurePolicy"
    action = next(r["action"] for r in failure_policy(0)["rules"] if reason in r["onJobFailureReasons"])
    return {"FailJobSet": "fails the set", "RestartJobSet": "restarts every pod"}[action]


def exit_rows() -> list[list[object]]:
    names, requeued = meanings(), sbatch_requeued(SBATCH.read_text())
    rows = []
    for status in STATUSES:
        final = status == 0
        rows.append([status, names[status],
                     "-" if final else ("resubmit" if status in RETRYABLE else "no retry"),
                     "ends" if final else ("requeue" if status in requeued else "no requeue"),
                     jobset_action(status)])
    return rows


def cmd_ls(url: str) -> None:
    """Every object under the prefix, relative to it, with its size in bytes."""
    from jaxinfra.storage import filesystem

    fs, root = filesystem(url)
    rows = [[path[len(root):].lstrip("/"), int(info.get("size") or 0)]
            for path, info in sorted(fs.find(root, detail=True).items())]
    print(format_table(rows, [Column("object"), Column("bytes", ",", ">")]))
    print(f"{len(rows)} objects, {sum(r[1] for r in rows):,} bytes under {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("exits")
    sub.add_parser("ls").add_argument("url")
    args = parser.parse_args()
    if args.cmd == "exits":
        print(format_table(exit_rows(), [Column("status", align=">"), Column("meaning"), Column("sweep --wait"),
                                         Column("train.sbatch"), Column("JobSet")]))
    else:
        cmd_ls(args.url)


if __name__ == "__main__":
    main()
