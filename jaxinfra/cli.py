"""`jaxinfra` command line: thin wrappers over Python functions that tests call directly.

CONFIG is a preset name (jaxinfra/presets/) or a YAML path; KEY=VALUE overrides it (model.num_layers=8).
Run dirs, --restore, data.paths, sweep --out and CONFIG may be gs:// or s3:// URLs (docs/clusters.md).
train, info and bench also take --coordinator HOST:PORT --num-processes N --process-id I (multi-host).

    jaxinfra train [CONFIG] [KEY=VALUE ...] [--run-dir DIR] [--restore PATH] [--restart-data] [--allow-fresh-start]
                                                    train; a run dir resumes (changed keys listed; a changed data
                                                    stream needs --restart-data; no readable checkpoint: exit 74
                                                    unless --allow-fresh-start)
    jaxinfra info [CONFIG] [KEY=VALUE ...] [--inference [--max-len N]]   devices, mesh, sharding, bytes
    jaxinfra plan CONFIG [KEY=VALUE ...] [--devices N] [--device-kind K] [--hbm-gib G] [--compile] [--search] [--json]
                  [--report]                        memory per device, step time, bottleneck; --search ranks layouts;
                                                    a plan train would refuse exits 2 (--report: a report only, 0)
    jaxinfra export-params RUN OUT [--dtype D] [--overwrite]   a run's newest params alone (optionally cast)
    jaxinfra bench collectives [KEY=VALUE ...] [--min-bytes N] [--max-bytes N] [--ops a,b]   collective timings
    jaxinfra profile RUN [--top N]                  a run's profile window (log.profile_steps): category shares, top ops
    jaxinfra launch --local-processes N [--devices-per-process M] -- COMMAND ...   N local processes
    jaxinfra launch k8s CONFIG --hosts N [--image IMAGE] [--run-dir DIR | --pvc CLAIM] [--tpu-type T --tpu-topology AxB
                    | --gpus-per-host G] [--max-restarts R] [--queue Q] [--out FILE] [KEY=VALUE ...]
                                                    a multi-host run as a Kubernetes JobSet (manifests printed)
    jaxinfra sweep SPEC [KEY=VALUE ...] [--dry-run] [--launcher local|slurm|k8s|jobset] [--out DIR] [--no-fit]
                                                    scaling-law sweep: plan, run or write job files
    jaxinfra scaling collect OUT_DIR                results.csv/.jsonl from a sweep's run directories
    jaxinfra scaling fit RESULTS [--plot DIR] [--out FIT.json] [--bootstrap N] [--n-column COL]   fits
    jaxinfra scaling predict --fit FIT.json --compute C   compute-optimal N, D and loss at C FLOPs
    jaxinfra hf import HF_DIR OUT [KEY=VALUE ...] [--overwrite]   Hugging Face safetensors -> a run directory
    jaxinfra hf export RUN_OR_CKPT OUT_DIR [--dtype D] [--max-shard-gb G] [--overwrite]   a run -> HF safetensors
    jaxinfra hf check HF_DIR [RUN] [--tol 1e-5]   logits vs transformers per position; exit 1 names the layer
    jaxinfra generate CKPT (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N] [--temperature T]
                      [--top-k K] [--top-p P] [--stop-ids ...]   sampling with a KV cache
    jaxinfra eval CKPT (--tokens FILE.npy | --text FILE.txt) [--batch-size B]   mean next-token loss, one JSON line
    jaxinfra eval CKPT --tasks T1,T2 [--include-path DIR] [--limit N] ...    lm-evaluation-harness table + JSON
    jaxinfra data prepare INPUT... --out DIR (--tokenizer PATH | --bytes) [--workers N] [--shard-tokens N]
    jaxinfra data inspect DIR [CONFIG] [KEY=VALUE ...]   counts, lengths, a decoded sample, checks
    jaxinfra quantize RUN_OR_CKPT OUT --weights int8 [--group-size N] [--overwrite]   weight-only int8 for inference
    jaxinfra distill save-logits TEACHER --out DIR --top-k K --steps N [--data KEY=VALUE ...]
                                                    a teacher's top-k logits for offline distillation
    jaxinfra dpo save-reference CONFIG [KEY=VALUE ...] --out DIR [--restore PATH]
                                                    a DPO run's reference log-probs (no reference model in memory)
    jaxinfra lora merge RUN OUT                     LoRA adapters folded into the base: a plain params-only run

Bad input (config, mesh, data, checkpoint) exits with status 2 and one line on stderr, no
traceback; an I/O failure (a write or read the storage refused, a path of the wrong kind, a corrupt
file: jaxinfra/exits.py io_failure_line) exits 74 the same way; the statuses are in jaxinfra/exits.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import sys

from jaxinfra.atomic import add_overwrite
from jaxinfra.config import Config, ConfigError, load_config, preset_names
from jaxinfra.exits import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_IO_FAILED,
)
from jaxinfra.flags import number_flag


def _config_stem(source: str) -> str:
    return pathlib.Path(source).stem if source.endswith((".yaml", ".yml")) else source


def _join_process_group(args: argparse.Namespace) -> None:
    from jaxinfra.distributed import from_flags_and_env, initialize

    initialize(from_flags_and_env(args.coordinator, args.num_processes, args.process_id))


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # bad input fails here: before any device, process group or compile
    _check_urls(run_dir=args.run_dir, restore=args.restore)
    cfg = _tracker_defaults(cfg, _config_stem(args.config))
    from jaxinfra.hf.tokenizer_files import restore_defaults

    cfg, note = restore_defaults(cfg, args.restore, args.overrides)  # an `hf import`'s tokenizer and template
    if note:
        print(f"jaxinfra train: {note}")
    _join_process_group(args)
    from jaxinfra.plan.cli import preflight
    from jaxinfra.train import train

    preflight(cfg, force=args.force)  # one line: the plan's memory estimate; too big -> exit 2 before compiling
    run_dir = args.run_dir or f"runs/{_config_stem(args.config)}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    summary = train(cfg, run_dir, restore_from=args.restore, restart_data=args.restart_data,
                    allow_fresh_start=args.allow_fresh_start)
    return int(summary.get("exit_code", 0))


def _tracker_defaults(cfg: Config, config_name: str) -> Config:
    """log.mlflow.experiment defaults to the config's name (the preset or YAML stem), recorded in the run's
    config.yaml so a rerun of that file lands in the same experiment; a missing tracker package: one line."""
    from jaxinfra.metrics.trackers import missing_package

    if problem := missing_package(cfg.log.wandb, cfg.log.mlflow):
        raise ConfigError(problem)
    m = cfg.log.mlflow
    if not m.enabled or m.experiment is not None:
        return cfg
    mlflow = dataclasses.replace(m, experiment=pathlib.Path(config_name).name)
    return dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, mlflow=mlflow))


def _check_urls(**flags: str | None) -> None:
    """A gs:// / s3:// flag whose bucket is missing, unreachable or refuses us (or an unsupported URL
    scheme): one line naming it, before anything is written or compiled."""
    from jaxinfra.storage import check_bucket, is_url

    for name, value in flags.items():
        if value is not None and is_url(value):
            check_bucket(value, f"--{name.replace('_', '-')}")


def cmd_info(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides) if args.config else None
    _join_process_group(args)
    from jaxinfra.info import describe

    print(describe(cfg, args.max_len if args.inference else None))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from jaxinfra.metrics.run_profile import NoProfileError, read_run_profile
    from jaxinfra.metrics.trace import format_profile

    try:
        profile, window = read_run_profile(args.run_dir)
    except NoProfileError as e:  # bad input: one line, exit 2
        raise ConfigError(str(e)) from None
    print(f"{args.run_dir}: steps {window['start'] + 1}..{window['stop']} (log.profile_steps=[{window['start']}, "
          f"{window['stop']}]), trace {window['trace']}")
    print(format_profile(profile, args.top))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfra", description="JAX/XLA training stack for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    presets = ", ".join(preset_names())
    _add_train(sub, presets)
    _add_info(sub, presets)
    _add_checkpoint_tools(sub)
    _add_bench(sub)
    _add_profile(sub)
    _add_launch(sub)
    _add_package_commands(sub)
    return parser


def _add_train(sub: argparse._SubParsersAction, presets: str) -> None:
    p = sub.add_parser("train", help="train a model from a preset or YAML config")
    p.add_argument("config", nargs="?", default="tiny", help=f"preset name ({presets}) or YAML path; default tiny")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. model.num_layers=8 train.steps=100")
    p.add_argument("--run-dir", help="output directory (default runs/<config>-<time>), or a gs:// / s3:// URL; a "
                   "run dir that holds checkpoints is resumed from its latest complete one")
    p.add_argument("--restore", metavar="PATH", help="start from another run's checkpoint (checkpoint.restore="
                   "full|params)")
    p.add_argument("--force", action="store_true", help="train even when the plan's analytic memory exceeds the "
                   "device memory by more than 10%%")
    p.add_argument("--restart-data", action="store_true", help="resume (or --restore) a checkpoint written for "
                   "another data stream (data.*, train.seed, train.batch_size or train.seq_len changed): the model "
                   "and optimizer continue, the data starts from its beginning; without it such a resume is refused")
    p.add_argument("--allow-fresh-start", action="store_true", help="when none of the run dir's checkpoints can be "
                   "read, set them aside and train from step 0 (default: refuse with exit 74, moving nothing, so a "
                   "rerun resumes once the storage is back); metrics.jsonl is kept under another name")
    _add_process_flags(p)
    p.set_defaults(func=cmd_train)


def _add_info(sub: argparse._SubParsersAction, presets: str) -> None:
    p = sub.add_parser("info", help="devices, versions, and the mesh and parameter layout a config would get")
    p.add_argument("config", nargs="?", help=f"preset name ({presets}) or YAML path")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--inference", action="store_true", help="also the decode KV cache's bytes for one row "
                   "(sliding-window layers counted at their window)")
    number_flag(p, "--max-len", lo=0, note="0: train.seq_len", default=0, metavar="N",
                   help="with --inference: positions per row (default train.seq_len)")
    _add_process_flags(p)
    p.set_defaults(func=cmd_info)


def _add_checkpoint_tools(sub: argparse._SubParsersAction) -> None:
    """export-params and quantize: a run's params -> a params-only checkpoint."""
    p = sub.add_parser("export-params", help="write a run's newest params alone (optionally cast) for inference")
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast the params (default: as trained)")
    add_overwrite(p)
    p.set_defaults(func=cmd_export_params)

    p = sub.add_parser("quantize", help="a run's params -> a weight-only int8 checkpoint (generate / eval load it)")
    p.add_argument("source", metavar="RUN_OR_CKPT", help="run directory (newest checkpoint) or RUN/checkpoints/N")
    p.add_argument("out", help="output run directory: config.yaml (quant.weights=int8) + checkpoints/0")
    p.add_argument("--weights", required=True, metavar="MODE", help="int8")
    number_flag(p, "--group-size", lo=0, note="0: per output channel", default=0, metavar="N",
                   help="one scale per N consecutive inputs (must divide each input dimension); 0: per output channel")
    add_overwrite(p)
    p.set_defaults(func=cmd_quantize)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="micro-benchmarks: `bench collectives` times each collective per mesh axis")
    p.add_argument("what", choices=["collectives"])
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="mesh sizes, e.g. mesh.fsdp=4 mesh.tensor=2")
    number_flag(p, "--min-bytes", lo=1, default=1024)  # 0 would never grow: the sizes are multiplied
    number_flag(p, "--max-bytes", lo=1, default=64 * 2**20, help="largest message per device (default 64 MiB)")
    p.add_argument("--ops", default=",".join(("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")))
    _add_process_flags(p)
    p.set_defaults(func=cmd_bench)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="a run's profile window (log.profile_steps): per-category shares and top ops")
    p.add_argument("run_dir", metavar="RUN", help="a run directory trained with log.profile_steps=[START,STOP]")
    number_flag(p, "--top", lo=1, default=12, help="ops listed, longest first (default 12)")
    p.set_defaults(func=cmd_profile)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="start N local processes of a jaxinfra command (multi-host testing); "
                       "`jaxinfra launch k8s CONFIG --hosts N ...` prints a Kubernetes JobSet instead",
                       description="jaxinfra launch k8s CONFIG --hosts N ...: see jaxinfra launch k8s --help")
    number_flag(p, "--local-processes", lo=1, required=True, metavar="N")
    number_flag(p, "--devices-per-process", lo=1, default=1, metavar="M", help="fake CPU devices each")
    p.add_argument("command", nargs=argparse.REMAINDER, help="e.g. -- train tiny mesh.data=-1")
    p.set_defaults(func=cmd_launch)


def _add_package_commands(sub: argparse._SubParsersAction) -> None:
    """The subcommands each feature package registers itself (their modules load no jax at import)."""
    from jaxinfra.data_cli import add_subcommands as add_data  # data {prepare,inspect}
    from jaxinfra.distill.cli import add_subcommands as add_distill  # distill save-logits
    from jaxinfra.dpo.cli import add_subcommands as add_dpo  # dpo save-reference
    from jaxinfra.harness.cli import add_task_source  # eval --tasks (lm-evaluation-harness)
    from jaxinfra.hf.cli import add_subcommands as add_hf  # hf {import,export,check}
    from jaxinfra.infer.cli import add_subcommands as add_inference  # generate, eval
    from jaxinfra.lora.cli import add_subcommands as add_lora  # lora merge
    from jaxinfra.plan.cli import add_subcommands as add_plan  # plan
    from jaxinfra.scaling.cli import add_subcommands as add_scaling  # sweep, scaling {collect,fit,predict}

    # In this order: `jaxinfra --help` lists the subcommands as they are added.
    for add in (add_scaling, add_hf, lambda s: add_inference(s, extend_eval=add_task_source), add_plan, add_data,
                add_distill, add_dpo, add_lora):
        add(sub)


def _add_process_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-host: process 0's address (or JAX_COORDINATOR_ADDRESS)")
    number_flag(p, "--num-processes", lo=1, help="multi-host: process count (or JAX_NUM_PROCESSES)")
    number_flag(p, "--process-id", lo=0, help="multi-host: this process (or JAX_PROCESS_ID)")


def cmd_export_params(args: argparse.Namespace) -> int:
    from jaxinfra.checkpoint import export_params

    print(export_params(args.run_dir, args.out, args.dtype, overwrite=args.overwrite))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    if getattr(args, "overrides", None):
        raise ConfigError(f"quantize takes no KEY=VALUE overrides: {' '.join(args.overrides)}")
    from jaxinfra.quantize import quantize_checkpoint

    report = quantize_checkpoint(args.source, args.out, args.weights, args.group_size, overwrite=args.overwrite)
    print(f"quantized step {report['source_step']} -> {report['checkpoint']}: params {report['bytes'] / 2**20:.2f} MiB "
          f"(float {report['float_bytes'] / 2**20:.2f} MiB, {report['bytes'] / report['float_bytes']:.3f})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    cfg = load_config(None, args.overrides)
    _join_process_group(args)
    import jax

    from jaxinfra.bench import collectives_table, format_table, message_sizes
    from sharding.mesh import make_mesh

    mesh = make_mesh(cfg.mesh)
    rows = collectives_table(mesh, message_sizes(args.min_bytes, args.max_bytes), args.ops.split(","))
    if jax.process_index() == 0:
        print(f"{jax.process_count()} process(es), {jax.device_count()} x {jax.devices()[0].device_kind}, "
              f"mesh {dict(mesh.shape)}")
        print(format_table(rows))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from jaxinfra.launch import launch_local

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError("launch: give the command after --, e.g. jaxinfra launch --local-processes 2 -- train tiny")
    return launch_local(command, args.local_processes, args.devices_per_process)


def cmd_launch_k8s(argv: list[str]) -> int:
    from jaxinfra.cluster.launch_k8s import cmd_launch_k8s as launch_k8s

    return launch_k8s(argv)


def _parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if "=" not in x or x.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    if getattr(args, "config", None) and "=" in args.config:  # `jaxinfra train a.b=1`: no config given
        args.overrides = [args.config, *args.overrides]
        args.config = "tiny" if args.command == "train" else None
    return args


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    if argv[:2] == ["launch", "k8s"]:  # its own parser, run inside main's error handling (one line, exit 2)
        return argparse.Namespace(func=lambda _: cmd_launch_k8s(argv[2:]))
    if argv[:1] == ["launch"]:  # everything after the launcher's own flags belongs to the child
        return parser.parse_args(argv)
    return _parse_with_overrides(parser, argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come after options (`train tiny --run-dir X a.b=1`): argparse leaves those as extras.
    argv = list(sys.argv[1:] if argv is None else argv)
    from jaxinfra.exits import bad_input_errors, io_failure_line

    try:  # parsing too: a numeric flag out of its range is a ConfigError (jaxinfra/flags.py)
        args = _parse(parser, argv)
        return args.func(args)
    except bad_input_errors() as e:
        print(f"jaxinfra: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("jaxinfra: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `jaxinfra info | head`: the reader left; no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as e:  # I/O failures (jaxinfra/exits.py decides which): one line; anything else is a bug
        line = io_failure_line(e)
        if line is None:
            raise
        print(f"jaxinfra: error: {line}", file=sys.stderr)
        return EXIT_IO_FAILED


def main_exit() -> None:
    """Console-script entry: exit with main()'s status."""
    sys.exit(main())


if __name__ == "__main__":
    main_exit()
