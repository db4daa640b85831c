"""Test setup: 8 fake CPU devices (before jax is imported) and the persistent compile cache."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

# jax reads JAX_COMPILATION_CACHE_DIR itself; cache every entry, however small or fast to compile.
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long checks, covered in the default run by a faster test")
