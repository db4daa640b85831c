"""A training run's profile window (`log.profile_steps`) and `jaxinfra profile RUN`.

The layout is checked the way TensorBoard's profile plugin (openxla/xprof, not installed here) finds
profiles: under a logdir (here RUN/profile, the root run '.') it lists each subdirectory of
`plugins/profile/` as a profile run, and each `<host>.xplane.pb` in it as that host's XSpace. The
xplane file is read with the XSpace schema (tsl/profiler/protobuf/xplane.proto, the fields needed),
built here, so the test needs no profiler package.
"""

from __future__ import annotations

import gzip
import json
import re

import jax
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from jaxinfra import cli
from jaxinfra.config import load_config
from jaxinfra.exits import EXIT_BAD_INPUT
from jaxinfra.train import train

WINDOW = (2, 5)  # steps 3, 4, 5 of 6
RUN = ["train.steps=6", "train.eval_every=0", "log.every=3", "log.progress=false", "log.tensorboard=false",
       "checkpoint.enabled=false", "model.num_layers=2", "train.seq_len=32", "train.batch_size=4", "mesh.data=1",
       f"log.profile_steps=[{WINDOW[0]},{WINDOW[1]}]"]
XPLANE_FILE = re.compile(r"(?:(.*)\.)?(xplane\.pb)")  # the plugin's file name convention: <host>.xplane.pb


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("profiled")
    compiles = []

    def listen(event: str, _seconds: float, **kw) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(kw.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        summary = train(load_config("tiny", RUN), run_dir, jax.devices()[:1])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return run_dir, summary, [name for name in compiles if "train_step" in name]


def _xspace_class():
    """The XSpace message with the fields this test reads (field numbers from xplane.proto)."""
    f = descriptor_pb2.FileDescriptorProto(name="xplane_subset.proto", package="tensorflow.profiler", syntax="proto3")
    types = descriptor_pb2.FieldDescriptorProto
    fields = {"XEvent": [("metadata_id", 1, types.TYPE_INT64, None, False)],
              "XLine": [("name", 2, types.TYPE_STRING, None, False), ("events", 4, types.TYPE_MESSAGE, "XEvent", True)],
              "XPlane": [("name", 2, types.TYPE_STRING, None, False), ("lines", 3, types.TYPE_MESSAGE, "XLine", True)],
              "XSpace": [("planes", 1, types.TYPE_MESSAGE, "XPlane", True),
                         ("hostnames", 4, types.TYPE_STRING, None, True)]}
    for name, spec in fields.items():
        message = f.message_type.add(name=name)
        for field, number, kind, type_name, repeated in spec:
            message.field.add(name=field, number=number, type=kind,
                              label=types.LABEL_REPEATED if repeated else types.LABEL_OPTIONAL,
                              type_name=f".tensorflow.profiler.{type_name}" if type_name else None)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.profiler.XSpace"))


def test_window_writes_a_trace_tensorboard_lists(profiled):
    run_dir, summary, train_step_compiles = profiled
    assert summary["exit_code"] == 0
    assert len(train_step_compiles) == 1  # compiled ahead for timing, and the jitted step reused it
    profile_runs = [p for p in (run_dir / "profile" / "plugins" / "profile").iterdir() if p.is_dir()]
    assert len(profile_runs) == 1
    hosts = [m.group(1) for m in map(XPLANE_FILE.fullmatch, (p.name for p in profile_runs[0].iterdir())) if m]
    assert len(hosts) == 1 and hosts[0]
    space = _xspace_class()()
    space.ParseFromString((profile_runs[0] / f"{hosts[0]}.xplane.pb").read_bytes())
    assert list(space.hostnames) == hosts  # the file is named for the host the XSpace says it traced
    host_plane = next(p for p in space.planes if p.name == "/host:CPU")
    assert sum(len(line.events) for line in host_plane.lines) > 0
    with gzip.open(profile_runs[0] / "perfetto_trace.json.gz", "rt") as f:
        perfetto = json.load(f)
    assert perfetto["traceEvents"] and "metadata" not in perfetto  # what Perfetto's UI loads


def test_window_holds_exactly_its_steps(profiled):
    """Independent of the summarizer: the raw trace's train-step executions are the window's steps."""
    run_dir, _, _ = profiled
    window = json.loads((run_dir / "profile" / "window.json").read_text())
    assert (window["start"], window["stop"], window["steps"]) == (*WINDOW, WINDOW[1] - WINDOW[0])
    with gzip.open(run_dir / "profile" / window["trace"], "rt") as f:
        events = json.load(f)["traceEvents"]
    runs = {e["args"]["run_id"] for e in events if e.get("ph") == "X"
            and str(e.get("args", {}).get("hlo_module", "")).startswith("jit_train_step")}
    assert len(runs) == WINDOW[1] - WINDOW[0]


def test_profile_command_prints_shares_summing_to_one(profiled, capsys):
    run_dir, _, _ = profiled
    assert cli.main(["profile", str(run_dir), "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert f"steps {WINDOW[0] + 1}..{WINDOW[1]}" in out and "profile: 3 steps" in out
    table = out.split("top 4 ops:")[0]
    shares = [float(line.split()[-1]) for line in table.splitlines()[3:] if line.strip()]
    assert len(shares) == 8 and sum(shares) == pytest.approx(100.0, abs=1.0)  # 8 categories, rounded to 0.1
    assert len([line for line in out.split("top 4 ops:")[1].splitlines() if line.strip()]) == 1 + 4


def test_profile_bad_input_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    assert cli.main(["profile", str(tmp_path / "plain")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfra: error: ") and "log.profile_steps" in err[0]
    code = cli.main(["train", "tiny", "train.steps=4", "log.profile_steps=[3,9]", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT and len(err) == 1 and "log.profile_steps=[3, 9]" in err[0]
    assert not (tmp_path / "r").exists()  # refused before anything was written
