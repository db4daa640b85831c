"""The persistent compilation cache of `jaxinfra train` (jaxinfra/compile_cache.py).

Jax's cache is process-global and set up at the first compile, so the runs that must start cold
run as CLI subprocesses with their own `train.compile_cache` directory (which wins over the
JAX_COMPILATION_CACHE_DIR that tests/conftest.py sets for the test session)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import zlib

import pytest
from subprocs import cli_env

from jaxinfra import compile_cache

RUN = ["train.steps=2", "train.eval_every=0", "log.every=1", "log.progress=false", "log.tensorboard=false",
       "checkpoint.enabled=false", "model.num_layers=2", "train.seq_len=32", "train.batch_size=4"]


def _train(run_dir: pathlib.Path, cache: pathlib.Path) -> tuple[dict, str, str]:
    done = subprocess.run([sys.executable, "-m", "jaxinfra", "train", "tiny", *RUN, f"train.compile_cache={cache}",
                           "--run-dir", str(run_dir)], env=cli_env(1), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((run_dir / "summary.json").read_text()), done.stdout, done.stderr


def _step_entries(cache: pathlib.Path) -> list[pathlib.Path]:
    return sorted(cache.glob("jit_train_step-*-cache"))


@pytest.fixture(scope="module")
def cold_then_warm(tmp_path_factory):
    """A cold cache directory, filled by one run; a second run of the same config reads it."""
    work = tmp_path_factory.mktemp("cache")
    cache = work / "xla"
    first = _train(work / "run1", cache)
    entries = {p: p.read_bytes() for p in _step_entries(cache)}
    second = _train(work / "run2", cache)
    return work, cache, first, second, entries


def test_second_run_loads_the_step_from_the_cache(cold_then_warm):
    _, cache, (first, out1, _), (second, out2, _), entries = cold_then_warm
    assert len(entries) == 1  # the train step's entry was written by the first run
    assert first["compile_cache"] == second["compile_cache"] == str(cache)
    assert first["compile_cache_hit"] is False and second["compile_cache_hit"] is True
    assert f"cache: miss, wrote {cache})" in out1 and f"cache: hit, {cache})" in out2
    for s, out in ((first, out1), (second, out2)):
        assert s["compile_s"] == pytest.approx(s["compile_trace_s"] + s["compile_lower_s"] + s["compile_xla_s"])
        assert min(s["compile_trace_s"], s["compile_lower_s"], s["compile_xla_s"], s["first_step_s"]) > 0
        line, = (x for x in out.splitlines() if "step compiled in" in x)  # once, after the first step ran
        assert line.endswith(f"; first step ran in {s['first_step_s']:.2f} s"), line
        assert f"(trace {s['compile_trace_s']:.1f} s, lower {s['compile_lower_s']:.1f} s, XLA " in line, line
    assert first["first_step_s"] < first["compile_xla_s"]  # the run alone: the step's compile is not in it
    assert second["compile_xla_s"] < first["compile_xla_s"]  # a load, not a compile
    assert second["final_loss"] == first["final_loss"]  # the cached program computes the same


def test_corrupted_entry_warns_once_compiles_and_is_replaced(cold_then_warm):
    work, cache, (first, _, _), _, entries = cold_then_warm
    (entry, good), = entries.items()
    entry.write_bytes(good[: len(good) // 2])  # a write cut short (jax writes entries in place, not atomically)
    summary, out, err = _train(work / "run3", cache)
    warnings = [line for line in (out + err).splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "jaxinfra: warning: compile cache entry of jit_train_step unreadable"), out + err
    assert "Traceback" not in err and "UserWarning" not in err
    assert summary["exit_code"] == 0 and summary["compile_cache_hit"] is False
    assert summary["final_loss"] == first["final_loss"]
    zlib.decompress(entry.read_bytes())  # jax's entry format (zlib without zstandard): whole again


def test_cache_dir_setting_and_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir(None) == str(tmp_path / "xdg" / "jaxinfra" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache.cache_dir(None) == os.path.join(str(tmp_path), ".cache", "jaxinfra", "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.cache_dir(None) == str(tmp_path / "env")  # the variable wins over the default
    assert compile_cache.cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")  # an explicit path over it
    monkeypatch.chdir(tmp_path)
    assert compile_cache.cache_dir("rel") == str(tmp_path / "rel")
    assert compile_cache.cache_dir(False) is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
    assert compile_cache.cache_dir(None) is None  # empty variable: off
