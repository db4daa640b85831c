"""lm-evaluation-harness reference results of lm-eval's own `hf` model, for tests/test_lm_eval.py.

Run with the fixture venv (torch + transformers + lm-eval + accelerate, which lm-eval's hf model
imports) and a Python with jax for the jaxinfra steps (the test suite itself never imports torch):

    HF_HUB_OFFLINE=1 PYTHONPATH=. python scripts/make_lm_eval_fixtures.py --jax-python /work/venv/bin/python

It writes tests/fixtures/lm_eval/:
  tasks/mc.jsonl, tasks/gen.jsonl   the documents of the two local tasks (tasks/*.yaml, kept in git:
                                    a multiple-choice task scored by acc, a generate_until task by exact_match)
  model/                            `hf export` (float32) of a `tiny` run trained here (byte-level)
  reference.json                    lm-eval's `hf` model (torch float32, CPU, max_length 128) on both tasks:
                                    per request its (context, continuation) or (context, until), log-likelihood
                                    and is_greedy, or generated text; the task metrics

The HF side needs a tokenizer: byte-level runs export none (no HF tokenizer maps ids 0..255 to bytes by
default), so this script builds one, a byte-level BPE with no merges whose ids are the byte values and
whose eos is byte 0 (as jaxinfra/harness/tokens.py takes for a byte-level run), in a scratch copy of model/.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "lm_eval"
MAX_LENGTH = 128
TRAIN = ["tiny", "model.d_model=64", "model.num_layers=2", "model.mlp_dim=192", "train.steps=400",
         "train.eval_every=0", "train.seq_len=128", "log.every=100"]

MC_DOCS = [  # (context, choices, answer): plausible distractors, so the accuracy is neither 0 nor 1
    ("import o", ["s", "perator", "ther", "bject"], 0),
    ("def __init__(se", ["lf", "t", "nd", "e"], 0),
    ("for i in ra", ["nge(", "ise(", "w(", "ndom("], 0),
    ("    return Non", ["e", "e_", "ce", "sense"], 0),
    ("class Foo(obj", ["ect):", "ects):", "ection):", "):"], 0),
    ("if __name__ == '__ma", ["in__':", "p__':", "ke__':", "x__':"], 0),
    ("    def __len__(self):\n        ret", ["urn", "ry", "ain", "ract"], 0),
    ("    except Exception as ", ["e:", "exc:", "err:", "ex:"], 0),
    ("        self.", ["_", "x", "assert", "name"], 3),
    ("from os import pa", ["th", "rdir", "ss", "ir"], 0),
]
GEN_DOCS = [  # (context, target): the model copies some of these patterns and misses others
    ("import os\nimport sys\nimport o", "s"),
    ("def __init__(self):\n    pass\ndef __init__(sel", "f)"),
    ("    return None\n    return Non", "e"),
    ("if __name__ == '__main__':\n    main()\nif __name__ == '__ma", "in__':"),
    ("for i in range(10):\n    pass\nfor i in rang", "e(10):"),
    ("class A(object):\n    pass\nclass B(obj", "ect):"),
    ("        self.assertEqual(x, 1)\n        self.", "assertEqual(x, 1)"),
    ("x = 1\ny = 2\nz = ", "3"),
]


def write_docs(folder: pathlib.Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "mc.jsonl", "w", encoding="utf-8") as f:
        for context, choices, answer in MC_DOCS:
            f.write(json.dumps({"context": context, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w", encoding="utf-8") as f:
        for context, target in GEN_DOCS:
            f.write(json.dumps({"context": context, "target": target}) + "\n")


def task_dir(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """The task YAMLs of `src` with __DATA__ replaced by src's absolute path (lm-eval reads data_files from the cwd)."""
    dst.mkdir(parents=True, exist_ok=True)
    for yaml in src.glob("*.yaml"):
        (dst / yaml.name).write_text(yaml.read_text().replace("__DATA__", str(src.resolve())))
    return dst


def train_and_export(jax_python: str, scratch: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = scratch / "run"
    subprocess.run([jax_python, "-m", "jaxinfra", "train", *TRAIN, "--run-dir", str(run)], check=True, env=env)
    if (OUT / "model").exists():
        shutil.rmtree(OUT / "model")
    subprocess.run([jax_python, "-m", "jaxinfra", "hf", "export", str(run), str(OUT / "model"), "--dtype", "float32"],
                   check=True, env=env)


def byte_tokenizer(model_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A scratch copy of the export plus a byte-level tokenizer whose ids are the byte values."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    chars = pre_tokenizers.ByteLevel.alphabet()
    table = _bytes_to_unicode()
    assert set(table.values()) == set(chars)
    tok = tokenizers.Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=table[0])
    fast.save_pretrained(out)
    assert fast.encode("a\n é") == list("a\n é".encode()), fast.encode("a\n é")
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenization emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def reference(hf_dir: pathlib.Path, tasks: pathlib.Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=4, max_length=MAX_LENGTH)
    results = simple_evaluate(model=lm, tasks=["jaxinfra_mc", "jaxinfra_gen"], log_samples=True, bootstrap_iters=0,
                              task_manager=TaskManager(include_path=str(tasks)))
    out = {"max_length": MAX_LENGTH, "acc": results["results"]["jaxinfra_mc"]["acc,none"],
           "exact_match": results["results"]["jaxinfra_gen"]["exact_match,none"], "mc": [], "gen": []}
    for s in sorted(results["samples"]["jaxinfra_mc"], key=lambda s: s["doc_id"]):
        for (ctx, cont), (ll, greedy) in zip(s["arguments"], [r[0] for r in s["resps"]]):
            out["mc"].append({"doc_id": s["doc_id"], "context": ctx, "continuation": cont, "loglikelihood": float(ll),
                              "is_greedy": bool(greedy)})
    for s in sorted(results["samples"]["jaxinfra_gen"], key=lambda s: s["doc_id"]):
        out["gen"].append({"doc_id": s["doc_id"], "context": s["arguments"][0][0], "text": s["resps"][0][0],
                           "target": s["target"]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jax-python", default=sys.executable, help="a Python with jax and jaxinfra's deps")
    parser.add_argument("--skip-train", action="store_true", help="reuse tests/fixtures/lm_eval/model")
    args = parser.parse_args()
    write_docs(OUT / "tasks")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        if not args.skip_train:
            train_and_export(args.jax_python, scratch)
        hf_dir = byte_tokenizer(OUT / "model", scratch / "hf")
        ref = reference(hf_dir, task_dir(OUT / "tasks", scratch / "tasks"))
    (OUT / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"acc {ref['acc']:.3f}, exact_match {ref['exact_match']:.3f}, {len(ref['mc'])} loglikelihood requests; "
          f"generated {[g['text'] for g in ref['gen']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
