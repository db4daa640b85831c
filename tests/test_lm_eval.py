"""lm-evaluation-harness adapter (jaxinfra/harness/) against lm-eval's own HF backend.

The reference (tests/fixtures/lm_eval/reference.json, from scripts/make_lm_eval_fixtures.py) is lm-eval's
`hf` model (torch, float32) on the `hf export` of a trained tiny byte-level run, on two local tasks: the
run is rebuilt here by `hf import` of that export, so both sides hold the same weights."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from jaxinfra import cli
from jaxinfra.harness import HarnessError, require_lm_eval
from jaxinfra.harness.tasks import check_tasks, flat_scores, run_tasks, task_manager

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "lm_eval"
REF = json.loads((FIXTURES / "reference.json").read_text())
TASKS = ["jaxinfra_mc", "jaxinfra_gen"]


def _main(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = cli.main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    """The fixture's export imported back as a run (byte-level: the export carries no tokenizer)."""
    out = tmp_path_factory.mktemp("lm-eval-run") / "run"
    assert cli.main(["hf", "import", str(FIXTURES / "model"), str(out), f"train.seq_len={REF['max_length']}"]) == 0
    return out


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> str:
    """The local task YAMLs with their data files' absolute path (lm-eval reads data_files from the cwd)."""
    out = tmp_path_factory.mktemp("lm-eval-tasks")
    for yaml in (FIXTURES / "tasks").glob("*.yaml"):
        (out / yaml.name).write_text(yaml.read_text().replace("__DATA__", str((FIXTURES / "tasks").resolve())))
    return str(out)


def _lm(run_dir: pathlib.Path, *overrides: str):
    require_lm_eval()
    from jaxinfra.harness.model import JaxinfraLM

    return JaxinfraLM(pretrained=str(run_dir), overrides=["mesh.data=1", *overrides], batch_size=8)


def _check_against_hf(lm, tasks_dir: str) -> None:
    results = run_tasks(lm, TASKS, include_path=tasks_dir, log_samples=True, bootstrap_iters=0)
    mine = [(args, resp[0]) for s in sorted(results["samples"]["jaxinfra_mc"], key=lambda s: s["doc_id"])
            for args, resp in zip(s["arguments"], s["resps"])]
    assert [tuple(a) for a, _ in mine] == [(r["context"], r["continuation"]) for r in REF["mc"]]
    diff = np.abs(np.array([r[0] for _, r in mine]) - np.array([r["loglikelihood"] for r in REF["mc"]]))
    assert diff.max() < 1e-4, diff.max()
    assert [bool(r[1]) for _, r in mine] == [r["is_greedy"] for r in REF["mc"]]
    texts = [s["resps"][0][0] for s in sorted(results["samples"]["jaxinfra_gen"], key=lambda s: s["doc_id"])]
    assert texts == [g["text"] for g in REF["gen"]]
    scores = flat_scores(results)
    assert scores["eval/jaxinfra_mc/acc"] == REF["acc"] and 0 < REF["acc"] < 1
    assert scores["eval/jaxinfra_gen/exact_match"] == REF["exact_match"] and 0 < REF["exact_match"] < 1


def test_matches_hf_backend_one_device(run_dir, tasks_dir):
    lm = _lm(run_dir)
    assert lm.scorer.mesh.devices.size == 1
    _check_against_hf(lm, tasks_dir)


def test_matches_hf_backend_sharded(run_dir, tasks_dir):
    import jax

    lm = _lm(run_dir, "mesh.fsdp=4", "mesh.tensor=2")
    assert dict(lm.scorer.mesh.shape)["fsdp"] == 4 and dict(lm.scorer.mesh.shape)["tensor"] == 2
    sharded = [x for x in jax.tree.leaves(lm.scorer.params) if len(x.sharding.device_set) == 8
               and not x.sharding.is_fully_replicated]
    assert sharded  # the weights really are split over the 8 devices
    _check_against_hf(lm, tasks_dir)


def test_rolling_matches_eval_tokens(run_dir, tmp_path, capsys):
    """loglikelihood_rolling of a text = -(eval loss x predictions) of `jaxinfra eval --tokens` on the
    same ids behind the prefix id (one window: the text fits max_length), an independent forward."""
    from lm_eval.api.instance import Instance

    text = "def rolling(self):\n    return sum(x for x in range(10))  # é\n"
    lm = _lm(run_dir)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    ids = [lm.prefix_token_id, *text.encode("utf-8")]
    np.save(tmp_path / "t.npy", np.asarray([ids], np.int32))
    status, out, err = _main(capsys, "eval", str(run_dir), "--tokens", str(tmp_path / "t.npy"), "mesh.data=1")
    assert status == 0, err
    line = json.loads(out)
    assert line["tokens"] == len(ids) - 1
    assert abs(got + line["eval_loss"] * line["tokens"]) < 1e-3 * len(ids)
    assert got < 0
    # a context past max_length keeps its last ids (left truncation, as lm-eval's HF model): the request
    # scores as the one whose context is already cut to max_length + 1 - len(continuation) ids
    ids = list((text * 4).encode())
    context, continuation = ids[:-10], ids[-10:]
    keep = lm.max_length + 1 - len(continuation)
    long, cut, short = lm._loglikelihood_tokens([(None, context, continuation), (None, context[-keep:], continuation),
                                                 (None, context[-keep + 40:], continuation)])
    assert len(context) > keep and long == cut and abs(long[0] - short[0]) > 1e-6


def test_cli_table_and_json(run_dir, tasks_dir, tmp_path, capsys):
    """`jaxinfra eval RUN --tasks` end to end; --limit 4: acc is the share of the first 4 docs whose
    answer has the highest reference log-likelihood (computed here from the fixture)."""
    out = tmp_path / "r.json"
    status, stdout, err = _main(capsys, "eval", str(run_dir), "--tasks", "jaxinfra_mc", "--include-path", tasks_dir,
                                "--limit", "4", "--output", str(out), "--batch-size", "4", "mesh.data=1")
    assert status == 0, err
    assert "jaxinfra_mc" in stdout and "acc" in stdout and "|" in stdout
    results = json.loads(out.read_text())
    answers = [json.loads(line)["answer"] for line in (FIXTURES / "tasks" / "mc.jsonl").read_text().splitlines()]
    lls = {}
    for r in REF["mc"]:
        lls.setdefault(r["doc_id"], []).append(r["loglikelihood"])
    expected = np.mean([int(np.argmax(lls[d])) == answers[d] for d in range(4)])
    assert results["results"]["jaxinfra_mc"]["acc,none"] == pytest.approx(expected)
    assert str(out) in err


def test_bad_input(run_dir, tasks_dir, tmp_path, capsys, monkeypatch):
    with pytest.raises(HarnessError, match=r"unknown lm-eval task 'jaxinfra_mcq'; close matches: jaxinfra_mc"):
        check_tasks(task_manager(tasks_dir, ["jaxinfra_mc"]), ["jaxinfra_mc", "jaxinfra_mcq"])
    status, _, err = _main(capsys, "eval", str(run_dir), "--tasks", "jaxinfra_mc", "--include-path",
                           str(tmp_path / "missing"))
    assert status == 2 and err.count("\n") == 1 and "--include-path" in err and "no such directory" in err
    status, _, err = _main(capsys, "eval", str(run_dir), "--tokens", "x.npy", "--num-fewshot", "2")
    assert status == 2 and "--num-fewshot applies to --tasks only" in err
    status, _, err = _main(capsys, "eval", str(run_dir), "--tasks", "jaxinfra_mc", "--seq-len", "8")
    assert status == 2 and "--seq-len applies to --tokens / --text only" in err
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if the extra were not installed
    status, _, err = _main(capsys, "eval", str(run_dir), "--tasks", "jaxinfra_mc")
    assert status == 2 and err == ("jaxinfra: error: jaxinfra eval --tasks needs lm-evaluation-harness: "
                                   "pip install 'jaxinfra[eval]'\n")


def test_flat_scores_names():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict": 1.0,
                                 "exact_match_stderr,strict": "N/A", "samples": 4}}}
    assert flat_scores(results) == {"eval/t/acc": 0.5, "eval/t/acc_stderr": 0.1, "eval/t/exact_match_strict": 1.0}


# ---------------------------------------------------------------- evals during training


def _reference_acc(cfg, variables, docs: list[dict]) -> float:
    """Multiple-choice accuracy from the training forward's per-token log-probs (jaxinfra/infer/logprobs.py),
    an independent path: each choice's summed log-prob after its context's bytes."""
    from jaxinfra.infer.logprobs import policy_token_logps

    # Every doc's choices in one call (right padding, `lengths`): one compiled program, not one per width.
    rows = [list(doc["context"].encode()) + list(c.encode()) for doc in docs for c in doc["choices"]]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    logps = iter(policy_token_logps(cfg, variables, tokens, lengths=np.asarray([len(r) for r in rows])))
    hits = []
    for doc in docs:
        n = len(doc["context"].encode())
        sums = [next(logps)[n - 1:n + len(c.encode()) - 1].sum() for c in doc["choices"]]
        hits.append(int(np.argmax(sums)) == doc["answer"])
    return float(np.mean(hits))


def test_extension_scores_at_its_steps(tasks_dir, monkeypatch):
    import jax

    from jaxinfra.config import load_config
    from jaxinfra.extensions import HostContext, extensions_for
    from jaxinfra.harness.extension import TaskEvals, for_config
    from jaxinfra.runtime import build_runtime
    from jaxinfra.state import model_state

    cfg = load_config("tiny", ["model.d_model=64", "model.num_layers=2", "model.mlp_dim=192", "train.steps=5",
                               "train.batch_size=2", "train.seq_len=64", "mesh.data=1", "eval.tasks=[jaxinfra_mc]",
                               f"eval.include_path={tasks_dir}", "eval.limit=4", "eval.every=2"])
    assert for_config(load_config("tiny", [])) is None
    ext = for_config(cfg)
    assert isinstance(ext, TaskEvals) and [e.name for e in extensions_for(cfg)].count("eval") <= 1
    rt = build_runtime(cfg, jax.devices()[:1], extensions=[ext])
    state = rt.init_state()
    host = HostContext(rt, [], 0, 2, current_state=lambda: state)
    docs = [json.loads(line) for line in (FIXTURES / "tasks" / "mc.jsonl").read_text().splitlines()[:4]]
    assert ext.host_metrics(host, 1) == {} and ext.host_metrics(host, 3) == {}
    with jax.set_mesh(rt.mesh):  # inside the train loop's mesh context too
        first = ext.host_metrics(host, 2)
    assert set(first) == {"eval/jaxinfra_mc/acc"}  # bootstrap_iters=0: no stderr (N/A is dropped)
    assert first["eval/jaxinfra_mc/acc"] == _reference_acc(cfg, jax.device_get(model_state(state)), docs)
    lm, compiled = ext.lm, ext.lm.scorer._fn._cache_size()
    state = state.replace(params=jax.tree.map(lambda x: x * 3.0, state.params))  # "trained": other params
    last = ext.host_metrics(host, 5)  # the last step, not a multiple of every
    assert ext.lm is lm and ext.lm.scorer._fn._cache_size() == compiled  # no rebuild, no recompile
    assert last["eval/jaxinfra_mc/acc"] == _reference_acc(cfg, jax.device_get(model_state(state)), docs)
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)
    with pytest.raises(HarnessError, match=r"^eval.tasks needs lm-evaluation-harness: pip install 'jaxinfra\[eval\]'$"):
        for_config(cfg).setup(rt)


def test_run_tokenizer_bytes_tokenizer_and_chat():
    """Byte-level runs: UTF-8 ids, NUL as end-of-text, no template; a chat run's tokenizer.json: its
    tokenizer_config eos spelled out (the text lm-eval adds to `until`) and its chat template rendered."""
    from jaxinfra.config import load_config
    from jaxinfra.harness.tokens import run_tokenizer

    tok = run_tokenizer(load_config("tiny", []))
    assert tok.encode("é\n") == [0xC3, 0xA9, 10] and tok.decode([0xC3, 0xA9]) == "é"
    assert (tok.eot_id, tok.prefix_id, tok.eot_text(), tok.template_source()) == (0, 0, "\x00", None)
    qwen = FIXTURES.parent / "chat" / "qwen"
    cfg = load_config("tiny", ["data.source=chat", "data.chat_template=tokenizer", f"data.tokenizer={qwen}/tokenizer.json",
                               "data.paths=[x.jsonl]"])
    tok = run_tokenizer(cfg)
    eos = json.loads((qwen / "tokenizer_config.json").read_text())["eos_token"]
    assert tok.eot_text() == eos and tok.encode(eos) == [tok.eot_id]
    text = tok.chat_text([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.encode("hello world")) == "hello world" and tok.prefix_id == tok.eot_id  # no bos_token
    llama = FIXTURES.parent / "chat" / "llama3"
    tok = run_tokenizer(load_config("tiny", [f"data.tokenizer={llama}/tokenizer.json", "data.paths=[x.txt]"]))
    assert tok.encode("<|begin_of_text|>") == [tok.prefix_id] != [tok.eot_id]  # its BOS, as lm-eval's HF model


def test_training_logs_task_scores_to_every_sink(tasks_dir, tmp_path):
    """Acceptance 3 end to end: `eval.tasks` in a training run (the `eval` extension found by its entry point)
    puts the task score at its steps into metrics.jsonl, TensorBoard, the offline W&B run and the MLflow
    store, each read back through its own reader (the readers of tests/test_trackers.py)."""
    import jax
    from mlflow.tracking import MlflowClient
    from test_trackers import _tensorboard_scalars, _wandb_records

    from jaxinfra.config import load_config
    from jaxinfra.metrics.trackers import default_tracking_uri
    from jaxinfra.train import Trainer

    key = "eval/jaxinfra_mc/acc"
    cfg = load_config("tiny", ["model.d_model=64", "model.num_layers=2", "model.mlp_dim=192", "train.steps=4",
                               "train.batch_size=2", "train.seq_len=64", "mesh.data=1", "train.eval_every=0",
                               "log.progress=false", "checkpoint.enabled=false", "eval.tasks=[jaxinfra_mc]",
                               f"eval.include_path={tasks_dir}", "eval.limit=4", "eval.every=2",
                               "log.wandb.project=jaxinfra-tests", "log.mlflow.experiment=task-evals"])
    run_dir = tmp_path / "run"
    Trainer(cfg, run_dir, jax.devices()[:1]).run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    jsonl = [(r["step"], r[key]) for r in rows if key in r]
    assert [s for s, _ in jsonl] == [2, 4] and all(0 <= v <= 1 for _, v in jsonl)
    assert [(s, pytest.approx(v)) for s, v in _tensorboard_scalars(run_dir)[key]] == jsonl
    state = json.loads((run_dir / "trackers.json").read_text())
    client = MlflowClient(default_tracking_uri(run_dir))
    assert [(m.step, m.value) for m in client.get_metric_history(state["mlflow"]["run_id"], key)] == jsonl
    records = _wandb_records(next(run_dir.glob("wandb/offline-run-*/run-*.wandb")))
    history = [(r.history.step.num, {i.nested_key[0]: json.loads(i.value_json) for i in r.history.item})
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(s, row[key]) for s, row in history if key in row] == jsonl
