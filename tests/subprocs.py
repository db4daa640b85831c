"""What the tests' `python -m jaxinfra ...` children need (their environment), and the process limits tests change."""

from __future__ import annotations

import contextlib
import os
import pathlib
import resource

REPO = pathlib.Path(__file__).resolve().parents[1]


def cli_env(devices: int) -> dict[str, str]:
    """os.environ with this checkout importable and `devices` fake CPU devices. The session's other
    XLA flags (conftest's optimisation level) and compile cache are kept, so children compile as
    cheaply as the test process and share programs with each other."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": " ".join(flags)}


@contextlib.contextmanager
def file_size_limit_restored():
    """Put this process's file size limit back afterwards (a soft limit may be raised again up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
