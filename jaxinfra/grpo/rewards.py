"""GRPO's reward functions: `grpo.reward` entries `module:function` or `path.py:function`.

Contract: fn(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float],
one finite number per completion (prompts repeated group_size times, in rollout order). Entries
are resolved when the run is set up (before anything compiles): one that cannot be imported is a
ConfigError naming it. The reward of a completion is the weighted sum over functions
(grpo.reward_weights, all 1 when empty). A function that raises, returns the wrong count or a
non-finite / non-number value is a DataError naming the function and the first row at fault.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np

from jaxinfra.config import ConfigError
from jaxinfra.data.config import DataError

RewardFn = Callable[[list[str], list[str], list[str | None]], Sequence[float]]


def _load_path(path: str, entry: str):
    """A module from a .py file (relative to the working directory)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigError(f"grpo.reward={entry!r}: cannot import: file {path!r} not found (paths are relative "
                          f"to the working directory {os.getcwd()})")
    name = f"jaxinfra_reward_{abs(hash(full)):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - user code: any failure is a bad grpo.reward
        del sys.modules[name]
        raise ConfigError(f"grpo.reward={entry!r}: cannot import {path!r}: {type(e).__name__}: {e}") from None
    return module


def load_reward(entry: str) -> RewardFn:
    """The function named by `module:function` or `path.py:function`; ConfigError naming the entry."""
    where, _, attr = entry.rpartition(":")
    if not where or not attr:
        raise ConfigError(f"grpo.reward={entry!r}: expected 'module:function' or 'path.py:function'")
    if where.endswith(".py") or os.sep in where:
        module = _load_path(where, entry)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001 - user code
            raise ConfigError(f"grpo.reward={entry!r}: cannot import module {where!r}: "
                              f"{type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"grpo.reward={entry!r}: {where!r} has no function {attr!r}")
    return fn


class Rewards:
    """The configured reward functions and their weights."""

    def __init__(self, entries: Sequence[str], weights: Sequence[float] = ()):
        self.entries = tuple(entries)
        self.fns = [load_reward(e) for e in self.entries]
        self.weights = tuple(float(w) for w in weights) if weights else (1.0,) * len(self.fns)

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None]) -> np.ndarray:
        """float64 [rows]: the weighted sum of every function's rewards."""
        total = np.zeros(len(completions), np.float64)
        for entry, fn, w in zip(self.entries, self.fns, self.weights, strict=True):
            total += w * score(entry, fn, prompts, completions, answers)
        return total


def _head(text: str, n: int = 40) -> str:
    return repr(text[:n] + ("..." if len(text) > n else ""))


def score(entry: str, fn: RewardFn, prompts: list[str], completions: list[str],
          answers: list[str | None]) -> np.ndarray:
    """One function's rewards, checked: DataError naming the function and the row at fault."""
    try:
        out = fn(list(prompts), list(completions), list(answers))
    except Exception as e:  # noqa: BLE001 - user code: name it and the first row it was given
        raise DataError(f"grpo.reward {entry!r} raised {type(e).__name__}: {e} (on rows 0..{len(prompts) - 1}; "
                        f"row 0: prompt {_head(prompts[0])})") from None
    try:
        values = list(out)
    except TypeError:
        raise DataError(f"grpo.reward {entry!r} returned {type(out).__name__}, not a list of "
                        f"{len(completions)} numbers") from None
    if len(values) != len(completions):
        raise DataError(f"grpo.reward {entry!r} returned {len(values)} rewards for {len(completions)} completions "
                        f"(row 0: prompt {_head(prompts[0])})")
    for i, v in enumerate(values):
        ok = isinstance(v, int | float | np.integer | np.floating | np.bool_)  # bools count as 0 / 1
        if not ok or not math.isfinite(float(v)):
            raise DataError(f"grpo.reward {entry!r} returned {v!r} for row {i} (prompt {_head(prompts[i])}): "
                            f"every reward must be a finite number")
    return np.asarray(values, np.float64)
