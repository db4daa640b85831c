"""`jaxinfra eval RUN --tasks T1,T2 ...`: lm-evaluation-harness tasks on a run (the `jaxinfra` model).

    jaxinfra eval CKPT --tasks T1,T2 [--num-fewshot K] [--limit N] [--include-path DIR] [--output PATH]
                  [--log-samples] [--apply-chat-template] [--batch-size N] [KEY=VALUE ...]

`add_task_source` joins --tasks to jaxinfra/infer/cli.py's `eval` (one required group with --tokens /
--text; jaxinfra/cli.py wires it, so the infer package never imports this one) and dispatches.
Task names and --include-path are checked before the model loads (bad input fails fast, one line,
exit 2); lm-eval's table goes to stdout, its results JSON to --output (default
RUN/eval/lm_eval-<UTC time>.json), the path to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

from jaxinfra.atomic import atomic_write_text, check_output
from jaxinfra.compile_cache import configure as configure_compile_cache
from jaxinfra.flags import number_flag
from jaxinfra.harness import HarnessError, require_lm_eval

# `eval --tasks` only; None/False = not given, so --tokens/--text can refuse them
TASK_OPTIONS = ("num_fewshot", "limit", "include_path", "output", "overwrite", "log_samples", "apply_chat_template")


def add_task_source(p: argparse.ArgumentParser, source: argparse._MutuallyExclusiveGroup) -> None:
    """--tasks in the eval parser's source group, its options, and the dispatching func."""
    source.add_argument("--tasks", help="comma-separated lm-evaluation-harness tasks (jaxinfra[eval]): prints "
                        "lm-eval's table and writes its JSON")
    number_flag(p, "--num-fewshot", lo=0, help="--tasks: few-shot examples per prompt (default: each task's)")
    number_flag(p, "--limit", lo=1, help="--tasks: documents per task (default: all)")
    p.add_argument("--include-path", help="--tasks: a folder of local task YAMLs (offline tasks on local data files)")
    p.add_argument("--output", help="--tasks: where lm-eval's results JSON goes (default RUN/eval/lm_eval-<time>.json)")
    p.add_argument("--overwrite", action="store_true", help="--tasks: replace an existing --output (else refused)")
    p.add_argument("--log-samples", action="store_true", help="--tasks: every request and response in the JSON")
    p.add_argument("--apply-chat-template", action="store_true", help="--tasks: prompts through the run's chat "
                   "template (data.chat_template)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """--tasks here; --tokens / --text to jaxinfra/infer/cli.py cmd_eval (the task options refused there)."""
    if args.tasks is not None:
        if args.seq_len is not None:
            raise HarnessError("--seq-len applies to --tokens / --text only (--tasks rows are lm-eval's requests)")
        return cmd_eval_tasks(args)
    given = [o for o in TASK_OPTIONS if getattr(args, o) not in (None, False)]
    if given:
        raise HarnessError(f"--{given[0].replace('_', '-')} applies to --tasks only")
    from jaxinfra.infer.cli import cmd_eval as cmd_eval_loss

    return cmd_eval_loss(args)


def output_path(args: argparse.Namespace) -> pathlib.Path:
    """--output, else RUN/eval/lm_eval-<UTC time>.json beside the run's checkpoints."""
    if args.output:
        return pathlib.Path(args.output)
    from jaxinfra.infer import resolve_checkpoint

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return pathlib.Path(resolve_checkpoint(args.ckpt)[0]) / "eval" / f"lm_eval-{stamp}.json"


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    require_lm_eval()
    from lm_eval.utils import handle_non_serializable, make_table

    from jaxinfra.harness.tasks import check_tasks, run_tasks, task_manager

    tasks = args.tasks.split(",")
    manager = task_manager(args.include_path, tasks)
    names = check_tasks(manager, tasks)
    out = output_path(args)
    check_output(out, args.overwrite, directory=False)  # before hours of evaluation, not after
    from jaxinfra.harness.model import JaxinfraLM

    lm = JaxinfraLM(pretrained=args.ckpt, overrides=list(args.overrides), batch_size=args.batch_size)
    configure_compile_cache(lm.cfg)  # before the first request compiles: the run's train.compile_cache
    results = run_tasks(lm, names, limit=args.limit, num_fewshot=args.num_fewshot, include_path=args.include_path,
                        log_samples=args.log_samples, apply_chat_template=args.apply_chat_template, manager=manager)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    atomic_write_text(out, json.dumps(results, indent=1, default=handle_non_serializable, ensure_ascii=False) + "\n",
                      replace=args.overwrite)
    print(f"jaxinfra eval: lm-eval results -> {out}", file=sys.stderr)
    return 0
