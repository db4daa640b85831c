"""Training metrics: analytic FLOP counts, device peaks, and metric writers.

Step profiles and memory (docs/profiling.md), imported by module: `hlo` (what each op of a
compiled program is), `trace` (a jax.profiler trace -> each category's share of the step),
`memory` (compiled memory estimates, the allocator's peak, the largest batch that fits),
`run_profile` (a training run's profile window, log.profile_steps, and `jaxinfra profile RUN`).
`writers.MetricsLogger` is the run's one metrics writer (JSONL, TensorBoard) and feeds the experiment
trackers of `trackers` (W&B, MLflow; docs/evaluation.md).

The FLOP counts are jax-free and load with the package; the rest loads on first use (PEP 562),
so the planner, the scaling tools and the CLI's parser can count FLOPs without loading jax.
"""

import importlib
from typing import Any

from jaxinfra.metrics.flops import flops_per_token, param_counts

_LAZY = {"PEAK_FLOPS_PER_DEVICE": "peak", "measure_matmul_flops": "peak", "peak_flops_per_device": "peak",
         "MetricsLogger": "writers", "ProgressBar": "writers", "mfu": "writers", "write_summary": "writers"}

__all__ = [
    "PEAK_FLOPS_PER_DEVICE",
    "MetricsLogger",
    "ProgressBar",
    "flops_per_token",
    "measure_matmul_flops",
    "mfu",
    "param_counts",
    "peak_flops_per_device",
    "write_summary",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
