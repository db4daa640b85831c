"""`jaxinfra launch k8s CONFIG --hosts N [--image IMAGE] ... [KEY=VALUE ...]`: one multi-host run as a JobSet.

Prints the manifests (a ConfigMap with the config file when CONFIG is a local file, then the JobSet)
as multi-document YAML for `kubectl apply -f -`, or writes them to --out. Every mistake is one line
and exit status 2 (a ConfigError), argparse's own included: jaxinfra/cli.py hands the arguments
after `launch k8s` to `cmd_launch_k8s`, inside its error handling.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys
from typing import NoReturn

from jaxinfra.atomic import atomic_write_text
from jaxinfra.cluster.jobset import (
    JobSetSpec,
    dns_name,
    is_url,
    max_name_length,
    single_run,
    to_yaml,
    tpu_chips,
)
from jaxinfra.config import ConfigError, load_config


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # a ConfigError: one line, exit 2, no usage block
        raise ConfigError(f"launch k8s: {message} (see jaxinfra launch k8s --help)")


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="jaxinfra launch k8s", description="Print the Kubernetes JobSet of one multi-host "
                       "run: N pods, pod i = jax process i, each running `jaxinfra train CONFIG --run-dir DIR "
                       "KEY=VALUE ...`. Apply with kubectl apply -f.")
    p.add_argument("config", help="preset name (in the image), a local YAML file (shipped in a ConfigMap) "
                   "or a gs:// / s3:// URL")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="overrides, as on jaxinfra train")
    p.add_argument("--hosts", type=_count, required=True, metavar="N", help="pods (jax processes)")
    p.add_argument("--image", help="container image (default jaxinfra:cpu|cuda|tpu, see docker/Dockerfile)")
    p.add_argument("--name", help="JobSet name (default jaxinfra-<config>)")
    p.add_argument("--namespace")
    p.add_argument("--run-dir", metavar="DIR", help="gs:// or s3:// URL, or a path on --pvc (default runs/<name>)")
    p.add_argument("--pvc", metavar="CLAIM", help="PersistentVolumeClaim mounted at --workdir for the run dir")
    p.add_argument("--workdir", default="/workspace", help="the container's working directory (default %(default)s)")
    p.add_argument("--tpu-type", metavar="ACCEL", help="GKE TPU accelerator, e.g. tpu-v5p-slice, tpu-v6e-slice")
    p.add_argument("--tpu-topology", metavar="AxB[xC]", help="TPU slice topology, e.g. 2x2x4 or 4x4")
    p.add_argument("--gpus-per-host", type=_count, default=0, metavar="G", help="nvidia.com/gpu per pod")
    p.add_argument("--cpu", help="CPU request per pod, e.g. 8")
    p.add_argument("--memory", help="memory request per pod, e.g. 64Gi")
    p.add_argument("--max-restarts", type=_count, default=3, metavar="R",
                   help="whole-set restarts on exit 70/75 or a lost pod (default %(default)s)")
    p.add_argument("--queue", metavar="LOCALQUEUE", help="Kueue: label the JobSet kueue.x-k8s.io/queue-name")
    p.add_argument("--port", type=_count, default=1234, help="the jax coordinator's port (default %(default)s)")
    p.add_argument("--grace-seconds", type=_count, default=120, metavar="S",
                   help="time after SIGTERM to commit a checkpoint (default %(default)s)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra pod variable (repeat)")
    p.add_argument("--env-secret", metavar="SECRET", help="a Secret whose keys become variables (bucket credentials)")
    p.add_argument("--service-account", metavar="NAME", help="the pods' service account (e.g. Workload Identity)")
    p.add_argument("--out", metavar="FILE", help="write the manifests here instead of printing them")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out FILE (else refused)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments after `launch k8s`; KEY=VALUE overrides may come after the options too."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if "=" not in x or x.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    if "=" in args.config:
        parser.error(f"give CONFIG (a preset, a YAML file or a URL) before the overrides, got {args.config!r}")
    return args


def spec_from_args(args: argparse.Namespace) -> JobSetSpec:
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"launch k8s: --env {item!r} is invalid: must be NAME=VALUE")
        env[key] = value
    spec = JobSetSpec(image=args.image, hosts=args.hosts, namespace=args.namespace, tpu_type=args.tpu_type,
                      tpu_topology=args.tpu_topology, gpus_per_host=args.gpus_per_host, cpu=args.cpu,
                      memory=args.memory, max_restarts=args.max_restarts, pvc=args.pvc, workdir=args.workdir,
                      queue=args.queue, port=args.port, grace_seconds=args.grace_seconds, env=env,
                      env_secret=args.env_secret, service_account=args.service_account)
    for key, value, allowed in spec.problems():
        flag = "--" + key.replace("_", "-")
        said = f"{flag} is missing" if value is None else f"{flag} {value} is invalid"
        raise ConfigError(f"launch k8s: {said}: must be {allowed.replace('tpu_', '--tpu-')}")
    return spec


def _config_text(config: str, overrides: list[str]) -> str | None:
    """Checks the config here (a bad key fails now, not in the pod); a local file's text to ship, else None."""
    if is_url(config):
        return None  # read by the pods from the bucket
    load_config(config, overrides)
    path = pathlib.Path(config)
    return path.read_text() if config.endswith((".yaml", ".yml")) and path.is_file() else None


def cmd_launch_k8s(argv: list[str]) -> int:
    args = parse(argv)
    spec = spec_from_args(args)
    stem = pathlib.PurePath(args.config).stem if args.config.endswith((".yaml", ".yml")) else args.config
    name = args.name or dns_name(f"jaxinfra-{stem}", max_name_length(spec.hosts))
    run_dir = args.run_dir or (f"runs/{name}" if spec.pvc else None)
    if run_dir is None:
        raise ConfigError("launch k8s: give --run-dir gs://BUCKET/DIR (or s3://), or --pvc CLAIM to keep the "
                          "run dir on a mounted volume (the pods' own disks do not outlive them)")
    objects = single_run(args.config, args.overrides, spec, name, run_dir, _config_text(args.config, args.overrides))
    apply = f"kubectl apply -f {args.out}" if args.out else "jaxinfra launch k8s ... | kubectl apply -f -"
    header = (f"jaxinfra launch k8s: JobSet {name}, {spec.hosts} pod(s) x {_devices(spec)}, image "
              f"{spec.image_name}, run dir {run_dir}\nmade by: jaxinfra launch k8s {shlex.join(argv)}\n"
              f"apply: {apply}; follow: kubectl get jobset {name}; kubectl logs job/{name}-train-0")
    text = to_yaml(objects, header)
    if args.out:
        atomic_write_text(args.out, text, replace=args.overwrite)
        print(f"launch k8s: wrote {args.out} ({', '.join(o['kind'] for o in objects)}); kubectl apply -f {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def _devices(spec: JobSetSpec) -> str:
    if spec.tpu_type and spec.tpu_topology:
        return f"{tpu_chips(spec.tpu_topology) // spec.hosts} TPU chip(s) ({spec.tpu_type} {spec.tpu_topology})"
    return f"{spec.gpus_per_host} GPU(s)" if spec.gpus_per_host else "CPU"
