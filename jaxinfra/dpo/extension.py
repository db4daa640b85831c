"""The dpo step extension (being built: until then a dpo config is refused as having no extension)."""

from __future__ import annotations

from jaxinfra.config import Config
from jaxinfra.extensions import StepExtension


def for_config(cfg: Config) -> StepExtension | None:
    """The `jaxinfra.extensions` entry point."""
    return None
