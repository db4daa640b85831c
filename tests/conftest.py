"""Test setup: 8 fake CPU devices (before jax is imported) and the persistent compile cache."""

import os
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
# XLA:CPU's LLVM optimisation level: level 0 compiles the tests' tiny programs ~3x faster and they
# still compute the same function (float results move by summation order, ~1e-7 relative, far
# inside every tolerance; bitwise checks compare runs compiled alike). A user's level wins.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# Compilation dominates on CPU, and every build_runtime makes fresh jitted functions, so tests
# recompile programs other tests already compiled. XLA's persistent cache (keyed by the program)
# makes each distinct program compile once per run, and not at all on a rerun. A user's
# JAX_COMPILATION_CACHE_DIR wins (set it empty to turn the cache off); otherwise <repo>/.jax_cache
# (git-ignored). Set in os.environ (jax reads it at import) so that CLI and multi-process
# subprocesses started by the tests share it. Cache every entry, however small or fast to compile.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".jax_cache"))
if os.environ["JAX_COMPILATION_CACHE_DIR"]:
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker per core, at most 4 (each holds 8 fake devices and its
    own compiled programs; compilation, which dominates, is single-threaded per program)."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long checks, covered in the default run by a faster test")
