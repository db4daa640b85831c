"""lm-evaluation-harness tasks during training: the `eval` step extension (config section `eval`).

At every completed step that is a multiple of `eval.every` (0: `train.eval_every`) and at the last
step (`train.steps`), `host_metrics` runs `eval.tasks` on the live params (`host.current_state()`,
used in place on the run's mesh through `JaxinfraLM.from_memory`, built once: later evals only swap
the params, so the compiled programs are reused) and returns lm-eval's scores as
`eval/<task>/<metric>` (jaxinfra/harness/tasks.py flat_scores); the train loop logs them at that
step to metrics.jsonl, TensorBoard and the trackers. A missing lm-eval, an unknown task or a missing
include path is refused at setup, before the first step compiles (one line, exit 2).
"""

from __future__ import annotations

from typing import Any

from jaxinfra.config import Config
from jaxinfra.extensions import HostContext, StepExtension
from jaxinfra.harness import require_lm_eval


def for_config(cfg: Config) -> StepExtension | None:
    """The `jaxinfra.extensions` entry point (pyproject.toml): task evals when `eval.tasks` is set."""
    return TaskEvals(cfg) if cfg.eval.enabled else None


class TaskEvals(StepExtension):
    name = "eval"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.every = cfg.eval.every or cfg.train.eval_every
        self.lm: Any = None  # a JaxinfraLM, built at the first eval
        self.manager: Any = None
        self.tasks: list[str] = []

    def setup(self, rt: Any) -> None:
        """Refuse a missing lm-eval or bad task names now, not at the first eval."""
        require_lm_eval("eval.tasks")
        from jaxinfra.harness import HarnessError
        from jaxinfra.harness.tasks import check_tasks, task_manager

        if dict(rt.mesh.shape).get("stage", 1) > 1:  # the inference forward has no pipeline schedule
            raise HarnessError(f"eval.tasks does not run on pipeline stages (mesh.stage={rt.mesh.shape['stage']})")
        ev = self.cfg.eval
        self.manager = task_manager(ev.include_path, ev.tasks)
        self.tasks = check_tasks(self.manager, ev.tasks)

    def due(self, step: int) -> bool:
        return step == self.cfg.train.steps or (self.every > 0 and step % self.every == 0)

    def host_metrics(self, host: HostContext, step: int) -> dict[str, float]:
        """{"eval/<task>/<metric>": value} at the eval steps, {} at the others."""
        if not self.due(step):
            return {}
        from jaxinfra.harness.model import JaxinfraLM
        from jaxinfra.harness.tasks import flat_scores, run_tasks
        from jaxinfra.state import model_state

        if not self.tasks:  # setup not called (a runtime built without it): check now
            self.setup(host.rt)
        params = model_state(host.current_state())
        if self.lm is None:
            self.lm = JaxinfraLM.from_memory(self.cfg, params, run_dir=host.run_dir, mesh=host.rt.mesh,
                                             batch_size=self.cfg.train.batch_size)
        else:
            self.lm.update_params(params)
        ev = self.cfg.eval
        results = run_tasks(self.lm, self.tasks, limit=ev.limit, num_fewshot=ev.num_fewshot, manager=self.manager,
                            bootstrap_iters=0)  # no bootstrapped stderrs: they would cost more than the eval
        return flat_scores(results)
