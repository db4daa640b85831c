"""Failures at scale and the checkpoint interval that follows (docs/guide/16-hardware-clusters.md).

A synchronous job on N devices stops when any one of them fails, so with independent failures
its mean time between interruptions is the per-device MTBF divided by N. Between two
checkpoints a job loses, per failure, on average half an interval of work plus the restart;
checkpointing more often costs the write time C (for jaxinfra's asynchronous checkpoints, the
seconds the loop is blocked: `checkpoint_block_s` in metrics.jsonl) once per interval. The
first-order cost per second of run (Young, CACM 1974):

    lost_fraction(t) = C / t + (t / 2 + R) / M      (t interval, C checkpoint cost, R restart, M MTBF)

is smallest at t = sqrt(2 C M) (`young_interval`). Daly (FGCS 2006) solved the exact model
(exponential failures, a failure may strike during a checkpoint or a restart) to higher order:
`daly_interval`; `exact_wall_factor` is that exact model, for checking both.
"""

from __future__ import annotations

import math


def job_mtbf_s(device_mtbf_s: float, devices: int) -> float:
    """Mean seconds between interruptions of a job that stops when any of `devices` fails."""
    if devices < 1 or device_mtbf_s <= 0:
        raise ValueError(f"need devices >= 1 and a positive MTBF, got {devices}, {device_mtbf_s}")
    return device_mtbf_s / devices


def device_mtbf_s(interruptions: int, days: float, devices: int) -> float:
    """Per-device MTBF implied by `interruptions` of a job on `devices` over `days` (reported counts)."""
    if interruptions < 1:
        raise ValueError("need at least one interruption to estimate an MTBF")
    return days * 86400.0 * devices / interruptions


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval sqrt(2 C M), the minimum of `lost_fraction`."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError("checkpoint time and MTBF must be positive")
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum: sqrt(2CM) (1 + x/3 + x^2/9) - C with x = sqrt(C / 2M), for C < 2M;
    M itself beyond that (checkpointing then costs more than it saves)."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError("checkpoint time and MTBF must be positive")
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = math.sqrt(checkpoint_s / (2.0 * mtbf_s))
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + x / 3.0 + x * x / 9.0) - checkpoint_s


def lost_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order fraction of wall time lost: checkpoint cost C/t plus, per failure (1/M per second),
    the half interval of work redone and the restart."""
    return checkpoint_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s


def exact_wall_factor(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Wall seconds per second of useful work under exponential failures (Daly's exact model):
    M e^(R/M) (e^((t + C)/M) - 1) / t. Its minimum over t is the true optimum interval."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m) / interval_s


def checkpoint_every(interval_s: float, step_s: float) -> int:
    """The `checkpoint.every` (in steps) nearest an interval, at least 1."""
    if step_s <= 0:
        raise ValueError("step time must be positive")
    return max(1, round(interval_s / step_s))
