"""Every numeric config key and command-line flag has a declared range, and one path refuses a value outside it.

Table-driven and in-process: the config tree is walked by its dataclass fields (a new numeric key
without a range fails here), each key is set just outside its range and `validate` must refuse it in
one line naming the key and the allowed range. Two subprocess runs show the issue's reproductions end
to end (exit 2, one stderr line, no run dir left behind)."""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys
import typing

import pytest

from jaxinfra import cli
from jaxinfra.config import Config, ConfigError, validate
from jaxinfra.data.config import MixtureConfig
from models.config import ModelConfig
from sharding.ranges import Range, field_range, range_problems
from tests.subprocs import REPO, cli_env

BASE = Config(data=dataclasses.replace(Config().data, mixture={"a": MixtureConfig(paths=("a.bin",))}))


def _numeric(tp: typing.Any) -> bool:
    """int or float, optional or not, or a tuple (of tuples) of them; never bool."""
    args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(tp) in (typing.Union, tuple) or type(tp).__name__ == "UnionType":
        return bool(args) and all(_numeric(a) for a in args)
    return tp in (int, float)


def _numeric_keys(cls: type, prefix: str) -> list[tuple[str, dataclasses.Field, type]]:
    """(dotted key, field, scalar type) of every numeric field under `cls`; dict sections as `<name>.a`."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _numeric_keys(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            out += _numeric_keys(typing.get_args(tp)[1], f"{prefix}{f.name}.a.")
        elif _numeric(tp):
            out.append((prefix + f.name, f, float if "float" in str(tp) else int))
    return out


KEYS = _numeric_keys(Config, "")


def _replace(obj: typing.Any, path: list[str], value: typing.Any) -> typing.Any:
    if not path:
        return value
    if isinstance(obj, dict):
        return {**obj, path[0]: _replace(obj[path[0]], path[1:], value)}
    return dataclasses.replace(obj, **{path[0]: _replace(getattr(obj, path[0]), path[1:], value)})


def _outside(r: Range, kind: type) -> list[typing.Any]:
    """Values just outside the range on each bounded side."""
    step = 1 if kind is int else 1e-3
    out = []
    if r.lo is not None:
        out.append(kind(r.lo) if r.lo_open else kind(r.lo) - step)
    if r.hi is not None:
        out.append(kind(r.hi) if r.hi_open else kind(r.hi) + step)
    return [v for v in out if v not in r.also]


def test_every_numeric_config_key_declares_a_range():
    assert len(KEYS) > 100  # the walk found the tree (sections, optional fields, tuples, mixture sources)
    missing = [key for key, f, _ in KEYS if field_range(f) is None]
    assert not missing, f"numeric config keys without a declared range (sharding/ranges.py ranged()): {missing}"
    assert range_problems(BASE) == [] and validate(BASE) is None  # every default lies inside its range


@pytest.mark.parametrize("key, field, kind", KEYS, ids=[k for k, _, _ in KEYS])
def test_a_value_outside_each_range_is_refused_in_one_line(key, field, kind):
    r = field_range(field)
    values = _outside(r, kind)
    if not values:  # unbounded: any finite number; inf and nan are refused (here and by validate's finite check)
        assert r.describe() == "a finite number" or r.describe().startswith("a finite number (")
        values = [math.inf]
    tuple_depth = str(field.type).count("tuple")
    for bad in values:
        value = bad
        for _ in range(tuple_depth):
            value = (value,)
        with pytest.raises(ConfigError) as refused:
            validate(_replace(BASE, key.split("."), value))
        message = str(refused.value)
        assert "\n" not in message
        if math.isfinite(bad):
            allowed = r.describe("None" in str(field.type))
            assert message == f"{key}={value!r} is invalid: must be {allowed}"
        else:
            assert message.startswith(f"{key}=") and "must be finite" in message


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.keep=0"], "checkpoint.keep=0 is invalid: must be >= 1"),
    (["checkpoint.keep=-1"], "checkpoint.keep=-1 is invalid: must be >= 1"),
    (["optimizer.beta1=1.5"], "optimizer.beta1=1.5 is invalid: must be in [0, 1)"),
    (["optimizer.eps=-1"], "optimizer.eps=-1.0 is invalid: must be > 0"),
    (["optimizer.weight_decay=-5"], "optimizer.weight_decay=-5.0 is invalid: must be >= 0"),
    (["train.step_timeout_s=-5"], "train.step_timeout_s=-5.0 is invalid: must be >= 0 (0: no watchdog)"),
    (["train.max_bad_steps=0"], "train.max_bad_steps=0 is invalid: must be >= 1"),
])
def test_the_issues_settings_are_one_line_exit_2(overrides, message, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "tiny", "--run-dir", str(run), "data.source=synthetic", "train.steps=2", "train.batch_size=4",
            "train.seq_len=32", *overrides]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.splitlines() == [f"jaxinfra: error: {message}"]
    assert not run.exists()  # refused before anything is written


def test_section_problems_carry_the_ranges():
    """ModelConfig.problems() (hf import, sweeps, teachers call it alone) reports the same ranges."""
    assert ModelConfig(num_heads=0).problems() == [("num_heads", 0, ">= 1")]
    assert ModelConfig(rope_scaling_factor=0.5).problems() == [("rope_scaling_factor", 0.5, ">= 1 or null")]


# ---------------------------------------------------------------- command-line flags


def _flag_calls() -> list[tuple[str, int, str]]:
    """(file, line, call) of every add_argument with type=int/float (or a home-made number type) in jaxinfra/."""
    found = []
    for path in sorted((REPO / "jaxinfra").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                kind = next((k.value for k in node.keywords if k.arg == "type"), None)
                if kind is not None and ast.unparse(kind) in ("int", "float"):
                    found.append((str(path.relative_to(REPO)), node.lineno, ast.unparse(node)[:80]))
    return found


def test_every_numeric_flag_is_declared_with_its_range():
    # launch k8s has its own parser: its flags are fields of JobSetSpec, whose problems() check them.
    assert [c for c in _flag_calls() if not c[0].endswith("cluster/launch_k8s.py")] == []


@pytest.mark.parametrize("argv, message", [
    (["plan", "tiny", "--devices", "0"], "plan: --devices=0 is invalid: must be >= 1"),
    (["plan", "tiny", "--devices", "8", "--efficiency", "1.5"], "plan: --efficiency=1.5 is invalid: must be in (0, 1]"),
    (["generate", "RUN", "--prompt", "a", "--top-p", "0"], "generate: --top-p=0.0 is invalid: must be in (0, 1] (1 = off)"),
    (["eval", "RUN", "--batch-size", "0"], "eval: --batch-size=0 is invalid: must be >= 1"),
    (["bench", "collectives", "--min-bytes", "0"], "bench: --min-bytes=0 is invalid: must be >= 1"),
    (["info", "tiny", "--inference", "--max-len", "-1"], "info: --max-len=-1 is invalid: must be >= 0 (0: train.seq_len)"),
    (["data", "prepare", "x", "out", "--workers", "0"], "data prepare: --workers 0 is invalid: must be >= 1"),
    (["scaling", "predict", "FIT", "--compute", "-1"], "scaling predict: --compute=-1.0 is invalid: must be > 0"),
    (["generate", "RUN", "--prompt", "a", "--top-k", "x"],
     "generate: --top-k='x' is invalid: must be an integer >= 0 (0 = off)"),
    (["hf", "export", "RUN", "OUT", "--max-shard-gb", "nan"], "hf export: --max-shard-gb=nan is invalid: must be > 0"),
])
def test_numeric_flags_out_of_range_are_one_line_exit_2(argv, message, capsys):
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.splitlines() == [f"jaxinfra: error: {message}"]


def test_end_to_end_one_line_exit_2_and_nothing_written(tmp_path):
    """The issue's reproductions as a user types them: `T checkpoint.keep=0` and `hf export --max-shard-gb -1`."""
    run, out = tmp_path / "run", tmp_path / "out"
    train = ["train", "tiny", "--run-dir", str(run), "data.source=synthetic", "train.steps=2", "train.batch_size=4",
             "train.seq_len=32", "checkpoint.keep=0"]
    export = ["hf", "export", str(run), str(out), "--max-shard-gb", "-1"]
    for argv, line in ((train, "checkpoint.keep=0 is invalid: must be >= 1"),
                       (export, "hf export: --max-shard-gb=-1.0 is invalid: must be > 0")):
        done = subprocess.run([sys.executable, "-m", "jaxinfra", *argv], capture_output=True, text=True,
                              env=cli_env(1), timeout=120)
        assert (done.returncode, done.stderr.splitlines()) == (2, [f"jaxinfra: error: {line}"])
    assert not run.exists() and not out.exists()



@pytest.mark.parametrize("env, message", [
    ({"JAX_NUM_PROCESSES": "0"}, "JAX_NUM_PROCESSES='0' is invalid: must be an integer >= 1"),
    ({"JAX_PROCESS_ID": "x"}, "JAX_PROCESS_ID='x' is invalid: must be an integer >= 0"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "process id 2 is invalid: must be in [0, 1] for 2 processes"),
])
def test_process_count_and_id_from_the_environment_are_range_checked(env, message, monkeypatch):
    """The environment twins of --num-processes / --process-id: one line (exit 2), not a ValueError traceback."""
    from jaxinfra.distributed import DistributedError, from_flags_and_env

    for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedError) as refused:
        from_flags_and_env()
    assert str(refused.value).startswith(message)
