"""Running lm-eval tasks on an LM, offline, and flattening the results to `eval/<task>/<metric>`."""

from __future__ import annotations

import difflib
import math
import pathlib
from collections.abc import Sequence
from typing import Any

from jaxinfra.harness import HarnessError, require_lm_eval


def task_manager(include_path: str | None = None, tasks: Sequence[str] = ()) -> Any:
    """lm-eval's TaskManager over `include_path` (local task YAMLs) and lm-eval's built-in tasks. When every
    name in `tasks` is a local task, the built-ins are left out: indexing their ~15k YAMLs takes seconds."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not pathlib.Path(include_path).is_dir():
            raise HarnessError(f"--include-path {include_path!r}: no such directory (a folder of lm-eval task YAMLs)")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if tasks and all(t.strip() in local.all_tasks for t in tasks if t.strip()):
            return local
    return TaskManager(include_path=include_path)


def check_tasks(manager: Any, tasks: Sequence[str]) -> list[str]:
    """The task names, each known to `manager` (a task, group or tag); else HarnessError listing close matches."""
    names = [t.strip() for t in tasks if t.strip()]
    if not names:
        raise HarnessError("--tasks is empty: give lm-eval task names, e.g. --tasks hellaswag,arc_easy")
    known = list(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hint = f"; close matches: {', '.join(close)}" if close else "; `lm-eval ls tasks` lists them"
            raise HarnessError(f"unknown lm-eval task {name!r}{hint}")
    return names


def run_tasks(lm: Any, tasks: Sequence[str], *, limit: int | None = None, num_fewshot: int | None = None,
              include_path: str | None = None, log_samples: bool = False, apply_chat_template: bool = False,
              bootstrap_iters: int = 100000, manager: Any = None) -> dict:
    """lm-eval's results dict (simple_evaluate) of `tasks` on `lm` (a JaxinfraLM instance).
    `manager`: a TaskManager to reuse (indexing the built-in tasks takes seconds)."""
    require_lm_eval()
    from lm_eval import simple_evaluate

    manager = manager if manager is not None else task_manager(include_path, tasks)
    names = check_tasks(manager, tasks)
    return simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, log_samples=log_samples,
                           apply_chat_template=apply_chat_template, task_manager=manager,
                           bootstrap_iters=bootstrap_iters, verbosity="WARNING")


def flat_scores(results: dict) -> dict[str, float]:
    """{"eval/<task>/<metric>": value} of a results dict: lm-eval's "acc,none" -> "acc", another filter f
    -> "acc_f"; stderr entries are kept as "<metric>_stderr" when they are numbers ("N/A" is dropped),
    as are non-numeric values and the "alias" / "samples" entries."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}_{filt}"
            if math.isfinite(float(value)):
                out[f"eval/{task}/{name}"] = float(value)
    return out
