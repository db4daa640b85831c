"""I/O failures end in one stderr line and exit 74, decided in one place (jaxinfra/exits.py
io_failure_line, used by jaxinfra.cli.main), with nothing of the user's lost (issue 35, found item 5);
corrupt input files (a garbage model.safetensors, a shard with flipped bytes) are one line of bad input.

The read-only cases use a real read-only directory: a tmpfs remounted read-only where this process
may mount (root: EROFS), else a chmod'ed copy (EACCES). The full disk is RLIMIT_FSIZE in this process
(tests/test_failure.py does the CLI on a tmpfs), with the save's background write awaited so the
step boundary that must stop the loop is known.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import time
import uuid

import jax
import numpy as np
import pytest
from subprocs import REPO, cli_env, file_size_limit_restored

from jaxinfra import cli
from jaxinfra.checkpoint import CheckpointWriteError
from jaxinfra.config import load_config
from jaxinfra.exits import EXIT_BAD_INPUT, EXIT_IO_FAILED, CorruptFileError, io_failure_line
from jaxinfra.train import Trainer, train

BASE = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=64",
        "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8",
        "train.eval_every=0", "log.every=1", "log.progress=false", "log.tensorboard=false", "mesh.data=1",
        "checkpoint.every=2", "checkpoint.keep=5"]
CLI = [*BASE, "mesh.data=-1", "train.steps=6"]  # in this process the CLI sees all 8 test devices


def cfg(*extra: str):
    return load_config("tiny", [*BASE, "train.steps=4", *extra])


def md5s(root: pathlib.Path) -> dict[str, str | None]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def one_line(capsys, argv: list[str], status: int) -> str:
    """cli.main(argv) in this process: `status`, and stderr exactly one line (returned)."""
    assert cli.main(argv) == status
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ------------------------------------------------------------------ the one place that decides


@pytest.mark.parametrize("code, fix", [
    (errno.ENOSPC, "free space"), (errno.EDQUOT, "free space"), (errno.EFBIG, "free space"),
    (errno.EROFS, "fix the permissions"), (errno.EACCES, "fix the permissions"), (errno.EPERM, "fix the permissions"),
    (errno.EISDIR, "move what is there aside"), (errno.ENOTDIR, "move what is there aside"),
    (errno.EEXIST, "move what is there aside"), (errno.EIO, "fix the path or the storage"),
    (errno.ESTALE, "fix the path or the storage")])
def test_storage_errors_are_one_line_naming_the_path(code, fix):
    line = io_failure_line(OSError(code, os.strerror(code), "/run/metrics.jsonl"))
    assert line is not None and "\n" not in line
    assert line.startswith(f"I/O failed ({os.strerror(code)}: /run/metrics.jsonl); {fix}")


def test_corrupt_input_files_are_bad_input_and_bugs_are_not_io_failures():
    from jaxinfra.exits import bad_input_errors

    corrupt = CorruptFileError("/hf/model.safetensors", "header too large")
    assert isinstance(corrupt, bad_input_errors()) and io_failure_line(corrupt) is None
    assert str(corrupt).startswith("/hf/model.safetensors could not be read (header too large)")
    for bug in (ValueError("x"), KeyError("k"), TypeError("t"), TimeoutError("no errno"), FileNotFoundError(2, "x")):
        assert io_failure_line(bug) is None  # a traceback is wanted (a missing input path is bad input: exit 2)


# ------------------------------------------------------------------ read-only run dirs


@contextlib.contextmanager
def read_only_copy(src: pathlib.Path):
    """A read-only copy of `src`: on a tmpfs remounted read-only (root), else chmod'ed (EACCES)."""
    if os.geteuid() != 0:
        where = pathlib.Path(shutil.copytree(src, src.parent / f"ro-{uuid.uuid4().hex[:8]}"))
        for p in [where, *where.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        try:
            yield where
        finally:
            for p in [where, *where.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
        return
    where = pathlib.Path("/tmp") / f"jaxinfra-ro-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True).returncode:
        where.rmdir()
        pytest.skip("root without mount(8) permission: no read-only directory to test on")
    try:
        shutil.copytree(src, where, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("trained")
    assert train(cfg(), run_dir, jax.devices()[:1])["exit_code"] == 0
    return run_dir


def test_read_only_run_dir_and_parent_are_one_line_exit_74(trained, capsys):
    with read_only_copy(trained) as run_dir:
        before = md5s(run_dir)
        line = one_line(capsys, ["train", "tiny", "--run-dir", str(run_dir), *CLI], EXIT_IO_FAILED)
        assert line.startswith("jaxinfra: error: I/O failed (") and str(run_dir) in line
        line = one_line(capsys, ["train", "tiny", "--run-dir", str(run_dir / "new" / "run"), *CLI], EXIT_IO_FAILED)
        assert f"{run_dir}/new" in line and "fix the permissions or choose a writable path" in line
        assert md5s(run_dir) == before


def test_metrics_jsonl_that_is_a_directory_is_one_line_and_nothing_is_written(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(IsADirectoryError) as caught:
        train(cfg("train.steps=2"), tmp_path, jax.devices()[:1])
    line = io_failure_line(caught.value)
    assert line.startswith(f"I/O failed (Is a directory: {tmp_path}/metrics.jsonl); move what is there aside")
    assert {p.name for p in tmp_path.iterdir()} <= {"metrics.jsonl", "config.yaml", "checkpoints"}
    assert (tmp_path / "metrics.jsonl").is_dir() and not any((tmp_path / "metrics.jsonl").iterdir())


def test_eval_of_a_read_only_run_with_a_damaged_newest_checkpoint_prints_no_tracebacks(trained, tmp_path):
    """Intermittently 346 lines of asyncio tracebacks in the issue (tensorstore's late callbacks after
    the failed read); run a few times: stderr stays empty and the result is step 2's."""
    damaged = pathlib.Path(shutil.copytree(trained, tmp_path / "run"))
    for path in (damaged / "checkpoints" / "4" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 64, (4, 33)).astype(np.int32))
    with read_only_copy(damaged) as run_dir:
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-m", "jaxinfra", "eval", str(run_dir), "--tokens", str(tokens)],
                                  env=cli_env(1), capture_output=True, text=True, timeout=300, cwd=REPO)
            assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr[-3000:]
            assert "checkpoints/4 is unreadable" in proc.stdout and '"eval_loss"' in proc.stdout


# ------------------------------------------------------------------ corrupt input files


def test_hf_import_of_a_garbage_safetensors_is_one_line_and_writes_nothing(tmp_path, capsys):
    src = pathlib.Path(shutil.copytree(REPO / "tests" / "fixtures" / "hf" / "llama", tmp_path / "hf"))
    for garbage in (b"garbage" * 10, (src / "model.safetensors").read_bytes()[:5000]):  # junk, and truncated
        (src / "model.safetensors").write_bytes(garbage)
        line = one_line(capsys, ["hf", "import", str(src), str(tmp_path / "out")], EXIT_BAD_INPUT)
        assert line.startswith(f"jaxinfra: error: {src}/model.safetensors could not be read (not a readable "
                               f"safetensors file: Error while deserializing header")
        assert not (tmp_path / "out").exists()


def test_data_inspect_verify_reports_flipped_bytes_instead_of_crashing(tmp_path, capsys):
    from jaxinfra.data.prepare import prepare

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(20)))
    out = tmp_path / "prepared"
    prepare([str(tmp_path / "in.jsonl")], str(out), workers=1, progress=False)
    shard = next(out.glob("shard-*.bin"))
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(b ^ 0xFF for b in data[:64])  # ids far outside the 257-id byte vocabulary
    shard.write_bytes(bytes(data))
    line = one_line(capsys, ["data", "inspect", str(out), "--verify"], EXIT_BAD_INPUT)
    assert line == f"jaxinfra: error: data inspect {out}: check failed: shard sha256 match meta.json: not {shard.name}"


# ------------------------------------------------------------------ a full disk during an async save



def test_no_step_runs_after_a_failed_async_save_and_the_summary_says_so(tmp_path, monkeypatch):
    """Step 2's save fails in the background (files capped at 200 KB: EFBIG, as a full disk fails);
    once that is known the loop stops at the next step boundary, not at step 4's save."""
    original = Trainer.save

    def save_then_let_it_fail(self, step, *args, **kwargs):
        if step == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        blocked = original(self, step, *args, **kwargs)
        while self.ckpt.manager.is_saving_in_progress():  # the background write has ended (failed)
            time.sleep(0.01)
        return blocked

    monkeypatch.setattr(Trainer, "save", save_then_let_it_fail)
    with file_size_limit_restored(), pytest.raises(CheckpointWriteError) as caught:
        train(cfg("train.steps=8"), tmp_path, jax.devices()[:1])
    assert (caught.value.step, caught.value.reason) == (2, "File too large")
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2  # step 3 never ran
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_code"] == EXIT_IO_FAILED and summary["steps"] == 2 and "step 2" in summary["error"]
    assert not list(tmp_path.glob("checkpoints/*"))  # the failed step's temporary directory removed


def test_params_written_outside_training_fail_in_one_line_and_leave_no_partial_write(trained, tmp_path, capsys):
    """export-params (and hf import, quantize, lora merge: save_params_only) on a full disk (EFBIG here)
    and into a read-only directory: the storage's error, one line, no Orbax pages, no tmp directory."""
    out = tmp_path / "exported"
    with file_size_limit_restored():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        line = one_line(capsys, ["export-params", str(trained), str(out)], EXIT_IO_FAILED)
    assert line.startswith(f"jaxinfra: error: I/O failed (File too large: {out}); free space")
    assert not list(tmp_path.iterdir())
    with read_only_copy(trained) as run_dir:
        line = one_line(capsys, ["export-params", str(run_dir), str(run_dir / "out")], EXIT_IO_FAILED)
        assert line.startswith("jaxinfra: error: I/O failed (") and f": {run_dir}/out" in line
