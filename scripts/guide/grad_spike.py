"""`jaxinfra train` with the gradient of chosen steps multiplied by a factor: an outlier batch, on demand.

    python scripts/guide/grad_spike.py STEPS FACTOR CONFIG --run-dir DIR [KEY=VALUE ...]

STEPS are 1-based, comma-separated. At those steps the objective (and so every gradient) is
multiplied by FACTOR; the reported cross-entropy (`loss`) is unchanged and `grad_norm` shows
the spike. Everything else is the CLI's own training path, as tests/nan_steps.py does for NaN.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp

from jaxinfra.extensions import StepContext, StepExtension


class GradSpike(StepExtension):
    """The objective times `factor` at `steps` (times 1 elsewhere)."""

    name = "grad_spike"

    def __init__(self, steps: Sequence[int], factor: float):
        self.steps, self.factor = tuple(int(s) for s in steps), float(factor)

    def objective(self, ctx: StepContext, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        spike = jnp.isin(ctx.step + 1, jnp.asarray(self.steps))
        return {**sums, "loss_sum": sums["loss_sum"] * jnp.where(spike, self.factor, 1.0)}


def main(argv: list[str]) -> int:
    import jaxinfra.runtime as runtime
    from jaxinfra.cli import main as cli_main

    steps, factor, rest = [int(s) for s in argv[0].split(",")], float(argv[1]), argv[2:]
    chosen = runtime.extensions_for
    runtime.extensions_for = lambda cfg: [*chosen(cfg), GradSpike(steps, factor)]
    return cli_main(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
