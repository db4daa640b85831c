"""Multi-host code paths on one machine: 2 processes x 4 fake CPU devices over gloo.

The launcher starts two real processes that join one jax.distributed group; each
reads only its own rows of every batch. Their losses must equal 1 process x 8 devices.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxinfra.config import load_config
from jaxinfra.train import train

REPO = pathlib.Path(__file__).resolve().parents[1]


def overrides(tokens: pathlib.Path) -> list[str]:
    return ["data.source=tokens", f"data.paths=[{tokens}]", "model.vocab_size=64", "model.num_layers=2",
            "train.steps=5", "train.seq_len=32", "train.batch_size=8", "train.eval_every=0", "log.every=1",
            "log.progress=false", "log.tensorboard=false", "mesh.data=2", "mesh.fsdp=4"]


def losses(run_dir: pathlib.Path) -> np.ndarray:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return np.array([line["loss"] for line in lines if "loss" in line])


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 64, size=32 * 300 + 1).astype(np.uint16))
    return path


def test_two_processes_equal_one_process(tmp_path, tokens):
    multi = tmp_path / "multi"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "jaxinfra", "launch", "--local-processes", "2", "--devices-per-process", "4",
           "--", "train", "tiny", "--run-dir", str(multi), *overrides(tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1]" in proc.stdout  # both processes ran and reported

    single = tmp_path / "single"
    assert jax.device_count() == 8
    train(load_config("tiny", overrides(tokens)), single)

    got, want = losses(multi), losses(single)
    assert len(got) == len(want) == 5
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_launcher_reports_a_failing_child(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "jaxinfra", "launch", "--local-processes", "2", "--", "train", "tiny",
           "model.num_layerz=1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown key 'model.num_layerz'" in proc.stdout


def test_cluster_launch_files_run_the_same_train_command():
    import yaml

    sbatch = (REPO / "scripts/slurm/train.sbatch").read_text()
    assert "srun" in sbatch and "jaxinfra train" in sbatch
    docs = list(yaml.safe_load_all((REPO / "scripts/k8s/train-indexed-job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["jaxinfra", "train"]
    env = {e["name"] for e in container["env"]}
    # the names jaxinfra.distributed reads
    assert {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"} <= env
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(
        next(e["value"] for e in container["env"] if e["name"] == "JAX_NUM_PROCESSES"))


def test_collectives_benchmark_rows():
    from jaxinfra.bench import OPS, collectives_table
    from sharding.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=4), jax.devices())
    rows = collectives_table(mesh, [4096], OPS)
    assert {(r["axis"], r["op"]) for r in rows} == {(a, op) for a in ("data", "fsdp") for op in OPS}
    for r in rows:
        n = r["n"]
        factor = {"all_reduce": 2 * (n - 1) / n, "ppermute": 1.0}.get(r["op"], (n - 1) / n)
        assert r["time_us"] > 0 and r["bytes"] >= 4096 * 0.75
        np.testing.assert_allclose(r["busbw_GBps"], r["algbw_GBps"] * factor)


@pytest.mark.parametrize("statuses, want", [
    ([0, 0], 0), ([2, -15], 2), ([-15, 2], 2),  # a stopped sibling's SIGTERM never wins
    ([-9, 70], 70),  # process killed (OOM), its survivor reports the lost peer
    ([70, 2], 2), ([70, 70], 70),  # a lost peer follows the real failure, even when seen first
    ([3, 2], 3), ([2, 0, 75], 2), ([-9, 0], 128 + 9), ([], 0)])
def test_launcher_status_is_the_most_meaningful_child_status(statuses, want):
    from jaxinfra.launch import most_meaningful_status

    assert most_meaningful_status(statuses) == want


@pytest.mark.parametrize("flags", [["--local-processes", "0"], ["--local-processes", "-1"],
                                   ["--local-processes", "2", "--devices-per-process", "0"]])
def test_launch_with_no_processes_or_devices_is_one_line_exit_2(flags, capsys):
    from jaxinfra.cli import main

    assert main(["launch", *flags, "--", "train", "tiny"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfra: error: launch: --") and "must be >= 1" in err[0]


def test_launcher_names_the_first_failure_and_exits_with_its_status():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "jaxinfra", "launch", "--local-processes", "2", "--", "train", "tiny",
           "model.num_layerz=1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    first = [l for l in proc.stderr.splitlines() if l.startswith("jaxinfra launch:")]
    assert len(first) == 1 and re.fullmatch(r"jaxinfra launch: process [01] failed first \(exit 2\)"
                                            r"(; stopped the others)?", first[0]), proc.stderr
    failed = first[0].split()[3]
    errors = [l for l in proc.stdout.splitlines() if "jaxinfra: error:" in l]
    assert [l for l in errors if l.startswith(f"[{failed}] ")] and len(errors) <= 2  # at most one line per process
    assert len({l.split()[0] for l in errors}) == len(errors) and "Traceback" not in proc.stdout
