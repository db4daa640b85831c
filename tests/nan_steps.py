"""A test-only step extension: NaN gradients at chosen (1-based) steps, for the fault-tolerance tests.

    python tests/nan_steps.py 3,4 tiny --run-dir DIR [KEY=VALUE ...]

is `jaxinfra train tiny --run-dir DIR ...` with those steps poisoned (the CLI's own path, the
extension added to the ones the config asks for).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxinfra.extensions import StepContext, StepExtension


class NanSteps(StepExtension):
    """The objective times NaN at `steps` (times 1 elsewhere): every gradient of those steps is NaN, as
    a bad batch or an overflow would make it, while the reported cross-entropy stays finite."""

    name = "nan_steps"

    def __init__(self, steps: Sequence[int]):
        self.steps = tuple(int(s) for s in steps)

    def objective(self, ctx: StepContext, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        bad = jnp.isin(ctx.step + 1, jnp.asarray(self.steps))
        return {**sums, "loss_sum": sums["loss_sum"] * jnp.where(bad, jnp.nan, 1.0)}


def main(argv: list[str]) -> int:
    import jaxinfra.runtime as runtime
    from jaxinfra.cli import main as cli_main

    steps, rest = [int(s) for s in argv[0].split(",")], argv[1:]
    chosen = runtime.extensions_for
    runtime.extensions_for = lambda cfg: [*chosen(cfg), NanSteps(steps)]
    return cli_main(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
