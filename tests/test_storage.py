"""Object storage: run dirs, data, sweeps and checkpoints on s3:// (gs:// shares the code path).

Against a local S3-compatible server (moto's server mode on 127.0.0.1, started once for the module)
with the same client code as for a real bucket: s3fs for files, TensorStore's s3 driver for checkpoints.
Skipped with the reason when moto is not installed (`pip install -e '.[test]'` brings it). There is no
GCS emulator: gs:// is checked here for URL parsing and driver dispatch only.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml
from subprocs import cli_env

from jaxinfra import cli, storage
from jaxinfra.config import load_config
from jaxinfra.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from jaxinfra.rundir import LOCK_NAME, ObjectLock, RunDirError
from jaxinfra.train import train

STEPS = 30
BASE = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=64",
        "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8",
        f"train.steps={STEPS}", "train.eval_every=0", "data.eval_batches=1", "log.every=1", "log.progress=false",
        "log.tensorboard=false", "checkpoint.every=10", "mesh.data=1"]
BUCKET = "jaxinfra-test"


# ---------------------------------------------------------------- the local S3 server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server with one bucket; the AWS_* variables point every client at it, JAXINFRA_CACHE
    at a fresh directory. Yields the bucket's URL."""
    server = shutil.which("moto_server") or (pathlib.Path(sys.executable).parent / "moto_server")
    if not pathlib.Path(server).exists():
        pytest.skip("moto_server not installed (pip install 'moto[server]'): no local S3 server to test against")
    pytest.importorskip("s3fs", reason="s3fs not installed (pip install s3fs)")
    port = _free_port()
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "JAXINFRA_CACHE": str(tmp_path_factory.mktemp("cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "moto_server did not start"
            time.sleep(0.1)
        import fsspec

        fsspec.filesystem("s3").mkdir(BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        proc.terminate()
        proc.wait(timeout=30)


def _losses(text: str) -> dict[int, float]:
    """Training loss per step of a metrics.jsonl; a resumed run re-logs steps, the last entry wins."""
    return {row["step"]: row["loss"] for row in map(json.loads, text.splitlines()) if "loss" in row}


def _spawn(run_dir: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxinfra", "train", "tiny", "--run-dir", run_dir, *BASE, *extra],
                            env=cli_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, status: int = 0) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == status, out[-3000:]
    return out


# ---------------------------------------------------------------- acceptance 4: train, SIGTERM, resume


@pytest.fixture(scope="module")
def bucket_run(s3, tmp_path_factory):
    """A 30-step run on the bucket, SIGTERMed once it logged 3 steps and resumed with the same command,
    and the same run uninterrupted on local disk (1-device children; the last two run together, on the
    programs the first one compiled)."""
    url, local = f"{s3}/runs/a", tmp_path_factory.mktemp("local-run")
    first = _spawn(url)
    staged = storage.RunStaging(url).local / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (staged.is_file() and len(_losses(staged.read_text())) >= 3):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.01)
    first.send_signal(signal.SIGTERM)
    out = _finish(first, EXIT_PREEMPTED)
    stopped = json.loads(storage.read_text(f"{url}/summary.json"))["steps"]
    reference, resume = _spawn(str(local)), _spawn(url)
    resumed = _finish(resume)
    _finish(reference)
    return {"url": url, "local": local, "stopped": stopped, "first": out, "resumed": resumed}


def test_sigterm_on_a_bucket_exits_75_and_resumes_bitwise_as_on_local_disk(bucket_run):
    url, stopped = bucket_run["url"], bucket_run["stopped"]
    assert 0 < stopped < STEPS and f"stopping at step {stopped}" in bucket_run["first"]
    assert f"resumed at step {stopped}" in bucket_run["resumed"] and f"run dir {url}" in bucket_run["resumed"]
    got = _losses(storage.read_text(f"{url}/metrics.jsonl"))
    want = _losses((bucket_run["local"] / "metrics.jsonl").read_text())
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want  # bitwise: the floats compare equal
    steps = sorted(int(p.name) for p in storage.as_path(f"{url}/checkpoints").iterdir() if p.name.isdigit())
    assert steps == [10, 20, 30]  # the newest checkpoint.keep=3; the one of the stop was pruned
    assert not storage.as_path(f"{url}/{LOCK_NAME}").exists()  # released at the end


def test_eval_and_generate_read_a_run_dir_on_the_bucket(bucket_run, tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(8 * 33, dtype=np.int32).reshape(8, 33) % 64)
    storage.as_path(f"{bucket_run['url']}-data/tokens.npy").write_bytes(tokens.read_bytes())
    results = []
    for run, token_file in ((bucket_run["url"], f"{bucket_run['url']}-data/tokens.npy"),
                            (str(bucket_run["local"]), str(tokens))):
        assert cli.main(["eval", run, "--tokens", token_file, "--batch-size", "8"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0] == results[1]  # the same params, read back from the bucket
    assert cli.main(["generate", f"{bucket_run['url']}/checkpoints/{STEPS}", "--prompt-ids", "1,2,3",
                     "--max-new-tokens", "4"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 4


def test_restore_from_a_run_dir_on_the_bucket(bucket_run, tmp_path):
    cfg = load_config("tiny", [*BASE, f"train.steps={STEPS + 2}"])
    summary = train(cfg, tmp_path / "restored", jax.devices()[:1], restore_from=bucket_run["url"])
    assert summary["resumed_from_step"] == STEPS and summary["steps"] == STEPS + 2


# ---------------------------------------------------------------- data and sweeps on the bucket


def test_token_files_on_the_bucket_train_as_the_local_copy(s3, tmp_path):
    tokens = tmp_path / "train.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 64, 20_000).astype(np.uint16))
    storage.as_path(f"{s3}/data/train.npy").write_bytes(tokens.read_bytes())
    summaries = []
    for name, path in (("local", str(tokens)), ("bucket", f"{s3}/data/train.npy")):
        cfg = load_config("tiny", [*BASE, "data.source=tokens", f"data.paths=[{path}]", "train.steps=3",
                                   "checkpoint.enabled=false"])
        train(cfg, tmp_path / name, jax.devices()[:1])
        summaries.append(_losses((tmp_path / name / "metrics.jsonl").read_text()))
    assert summaries[0] == summaries[1] and len(summaries[0]) == 3


def test_a_sweep_on_the_bucket_lands_there_and_collect_reads_it_back(s3, tmp_path, capsys):
    from jaxinfra.scaling.workflow import sweep

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "s", "base": "tiny",
        "overrides": ["data.source=synthetic", "train.batch_size=8", "train.seq_len=32", "train.eval_every=0",
                      "data.eval_batches=1", "log.progress=false", "log.tensorboard=false", "log.peak_tflops=1"],
        "sizes": {"rule": {"aspect_ratio": 32, "head_dim": 16, "mlp_ratio": 2, "multiple_of": 16}, "depths": [1]},
        "grid": {"tokens": [1024, 2048]}}))
    out = f"{s3}/sweeps/s"
    result = sweep(spec, out=out, in_process=True, devices=jax.devices()[:1], fit=False, echo=print)
    assert set(result["status"].values()) == {"done"}, result["status"]
    for run in result["plan"].runs:
        assert str(run.run_dir).startswith(out) and (run.run_dir / "summary.json").is_file()
    storage.as_path(f"{out}/results.csv").unlink()
    capsys.readouterr()
    assert cli.main(["scaling", "collect", out]) == 0
    assert f"2 finished runs -> {out}/results.csv" in capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(storage.read_text(f"{out}/results.csv"))))
    assert [r["run"] for r in rows] == [r.name for r in result["plan"].runs]
    assert not list(pathlib.Path.cwd().glob("s3:*"))  # nothing landed in a local directory named like the URL


# ---------------------------------------------------------------- bad input: one line, exit 2


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_misspelled_bucket_is_one_line_and_nothing_is_written_locally(s3, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("JAXINFRA_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    for argv in (["train", "tiny", *BASE, "--run-dir", "s3://jaxinfra-tset/run"],
                 ["train", "tiny", *BASE, "data.source=tokens", "data.paths=[s3://jaxinfra-tset/t.npy]"],
                 ["train", "s3://jaxinfra-tset/config.yaml"],
                 ["eval", "s3://jaxinfra-tset/run", "--tokens", "s3://jaxinfra-tset/x.npy"],
                 ["generate", "s3://jaxinfra-tset/run", "--prompt-ids", "1"],
                 ["scaling", "collect", "s3://jaxinfra-tset/sweep"]):
        assert cli.main(argv) == EXIT_BAD_INPUT, argv
        line = _one_line(capsys)
        assert "bucket s3://jaxinfra-tset does not exist" in line, line
    assert os.listdir(tmp_path) == []  # no staging dir, no cache, no runs/: nothing at all


def test_an_unreachable_endpoint_is_one_line_naming_the_bucket(s3, capsys, monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec reuses clients made with the old endpoint
    try:
        assert cli.main(["train", "tiny", *BASE, "--run-dir", f"{s3}/run"]) == EXIT_BAD_INPUT
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert f"--run-dir {s3}/run: bucket {s3} cannot be reached (Could not connect" in _one_line(capsys)


def test_an_unsupported_scheme_is_one_line(s3, capsys):
    assert cli.main(["train", "tiny", *BASE, "--run-dir", "az://container/run"]) == EXIT_BAD_INPUT
    assert "the URL scheme 'az://' is not supported; use gs://, s3:// or a local path" in _one_line(capsys)


def test_a_live_run_holds_the_bucket_lock_and_a_stale_lock_is_taken_over(s3, capsys, monkeypatch):
    """Another host's lock: refreshed while we watch, refused; not refreshed for STALE_S, taken over."""
    import threading

    monkeypatch.setattr(ObjectLock, "REFRESH_S", 0.3)
    monkeypatch.setattr(ObjectLock, "STALE_S", 1.0)
    url = f"{s3}/runs/locked"
    lock = storage.as_path(url) / LOCK_NAME
    other = {"host": "node-7", "pid": 4242, "since": "2026-01-01 00:00:00"}
    lock.write_text(json.dumps({**other, "refreshed": time.time()}))
    stop = threading.Event()

    def live_owner():  # the other run's refresher
        while not stop.wait(0.05):
            lock.write_text(json.dumps({**other, "refreshed": time.time()}))

    owner = threading.Thread(target=live_owner)
    owner.start()
    try:
        with pytest.raises(RunDirError, match="in use by pid 4242 on host node-7"):
            ObjectLock(url).acquire()
    finally:
        stop.set()
        owner.join()
    lock.write_text(json.dumps({**other, "refreshed": time.time()}))  # fresh, but nobody refreshes it
    mine = ObjectLock(url)
    start = time.monotonic()
    mine.acquire()
    assert 0.9 < time.monotonic() - start < 5 and "taking it over" in capsys.readouterr().out
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    mine.release()
    assert not lock.exists()


# ---------------------------------------------------------------- without a server


def test_urls_parse_and_dispatch_for_gs_and_s3(monkeypatch):
    assert storage.split_url("gs://b/x/y/") == ("gs", "b", "x/y")
    assert storage.split_url("s3://b") == ("s3", "b", "")
    assert isinstance(storage.as_path("runs/x"), pathlib.Path)
    assert str(storage.as_path("gs://b/run") / "checkpoints") == "gs://b/run/checkpoints"
    with pytest.raises(storage.StorageError, match="'az://' is not supported"):
        storage.as_path("az://c/x")
    import importlib.util

    if importlib.util.find_spec("gcsfs") is None:  # gs:// without its driver: one line naming the extra
        with pytest.raises(storage.StorageError, match=r"pip install 'jaxinfra\[gcs\]'"):
            storage.check_bucket("gs://b/run", "--run-dir")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    assert storage.s3_kvstore("s3://b/run/checkpoints/10") == {
        "driver": "s3", "bucket": "b", "path": "run/checkpoints/10", "endpoint": "http://127.0.0.1:9",
        "aws_region": "eu-west-3"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    assert storage.s3_kvstore("s3://b/x")["aws_credentials"] == {"type": "environment"}


def test_the_orbax_functions_the_s3_adapter_replaces_still_exist():
    """Orbax 0.12.8 has no s3:// TensorStore spec; storage.install_orbax_s3 replaces these three
    functions. If a future Orbax renames them (or learns s3:// itself), revisit the adapter."""
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    for module, name in ((ts_utils, "_normalize_path"), (ts_utils, "_use_gcs_driver"),
                         (gcs_utils, "get_kvstore_for_gcs")):
        assert callable(getattr(module, name, None)), f"orbax no longer has {module.__name__}.{name}"
    storage.install_orbax_s3()
    storage.install_orbax_s3()  # idempotent
    assert ts_utils._normalize_path("s3://b/run//checkpoints/") == "s3://b/run/checkpoints"
    assert ts_utils._normalize_path("gs://b/run/") == "gs://b/run"
    assert ts_utils._normalize_path("/tmp/run/") == "/tmp/run"
    assert ts_utils._use_gcs_driver("s3://b/x") and ts_utils._use_gcs_driver("gs://b/x")
    assert not ts_utils._use_gcs_driver("/tmp/x")
    assert gcs_utils.get_kvstore_for_gcs("gs://b/x")["bucket"] == "b"
    assert gcs_utils.get_kvstore_for_gcs("gs://b/x")["driver"] != "s3"
    assert gcs_utils.get_kvstore_for_gcs("s3://b/x")["driver"] == "s3"
