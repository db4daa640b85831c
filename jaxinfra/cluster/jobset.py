"""Kubernetes JobSet manifests, as plain dicts: one multi-host run, or one JobSet per run of a sweep.

A JobSet (jobset.x-k8s.io/v1alpha2, https://github.com/kubernetes-sigs/jobset) here holds one
replicated job, `train`, of one Indexed Job with N pods: pod i is jax process i. With
`network.enableDNSHostnames` the JobSet controller makes a headless Service named after the JobSet,
so pod 0 is reachable as `<name>-train-0-0.<name>` (pod names are `<jobset>-<replicatedJob>-<job
index>-<pod index>`); every pod gets

    JAX_COORDINATOR_ADDRESS=<name>-train-0-0.<name>:PORT   JAX_NUM_PROCESSES=N
    JAX_PROCESS_ID=<its completion index>                   (downward API, batch.kubernetes.io/job-completion-index)

which `jaxinfra.distributed` reads, so the container runs the laptop's command unchanged:
`jaxinfra train CONFIG --run-dir DIR KEY=VALUE ...`.

Exit statuses (jaxinfra/exits.py) become the failure policy. The Job's `podFailurePolicy` fails the
Job at once (reason PodFailurePolicy) on 2, 3 or 74, and counts 70 and 75 as ordinary failures; with
`backoffLimit: 0` one counted failure fails the Job (reason BackoffLimitExceeded). The JobSet's
`failurePolicy` turns PodFailurePolicy into FailJobSet and everything else into RestartJobSet (all
pods recreated, the run resumes from its last checkpoint), at most `max_restarts` times.

Nothing here talks to a cluster: `jaxinfra launch k8s` prints the manifests, `sweep --launcher
jobset` writes them (jaxinfra/scaling/runner.py), tests/test_jobset.py validates them against the
Kubernetes client's models and the JobSet CRD's schema.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import re
from typing import Any

import yaml

from jaxinfra.config import ConfigError
from jaxinfra.exits import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_HUNG, EXIT_PREEMPTED, EXIT_WRITE_FAILED

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "train"
COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue admits (unsuspends) a JobSet carrying it
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
TPU_RESOURCE, GPU_RESOURCE = "google.com/tpu", "nvidia.com/gpu"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
# Kubernetes wants each onExitCodes list sorted and free of 0.
NO_RETRY_EXITS = tuple(sorted((EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_WRITE_FAILED)))  # the same failure again
RESTART_EXITS = tuple(sorted((EXIT_HUNG, EXIT_PREEMPTED)))  # rerun the same command: it resumes
URL_SCHEMES = ("gs://", "s3://")
CONFIG_MOUNT = "/etc/jaxinfra"  # where a ConfigMap-shipped config file appears in the pod
_POD_SUFFIX = 6  # "-abcde": Kubernetes appends a random suffix to each pod name
_MAX_NAME = 63


@dataclasses.dataclass(frozen=True)
class JobSetSpec:
    """One run's JobSet settings: `launcher.jobset` of a sweep spec and the flags of `jaxinfra launch k8s`."""

    image: str | None = None  # None: jaxinfra:<cpu|cuda|tpu>, the tags docker/Dockerfile's header builds
    hosts: int = 1  # pods = jax processes per run
    namespace: str | None = None
    tpu_type: str | None = None  # the GKE accelerator label, e.g. tpu-v5p-slice, tpu-v5-lite-podslice, tpu-v6e-slice
    tpu_topology: str | None = None  # the slice's chip grid, e.g. 2x2x2 (v4, v5p) or 4x4 (v5e, v6e)
    gpus_per_host: int = 0  # nvidia.com/gpu per pod
    cpu: str | None = None  # CPU request per pod, e.g. "8"
    memory: str | None = None  # memory request per pod, e.g. "64Gi"
    max_restarts: int = 3  # whole-set restarts (exit 70, 75, a lost pod) before the JobSet fails
    pvc: str | None = None  # PersistentVolumeClaim mounted at workdir (run dirs on it); or use gs:// / s3://
    workdir: str = "/workspace"
    queue: str | None = None  # Kueue LocalQueue: adds the kueue.x-k8s.io/queue-name label
    port: int = 1234  # the jax coordinator's port on pod 0
    grace_seconds: int = 120  # terminationGracePeriodSeconds: time to commit a checkpoint after SIGTERM
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # extra variables, e.g. AWS_ENDPOINT_URL
    env_secret: str | None = None  # a Secret whose keys become variables (e.g. AWS_ACCESS_KEY_ID for s3://)
    service_account: str | None = None  # e.g. one bound to a GCP service account (Workload Identity, for gs://)

    @property
    def variant(self) -> str:
        """The image variant the accelerator needs: tpu, cuda or cpu."""
        return "tpu" if self.tpu_type else "cuda" if self.gpus_per_host else "cpu"

    @property
    def image_name(self) -> str:
        return self.image or f"jaxinfra:{self.variant}"

    def problems(self) -> list[tuple[str, Any, str]]:
        """(key, value, what it must be) for each invalid setting; empty when valid."""
        out: list[tuple[str, Any, str]] = []
        for key, low in (("hosts", 1), ("gpus_per_host", 0), ("max_restarts", 0), ("grace_seconds", 0)):
            if getattr(self, key) < low:
                out.append((key, getattr(self, key), "a positive integer" if low else "an integer >= 0"))
        if not 1 <= self.port <= 65535:
            out.append(("port", self.port, "a port number, 1 to 65535"))
        if self.namespace is not None and not _is_dns_label(self.namespace, 63, start_letter=False):
            out.append(("namespace", self.namespace, "a DNS label (lower-case letters, digits, '-')"))
        if self.image is not None and not self.image.strip():
            out.append(("image", self.image, "a container image reference"))
        for key, longest in (("queue", 63), ("env_secret", 253), ("service_account", 253)):  # 63: a label value
            value = getattr(self, key)
            if value is not None and (len(value) > longest or not re.fullmatch(r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?",
                                                                                value)):
                out.append((key, value, f"a Kubernetes object name of at most {longest} characters "
                                        "(lower-case letters, digits, '-', '.')"))
        if bool(self.tpu_type) != bool(self.tpu_topology):
            out.append(("tpu_topology" if self.tpu_type else "tpu_type", None,
                        "given together with " + ("tpu_type" if self.tpu_type else "tpu_topology")))
        elif self.tpu_type and self.gpus_per_host:
            out.append(("gpus_per_host", self.gpus_per_host, "0 on TPU (tpu_type is set)"))
        elif self.tpu_topology:
            out += _tpu_problems(self.tpu_topology, self.hosts)
        return out


def _tpu_problems(topology: str, hosts: int) -> list[tuple[str, Any, str]]:
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){1,2}", topology):
        return [("tpu_topology", topology, "a chip grid such as 2x2x2 or 4x4")]
    chips = tpu_chips(topology)
    if hosts > 0 and (chips % hosts or chips // hosts not in (1, 2, 4, 8)):
        return [("hosts", hosts, f"a divisor of the {chips} chips of {topology} leaving 1, 2, 4 or 8 chips per host "
                 "(multi-host slices of v4, v5p, v5e and v6e have 4 per host)")]
    return []


def tpu_chips(topology: str) -> int:
    """The chip count of a TPU topology: 2x2x4 -> 16."""
    n = 1
    for side in topology.split("x"):
        n *= int(side)
    return n


def check_spec(spec: JobSetSpec, where: str) -> None:
    """Raises ConfigError naming the first invalid setting; `where` prefixes the key (launcher.jobset.)."""
    for key, value, allowed in spec.problems():
        raise ConfigError(f"{where}{key}={value!r} is invalid: must be {allowed}")


# ---------------------------------------------------------------- names


def _is_dns_label(text: str, max_len: int, start_letter: bool = True) -> bool:
    first = "[a-z]" if start_letter else "[a-z0-9]"
    return len(text) <= max_len and re.fullmatch(rf"{first}([-a-z0-9]*[a-z0-9])?", text) is not None


def max_name_length(hosts: int) -> int:
    """The longest JobSet name whose pod names (`<name>-train-0-<hosts-1>-abcde`) stay within 63 characters."""
    return _MAX_NAME - len(f"-{REPLICATED_JOB}-0-{max(hosts, 1) - 1}") - _POD_SUFFIX


def check_name(name: str, hosts: int) -> None:
    """A JobSet name the JobSet webhook accepts: a DNS-1035 label short enough for its pod names."""
    longest = max_name_length(hosts)
    if not _is_dns_label(name, longest):
        raise ConfigError(f"JobSet name {name!r} is invalid: must be a DNS label of at most {longest} characters "
                          f"(lower-case letters, digits, '-', starting with a letter) so its pod names fit in 63")


def dns_name(text: str, max_len: int, *, unique: bool = False) -> str:
    """A DNS-1035 label from any text: lower-cased, other characters -> '-', shortened with a hash if needed.

    unique=True always appends a short hash of `text` (two texts that read the same once cleaned differ).
    """
    clean = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not clean or not clean[0].isalpha():
        clean = f"j-{clean}".rstrip("-")
    if unique or len(clean) > max_len:
        tag = hashlib.sha1(text.encode()).hexdigest()[:5]
        clean = f"{clean[: max_len - len(tag) - 1].rstrip('-')}-{tag}"
    return clean


def coordinator_address(name: str, port: int) -> str:
    """Pod 0's stable DNS name (the JobSet's headless Service is named after the JobSet) and the port."""
    return f"{name}-{REPLICATED_JOB}-0-0.{name}:{port}"


def is_url(path: str) -> bool:
    return str(path).startswith(URL_SCHEMES)


def check_run_dir(run_dir: str, spec: JobSetSpec, what: str) -> None:
    """A run dir the pods can share and that outlives them: a bucket URL, or a path on the mounted claim."""
    if is_url(run_dir):
        return
    inside = not pathlib.PurePosixPath(run_dir).is_absolute() or pathlib.PurePosixPath(run_dir).is_relative_to(
        spec.workdir)
    if spec.pvc and inside:
        return
    where = (f"is outside the claim's mount {spec.workdir}" if spec.pvc
             else "would be on each pod's own disk, lost when the pod ends")
    raise ConfigError(f"{what} {run_dir} {where}: give a gs:// or s3:// URL, or a PersistentVolumeClaim "
                      f"(pvc) mounted at {spec.workdir} and a path under it")


# ---------------------------------------------------------------- the objects


def pod_failure_policy() -> dict[str, Any]:
    """The Job's rules by exit status: 2, 3, 74 fail the Job (no retry); 70, 75 count as a failure (restart)."""
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": REPLICATED_JOB, "operator": "In",
                                              "values": list(NO_RETRY_EXITS)}},
        {"action": "Count", "onExitCodes": {"containerName": REPLICATED_JOB, "operator": "In",
                                            "values": list(RESTART_EXITS)}},
    ]}


def failure_policy(max_restarts: int) -> dict[str, Any]:
    """The JobSet's rules by the failed Job's reason: a no-retry status fails the set, anything else restarts it."""
    # Rule names: the JobSet webhook wants ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$ (no '-').
    return {"maxRestarts": max_restarts, "rules": [
        {"name": "no_retry_exit_status", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "restart_and_resume", "action": "RestartJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]},
    ]}


def resources(spec: JobSetSpec) -> dict[str, Any]:
    """Requests and limits per pod; device counts as strings (the API's quantities) and equal in both."""
    devices: dict[str, str] = {}
    if spec.tpu_type and spec.tpu_topology:
        devices[TPU_RESOURCE] = str(tpu_chips(spec.tpu_topology) // spec.hosts)
    elif spec.gpus_per_host:
        devices[GPU_RESOURCE] = str(spec.gpus_per_host)
    requests = {**devices, **{k: v for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v}}
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if devices:
        out["limits"] = dict(devices)
    return out


def pod_env(name: str, spec: JobSetSpec) -> list[dict[str, Any]]:
    """The JAX_* variables `jaxinfra.distributed` reads, then the spec's own."""
    env: list[dict[str, Any]] = [
        {"name": "JAX_COORDINATOR_ADDRESS", "value": coordinator_address(name, spec.port)},
        {"name": "JAX_NUM_PROCESSES", "value": str(spec.hosts)},
        {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}}},
    ]
    if spec.variant == "cpu" and spec.hosts > 1:  # CPU collectives across processes need gloo (as `jaxinfra launch`)
        env.append({"name": "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "value": "gloo"})
    return env + [{"name": k, "value": str(v)} for k, v in sorted(spec.env.items())]


def _pod_spec(name: str, spec: JobSetSpec, command: list[str], config_map: str | None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": REPLICATED_JOB, "image": spec.image_name, "command": list(command),
                                 "workingDir": spec.workdir, "env": pod_env(name, spec),
                                 "ports": [{"name": "coordinator", "containerPort": spec.port}]}
    if spec.env_secret:
        container["envFrom"] = [{"secretRef": {"name": spec.env_secret}}]
    res = resources(spec)
    if res:
        container["resources"] = res
    mounts, volumes = [], []
    if spec.pvc:
        mounts.append({"name": "work", "mountPath": spec.workdir})
        volumes.append({"name": "work", "persistentVolumeClaim": {"claimName": spec.pvc}})
    if config_map:
        mounts.append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": config_map}})
    if mounts:
        container["volumeMounts"] = mounts
    # restartPolicy Never: a pod failure policy needs it, and a restart is the whole set's, not one pod's.
    pod: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": spec.grace_seconds,
                           "containers": [container]}
    if volumes:
        pod["volumes"] = volumes
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    if spec.tpu_type and spec.tpu_topology:
        pod["nodeSelector"] = {TPU_ACCELERATOR_LABEL: spec.tpu_type, TPU_TOPOLOGY_LABEL: spec.tpu_topology}
    return pod


def jobset(name: str, command: list[str], spec: JobSetSpec, *, config_map: str | None = None,
           labels: dict[str, str] | None = None) -> dict[str, Any]:
    """One run as a JobSet: `spec.hosts` pods, pod i is jax process i, all running `command`."""
    check_spec(spec, "")
    check_name(name, spec.hosts)
    job = {"parallelism": spec.hosts, "completions": spec.hosts, "completionMode": "Indexed", "backoffLimit": 0,
           "podFailurePolicy": pod_failure_policy(),
           "template": {"spec": _pod_spec(name, spec, command, config_map)}}
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "jaxinfra", **(labels or {})}}
    if spec.queue:
        metadata["labels"][QUEUE_LABEL] = spec.queue
    if spec.tpu_type:  # the set's pods on one slice (node pool), as XPK places them
        metadata["annotations"] = {EXCLUSIVE_TOPOLOGY: TPU_NODE_POOL_LABEL}
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    return {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata,
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "failurePolicy": failure_policy(spec.max_restarts),
                     "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}]}}


def single_run(config: str, overrides: list[str], spec: JobSetSpec, name: str, run_dir: str,
               config_text: str | None = None) -> list[dict[str, Any]]:
    """`jaxinfra launch k8s`: the manifests of one run, the laptop's `jaxinfra train` command in every pod.

    `config` is passed as given (a preset in the image, or a gs:// / s3:// URL), unless `config_text`
    holds a local file's text: then it is shipped in a ConfigMap `<name>-config` and read from its mount.
    """
    check_run_dir(run_dir, spec, "--run-dir")
    objects: list[dict[str, Any]] = []
    cm_name = None
    if config_text is not None:
        filename = re.sub(r"[^-._a-zA-Z0-9]", "_", pathlib.PurePath(config).name) or "config.yaml"
        cm_name = f"{name}-config"
        objects.append(config_map(cm_name, filename, config_text, spec.namespace))
        config = f"{CONFIG_MOUNT}/{filename}"
    command = ["jaxinfra", "train", config, "--run-dir", run_dir, *overrides]
    return [*objects, jobset(name, command, spec, config_map=cm_name)]


def config_map(name: str, filename: str, text: str, namespace: str | None = None) -> dict[str, Any]:
    """A ConfigMap holding one config file (key `filename`), mounted read-only at CONFIG_MOUNT."""
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "jaxinfra"}}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {filename: text}}


# ---------------------------------------------------------------- YAML


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (a shipped config file) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_BlockDumper.add_representer(str, _str)


def to_yaml(objects: list[dict[str, Any]], header: str = "") -> str:
    """A multi-document YAML stream (`kubectl apply -f` takes it); `header` lines become comments."""
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    docs = [yaml.dump(o, Dumper=_BlockDumper, sort_keys=False, width=10_000) for o in objects]
    return comments + "---\n" + "---\n".join(docs)
