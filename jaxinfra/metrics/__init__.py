"""Training metrics: analytic FLOP counts, device peaks, and metric writers.

Step profiles and memory (docs/profiling.md), imported by module: `hlo` (what each op of a
compiled program is), `trace` (a jax.profiler trace -> each category's share of the step),
`memory` (compiled memory estimates, the allocator's peak, the largest batch that fits).
"""

from jaxinfra.metrics.flops import flops_per_token, param_counts
from jaxinfra.metrics.peak import PEAK_FLOPS_PER_DEVICE, measure_matmul_flops, peak_flops_per_device
from jaxinfra.metrics.writers import MetricsLogger, ProgressBar, mfu, write_summary

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
