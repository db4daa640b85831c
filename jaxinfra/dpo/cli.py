"""`jaxinfra dpo` subcommands (registered by jaxinfra/cli.py's build_parser).

    jaxinfra dpo save-reference CONFIG [KEY=VALUE ...] --out DIR [--restore PATH] [--steps N] [--no-progress]

CONFIG and the overrides are the DPO run's (the same data, train.seq_len / batch_size / seed);
--restore is the checkpoint the run will start from (the reference when dpo.reference is null).
Training with dpo.reference=DIR then reads the saved log-probs: no reference model in memory.
"""

from __future__ import annotations

import argparse
import json

from jaxinfra.flags import number_flag


def cmd_save_reference(args: argparse.Namespace) -> int:
    from jaxinfra.dpo.save import save_reference

    report = save_reference(args.config, getattr(args, "overrides", []), args.out, args.restore, args.steps,
                            progress=not args.no_progress)
    print(json.dumps(report))
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Adds `dpo save-reference` to the jaxinfra parser."""
    dpo = sub.add_parser("dpo", help="preference tuning: save a reference policy's log-probs for a DPO run")
    dpo_sub = dpo.add_subparsers(dest="dpo_command", required=True)
    p = dpo_sub.add_parser("save-reference", help="the reference's per-token log-probs of the batches of steps 1..N")
    p.add_argument("config", help="the DPO run's preset name or YAML path")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="the DPO run's overrides (data.*, train.*, ...)")
    p.add_argument("--out", required=True, help="new directory (an unfinished one of the same command continues)")
    p.add_argument("--restore", default=None, help="the checkpoint the DPO run starts from (its reference when "
                                                    "dpo.reference is null)")
    number_flag(p, "--steps", lo=1, sep=" ", default=None, help="training steps covered (default: train.steps)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_save_reference)
