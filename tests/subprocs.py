"""The environment for `python -m jaxinfra ...` children of the tests."""

from __future__ import annotations

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def cli_env(devices: int) -> dict[str, str]:
    """os.environ with this checkout importable and `devices` fake CPU devices. The session's other
    XLA flags (conftest's optimisation level) and compile cache are kept, so children compile as
    cheaply as the test process and share programs with each other."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": " ".join(flags)}
