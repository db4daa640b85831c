"""Outputs are built beside their final name and renamed into place (jaxinfra/atomic.py), and an existing
output is refused unless --overwrite: a writer killed with SIGKILL (tests/killpoint.py freezes it mid-write or
just before the rename) leaves nothing under the final name that looks complete, its temporary is
recognisable, and the next write of the same output removes it."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import pytest

from jaxinfra import atomic, cli
from jaxinfra.atomic import OutputExistsError, atomic_dir, atomic_write_text
from jaxinfra.exits import EXIT_BAD_INPUT
from tests.subprocs import REPO, cli_env

LLAMA = REPO / "tests" / "fixtures" / "hf" / "llama"


def _md5s(folder: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("jaxinfra: error: ") and "Traceback" not in err, err
    return err


def _killed_at(tmp_path: pathlib.Path, mode: str, k: int, argv: list[str]) -> int:
    """Runs `jaxinfra argv` in a child frozen at the killpoint, SIGKILLs it there; returns its pid."""
    marker = tmp_path / f"at-{mode}-{k}"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "killpoint.py"), mode, str(k), str(marker), "--",
                             *argv], env=cli_env(1), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate()[1].decode()
    assert alive and marker.exists(), f"the child never reached the killpoint: {err[-2000:]}"
    return proc.pid


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    """A params-only run dir (the llama fixture imported): the source the writers below export."""
    from jaxinfra.hf.importer import import_hf

    out = tmp_path_factory.mktemp("atomic") / "run"
    import_hf(LLAMA, out, devices=jax.devices()[:1])
    return out


# ---------------------------------------------------------------- the helper


def test_files_are_refused_unless_replaced_and_errors_leave_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "a" / "out.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(OutputExistsError, match=r"out.json already exists; pass --overwrite to replace it"):
        atomic_write_text(path, "new\n")
    with pytest.raises(OutputExistsError, match="is a directory"):
        atomic_write_text(tmp_path / "a", "x")

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", crash)  # the write fails before the rename
    with pytest.raises(OSError):
        atomic_write_text(path, "new\n", replace=True)
    monkeypatch.undo()
    assert path.read_text() == "old\n" and os.listdir(path.parent) == ["out.json"]  # no temporary left
    atomic_write_text(path, "new\n", replace=True)
    assert path.read_text() == "new\n"


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_directories_are_swapped_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    with atomic_dir(out) as build:
        for i in range(3):
            (build / f"shard-{i}").write_text(str(i))
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        with atomic_dir(out):
            pass
    with pytest.raises(RuntimeError), atomic_dir(out, replace=True) as build:
        (build / "new").write_text("half")
        raise RuntimeError("killed midway")
    assert sorted(os.listdir(tmp_path)) == ["out"] and sorted(os.listdir(out)) == ["shard-0", "shard-1", "shard-2"]
    with atomic_dir(out, replace=True) as build:
        (build / "only").write_text("new")
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["only"]  # no stale shard survives


def test_refusals_of_the_wrong_kind_of_path(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="is a file; the output is a directory"), atomic_dir(tmp_path / "file"):
        pass
    (tmp_path / "empty").mkdir()
    with atomic_dir(tmp_path / "empty") as build:  # an empty directory holds nothing to lose: used
        (build / "x").write_text("1")
    assert os.listdir(tmp_path / "empty") == ["x"]
    with pytest.raises(OutputExistsError, match="is or holds the input"), \
            atomic_dir(tmp_path, replace=True, inputs=[tmp_path / "file"]):
        pass


def test_temporaries_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getppid()
    for name in (f"out.tmp-{dead_pid}", f"out.old-{dead_pid}", f"out.tmp-{dead_pid}.orbax-checkpoint-tmp-1",
                 f"out.tmp-{live_pid}", f"other.tmp-{dead_pid}"):
        (tmp_path / name).mkdir()
    assert atomic.is_temporary(f"model.safetensors.tmp-{dead_pid}") and not atomic.is_temporary("model.safetensors")
    with atomic_dir(tmp_path / "out") as build:
        (build / "x").write_text("1")
    assert sorted(os.listdir(tmp_path)) == sorted(["out", f"out.tmp-{live_pid}", f"other.tmp-{dead_pid}"])


def test_small_writers_go_through_the_helper(tmp_path, monkeypatch):
    """Each writer of a run's or a sweep's small files, failing mid-write, keeps the old file whole."""
    from jaxinfra.distill.logits import _write_json
    from jaxinfra.metrics.writers import write_summary
    from jaxinfra.scaling.results import write_results
    from jaxinfra.sft.tasks import write_jsonl

    writers = {"summary.json": lambda v: write_summary(tmp_path, {"v": v}),
               "results.csv": lambda v: write_results([{"N": v}], tmp_path),
               "rows.jsonl": lambda v: write_jsonl([{"v": v}], tmp_path / "rows.jsonl"),
               "meta.json": lambda v: _write_json(tmp_path / "meta.json", {"v": v})}
    for write in writers.values():
        write(1)
    before = _md5s(tmp_path)

    class Half:
        def __init__(self, *args, **kwargs):
            self.f = open(*args, **kwargs)

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(atomic, "open", Half, raising=False)
    for name, write in writers.items():
        with pytest.raises(OSError):
            write(2)
        assert _md5s(tmp_path) == before, name
    assert not [n for n in os.listdir(tmp_path) if atomic.is_temporary(n)]


# ---------------------------------------------------------------- hf export, quantize, export-params


def test_hf_export_killed_mid_write_leaves_no_output_then_reruns(run, tmp_path, capsys):
    out = tmp_path / "hf"
    pid = _killed_at(tmp_path, "write", 3, ["hf", "export", str(run), str(out)])
    assert not out.exists()  # no model.safetensors under its final name, no config.json
    partial = tmp_path / f"hf.tmp-{pid}"
    assert partial.is_dir() and not (partial / "config.json").exists()
    assert cli.main(["hf", "export", str(run), str(out), "--max-shard-gb", "0.0001"]) == 0
    assert not partial.exists()  # the dead writer's temporary is removed by the next export
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    sharded = _md5s(out)

    err = _one_line(capsys, ["hf", "export", str(run), str(out)])
    assert f"{out} already exists; pass --overwrite to replace it" in err and _md5s(out) == sharded
    pid = _killed_at(tmp_path, "dir", 1, ["hf", "export", str(run), str(out), "--overwrite"])
    assert _md5s(out) == sharded  # killed before the swap: the old export, whole
    assert cli.main(["hf", "export", str(run), str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]  # no stale shard
    assert sorted(os.listdir(tmp_path)) == ["at-dir-1", "at-write-3", "hf"]


def test_params_only_outputs_are_built_beside_and_refused_in_one_line(run, tmp_path, capsys):
    out = tmp_path / "q"
    pid = _killed_at(tmp_path, "dir", 1, ["quantize", str(run), str(out), "--weights", "int8"])
    assert not out.exists() and atomic.is_temporary(f"q.tmp-{pid}") and (tmp_path / f"q.tmp-{pid}").is_dir()
    (tmp_path / "file").write_text("mine")
    err = _one_line(capsys, ["quantize", str(run), str(tmp_path / "file"), "--weights", "int8"])
    assert "is a file; the output is a directory" in err and (tmp_path / "file").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert cli.main(["export-params", str(run), str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "_CHECKPOINT_METADATA").is_file()
    capsys.readouterr()
    err = _one_line(capsys, ["export-params", str(run), str(tmp_path / "empty")])
    assert "already exists; pass --overwrite" in err


# ---------------------------------------------------------------- data prepare


def test_data_prepare_killed_mid_shard_then_failed_input_never_blocks(tmp_path, capsys):
    from jaxinfra.data.prepare import prepare

    docs = tmp_path / "a.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    out = tmp_path / "out"
    argv = ["data", "prepare", str(docs), "--out", str(out), "--bytes", "--workers", "1", "--shard-tokens", "2000"]
    _killed_at(tmp_path, "write", 3, argv)  # prepare.json, shard 0, then halfway through shard 0's offsets
    assert not (out / "meta.json").exists()
    meta = prepare([str(docs)], str(out), shard_tokens=2000, workers=1, progress=False)  # resumes
    clean = prepare([str(docs)], str(tmp_path / "clean"), shard_tokens=2000, workers=1, progress=False)
    assert meta["shards"] == clean["shards"] and not [n for n in os.listdir(out) if atomic.is_temporary(n)]

    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"nope": 1}\n')
    argv = ["data", "prepare", str(docs), str(bad), "--out", str(tmp_path / "two"), "--bytes", "--workers", "1",
            "--no-progress"]
    err = _one_line(capsys, argv)
    assert "no 'text' key" in err and not (tmp_path / "two").exists()  # nothing left to block the rerun
    bad.write_text('{"text": "fine"}\n{"text": "fixed"}\n')
    assert cli.main(argv) == 0 and (tmp_path / "two" / "meta.json").is_file()


def test_named_files_are_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "m.yaml"
    out.write_text("mine")
    argv = ["launch", "k8s", "tiny", "--hosts", "2", "--gpus-per-host", "1", "--pvc", "runs", "--out", str(out)]
    assert "pass --overwrite" in _one_line(capsys, argv) and out.read_text() == "mine"
    pid = _killed_at(tmp_path, "write", 1, [*argv, "--overwrite"])  # halfway through the manifests
    half = tmp_path / f"m.yaml.tmp-{pid}"
    assert out.read_text() == "mine" and half.is_file() and atomic.is_temporary(half.name)
    assert cli.main([*argv, "--overwrite"]) == 0 and out.read_text().startswith("# jaxinfra launch k8s")
    assert not half.exists()
    from jaxinfra.distill.logits import LogitsError, LogitsWriter

    with pytest.raises(LogitsError, match=r"--out .*m.yaml is a file; give a new directory"):
        LogitsWriter(out, {})  # save-logits / save-reference resume a directory: a file there is one line
