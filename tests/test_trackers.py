"""W&B and MLflow fed by the one metrics writer, host metrics from an extension, resume without duplicates.

One tiny run with a test extension (tests/fake_eval.py, standing in for lm-eval) that reports
`eval/fake_task/acc` after steps 2 and 4 and crashes after step 3 (the checkpoint is at step 2); the same
command then resumes to the end. Every output is read back through its own format: metrics.jsonl as
JSON, TensorBoard's event files (TFRecord + tensorboardX's Event proto, START purges applied as
TensorBoard does), MLflow through `MlflowClient`, and the offline W&B run's `.wandb` transaction log
(LevelDB log framing + wandb's own `Record` protobuf; the installed wandb no longer ships a Python reader).
"""

from __future__ import annotations

import json
import pathlib
import signal
import struct
import sys

import jax
import pytest
from fake_eval import KEY, FakeEval

from jaxinfra.config import ConfigError, load_config
from jaxinfra.metrics.trackers import default_tracking_uri
from jaxinfra.train import EXIT_PREEMPTED, Trainer

STEPS, CRASH = 6, 3
SCORES = {2: 0.02, 4: 0.04}
BASE = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=64",
        "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8",
        f"train.steps={STEPS}", "train.eval_every=0", "log.every=1", "log.progress=false", "checkpoint.every=2",
        "mesh.data=1", "log.wandb.project=jaxinfra-tests", "log.wandb.tags=[t1]", "log.mlflow.experiment=trackers"]
# (test_checkpoint.py's model and steps: the suite compiles that program once)


def _train(run_dir: pathlib.Path, fail_at: int | None = None) -> tuple[FakeEval, dict | None]:
    ext = FakeEval(SCORES, fail_at=fail_at)
    trainer = Trainer(load_config("tiny", BASE), run_dir, jax.devices()[:1], extensions=[ext])
    try:
        return ext, trainer.run()
    except RuntimeError as e:
        assert "fake_eval: crash" in str(e)
        return ext, None


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("tracked-run")
    from mlflow.tracking import MlflowClient

    first, _ = _train(run_dir, fail_at=CRASH)
    after_crash = json.loads((run_dir / "trackers.json").read_text())
    after_crash["mlflow_status"] = MlflowClient(default_tracking_uri(run_dir)).get_run(
        after_crash["mlflow"]["run_id"]).info.status
    second, summary = _train(run_dir)
    return {"dir": run_dir, "first": first, "second": second, "summary": summary, "after_crash": after_crash}


def _jsonl(run_dir: pathlib.Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def test_host_metrics_hook_runs_after_every_step_and_logs_only_what_it_returns(crashed_and_resumed):
    run = crashed_and_resumed
    assert run["first"].calls == [1, 2, 3] and run["second"].calls == [3, 4, 5, 6]  # resumed from step 2
    assert run["summary"]["exit_code"] == 0 and run["summary"]["resumed_from_step"] == 2
    assert _jsonl(run["dir"], KEY) == sorted(SCORES.items())
    assert [s for s, _ in _jsonl(run["dir"], "loss")] == list(range(1, STEPS + 1))


def test_tensorboard_has_the_host_metrics_and_each_loss_step_once(crashed_and_resumed):
    scalars = _tensorboard_scalars(crashed_and_resumed["dir"])
    assert [s for s, _ in scalars[KEY]] == sorted(SCORES)
    assert dict(scalars[KEY]) == pytest.approx(SCORES, rel=1e-6)  # TensorBoard keeps float32
    assert [s for s, _ in scalars["loss"]] == list(range(1, STEPS + 1))
    assert dict(scalars["loss"]) == pytest.approx(dict(_jsonl(crashed_and_resumed["dir"], "loss")), rel=1e-6)


def test_mlflow_run_continues_with_every_step_once_and_the_config_as_params(crashed_and_resumed):
    from mlflow.tracking import MlflowClient

    run_dir = crashed_and_resumed["dir"]
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert crashed_and_resumed["after_crash"]["mlflow"]["run_id"] == state["run_id"]
    assert crashed_and_resumed["after_crash"]["mlflow_status"] == "FAILED"
    assert crashed_and_resumed["after_crash"]["mlflow"]["last_step"] == CRASH and state["last_step"] == STEPS
    uri = default_tracking_uri(run_dir)
    assert state["tracking_uri"] == uri and (run_dir / "mlflow.db").is_file()
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("trackers").experiment_id])
    assert [r.info.run_id for r in runs] == [state["run_id"]] and runs[0].info.status == "FINISHED"
    assert runs[0].info.run_name == run_dir.name
    history = {k: [(m.step, m.value) for m in client.get_metric_history(state["run_id"], k)] for k in (KEY, "loss")}
    assert history[KEY] == sorted(SCORES.items())
    assert sorted(history["loss"]) == _jsonl(run_dir, "loss")  # the crashed attempt's step 3, not a second copy
    params = runs[0].data.params
    assert params["model.d_model"] == "64" and params["train.steps"] == str(STEPS)
    assert params["log.wandb.tags"] == '["t1"]'
    assert runs[0].data.metrics["summary/steps"] == STEPS


def test_wandb_offline_run_is_continued_with_every_step_once_and_the_config(crashed_and_resumed):
    run_dir = crashed_and_resumed["dir"]
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"]
    assert crashed_and_resumed["after_crash"]["wandb"]["run_id"] == run_id
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)  # one run, two attempts
    attempts = [_wandb_records(f) for f in files]
    exits = [[r.exit.exit_code for r in a if r.WhichOneof("record_type") == "exit"] for a in attempts]
    assert exits == [[1], [0]]  # the crashed attempt finished as failed, the resumed one as done
    records = [r for a in attempts for r in a]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {r.run_id for r in runs} == {run_id} and runs[0].display_name == run_dir.name
    assert list(runs[0].tags) == ["t1"] and runs[0].project == "jaxinfra-tests"
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["model"]["d_model"] == 64 and config["train"]["steps"] == STEPS
    rows = [(r.history.step.num, {i.nested_key[0]: json.loads(i.value_json) for i in r.history.item})
            for r in records if r.WhichOneof("record_type") == "history"]
    steps = [s for s, _ in rows]
    assert len(steps) == len(set(steps))  # no step twice across the two attempts
    assert [(s, row[KEY]) for s, row in rows if KEY in row] == sorted(SCORES.items())
    assert [(s, row["loss"]) for s, row in rows if "loss" in row] == _jsonl(run_dir, "loss")


def test_a_preempted_run_ends_its_tracker_runs_as_killed(tmp_path):
    from mlflow.tracking import MlflowClient

    ext = FakeEval({}, sigterm_at=2)
    cfg = load_config("tiny", [*BASE, "log.tensorboard=false"])
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        summary = Trainer(cfg, tmp_path, jax.devices()[:1], extensions=[ext]).run()
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    assert summary["exit_code"] == EXIT_PREEMPTED and summary["steps"] == 2
    state = json.loads((tmp_path / "trackers.json").read_text())
    assert MlflowClient(default_tracking_uri(tmp_path)).get_run(state["mlflow"]["run_id"]).info.status == "KILLED"
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert [r.exit.exit_code for r in _wandb_records(wandb_file) if r.WhichOneof("record_type") == "exit"] == [75]


def test_sweep_collect_reads_the_last_task_metric_of_a_run(crashed_and_resumed):
    from jaxinfra.scaling.results import run_row

    run_dir = crashed_and_resumed["dir"]
    row = run_row(run_dir, metrics=["grad_norm"])
    assert row[KEY] == SCORES[4] and row["grad_norm"] == _jsonl(run_dir, "grad_norm")[-1][1]
    assert row["eval_loss"] == crashed_and_resumed["summary"]["final_eval_loss"]


def test_missing_tracker_package_is_one_line_exit_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    from jaxinfra.cli import main

    for package, key in (("wandb", "log.wandb.project=p"), ("mlflow", "log.mlflow.experiment=e")):
        monkeypatch.setitem(sys.modules, package, None)  # `import wandb` now raises ImportError
        with pytest.raises(ConfigError, match=rf"is set but {package} is not installed: pip install "
                                              rf"'jaxinfra\[{package}\]'"):
            Trainer(load_config("tiny", [key]), tmp_path / "api")
        assert main(["train", "tiny", key, "--run-dir", str(tmp_path / "cli")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"jaxinfra: error: {key.split('=')[0]} is set but {package} is not installed: "
                       f"pip install 'jaxinfra[{package}]'"]
        monkeypatch.delitem(sys.modules, package)
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_cli_defaults_the_mlflow_experiment_to_the_config_name_and_explicit_wins():
    from jaxinfra.cli import _config_stem, _tracker_defaults

    on = load_config("tiny", ["log.mlflow.tracking_uri=sqlite:///x.db"])
    assert _tracker_defaults(on, _config_stem("configs/my-run.yaml")).log.mlflow.experiment == "my-run"
    assert _tracker_defaults(on, _config_stem("tiny")).log.mlflow.experiment == "tiny"
    mine = load_config("tiny", ["log.mlflow.experiment=mine"])
    assert _tracker_defaults(mine, "tiny").log.mlflow.experiment == "mine"
    off = load_config("tiny", [])
    assert _tracker_defaults(off, "tiny") == off  # MLflow stays off


# ---------------------------------------------------------------- readers


def _tensorboard_scalars(run_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the run's event files in write order; a SessionLog START at step P
    (a resumed writer's purge_step) drops the earlier events at steps >= P, as TensorBoard does."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                out = {tag: {s: v for s, v in points.items() if s < event.step} for tag, points in out.items()}
            for value in event.summary.value:
                points = out.setdefault(value.tag, {})
                assert event.step not in points, f"{value.tag} step {event.step} twice"
                points[event.step] = value.simple_value
    return {tag: sorted(points.items()) for tag, points in out.items()}


def _wandb_records(path: pathlib.Path) -> list:
    """The Records of a .wandb transaction log: a 7-byte header (':W&B', magic 0xBEE1, version 0), then
    LevelDB log records (32 KiB blocks; 7-byte headers crc, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero-filled trailer
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
    return records
