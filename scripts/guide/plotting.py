"""matplotlib for the guide's figures, or one line saying how to install it."""

from __future__ import annotations

import pathlib
import sys
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (the scaling plots' own loader); exits with one line without it."""
    from jaxinfra.config import ConfigError
    from jaxinfra.scaling.plots import _pyplot

    try:
        return _pyplot()
    except ConfigError as e:
        raise SystemExit(f"{pathlib.Path(sys.argv[0]).name}: {e}") from None
