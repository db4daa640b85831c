"""Count XLA compilations over a training run, and say which step each came at (the no-recompile check).

Jax records `/jax/core/compile/backend_compile_duration` (jax/_src/dispatch.py BACKEND_COMPILE_EVENT)
around every backend compile of a jitted program, a load from the persistent cache included, so a
recompile is seen even when tests/conftest.py's cache serves it. `Runtime.train_step` is wrapped to
count the steps dispatched, which places each compile in the run."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import jax
import pytest

from jaxinfra.runtime import Runtime

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileLog:
    """(step, program) per compile: step 0 is before the first train step's dispatch, k during or after step k's."""

    def __init__(self) -> None:
        self.step = 0
        self.compiles: list[tuple[int, str]] = []

    def listen(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self.compiles.append((self.step, str(kwargs.get("fun_name"))))

    def count(self, program: str) -> int:
        return sum(name == f"jit({program})" for _, name in self.compiles)


@contextlib.contextmanager
def compile_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[CompileLog]:
    log = CompileLog()
    step = Runtime.train_step

    def counted(rt: Runtime, *args, **kwargs):
        log.step += 1
        return step(rt, *args, **kwargs)

    monkeypatch.setattr(Runtime, "train_step", counted)
    jax.monitoring.register_event_duration_secs_listener(log.listen)
    try:
        yield log
    finally:
        jax.monitoring.unregister_event_duration_listener(log.listen)
        monkeypatch.setattr(Runtime, "train_step", step)


def assert_no_recompile(log: CompileLog) -> None:
    """The train step compiles once, ahead of step 1 (whose call reuses that program), and never again;
    the eval step once (its first call); after step 1 no program compiles that compiled before, nor twice
    (a one-off helper's first call, e.g. the checkpoint's finite check at the first save, is allowed)."""
    train_compiles = [step for step, name in log.compiles if name == "jit(train_step)"]
    assert train_compiles == [0], f"train_step compiled at steps {train_compiles}, want [0]: {log.compiles}"
    assert log.count("eval_step") == 1, f"eval_step compiled {log.count('eval_step')} times: {log.compiles}"
    before = {name for step, name in log.compiles if step == 0}
    later = Counter(name for step, name in log.compiles if step >= 1)
    again = sorted(name for name, n in later.items() if n > 1 or name in before)
    assert not again, f"recompiled after the first step: {again} ({log.compiles})"
