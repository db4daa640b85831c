"""`Stat`: model state that is not trained (no gradient update, no optimizer state, no weight decay).

The train state keeps a model's Stats in their own subtree beside the params
(`nnx.split(model, nnx.Param, Stat)`): sharded by their logical axes and checkpointed like
params, but the optimizer never sees them. The train step updates them after the optimizer
from what the step observed (jaxinfra/extensions.py ModelStats): DeepSeek-V3's router bias from
the expert loads (models/router.py), fp8 delayed scaling's amax histories from the absmaxes their
custom VJP returns as a "cotangent" (models/project.py, models/qdot.py).
"""

from __future__ import annotations

from flax import nnx


class Stat(nnx.Variable):
    """A non-trainable model variable: updated by the train step's post-update hook, never by the optimizer."""
