"""Rematerialisation policies by name (models.config.RematPolicy) -> jax.checkpoint policies."""

from __future__ import annotations

from collections.abc import Callable

import jax

from kernels import mixed
from models.config import SAVED_NAMES


def remat_policy(name: str) -> Callable | None:
    """jax.checkpoint policy for a policy name; None means no rematerialisation."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "save_dots":
        return _rounded(jax.checkpoint_policies.checkpoint_dots, mixed.SAVED, mixed.SAVED_BATCHED)
    if name == "save_dots_no_batch":
        return _rounded(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, mixed.SAVED)
    if name in SAVED_NAMES:
        return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[name])
    raise ValueError(f"unknown remat policy {name!r}")


def _rounded(dots_policy: Callable, *names: str) -> Callable:
    """`dots_policy`, except that a bf16 x bf16 -> float32 dot of kernels/mixed.py is kept as its rounded
    (compute-dtype) result, saved by name, not as the float32 dot output: half the bytes. Float32 runs have
    no such dots, so their policy is unchanged."""
    by_name = jax.checkpoint_policies.save_only_these_names(*names)

    def policy(prim, *avals, **params):
        if mixed.is_mixed_dot(prim, *avals, **params):
            return False
        return dots_policy(prim, *avals, **params) or by_name(prim, *avals, **params)

    return policy
