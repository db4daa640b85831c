"""A test-only step extension standing in for lm-eval during training: host metrics at chosen steps.

`FakeEval({2: 0.5, 4: 0.75})` returns {"eval/fake_task/acc": value} after those steps and {} after the
others (jaxinfra/extensions.py: StepExtension.host_metrics); `fail_at=S` raises after step S, a crash
between checkpoints for the resume tests; `sigterm_at=S` sends this process SIGTERM there (a preemption:
the Trainer checkpoints step S and stops with exit 75).
"""

from __future__ import annotations

import signal
from typing import Any

from jaxinfra.extensions import HostContext, StepExtension

KEY = "eval/fake_task/acc"


class FakeEval(StepExtension):
    name = "fake_eval"

    def __init__(self, scores: dict[int, float], fail_at: int | None = None, sigterm_at: int | None = None):
        self.scores, self.fail_at, self.sigterm_at = dict(scores), fail_at, sigterm_at
        self.calls: list[int] = []

    def host_metrics(self, host: HostContext, step: int) -> dict[str, Any]:
        self.calls.append(step)
        if step == self.fail_at:
            raise RuntimeError(f"fake_eval: crash after step {step}")
        if step == self.sigterm_at:
            signal.raise_signal(signal.SIGTERM)
        return {KEY: self.scores[step]} if step in self.scores else {}
