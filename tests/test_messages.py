"""Words that say what happens (issue 35, item 6): each misleading message fixed at its root.

Table-driven and in-process where possible (`cli.main` gives the exit status and stderr through
capsys); one subprocess checks the real CLI's one-line stderr and status; two tiny training runs
check the stop line without checkpoints, the empty run dir and the resume rule end to end.
"""

from __future__ import annotations

import hashlib
import pathlib
import signal
import subprocess
import sys

import jax
import pytest
from subprocs import cli_env

from jaxinfra import cli
from jaxinfra.config import ConfigError, load_config, load_yaml
from jaxinfra.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_PREEMPTED
from jaxinfra.plan.devices import device_spec
from jaxinfra.plan.estimate import FIT_MARGIN, make_plan
from jaxinfra.plan.report import verdict
from jaxinfra.resume import ResumeChanges, changes, check_resume
from jaxinfra.rundir import created_by_run, remove_empty
from jaxinfra.scaling.results import collect, read_table
from jaxinfra.scaling.spec import load_spec
from jaxinfra.scaling.workflow import predict_from_file

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ["data.source=synthetic", "data.synthetic_vocab=64", "model.vocab_size=64", "model.d_model=32",
        "model.num_layers=1", "model.num_heads=2", "model.mlp_dim=64", "train.seq_len=16", "train.batch_size=8",
        "train.steps=2", "train.eval_every=0", "data.eval_batches=0", "log.every=1", "log.progress=false",
        "log.tensorboard=false", "mesh.data=1"]


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("jaxinfra: error: ") and "Traceback" not in err[0], err
    return err[0]


# ---------------------------------------------------------------- plan


def test_a_plan_that_does_not_fit_exits_2_after_the_report_unless_report_only(capsys):
    argv = ["plan", "llama3-8b", "--devices", "8", "--device-kind", "h100", "mesh.data=1", "mesh.fsdp=8"]
    assert cli.main(argv) == EXIT_BAD_INPUT
    out = capsys.readouterr()
    assert "DOES NOT FIT by" in out.out and "step time" in out.out  # the report comes first, in full
    err = out.err.strip().splitlines()
    assert len(err) == 1 and "the plan does not fit" in err[0] and "--report" in err[0]
    assert cli.main([*argv, "--report"]) == EXIT_OK
    assert "DOES NOT FIT by" in capsys.readouterr().out
    assert cli.main([*argv, "--json"]) == EXIT_BAD_INPUT  # --json: the object on stdout, then the same refusal
    assert '"refused": true' in capsys.readouterr().out


def test_the_plan_and_train_preflight_share_one_fit_rule():
    """Over the device memory but inside the estimate's margin: `train` runs it, so `plan` passes it and
    says so instead of DOES NOT FIT; beyond the margin both refuse."""
    cfg = load_config("tiny")
    total = make_plan(cfg, 1, device_spec("h100", 1)).memory.total
    within = make_plan(cfg, 1, device_spec("h100", 1, memory_gib=total / 1.05 / 2**30))
    beyond = make_plan(cfg, 1, device_spec("h100", 1, memory_gib=total / (FIT_MARGIN + 0.05) / 2**30))
    assert not within.fits and not within.refused and "within the estimate's 10% margin" in verdict(within)
    assert beyond.refused and verdict(beyond).startswith("DOES NOT FIT")


def test_search_names_the_divisibility_problem_not_memory(capsys):
    assert cli.main(["plan", "tiny", "--devices", "7", "--device-kind", "h100", "--search"]) == EXIT_BAD_INPUT
    line = _one_error_line(capsys)
    assert "passes the config validation" in line and "memory was never the limit" in line
    assert "train.batch_size=16" in line and "is not divisible" in line and "fits" not in line


# ---------------------------------------------------------------- config path, flags, empty values


@pytest.mark.parametrize("layout, want", [
    ({"config.yaml": "{}"}, "is a directory, not a YAML file or a preset name; it is a run directory: give its"),
    ({}, "is a directory, not a YAML file or a preset name"),
])
def test_a_directory_given_as_the_config_is_named_a_directory(tmp_path, layout, want):
    for name, text in layout.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match="is a directory") as refused:
        load_yaml(str(tmp_path))
    assert want in str(refused.value) and "not found" not in str(refused.value)
    if layout:
        assert f"{tmp_path}/config.yaml" in str(refused.value)


@pytest.mark.parametrize("call, what", [
    (lambda d: load_spec(str(d)), "sweep spec"),
    (read_table, "results file"),
    (lambda d: predict_from_file(d, 1e20), "fit file"),
])
def test_every_file_argument_calls_a_directory_a_directory(tmp_path, call, what):
    with pytest.raises(ConfigError) as refused:
        call(tmp_path)
    assert str(refused.value) == f"{what} {tmp_path} is a directory, not a file"
    (tmp_path / "results.csv").write_text("N,D\n")
    with pytest.raises(ConfigError, match="is a file, not a directory"):  # and the other way round
        collect(tmp_path / "results.csv")


def test_a_preset_name_wins_over_a_directory_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert load_yaml("tiny")["model"]


@pytest.mark.parametrize("value, want", [
    ("", "--kv-cache '' sets quant.kv_cache: an empty value (null) is not allowed; choose one of ['none', 'int8']"),
    ("int4", "--kv-cache 'int4' sets quant.kv_cache: 'int4' is not allowed; choose one of ['none', 'int8']"),
])
def test_kv_cache_flag_is_named_with_the_allowed_values(capsys, tmp_path, value, want):
    # Checked before the checkpoint is read: the run need not exist.
    assert cli.main(["generate", str(tmp_path), "--prompt-ids", "1", "--kv-cache", value]) == EXIT_BAD_INPUT
    assert _one_error_line(capsys) == f"jaxinfra: error: {want}"


def test_an_empty_override_is_called_empty_not_none():
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer, got an empty value \(null\)"):
        load_config("tiny", ["train.steps="])


def test_cli_one_line_and_status_for_a_directory_config(tmp_path):
    (tmp_path / "config.yaml").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "jaxinfra", "train", str(tmp_path)], capture_output=True, text=True,
                          env=cli_env(1), cwd=REPO, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_BAD_INPUT and len(err) == 1 and "is a directory" in err[0], proc.stderr
    assert f"give its {tmp_path}/config.yaml" in err[0] and not proc.stdout


# ---------------------------------------------------------------- run dirs


def test_a_failed_start_removes_only_the_empty_directories_it_created(tmp_path):
    new = tmp_path / "a" / "b" / "run"
    assert created_by_run(new) == tmp_path / "a"
    (new / "checkpoints").mkdir(parents=True)
    remove_empty(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    kept = tmp_path / "mine"
    (kept / "checkpoints" / "0").mkdir(parents=True)
    (kept / "checkpoints" / "notes.txt").write_text("the user's")
    assert created_by_run(kept) is None  # a run dir the user had is never removed
    remove_empty(kept)  # and a file anywhere keeps its directory and every one above it
    assert (kept / "checkpoints" / "notes.txt").read_text() == "the user's" and not (kept / "checkpoints/0").exists()


def test_restore_and_data_failures_leave_no_empty_run_dir(tmp_path):
    from jaxinfra.exits import bad_input_errors
    from jaxinfra.train import train

    one = jax.devices()[:1]
    with pytest.raises(bad_input_errors(), match="no such run directory"):
        train(load_config("tiny", TINY), tmp_path / "new" / "run", one, restore_from=tmp_path / "nothing")
    with pytest.raises(bad_input_errors(), match="file not found"):
        train(load_config("tiny", [*TINY, "data.source=tokens", f"data.paths=[{tmp_path}/none.bin]"]),
              tmp_path / "new" / "run", one)
    (tmp_path / "pre").mkdir()
    with pytest.raises(bad_input_errors(), match="no such run directory"):
        train(load_config("tiny", TINY), tmp_path / "pre", one, restore_from=tmp_path / "nothing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pre"]  # the user's own dir stays


# ---------------------------------------------------------------- stop and resume


def test_sigterm_without_checkpoints_says_a_rerun_starts_over(tmp_path, capsys):
    from jaxinfra.train import Trainer

    trainer = Trainer(load_config("tiny", [*TINY, "checkpoint.enabled=false"]), tmp_path, jax.devices()[:1])
    trainer._signal = signal.SIGTERM  # as the handler records it: stop after the next step
    assert trainer.run()["exit_code"] == EXIT_PREEMPTED
    out = capsys.readouterr().out
    assert "no checkpoint (checkpoint.enabled=false): nothing was saved, a rerun of the same command starts over " \
           "from step 0" in out and "to resume" not in out


def test_stop_lines_never_promise_a_checkpoint_that_checkpoint_enabled_false_never_wrote():
    from jaxinfra.train import _kept

    assert _kept(load_config("tiny"), "the last good") == "the last good checkpoint is kept"
    assert _kept(load_config("tiny", ["checkpoint.enabled=false"]), "the last good") == (
        "no checkpoint exists (checkpoint.enabled=false): a rerun starts over from step 0")


CKPT = {"config": "data: {source: synthetic, eval_batches: 4}\noptimizer: {lr: 0.001}\ntrain: {steps: 2, seed: 0}\n"}


@pytest.mark.parametrize("current, restart, refused, note", [
    ({"data": {"source": "synthetic", "eval_batches": 4}, "optimizer": {"lr": 0.001}, "train": {"steps": 2, "seed": 0}},
     False, None, None),
    ({"data": {"source": "synthetic", "eval_batches": 4}, "optimizer": {"lr": 0.01}, "train": {"steps": 4, "seed": 0}},
     False, None, "optimizer.lr: 0.001 -> 0.01; train.steps: 2 -> 4"),
    ({"data": {"source": "synthetic", "eval_batches": 1}, "optimizer": {"lr": 0.001}, "train": {"steps": 2, "seed": 0}},
     False, None, "data.eval_batches: 4 -> 1"),  # evaluation only: the training stream is the same
    ({"data": {"source": "text", "eval_batches": 4}, "optimizer": {"lr": 0.001}, "train": {"steps": 2, "seed": 0}},
     False, "data.source: synthetic -> text", None),
    ({"data": {"source": "synthetic", "eval_batches": 4}, "optimizer": {"lr": 0.001}, "train": {"steps": 2, "seed": 1}},
     False, "train.seed: 0 -> 1", None),
    ({"data": {"source": "text", "eval_batches": 4}, "optimizer": {"lr": 0.001}, "train": {"steps": 2, "seed": 0}},
     True, None, "data.source: synthetic -> text, the data restarts from its beginning (--restart-data)"),
])
def test_one_rule_for_what_a_resume_may_change(current, restart, refused, note):
    found = changes(CKPT, current)
    if refused:
        with pytest.raises(ConfigError, match="another data stream") as e:
            check_resume(8, found, restart, feeds_own_batches=False)
        assert refused in str(e.value) and "--restart-data" in str(e.value)
        return
    got = check_resume(8, found, restart, feeds_own_batches=False)
    assert got == (None if note is None else
                   f"jaxinfra: note: resuming step 8 with settings changed since that checkpoint: {note}")


@pytest.mark.parametrize("key, breaks", [
    ("data.source", True), ("data.paths", True), ("data.shuffle", True), ("data.mixture.web.paths", True),
    ("train.seed", True), ("train.batch_size", True), ("train.seq_len", True),
    ("data.eval_batches", False), ("data.mixture.web.weight", False), ("data.mixture.web.weights", False),
    ("optimizer.lr", False), ("schedule.warmup_steps", False), ("train.steps", False), ("mesh.data", False),
])
def test_which_keys_break_the_data_position(key, breaks):
    from jaxinfra.resume import breaks_data_position

    assert breaks_data_position(key) is breaks


def test_resume_rule_without_a_saved_config_and_for_an_extension_that_feeds_batches():
    old = changes({"global_batch": 8, "seq_len": 16}, {"train": {"batch_size": 4, "seq_len": 16}})
    assert old == ResumeChanges(("train.batch_size: 8 -> 4",))
    with pytest.raises(ConfigError, match=r"train\.batch_size: 8 -> 4"):
        check_resume(3, old, False, feeds_own_batches=False)
    assert "train.batch_size" in check_resume(3, old, False, feeds_own_batches=True)  # GRPO checks its own


def test_a_refused_resume_changes_nothing_and_restart_data_continues(tmp_path, capsys):
    from jaxinfra.train import train

    one = jax.devices()[:1]
    train(load_config("tiny", TINY), tmp_path, one)
    files = {p: hashlib.md5(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()}
    changed = [*TINY, "train.steps=3", "data.synthetic_vocab=32"]
    # The CLI sees the session's 8 fake devices: mesh.data=-1 fills them (a resume may reshard).
    assert cli.main(["train", "tiny", *changed, "mesh.data=-1", "--run-dir", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "data.synthetic_vocab: 64 -> 32" in _one_error_line(capsys)
    assert files == {p: hashlib.md5(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()}
    summary = train(load_config("tiny", changed), tmp_path, one, restart_data=True)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    assert "train.steps: 2 -> 3, the data restarts from its beginning" in capsys.readouterr().out
