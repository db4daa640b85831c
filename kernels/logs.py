"""Warnings logged once per message (a fallback taken at every trace should not flood the log).

Lives in kernels/, the bottom layer, so that kernels/ and sharding/ share it without
importing the models or the runtime.
"""

from __future__ import annotations

import logging


def log_once(logger: logging.Logger, seen: set[str], message: str) -> None:
    """`logger.warning(message)` unless `seen` already holds it (each module keeps its own set)."""
    if message not in seen:
        seen.add(message)
        logger.warning(message)
