"""`jaxinfra plan` (registered by jaxinfra/cli.py's build_parser), and the pre-flight check of `jaxinfra train`.

    jaxinfra plan CONFIG [KEY=VALUE ...] [--devices N] [--device-kind KIND] [--hbm-gib G]
                  [--efficiency E] [--links FILE] [--compile] [--search] [--top K] [--inference] [--json] [--report]

Without --devices: the devices this process sees; without --device-kind: theirs. Bad input (an
impossible device count or memory, a layout the config validation refuses, nothing fits under
--search) is one line and exit status 2, as everywhere. A plan that does not fit (over the device
memory by more than estimate.FIT_MARGIN, which `jaxinfra train` refuses) prints in full and then
exits 2 the same way, unless --report asks for the report only.
"""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from jaxinfra.config import Config, ConfigError, load_config
from jaxinfra.flags import number_flag
from jaxinfra.plan.devices import DEVICE_KINDS, DeviceSpec, device_spec, kind_of


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory per device, step time and bottleneck of a config before launch; "
                       "--search ranks layouts")
    p.add_argument("config", help="preset name or YAML path")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    number_flag(p, "--devices", lo=1, help="device count (default: the devices this process sees)")
    p.add_argument("--device-kind", choices=DEVICE_KINDS, help="default: the kind of this process's devices")
    number_flag(p, "--hbm-gib", kind=float, lo=0, lo_open=True,
                help="memory per device in GiB (default: the device table's)")
    number_flag(p, "--efficiency", kind=float, lo=0, hi=1, lo_open=True,
                help="fraction of the peak the compute reaches (default: per kind)")
    p.add_argument("--links", metavar="FILE", help="`jaxinfra bench collectives` output: measured bandwidths "
                   "replace the link table")
    p.add_argument("--no-probe-cache", action="store_true", help="CPU: measure the per-kind probes again instead "
                   "of reading them from the probe cache ($XDG_CACHE_HOME/jaxinfra/plan-probes.json), and rewrite it")
    p.add_argument("--compile", action="store_true", help="also compile the real train step (fake CPU devices "
                   "when there are too few) and print XLA's memory and FLOPs beside the analytic ones")
    p.add_argument("--search", action="store_true", help="rank every layout of the devices that fits")
    p.add_argument("--inference", action="store_true", help="plan `jaxinfra generate` instead: params + KV cache "
                   "for train.batch_size rows x train.seq_len positions, and the decode step")
    number_flag(p, "--top", lo=1, default=10, help="--search: layouts to print (default 10)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--report", action="store_true", help="a report only: exit 0 even when the plan does not fit "
                   "(by default a plan over the device memory by more than 10%%, which `jaxinfra train` refuses, "
                   "prints in full and then exits 2)")
    p.set_defaults(func=cmd_plan)


def resolve_spec(args: argparse.Namespace, cfg: Config) -> tuple[int, DeviceSpec]:
    """(device count, device spec) from the flags, or from this process's devices."""
    if args.compile and args.devices:  # fake CPU devices must be asked for before the backend starts
        from jaxinfra.plan.compiled import request_cpu_devices

        request_cpu_devices(args.devices)
    need_jax = args.devices is None or args.device_kind in (None, "cpu")
    devices = None
    if need_jax:
        import jax

        devices = jax.devices()
    count = args.devices or len(devices)
    kind = args.device_kind or kind_of(devices[0])
    if kind != "cpu":  # planning a GPU/TPU (from here or there): the datasheet, no probes
        return count, device_spec(kind, count, args.hbm_gib, args.efficiency)
    from jaxinfra.plan import probes
    from jaxinfra.plan.devices import with_rates
    from jaxinfra.plan.layout import Layout

    cpus = jax.devices("cpu")
    peak = probes.peak_flops(cpus[0], cfg.model.dtype)
    spec = device_spec(kind, count, args.hbm_gib, args.efficiency, peak)  # + the bandwidth probe
    lay = Layout.of(cfg, count, "cpu")  # the step's shapes (a refused layout: the trainer's one-line error)
    return count, with_rates(spec, probes.rates(lay, cpus, count, use_cache=not args.no_probe_cache), args.efficiency)


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    count, spec = resolve_spec(args, cfg)
    if args.inference and (args.search or args.compile):
        raise ConfigError("--inference plans memory and decode speed only: drop --search and --compile")
    from jaxinfra.plan.links import read_measured

    measured = read_measured(args.links) if args.links else None
    if args.search:
        return _search(args, cfg, count, spec, measured)
    from jaxinfra.plan.estimate import make_plan
    from jaxinfra.plan.report import describe, size

    plan = make_plan(cfg, count, spec, measured, inference=args.inference)
    compiled = None
    if args.compile and not args.inference:
        from jaxinfra.plan.compiled import compiled_figures

        compiled = compiled_figures(cfg, count)
    if args.json:
        out: dict[str, Any] = plan.as_json()
        if compiled is not None:
            out["compiled_bytes_per_device"] = compiled["total_bytes"]
            out["compiled"] = compiled
        print(json.dumps(out))
    else:
        print(describe(plan, compiled["total_bytes"] if compiled else None))
        if compiled:
            print(f"compiled on {count} {compiled['platform']} devices: arguments {compiled['argument_bytes']:,}, "
                  f"temporaries {compiled['temp_bytes']:,}, outputs {compiled['output_bytes']:,}, aliased "
                  f"{compiled['alias_bytes']:,} bytes; XLA FLOPs/device {compiled['flops']:.4g} (analytic executed "
                  f"{plan.time.flops.executed:.4g})")
            moved = [f"{key} {calls:g} calls {size(total)}" for key, (calls, total) in compiled["collectives"].items()]
            print("compiled collectives per step (op x devices per group; a permute: x pairs): "
                  + ("; ".join(moved) or "none"))
    if plan.refused and not args.report:  # the same rule as train's pre-flight: printed in full, then refused
        from jaxinfra.plan.report import refusal

        raise ConfigError(refusal(plan))
    return 0


def train_command(args: argparse.Namespace, overrides: list[str]) -> str:
    return shlex.join(["jaxinfra", "train", args.config, *args.overrides, *overrides])


def _search(args: argparse.Namespace, cfg: Config, count: int, spec: DeviceSpec, measured) -> int:
    from jaxinfra.plan.report import seconds, size
    from jaxinfra.plan.search import Rejections, overrides, search

    rejected = Rejections()
    ranked = search(cfg, count, spec, measured, rejected)
    if not ranked:  # memory, a size that divides nothing, or no mesh at all: the line names which
        raise ConfigError(rejected.explain(count, spec.kind, size(spec.memory_bytes)))
    top = ranked[:args.top]
    if args.json:
        print(json.dumps({"candidates_fitting": len(ranked), "top": [
            {**p.as_json(), "command": train_command(args, overrides(p))} for p in top]}))
        return 0
    print(f"{len(ranked)} layouts of {count} x {spec.kind} fit {size(spec.memory_bytes)}; fastest first:")
    for i, p in enumerate(top, 1):
        print(f"{i:2d}. {seconds(p.time.step_s)}/step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.3f}, "
              f"memory {size(p.memory.total)}, bottleneck {p.bottleneck}")
        print(f"    {train_command(args, overrides(p))}")
    return 0


def preflight(cfg: Config, force: bool) -> None:
    """`jaxinfra train`: print the plan's one-line estimate (process 0) and refuse, before anything
    compiles, a config whose analytic memory exceeds the device's by more than 10%.

    On CPU the capacity is the host's RAM shared by its local devices."""
    import jax

    from jaxinfra.metrics.peak import peak_flops_per_device
    from jaxinfra.plan.estimate import make_plan
    from jaxinfra.plan.report import one_line, size

    devices, local = jax.devices(), jax.local_devices()[0]  # measure and ask only this process's devices
    kind = kind_of(local)
    probe = peak_flops_per_device(local, cfg.model.dtype)[0] if kind == "cpu" else None
    spec = device_spec(kind, jax.local_device_count(), None, None, probe)
    limit = (local.memory_stats() or {}).get("bytes_limit") if kind != "cpu" else None
    if limit:
        spec = device_spec(kind, jax.local_device_count(), limit / 2**30, None, probe)
    plan = make_plan(cfg, len(devices), spec)
    if jax.process_index() == 0:
        print(one_line(plan), flush=True)
    if plan.refused and not force:
        raise ConfigError(f"the plan's analytic memory, {size(plan.memory.total)} per device, exceeds the "
                          f"{spec.kind} device's {size(spec.memory_bytes)} by more than 10% (see `jaxinfra plan`; "
                          f"--search finds layouts that fit); pass --force to train anyway")
