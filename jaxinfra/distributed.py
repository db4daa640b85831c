"""Multi-process start-up: `jax.distributed.initialize` from flags, environment or the cluster.

Order of precedence: explicit `--coordinator/--num-processes/--process-id` flags, then
`JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, then jax's own
auto-detection, tried only where `_cluster_detected` recognises a cluster: a SLURM job
with more than one task (`SLURM_JOB_ID` set, `SLURM_NTASKS` > 1) or a multi-host TPU slice
(`TPU_WORKER_HOSTNAMES` naming two or more hosts). Under `srun` the group comes from SLURM's
step variables (`slurm_group`): coordinator = the step's first node, process id =
SLURM_PROCID; each task sees all of its node's accelerators when it is the node's only task
(jax's own detection would narrow it to device SLURM_LOCALID) and device SLURM_LOCALID when
the node runs one task per device. Anything else, Kubernetes included, sets
the JAX_* variables (scripts/k8s/train-indexed-job.yaml does). A plain single machine
initialises nothing. `exchange_json` shares small per-process dicts once the group is up.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from sharding.ranges import Range


class DistributedError(RuntimeError):
    """Start-up of the process group failed; one line naming the coordinator and processes."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str | None
    num_processes: int | None
    process_id: int | None

    @property
    def explicit(self) -> bool:
        return self.coordinator is not None


def from_flags_and_env(coordinator: str | None = None, num_processes: int | None = None,
                       process_id: int | None = None) -> ProcessGroup:
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = _env_int("JAX_NUM_PROCESSES", Range(1))
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = _env_int("JAX_PROCESS_ID", Range(0))
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise DistributedError(f"process id {process_id} is invalid: must be in [0, {num_processes - 1}] for "
                               f"{num_processes} processes (--process-id / JAX_PROCESS_ID)")
    return ProcessGroup(coordinator, num_processes, process_id)


def _env_int(name: str, allowed: Range) -> int:
    """An integer environment variable in its range (the flag's twin: --num-processes, --process-id)."""
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not allowed.holds(value):
        raise DistributedError(f"{name}={text!r} is invalid: must be an integer {allowed.describe()}")
    return value


def _cluster_detected() -> bool:
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return True
    if env.get("TPU_WORKER_HOSTNAMES", "").count(",") >= 1:  # multi-host TPU slice
        return True
    return False


def initialize(group: ProcessGroup, timeout_s: int = 300) -> None:
    """Join the process group (or do nothing on a single machine)."""
    if group.explicit:
        if group.num_processes is None or group.process_id is None:
            raise DistributedError(
                f"coordinator {group.coordinator} given, but --num-processes and --process-id "
                f"(or JAX_NUM_PROCESSES / JAX_PROCESS_ID) are missing")
        if group.num_processes == 1:
            return
        try:
            jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.num_processes,
                                       process_id=group.process_id, initialization_timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - jax raises XlaRuntimeError / RuntimeError with long texts
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistributedError(
                f"process {group.process_id} of {group.num_processes} could not join coordinator "
                f"{group.coordinator} within {timeout_s}s: {first}") from None
        return
    slurm = slurm_group()
    if slurm is not None:
        group, local_devices = slurm
        jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.num_processes,
                                   process_id=group.process_id, local_device_ids=local_devices,
                                   cluster_detection_method="deactivate", initialization_timeout=timeout_s)
    elif _cluster_detected():
        jax.distributed.initialize(initialization_timeout=timeout_s)


def slurm_group() -> tuple[ProcessGroup, list[int] | None] | None:
    """The process group of an `srun` step with more than one task, and the local device ids
    (None: all of the node's devices); None outside such a step."""
    env = os.environ
    names = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if not all(env.get(k) for k in names) or int(env["SLURM_NTASKS"]) < 2:
        return None
    from jax._src.clusters.slurm_cluster import SlurmCluster  # the nodelist parsing and port rule

    coordinator = SlurmCluster.get_coordinator_address(None, env.get("JAX_COORDINATOR_PORT"))
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    one_per_node = int(env["SLURM_NTASKS"]) <= nodes
    local = None if one_per_node else [int(env["SLURM_LOCALID"])]
    return ProcessGroup(coordinator, int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])), local


def exchange_json(local: dict[str, Any]) -> dict[str, Any]:
    """Merge small per-process dicts so every process holds the union (JSON through uint8 arrays)."""
    if jax.process_count() == 1:
        return dict(local)
    blob = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([blob.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    gathered = multihost_utils.process_allgather(padded)
    merged: dict[str, Any] = {}
    for row, size in zip(gathered, sizes.reshape(-1)):
        merged.update(json.loads(bytes(row[: int(size)]).decode()))
    return merged
