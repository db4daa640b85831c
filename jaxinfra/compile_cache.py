"""XLA's persistent compilation cache for `jaxinfra train`, `generate` and `eval`, on by default.

`configure(cfg)` points jax's cache at `train.compile_cache`: null -> `$JAX_COMPILATION_CACHE_DIR` if
set (empty: off), else `$XDG_CACHE_HOME/jaxinfra/xla` (`~/.cache/jaxinfra/xla`); a path -> that
directory; false -> off. A rerun of the same config then loads its programs from disk instead of
compiling them: tracing and lowering still run (they are Python and cannot be cached across
processes), XLA's compile is what the cache saves. The cache key is the program, the XLA flags, the
compile options, the devices and the jax/jaxlib versions, so a changed config or upgrade misses.
Jax only caches programs that took at least `jax_persistent_cache_min_compile_time_secs` (1 s by
default) to compile; we lower it to 0 (CPU compiles of small models are short, and every miss costs
a whole compile), unless the user set `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` /
`..._MIN_ENTRY_SIZE_BYTES` themselves. Only process 0 writes entries (jax's rule); every process reads.

An entry jax cannot read (truncated, garbled: zlib raises on its checksum, a valid stream of garbage
fails to deserialize) is a miss with a warning in jax; jax then compiles afresh but never overwrites
an existing file, so the bad entry would stay and warn on every run. `watch()` turns that into one
`jaxinfra: warning:` line and removes the bad file before jax writes the fresh executable in its place.

`watch()` also counts cache hits and writes (jax.monitoring events) while a compile runs, which is
how the trainer's startup line tells "cache: hit" from "cache: miss, wrote DIR".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import warnings
from collections.abc import Iterator
from typing import Any

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
# jax's own threshold settings and the environment variables that set them (a user's value wins).
_THRESHOLDS = (("jax_persistent_cache_min_compile_time_secs", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"),
               ("jax_persistent_cache_min_entry_size_bytes", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"))
_READ_ERROR = "Error reading persistent compilation cache entry"  # jax/_src/compiler.py's warning
_MISS_LOG = "PERSISTENT COMPILATION CACHE MISS"  # jax/_src/compiler.py log_persistent_cache_miss (DEBUG)
_ENTRY_SUFFIX = "-cache"  # jax/_src/lru_cache.py: one file <key>-cache per entry


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfra", "xla")


def cache_dir(setting: str | bool | None) -> str | None:
    """The directory `train.compile_cache` asks for (None: the cache is off)."""
    if setting is False:
        return None
    if isinstance(setting, str) and setting:
        return setting if "://" in setting else os.path.abspath(os.path.expanduser(setting))
    if ENV_DIR in os.environ:
        return os.environ[ENV_DIR] or None
    return default_dir()


def configure(cfg: Any) -> str | None:
    """Turn jax's persistent cache on at `cfg.train.compile_cache` (or off); returns the directory.

    Jax initialises its cache object once per process, at the first compile: when the directory
    changes after that (a second run in one process with another setting) the cache is reset so
    the new directory takes effect."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    directory = cache_dir(cfg.train.compile_cache)
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", directory)
        for option, env in _THRESHOLDS:
            if env not in os.environ:
                jax.config.update(option, 0)
    if (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache) != before:
        jax_cache.reset_cache()
    return directory


def active_dir() -> str | None:
    """The directory jax's cache reads and writes now (None: off)."""
    import jax

    return (jax.config.jax_compilation_cache_dir or None) if jax.config.jax_enable_compilation_cache else None


@dataclasses.dataclass
class CacheEvents:
    """What the persistent cache did during one `watch()`."""

    hits: int = 0
    writes: int = 0
    replaced: list[str] = dataclasses.field(default_factory=list)  # bad entry files removed
    notes: list[str] = dataclasses.field(default_factory=list)  # one warning line per bad entry


def _counter(events: CacheEvents):
    def count(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            events.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":  # jax records it when it writes an entry
            events.writes += 1
    return count


class _BadEntryFilter(logging.Filter):
    """Sees jax's (DEBUG) miss records: a miss on a key whose entry file is already there means jax
    could not read that file. The file is removed now, before jax writes the fresh executable (its
    LRU cache never overwrites), so the entry is replaced. Records pass on at the level the logger
    would have shown anyway."""

    def __init__(self, shown_level: int, events: CacheEvents, main: bool):
        super().__init__()
        self.shown_level, self.events = shown_level, events
        self.main = main  # only process 0 writes entries (jax's rule), so only it replaces them

    def filter(self, record: logging.LogRecord) -> bool:
        directory = active_dir()
        miss = isinstance(record.msg, str) and record.msg.startswith(_MISS_LOG) and len(record.args or ()) == 2
        if miss and self.main and directory and "://" not in directory:
            entry = pathlib.Path(directory) / f"{record.args[1]}{_ENTRY_SUFFIX}"
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                self.events.replaced.append(str(entry))
        return record.levelno >= self.shown_level


@contextlib.contextmanager
def watch() -> Iterator[CacheEvents]:
    """Count the cache's hits and writes inside the block, and replace entries jax could not read
    (one `jaxinfra: warning:` line each in `events.notes`, in place of jax's multi-line warning).
    Other warnings raised inside are passed on unchanged."""
    import jax

    events = CacheEvents()
    count = _counter(events)
    jax.monitoring.register_event_listener(count)
    logger = logging.getLogger("jax._src.compiler")
    level, shown = logger.level, logger.getEffectiveLevel()
    bad_entries = _BadEntryFilter(shown, events, jax.process_index() == 0)
    logger.addFilter(bad_entries)
    logger.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield events
    finally:
        jax.monitoring.unregister_event_listener(count)
        logger.removeFilter(bad_entries)
        logger.setLevel(level)
    _report(caught, events)


def _report(caught: list[warnings.WarningMessage], events: CacheEvents) -> None:
    for w in caught:
        text = str(w.message)
        if text.startswith(_READ_ERROR):
            module, _, reason = text.partition("for '")[2].partition("': ")
            replaced = events.replaced[len(events.notes)] if len(events.replaced) > len(events.notes) else None
            events.notes.append(f"jaxinfra: warning: compile cache entry of {module} unreadable "
                                f"({reason.splitlines()[0][:200] if reason else text[:200]}); compiled afresh"
                                + (f" and replaced {replaced}" if replaced else ""))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


@dataclasses.dataclass(frozen=True)
class CompileTimes:
    """The seconds of the train step's three compile phases (runtime.compile_train_step)."""

    trace_s: float  # jax traces the Python step into a jaxpr (Python; every process, every run)
    lower_s: float  # the jaxpr is emitted as StableHLO (Python; every run: not what the cache stores)
    xla_s: float  # XLA compiles the StableHLO, or loads the executable from the persistent cache

    @property
    def total_s(self) -> float:
        """summary.json's compile_s: the three phases, not the first step's run."""
        return self.trace_s + self.lower_s + self.xla_s


def describe(times: CompileTimes, events: CacheEvents, directory: str | None,
             first_step_s: float | None = None) -> str:
    """The startup line's account of the step's compile, and of its first run once that is known."""
    if directory is None:
        cache = "cache: off"
    elif events.hits:
        cache = f"cache: hit, {directory}"
    else:
        cache = f"cache: miss, wrote {directory}" if events.writes else f"cache: miss, {directory}"
    line = (f"step compiled in {times.total_s:.1f} s (trace {times.trace_s:.1f} s, lower {times.lower_s:.1f} s, "
            f"XLA {times.xla_s:.1f} s; {cache})")
    return line if first_step_s is None else f"{line}; first step ran in {first_step_s:.2f} s"
