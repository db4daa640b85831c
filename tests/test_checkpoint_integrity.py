"""Only committed checkpoints restore, and a run whose checkpoints cannot be read is never restarted
silently (issue 35, found items 3 and 4).

One trained run dir (steps 2 and 4 committed) is copied per case. A step directory without Orbax's
commit markers is ignored (read-only paths) or set aside (a run's own directory); when no checkpoint
can be read, nothing is moved and the run refuses (exit 74) until the storage is back or the user
passes --allow-fresh-start, and metrics.jsonl keeps its history either way.
"""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess
import sys

import jax
import pytest
from subprocs import cli_env

from jaxinfra.checkpoint import (
    COMMIT_MARKERS,
    Checkpointer,
    CheckpointError,
    CheckpointReadError,
    abstract_with_shardings,
    committed_steps,
    is_params_only,
    restore_params,
)
from jaxinfra.config import load_config
from jaxinfra.exits import EXIT_IO_FAILED
from jaxinfra.runtime import build_runtime
from jaxinfra.state import abstract_state
from jaxinfra.train import train

# tests/test_checkpoint.py's model, so the compiled programs are shared through the persistent cache.
BASE = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=64",
        "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8",
        "train.eval_every=0", "log.every=1", "log.progress=false", "log.tensorboard=false", "mesh.data=1",
        "checkpoint.every=2", "checkpoint.keep=5"]


def cfg(*extra: str):
    return load_config("tiny", [*BASE, "train.steps=4", *extra])


def md5s(run_dir: pathlib.Path) -> dict[str, str | None]:
    """Every path under the run dir with its contents' md5: "nothing moved or changed" compares these."""
    return {str(p.relative_to(run_dir)): hashlib.md5(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(run_dir.rglob("*"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("trained")
    assert train(cfg(), run_dir, jax.devices()[:1])["exit_code"] == 0
    assert committed_steps(run_dir / "checkpoints") == [2, 4]
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(trained, tmp_path / "run"))


@pytest.fixture(scope="module")
def target():
    rt = build_runtime(cfg(), jax.devices()[:1])
    return abstract_with_shardings(abstract_state(cfg().model, rt.tx), rt.state_shardings)


def _uncommitted_copy(run_dir: pathlib.Path, step: int, drop: tuple[str, ...]) -> pathlib.Path:
    """RUN/checkpoints/<step>: a copy of step 4 without the commit markers `drop` (its arrays are intact)."""
    copy = run_dir / "checkpoints" / str(step)
    shutil.copytree(run_dir / "checkpoints" / "4", copy)
    for name in drop:
        (copy / name).unlink()
    return copy


def _damage(step_dir: pathlib.Path) -> None:
    """Truncate the state's data files: the metadata still reads, the arrays do not."""
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


@pytest.mark.parametrize("drop", [COMMIT_MARKERS, COMMIT_MARKERS[:1], COMMIT_MARKERS[1:]],
                         ids=["both", "metadata", "commit_success"])
def test_a_step_without_commit_markers_is_never_restored(run_copy, target, capsys, drop):
    """Reading paths (eval, generate, hf export, quantize, --restore) ignore it with one warning line and
    leave it in place; asked for by name it is refused; the run's own Checkpointer sets it aside."""
    fake = _uncommitted_copy(run_copy, 8, drop)
    assert committed_steps(run_copy / "checkpoints") == [2, 4] and not is_params_only(run_copy)
    step, _ = restore_params(run_copy, target.params)
    warned = [line for line in capsys.readouterr().out.splitlines() if "commit markers" in line]
    assert step == 4 and len(warned) == 1 and str(fake) in warned[0] and fake.is_dir()
    with pytest.raises(CheckpointError, match=r"no committed checkpoint 8 under .* \(have: \[2, 4\]\)"):
        restore_params(fake, target.params)
    reader = Checkpointer(run_copy / "checkpoints", cfg().checkpoint, read_only=True)  # --restore's source
    assert reader.restore_latest(target)[0] == 4 and fake.is_dir()
    reader.close()
    own = Checkpointer(run_copy / "checkpoints", cfg().checkpoint)  # the run's own: set aside, then resumed
    assert not fake.exists() and own.steps() == [2, 4] and own.restore_latest(target)[0] == 4
    own.close()
    aside = [p.name for p in (run_copy / "checkpoints").iterdir() if ".uncommitted-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("8.uncommitted-")


def test_resume_skips_an_uncommitted_step_and_saves_over_its_number(run_copy, capsys):
    """The issue's "resumed at step 8": now resumed at 4, and step 6 saved where the fake 6 was."""
    _uncommitted_copy(run_copy, 6, COMMIT_MARKERS)
    summary = train(cfg("train.steps=6"), run_copy, jax.devices()[:1])
    assert summary["exit_code"] == 0 and summary["resumed_from_step"] == 4
    assert committed_steps(run_copy / "checkpoints") == [2, 4, 6]
    out = capsys.readouterr().out
    assert "resumed at step 4" in out and sum("commit markers" in line for line in out.splitlines()) == 1


def test_no_readable_checkpoint_refuses_moves_nothing_and_fresh_start_keeps_the_history(run_copy):
    for step in (2, 4):
        _damage(run_copy / "checkpoints" / str(step))
    before = md5s(run_copy)
    for _ in range(2):  # the identical rerun refuses the same way: never a silent restart
        with pytest.raises(CheckpointReadError, match=r"no checkpoint under .* could be read \(2 tried; step 4: "
                                                      r".*nothing was moved.*--allow-fresh-start"):
            train(cfg(), run_copy, jax.devices()[:1])
        assert md5s(run_copy) == before
    history = (run_copy / "metrics.jsonl").read_bytes()
    summary = train(cfg("train.steps=2"), run_copy, jax.devices()[:1], allow_fresh_start=True)
    assert summary["exit_code"] == 0 and summary["resumed_from_step"] == 0
    names = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    assert names[0] == "2" and [n.split("-")[0] for n in names[1:]] == ["2.unreadable", "4.unreadable"]
    kept = list(run_copy.glob("metrics.before-fresh-start-*.jsonl"))
    assert len(kept) == 1 and kept[0].read_bytes() == history


def test_a_run_dir_whose_checkpoints_were_all_set_aside_is_not_restarted(run_copy):
    """Set aside by an earlier run (or an earlier version): the refusal, then the start the user asked for."""
    for step in (2, 4):
        (run_copy / "checkpoints" / str(step)).rename(run_copy / "checkpoints" / f"{step}.unreadable-1")
    before = md5s(run_copy)
    with pytest.raises(CheckpointReadError, match=r"all set aside as unreadable \(2.unreadable-1, 4.unreadable-1\);"
                                                  r" refusing to train from step 0 .* --allow-fresh-start"):
        train(cfg(), run_copy, jax.devices()[:1])
    assert md5s(run_copy) == before


def test_an_unreadable_newest_checkpoint_of_another_run_is_left_in_place(run_copy, target, capsys):
    """--restore's source is only read: the previous checkpoint is used, nothing there is moved."""
    _damage(run_copy / "checkpoints" / "4")
    before = md5s(run_copy)
    reader = Checkpointer(run_copy / "checkpoints", cfg().checkpoint, read_only=True)
    assert reader.restore_latest(target)[0] == 2
    reader.close()
    assert md5s(run_copy) == before
    assert "checkpoint " + str(run_copy / "checkpoints" / "4") + " is unreadable" in capsys.readouterr().out


def test_cli_no_readable_checkpoint_is_one_line_exit_74(run_copy):
    """The issue's 628 lines of asyncio tracebacks and exit 2: now exit 74 and one stderr line."""
    for step in (2, 4):
        _damage(run_copy / "checkpoints" / str(step))
    before = md5s(run_copy)
    proc = subprocess.run([sys.executable, "-m", "jaxinfra", "train", "tiny", "--run-dir", str(run_copy), *BASE,
                           "train.steps=4"], env=cli_env(1), capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == EXIT_IO_FAILED and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"jaxinfra: error: no checkpoint under {run_copy}/checkpoints could be read")
    assert md5s(run_copy) == before


def test_orphan_read_tasks_of_tensorstore_are_dropped_and_others_kept():
    """A failed read's other array tasks, collected later (intermittently a page each at exit in the
    issue): their futures are tensorstore's, awaited bare, so no Orbax frame names them."""
    import logging

    from jaxinfra.checkpoint import _DropOrphanWriteTasks

    read = ValueError('Error opening "zarr" driver: Error reading "step/.zarray" in OCDBT database at local file '
                      '"/run/checkpoints/4/state/": Error reading Byte range [0, 2408)')
    mine = ValueError("my own task failed")
    for error, kept in ((read, False), (mine, True)):
        record = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1,
                                   "Task exception was never retrieved\nfuture: <Task finished coro=<_wrap_awaitable()>>",
                                   None, (ValueError, error, None))
        assert _DropOrphanWriteTasks().filter(record) is kept
