"""Kubernetes manifests (jaxinfra/cluster/jobset.py, `jaxinfra launch k8s`, `sweep --launcher jobset`), checked
without a cluster:

* core objects (the ConfigMap, and the JobSet's embedded Job template with its pod template) deserialize
  into the `kubernetes` client's models (V1ConfigMap, V1JobTemplateSpec: required fields checked), and
  `sanitize_for_serialization(model)` gives back exactly the manifest, so a misspelled or unknown field
  (which deserialization silently drops) fails;
* the JobSet validates against the JobSet CRD's openAPIV3Schema, vendored from the JobSet repository at
  tag v0.9.1 (tests/fixtures/k8s/). Its objects are closed (`additionalProperties: false`) here: the CRD is
  a structural schema, so the API server prunes unknown fields, and `kubectl apply` (strict field
  validation, the default since Kubernetes 1.27) refuses them;
* the rules the API server and the JobSet webhook check beyond the schemas (pod failure policy exit
  codes, failure-policy rule names and reasons, name lengths), and what each exit status makes the
  engine do, by evaluating the emitted policies as the Job and JobSet controllers do.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shlex

import pytest
import yaml

from jaxinfra import cli
from jaxinfra.cluster import jobset as js
from jaxinfra.config import ConfigError
from jaxinfra.scaling.spec import expand, load_spec

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra: pip install -e '.[test]'")
k8s = pytest.importorskip("kubernetes.client", reason="the kubernetes client is in the test extra")

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "k8s" / "jobset-v0.9.1-crd-schema.json"
API = k8s.ApiClient()


def _closed(schema):
    """Every object schema that lists its properties and says nothing of others rejects unknown fields."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({name: _closed(s) for name, s in v.items()} if k == "properties" else _closed(v))
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


_FIXTURE = json.loads(FIXTURE.read_text())
CRD = jsonschema.Draft7Validator(_closed(_FIXTURE["openAPIV3Schema"]))


def _quantities_as_strings(node):
    """The API's quantities are int-or-string; the client's models type them str (and refuse an int)."""
    if isinstance(node, list):
        return [_quantities_as_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: ({q: str(v) if isinstance(v, int) else v for q, v in val.items()}
                if k in ("limits", "requests") and isinstance(val, dict) else _quantities_as_strings(val))
            for k, val in node.items()}


def _roundtrip_errors(obj, model: str) -> list[str]:
    obj = _quantities_as_strings(obj)
    try:
        parsed = API._ApiClient__deserialize(copy.deepcopy(obj), model)
    except Exception as e:  # noqa: BLE001 - the client raises ValueError or pydantic's ValidationError
        return [f"{model}: {str(e).splitlines()[0]}"]
    back = API.sanitize_for_serialization(parsed)
    return [] if back == obj else [f"{model}: fields lost or changed in the round trip: {_diff(obj, back)}"]


def _diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            if a.get(k) != b.get(k):
                return _diff(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _diff(x, y, f"{path}[{i}]")
    return f"{path}: {a!r} -> {b!r}"


# The API server's checks of a pod failure policy (k8s.io/kubernetes pkg/apis/batch/validation) and the
# JobSet webhook's (kubernetes-sigs/jobset v0.9.1 pkg/webhooks/jobset_webhook.go), which no schema carries.
POD_FAILURE_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def _policy_errors(job: dict) -> list[str]:
    errors = []
    pod = job["template"]["spec"]
    if "podFailurePolicy" in job and pod.get("restartPolicy") != "Never":
        errors.append("podFailurePolicy needs restartPolicy: Never")
    names = {c.get("name") for c in pod["containers"]}
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        if rule["action"] not in POD_FAILURE_ACTIONS:
            errors.append(f"pod failure action {rule['action']!r}")
        codes = rule.get("onExitCodes")
        if (codes is None) == (rule.get("onPodConditions") is None):
            errors.append("a rule needs exactly one of onExitCodes, onPodConditions")
        if codes:
            values = codes["values"]
            if codes["operator"] not in ("In", "NotIn") or values != sorted(set(values)) or not 0 < len(values) <= 255:
                errors.append(f"onExitCodes {codes}: operator In/NotIn, values unique and ordered")
            if codes["operator"] == "In" and 0 in values:
                errors.append("onExitCodes: 0 is not allowed with In")
            if codes.get("containerName") not in names | {None}:
                errors.append(f"onExitCodes names no container of the pod: {codes['containerName']}")
    return errors


def _webhook_errors(obj: dict) -> list[str]:
    errors = []
    rules = obj["spec"].get("failurePolicy", {}).get("rules", [])
    if len({r["name"] for r in rules}) != len(rules):
        errors.append("failure policy rule names are not unique")
    for rule in rules:
        if not RULE_NAME.match(rule["name"]) or len(rule["name"]) > 128:
            errors.append(f"failure policy rule name {rule['name']!r}")
        errors += [f"job failure reason {r!r}" for r in rule.get("onJobFailureReasons", [])
                   if r not in JOB_FAILURE_REASONS]
    for rj in obj["spec"]["replicatedJobs"]:
        pods = rj["template"]["spec"].get("completions", 1)
        longest = f"{obj['metadata']['name']}-{rj['name']}-{rj.get('replicas', 1) - 1}-{pods - 1}-abcde"
        if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", longest) or len(longest) > 63:
            errors.append(f"pod name {longest} is not a DNS-1035 label of at most 63 characters")
    return errors


def validation_errors(obj: dict) -> list[str]:
    """Every problem Kubernetes (and the JobSet CRD + webhook) would find in one manifest; empty when valid."""
    kind = obj.get("kind")
    if kind in ("ConfigMap", "Service", "Job"):
        return _roundtrip_errors(obj, f"V1{kind}") + (_policy_errors(obj["spec"]) if kind == "Job" else [])
    assert kind == "JobSet" and obj["apiVersion"] == js.API_VERSION, obj.get("kind")
    errors = [f"JobSet CRD: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in CRD.iter_errors(obj)]
    errors += _roundtrip_errors(obj["metadata"], "V1ObjectMeta")
    for rj in obj["spec"]["replicatedJobs"]:
        errors += _roundtrip_errors(rj["template"], "V1JobTemplateSpec") + _policy_errors(rj["template"]["spec"])
    return errors + _webhook_errors(obj)


def engine_action(obj: dict, exit_code: int) -> str:
    """What the Job and JobSet controllers do when one pod of the JobSet ends with `exit_code`."""
    job = obj["spec"]["replicatedJobs"][0]["template"]["spec"]
    action = "Count"  # a failure no rule matches counts towards backoffLimit
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            action = rule["action"]
            break
    if action == "Ignore":
        return "pod recreated"
    reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
    assert action in ("FailJob", "Count") and job["backoffLimit"] == 0  # one counted failure fails the Job
    policy = obj["spec"].get("failurePolicy")
    if policy is None:
        return "FailJobSet"
    for rule in policy.get("rules", []):  # the first rule whose reasons match (none listed: any reason)
        if reason in rule.get("onJobFailureReasons", [reason]):
            return rule["action"]
    return "RestartJobSet"  # the JobSet controller's default action


def _env(obj: dict) -> dict:
    container = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _pod(obj: dict) -> dict:
    return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


# ---------------------------------------------------------------- the variants (acceptance 3)


def test_tpu_jobset_4_hosts():
    spec = js.JobSetSpec(hosts=4, tpu_type="tpu-v5p-slice", tpu_topology="2x2x4", image="r/jaxinfra:tpu",
                         queue="team-a", namespace="ml")
    objects = js.single_run("tiny", ["mesh.fsdp=-1"], spec, "llm", "gs://bucket/runs/llm")
    assert [o["kind"] for o in objects] == ["JobSet"]
    obj = objects[0]
    assert validation_errors(obj) == []
    job = obj["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4 and job["completionMode"] == "Indexed"
    assert obj["spec"]["network"]["enableDNSHostnames"] is True
    env = _env(obj)
    assert env["JAX_COORDINATOR_ADDRESS"] == "llm-train-0-0.llm:1234"  # pod 0 behind the JobSet's headless Service
    assert env["JAX_NUM_PROCESSES"] == "4"
    assert env["JAX_PROCESS_ID"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    pod = _pod(obj)
    res = pod["containers"][0]["resources"]
    assert res["requests"] == res["limits"] == {"google.com/tpu": "4"}  # 16 chips / 4 hosts
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x4"}
    assert obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert obj["metadata"]["namespace"] == "ml"
    assert pod["containers"][0]["command"] == ["jaxinfra", "train", "tiny", "--run-dir", "gs://bucket/runs/llm",
                                               "mesh.fsdp=-1"]


def test_gpu_jobset_2_hosts_with_a_shipped_config(tmp_path):
    config = tmp_path / "my model.yaml"
    config.write_text("model:\n  num_layers: 2\n")
    spec = js.JobSetSpec(hosts=2, gpus_per_host=8, pvc="runs", cpu="16", memory="64Gi", env={"NCCL_DEBUG": "WARN"},
                         env_secret="s3-creds", service_account="trainer")
    cm, obj = js.single_run(str(config), [], spec, "gpt", "runs/gpt", config.read_text())
    assert validation_errors(cm) == [] and validation_errors(obj) == []
    assert cm["data"] == {"my_model.yaml": "model:\n  num_layers: 2\n"}
    env = _env(obj)
    assert env["JAX_COORDINATOR_ADDRESS"] == "gpt-train-0-0.gpt:1234" and env["JAX_NUM_PROCESSES"] == "2"
    assert env["NCCL_DEBUG"] == "WARN" and "fieldRef" in env["JAX_PROCESS_ID"]
    pod = _pod(obj)
    container = pod["containers"][0]
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "8", "cpu": "16", "memory": "64Gi"},
                                      "limits": {"nvidia.com/gpu": "8"}}
    assert "nodeSelector" not in pod and container["image"] == "jaxinfra:cuda"
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}] and pod["serviceAccountName"] == "trainer"
    assert container["command"][:3] == ["jaxinfra", "train", f"{js.CONFIG_MOUNT}/my_model.yaml"]
    assert {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]["name"] == cm["metadata"]["name"]
    (cpu,) = js.single_run("tiny", [], js.JobSetSpec(hosts=2), "cpu", "s3://b/r")
    assert validation_errors(cpu) == [] and _env(cpu)["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert "resources" not in _pod(cpu)["containers"][0] and _pod(cpu)["containers"][0]["image"] == "jaxinfra:cpu"
    assert "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in env


def test_failure_policy_by_exit_status():
    """2, 3, 74 fail the JobSet; 70, 75 (and a crash or a killed pod) restart the whole set."""
    obj = js.jobset("run", ["jaxinfra", "train", "tiny"], js.JobSetSpec(hosts=2, max_restarts=5))
    assert validation_errors(obj) == []
    assert obj["spec"]["failurePolicy"]["maxRestarts"] == 5
    expected = {2: "FailJobSet", 3: "FailJobSet", 74: "FailJobSet", 70: "RestartJobSet", 75: "RestartJobSet",
                1: "RestartJobSet", 137: "RestartJobSet"}
    assert {code: engine_action(obj, code) for code in expected} == expected


# ---------------------------------------------------------------- the test of the tests


def _misspell(obj, path, new_key):
    obj = copy.deepcopy(obj)
    *parents, key = path
    node = obj
    for p in parents:
        node = node[p]
    node[new_key] = node.pop(key)
    return obj


_JOB = ("spec", "replicatedJobs", 0, "template", "spec")


@pytest.mark.parametrize("path, wrong", [
    (("spec", "network", "enableDNSHostnames"), "enableDnsHostnames"),
    (("spec", "failurePolicy", "maxRestarts"), "maxRestart"),
    (("spec", "failurePolicy", "rules", 0, "onJobFailureReasons"), "onJobFailureReason"),
    ((*_JOB, "parallelism"), "paralellism"),
    ((*_JOB, "podFailurePolicy", "rules", 0, "onExitCodes"), "onExitCode"),
    ((*_JOB, "template", "spec", "containers", 0, "resources"), "resource"),
    ((*_JOB, "template", "spec", "nodeSelector"), "nodeSelectors"),
    (("metadata", "labels"), "label"),
])
def test_a_misspelled_field_fails_validation(path, wrong):
    obj = js.jobset("run", ["jaxinfra", "train", "tiny"], js.JobSetSpec(hosts=4, tpu_type="tpu-v6e-slice",
                                                                        tpu_topology="4x4"))
    assert validation_errors(obj) == []
    errors = validation_errors(_misspell(obj, path, wrong))
    checker = "V1ObjectMeta" if path[0] == "metadata" else "JobSet CRD"  # the CRD leaves metadata open
    assert any(e.startswith(checker) and wrong in e for e in errors), errors
    if path[:len(_JOB)] == _JOB:  # the embedded Job template: the client's models catch it too
        assert any(e.startswith("V1JobTemplateSpec") and wrong in e for e in errors), errors


def _rule(o, i=0):
    return o["spec"]["failurePolicy"]["rules"][i]


def _exit_rule(o, i=0):
    return o["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][i]


@pytest.mark.parametrize("edit, says", [
    (lambda o: _rule(o).update(action="Fail"), "'Fail' is not one of"),
    (lambda o: _rule(o).update(name="no-retry"), "rule name 'no-retry'"),
    (lambda o: _rule(o, 1).update(name=_rule(o)["name"]), "not unique"),
    (lambda o: _rule(o).update(onJobFailureReasons=["ExitCode2"]), "job failure reason 'ExitCode2'"),
    (lambda o: _exit_rule(o)["onExitCodes"].update(values=[74, 2, 3]), "values unique and ordered"),
    (lambda o: _exit_rule(o)["onExitCodes"].update(values=[0, 2]), "0 is not allowed"),
    (lambda o: _exit_rule(o).update(action="Retry"), "pod failure action 'Retry'"),
    (lambda o: _exit_rule(o)["onExitCodes"].update(containerName="trainer"), "names no container"),
    (lambda o: _pod(o).update(restartPolicy="OnFailure"), "restartPolicy: Never"),
    (lambda o: _pod(o)["containers"][0].pop("name"), "'name' is a required property"),
    (lambda o: _pod(o)["containers"][0]["ports"][0].update(containerPort="1234"), "is not of type 'integer'"),
    (lambda o: o["metadata"].update(name="x" * 50), "at most 63 characters"),
])
def test_bad_values_fail_validation(edit, says):
    obj = js.jobset("run", ["jaxinfra", "train", "tiny"], js.JobSetSpec(hosts=2))
    edit(obj)
    errors = validation_errors(obj)
    assert any(says in e for e in errors), errors


def test_a_misspelled_config_map_field_fails_validation():
    cm = js.config_map("c", "a.yaml", "x: 1\n")
    assert validation_errors(cm) == []
    assert any("datas" in e for e in validation_errors(_misspell(cm, ("data",), "datas")))


# ---------------------------------------------------------------- settings, names, run dirs


def test_settings_are_checked():
    with pytest.raises(ConfigError, match=r"launcher\.jobset\.hosts=0 is invalid"):
        js.check_spec(js.JobSetSpec(hosts=0), "launcher.jobset.")
    assert [p[0] for p in js.JobSetSpec(tpu_type="tpu-v5p-slice").problems()] == ["tpu_topology"]
    assert [p[0] for p in js.JobSetSpec(hosts=3, tpu_type="t", tpu_topology="2x2x4").problems()] == ["hosts"]
    assert [p[0] for p in js.JobSetSpec(tpu_type="t", tpu_topology="4x4", gpus_per_host=1).problems()] == [
        "gpus_per_host"]
    assert js.JobSetSpec(hosts=1, tpu_type="tpu-v5-lite-podslice", tpu_topology="2x4").problems() == []
    assert [p[0] for p in js.JobSetSpec(queue="Team A", env_secret="a_b").problems()] == ["queue", "env_secret"]
    with pytest.raises(ConfigError, match="pod names fit in 63"):
        js.check_name("a" * 48, 4)
    for text in ("C2.5e5-L1-d16", "9lives", "a" * 80):
        name = js.dns_name(text, 47)
        js.check_name(name, 4)
    assert js.dns_name("x.y", 47) != js.dns_name("x.y", 47, unique=True)
    with pytest.raises(ConfigError, match="own disk"):
        js.check_run_dir("/runs/x", js.JobSetSpec(), "--run-dir")
    with pytest.raises(ConfigError, match="outside the claim"):
        js.check_run_dir("/elsewhere/x", js.JobSetSpec(pvc="c"), "--run-dir")
    js.check_run_dir("/workspace/runs/x", js.JobSetSpec(pvc="c"), "--run-dir")
    js.check_run_dir("s3://b/x", js.JobSetSpec(), "--run-dir")


# ---------------------------------------------------------------- the command line


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_launch_k8s_prints_valid_manifests(tmp_path, capsys):
    assert cli.main(["launch", "k8s", "tiny", "--hosts", "4", "--image", "r/jaxinfra:tpu", "--tpu-type",
                     "tpu-v5p-slice", "--tpu-topology", "2x2x4", "--run-dir", "gs://b/r", "train.steps=10",
                     "--queue", "q", "--max-restarts", "7"]) == 0
    (obj,) = _docs(capsys.readouterr().out)
    assert validation_errors(obj) == []
    assert obj["metadata"]["name"] == "jaxinfra-tiny" and obj["spec"]["failurePolicy"]["maxRestarts"] == 7
    assert _pod(obj)["containers"][0]["command"][-1] == "train.steps=10"
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  steps: 3\n")
    out = tmp_path / "m.yaml"
    assert cli.main(["launch", "k8s", str(config), "--hosts", "2", "--gpus-per-host", "1", "--pvc", "runs",
                     "--name", "small", "--out", str(out)]) == 0
    cm, obj = _docs(out.read_text())
    assert validation_errors(cm) == [] and validation_errors(obj) == []
    assert cm["data"]["c.yaml"] == config.read_text()
    assert "--run-dir" in (command := _pod(obj)["containers"][0]["command"]) and command[4] == "runs/small"


@pytest.mark.parametrize("args, says", [
    (["--hosts", "0", "--pvc", "c"], "--hosts 0 is invalid"),
    (["--hosts", "two", "--pvc", "c"], "expected a whole number"),
    (["--pvc", "c"], "required: --hosts"),
    (["--hosts", "2"], "give --run-dir"),
    (["--hosts", "2", "--pvc", "c", "model.nope=1"], "model.nope"),
    (["--hosts", "2", "--tpu-type", "tpu-v5p-slice", "--pvc", "c"], "--tpu-topology is missing"),
    (["--hosts", "2", "--run-dir", "/data/r"], "own disk"),
    (["--hosts", "2", "--pvc", "c", "--name", "Bad_Name"], "JobSet name 'Bad_Name'"),
])
def test_launch_k8s_bad_input_is_one_line_exit_2(args, says, capsys):
    assert cli.main(["launch", "k8s", "tiny", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and says in captured.err and captured.err.count("\n") == 1, captured.err


def test_launch_local_form_unchanged():
    args = cli.build_parser().parse_args(["launch", "--local-processes", "2", "--", "train", "tiny"])
    assert args.local_processes == 2 and args.command == ["--", "train", "tiny"]


def test_sweep_writes_one_valid_jobset_per_run(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "iso", "base": "tiny", "overrides": ["data.source=synthetic", "train.seq_len=32"],
        "sizes": {"rule": {"head_dim": 16}, "depths": [1, 2]}, "grid": {"tokens": [2.5e3, 5e3]},
        "launcher": {"jobset": {"hosts": 2, "gpus_per_host": 1, "pvc": "runs", "workdir": str(tmp_path),
                                "max_restarts": 4}}}))
    out = tmp_path / "out"
    plan = expand(load_spec(spec), out)
    (plan.runs[0].run_dir).mkdir(parents=True)
    (plan.runs[0].run_dir / "summary.json").write_text("{}")  # a finished run gets no JobSet
    assert cli.main(["sweep", str(spec), "--launcher", "jobset", "--out", str(out)]) == 0
    everything = _docs((out / "sweep-jobsets.yaml").read_text())
    todo = plan.runs[1:]
    assert len(everything) == len(todo) == 3
    assert sorted(p.name for p in (out / "jobsets").iterdir()) == sorted(f"{r.name}.yaml" for r in todo)
    names = set()
    for run, obj in zip(todo, everything):
        assert validation_errors(obj) == []
        assert _docs((out / "jobsets" / f"{run.name}.yaml").read_text()) == [obj]
        assert _pod(obj)["containers"][0]["command"] == run.command and run.config_path.is_file()
        assert _env(obj)["JAX_NUM_PROCESSES"] == "2" and obj["spec"]["failurePolicy"]["maxRestarts"] == 4
        names.add(obj["metadata"]["name"])
    assert len(names) == 3 and all(n.startswith("iso-") for n in names)


def test_sweep_spec_jobset_section_is_typed(tmp_path):
    base = {"name": "s", "base": "tiny", "sizes": {"depths": [1]}, "grid": {"tokens": [1e4]}}
    for section, says in (({"hostz": 2}, "launcher.jobset.hostz"), ({"hosts": 0}, "launcher.jobset.hosts=0"),
                          ({"hosts": "two"}, "launcher.jobset.hosts")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_spec({**base, "launcher": {"jobset": section}})
    out = tmp_path / "out"  # not on a claim nor a bucket: refused before anything is written
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**base, "launcher": {"jobset": {"hosts": 2}}}))
    assert cli.main(["sweep", str(spec), "--launcher", "jobset", "--out", str(out)]) == 2
    assert not out.exists()


def test_the_example_in_scripts_is_valid_and_current(tmp_path, capsys):
    """scripts/k8s/train-jobset.yaml is what its `made by:` command prints today."""
    text = (REPO / "scripts" / "k8s" / "train-jobset.yaml").read_text()
    argv = shlex.split(re.search(r"^# made by: jaxinfra (.*)$", text, re.M).group(1))
    argv[argv.index("--out") + 1] = str(tmp_path / "now.yaml")
    assert cli.main(argv) == 0
    assert _docs((tmp_path / "now.yaml").read_text()) == _docs(text)
    assert [validation_errors(o) for o in _docs(text)] == [[]]


def test_indexed_job_files_validate(tmp_path, capsys):
    """The other Kubernetes files: the Indexed Job example and `sweep --launcher k8s`'s Job."""
    for obj in _docs((REPO / "scripts" / "k8s" / "train-indexed-job.yaml").read_text()):
        assert validation_errors(obj) == [], obj["kind"]
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "s", "base": "tiny", "sizes": {"depths": [1]}, "grid": {"tokens": [1e4]},
                                    "launcher": {"k8s": {"gpus": 1, "cpu": "2", "pvc": "runs"}}}))
    assert cli.main(["sweep", str(spec), "--launcher", "k8s", "--out", str(tmp_path / "out")]) == 0
    (job,) = _docs((tmp_path / "out" / "sweep-job.yaml").read_text())
    assert validation_errors(job) == []
