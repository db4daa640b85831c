"""Rematerialisation policies by name (models.config.RematPolicy) -> jax.checkpoint policies."""

from __future__ import annotations

from collections.abc import Callable

import jax

from models.config import SAVED_NAMES


def remat_policy(name: str) -> Callable | None:
    """jax.checkpoint policy for a policy name; None means no rematerialisation."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "save_dots":
        return jax.checkpoint_policies.checkpoint_dots
    if name == "save_dots_no_batch":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name in SAVED_NAMES:
        return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[name])
    raise ValueError(f"unknown remat policy {name!r}")
