"""`jaxinfra lora` subcommands (registered by jaxinfra/cli.py's build_parser).

    jaxinfra lora merge RUN OUT [--overwrite]    W + A B * alpha/rank into each target: a float params-only run dir
                                   (config.yaml with lora.rank=0) that generate, eval, hf export and
                                   train --restore take

Training needs no command: `jaxinfra train CONFIG lora.rank=8 ...` (docs/post-training.md).
"""

from __future__ import annotations

import argparse

from jaxinfra.atomic import add_overwrite


def cmd_merge(args: argparse.Namespace) -> int:
    from jaxinfra.config import ConfigError
    from jaxinfra.lora.merge import merge_lora

    if getattr(args, "overrides", None):
        raise ConfigError(f"lora merge takes no KEY=VALUE overrides: {' '.join(args.overrides)}")
    out = merge_lora(args.run, args.out, overwrite=getattr(args, "overwrite", False))
    print(f"merged {args.run} -> {out}")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Adds `lora merge` to the jaxinfra parser."""
    lora = sub.add_parser("lora", help="LoRA adapters: merge them into the base weights")
    lora_sub = lora.add_subparsers(dest="lora_command", required=True)
    p = lora_sub.add_parser("merge", help="a LoRA run -> a plain run with W + A B * alpha/rank in each target")
    p.add_argument("run", metavar="RUN", help="LoRA run directory (newest checkpoint) or RUN/checkpoints/N")
    p.add_argument("out", metavar="OUT", help="new output run directory: config.yaml (lora.rank=0) + checkpoints/0")
    add_overwrite(p)
    p.set_defaults(func=cmd_merge)
