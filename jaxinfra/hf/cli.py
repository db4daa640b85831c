"""The `hf` subcommands (registered by jaxinfra/cli.py's build_parser).

    jaxinfra hf import HF_DIR OUT [KEY=VALUE ...] [--adapter PEFT_DIR] [--overwrite]    e.g. mesh.fsdp=4 mesh.tensor=2
    jaxinfra hf export RUN_OR_CKPT OUT_DIR [--dtype float32|bfloat16] [--max-shard-gb 5] [--adapters] [--overwrite]
    jaxinfra hf check HF_DIR [RUN] [--tol 1e-5]     exit 0 (matches), 1 (differs: names the first layer), 2

`--adapters` (a LoRA run): the base as without it (adapters NOT merged) plus PEFT's adapter_config.json
and adapter_model.safetensors, so `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT), OUT)`
loads the fine-tune (jaxinfra/hf/adapters.py).

Bad input raises HFError (a ConfigError) or CheckpointError, which jaxinfra.cli.main turns
into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
from typing import get_args

from jaxinfra.atomic import add_overwrite
from jaxinfra.flags import number_flag
from models.config import DType


def cmd_import(args: argparse.Namespace) -> int:
    from jaxinfra.hf.importer import import_hf

    report = import_hf(args.hf_dir, args.out, list(args.overrides), adapter=args.adapter,
                       overwrite=getattr(args, "overwrite", False))
    print(f"imported {report['family']} ({report['params'] / 1e6:.2f}M params) -> {report['checkpoint']} in "
          f"{report['seconds']:.1f}s; peak host RSS {report['peak_rss_bytes'] / 2**20:.0f} MiB, checkpoint on disk "
          f"{report['bytes_on_disk'] / 2**20:.0f} MiB")
    if report.get("hf_files"):
        print(f"carried: {', '.join(report['hf_files'])}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from jaxinfra.config import ConfigError
    from jaxinfra.hf.exporter import export_hf

    if getattr(args, "overrides", None):
        raise ConfigError(f"hf export takes no KEY=VALUE overrides: {' '.join(args.overrides)}")
    report = export_hf(args.source, args.out_dir, args.dtype, int(args.max_shard_gb * 2**30),
                       adapters=getattr(args, "adapters", False), overwrite=getattr(args, "overwrite", False))
    print(f"exported {report['family']} (step {report['step']}, {report['tensors']} tensors, "
          f"{report['bytes'] / 2**20:.1f} MiB in {len(report['files'])} file(s))"
          + (f" + {', '.join(report['tokenizer_files'])}" if report["tokenizer_files"] else "")
          + f" -> {report['out_dir']}")
    if "adapter_tensors" in report:
        print(f"adapters: {report['adapter_tensors']} PEFT tensors ({report['adapter_bytes'] / 2**20:.2f} MiB), "
              f"target_modules {report['target_modules']} -> {report['out_dir']}/adapter_model.safetensors")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from jaxinfra.hf.check import check_hf, format_report

    report = check_hf(args.hf_dir, args.run, args.tol)
    print(format_report(report))
    return 0 if report["ok"] else 1


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Adds `hf {import,export,check}` to the jaxinfra parser."""
    hf = sub.add_parser("hf", help="Hugging Face interop: import safetensors checkpoints, export runs")
    hf_sub = hf.add_subparsers(dest="hf_command", required=True)

    p = hf_sub.add_parser("import", help="HF dir (config.json + safetensors) -> jaxinfra run dir (params only)")
    p.add_argument("hf_dir")
    p.add_argument("out", help="output run directory: config.yaml + checkpoints/0")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. mesh.fsdp=4")
    p.add_argument("--adapter", metavar="PEFT_DIR", help="a PEFT LoRA adapter of this model: import a LoRA run "
                   "(base + adapters; the lora section from its adapter_config.json)")
    add_overwrite(p)
    p.set_defaults(func=cmd_import)

    p = hf_sub.add_parser("export", help="run dir or checkpoint -> HF config.json + model.safetensors")
    p.add_argument("source", metavar="RUN_OR_CKPT", help="run directory (newest checkpoint) or RUN/checkpoints/N")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="float32", choices=get_args(DType))
    number_flag(p, "--max-shard-gb", kind=float, lo=0, lo_open=True, default=5.0,
                help="split into several files above this size")
    p.add_argument("--adapters", action="store_true",
                   help="a LoRA run: also write its adapters in PEFT's format (the base is written unmerged)")
    add_overwrite(p)
    p.set_defaults(func=cmd_export)

    p = hf_sub.add_parser("check", help="score prompts with jaxinfra and transformers (or HF_DIR/reference.npz): "
                          "per-position max relative logit difference, losses, first diverging layer")
    p.add_argument("hf_dir")
    p.add_argument("run", nargs="?", help="an `hf import` output or run dir made from HF_DIR (default: import "
                   "HF_DIR in memory)")
    number_flag(p, "--tol", kind=float, lo=0, default=1e-5, help="max relative logit difference that passes "
                   "(float32: 1e-5); exit 1 above it")
    p.set_defaults(func=cmd_check)
