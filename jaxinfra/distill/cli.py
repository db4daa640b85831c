"""`jaxinfra distill` subcommands (registered by jaxinfra/cli.py's build_parser).

    jaxinfra distill save-logits TEACHER --out DIR --top-k 64 --steps N [--data KEY=VALUE ...]
                                 [--teacher-dtype bfloat16|float32] [--no-progress]

TEACHER is a run directory, RUN/checkpoints/<step> or an `hf import` output; --data overrides its
config.yaml the way the student run will set them (data.*, train.seq_len / batch_size / seed, mesh.*).
Online distillation needs no command: `jaxinfra train ... distill.teacher=TEACHER`.
"""

from __future__ import annotations

import argparse
import json
from typing import get_args

from jaxinfra.distill.config import TeacherDType
from jaxinfra.flags import number_flag


def cmd_save_logits(args: argparse.Namespace) -> int:
    from jaxinfra.distill.save import save_logits

    overrides = [*args.data, *getattr(args, "overrides", [])]
    report = save_logits(args.teacher, overrides, args.out, args.top_k, args.steps, args.teacher_dtype,
                         progress=not args.no_progress)
    print(json.dumps(report))
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Adds `distill save-logits` to the jaxinfra parser."""
    distill = sub.add_parser("distill", help="knowledge distillation: save a teacher's top-k logits for offline use")
    distill_sub = distill.add_subparsers(dest="distill_command", required=True)
    p = distill_sub.add_parser("save-logits", help="the teacher's top-k logits of the batches of steps 1..N")
    p.add_argument("teacher", help="run directory, RUN/checkpoints/<step> or an `hf import` output")
    p.add_argument("--data", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of the teacher's config.yaml that the student run uses too: data.*, "
                        "train.seq_len, train.batch_size, train.seed (and mesh.*)")
    p.add_argument("--out", required=True, help="new directory (an unfinished one of the same command continues)")
    number_flag(p, "--top-k", lo=1, sep=" ", default=64, help="logits kept per token (default 64)")
    number_flag(p, "--steps", lo=1, sep=" ", required=True, help="training steps covered (the student's train.steps)")
    p.add_argument("--teacher-dtype", default="bfloat16", choices=get_args(TeacherDType),
                   help="the teacher's params and compute dtype (default bfloat16, as distill.teacher_dtype)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_save_logits)
