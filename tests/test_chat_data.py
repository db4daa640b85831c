"""data.source=chat: conversations packed whole with their role codes, every row format, prepared
directories, bad rows, process-count invariance and resume.

The reference is each row rendered alone by `encode_chat` (jaxinfra/data/chat.py, itself checked
against transformers in tests/test_chat_template.py): every packed segment must be exactly one
conversation's ids (cut to seq_len + 1 when longer, and flagged once), with its role codes.
"""

from __future__ import annotations

import gzip
import json
import os
import re

import numpy as np
import pytest

from jaxinfra import cli
from jaxinfra.config import load_config
from jaxinfra.data import (
    DataConfig,
    DataError,
    make_eval_sets,
    make_train_iterator,
    row_states,
    set_row_states,
    vocab_size_of,
)
from jaxinfra.data.chat import encode_chat, load_chat_template, messages_of
from jaxinfra.data.config import MixtureConfig
from jaxinfra.data.encode import make_encoder

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SEQ = 192
KW = dict(seq_len=SEQ, global_batch_size=4, vocab_size=256, seed=3)
FIELDS = ("inputs", "targets", "segment_ids", "positions", "assistant", "truncated")
QWEN = "tests/fixtures/chat/qwen/tokenizer.json"  # a real tokenizer with its chat template (chat's fixtures)


def _conversations(n: int, seed: int) -> list[list[dict]]:
    """Conversations with unique first words; every 9th is too long for one row, some have a system turn."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = 70 if i % 9 == 4 else 12
        msgs = [{"role": "system", "content": "be brief"}] if i % 5 == 0 else []
        for t in range(int(rng.integers(1, 3)) + (2 if i % 9 == 4 else 0)):
            msgs.append({"role": "user", "content": f"c{seed}-{i}-{t} " + "q" * int(rng.integers(0, size))})
            msgs.append({"role": "assistant", "content": "é" * int(rng.integers(0, size // 2))})
        out.append(msgs)
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> dict:
    """The same kind of conversations as .jsonl (messages), .jsonl.gz (prompt/response), Parquet (messages:
    a list of structs) and Parquet (prompt/response)."""
    root = tmp_path_factory.mktemp("chats")
    rows = {"chat.jsonl": [{"messages": m} for m in _conversations(48, 1)],
            "pr.jsonl.gz": [{"prompt": m[-2]["content"], "response": m[-1]["content"]} for m in _conversations(40, 2)],
            "chat.parquet": [{"messages": m} for m in _conversations(40, 3)],
            "pr.parquet": [{"prompt": m[-2]["content"], "response": m[-1]["content"]} for m in _conversations(40, 4)]}
    with open(root / "chat.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + ("\n\n" if i == 2 else "\n")  # a blank line is skipped
                     for i, r in enumerate(rows["chat.jsonl"]))
    with gzip.open(root / "pr.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows["pr.jsonl.gz"])
    for name in ("chat.parquet", "pr.parquet"):
        pq.write_table(pa.Table.from_pylist(rows[name]), root / name, row_group_size=16)
    return {"root": root, "rows": rows, "path": {name: str(root / name) for name in rows}}


def _reference(rows: list[dict], tokenizer: str | None = None, spec: str = "chatml") -> dict[tuple, tuple]:
    """{ids cut to SEQ + 1: (all ids, role codes)} of every row rendered alone."""
    template, encoder = load_chat_template(spec, tokenizer), make_encoder(tokenizer)
    out = {}
    for r in rows:
        ids, codes = encode_chat(template, encoder, messages_of(r, "test"))
        out[tuple(ids[:SEQ + 1].tolist())] = (ids, codes)
    return out


def _check(batch: dict[str, np.ndarray], ref: dict[tuple, tuple]) -> list[tuple[tuple, bool]]:
    """Checks the packed layout against the reference; (conversation, was cut) of every segment."""
    assert set(batch) == set(FIELDS) and all(batch[k].shape[1] == SEQ and batch[k].dtype == np.int32 for k in FIELDS)
    seen = []
    for r in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][r]
        used = int((seg > 0).sum())
        assert np.array_equal(np.unique(seg[:used]), np.arange(1, seg[:used].max() + 1))  # 1, 2, ... left to right
        assert np.all(np.diff(seg[:used]) >= 0) and all(np.all(batch[k][r][used:] == 0) for k in FIELDS)
        for s in range(1, int(seg.max()) + 1):
            at = np.flatnonzero(seg == s)
            assert np.array_equal(batch["positions"][r][at], np.arange(len(at)))  # positions restart
            ids = (*batch["inputs"][r][at].tolist(), int(batch["targets"][r][at][-1]))
            assert ids in ref, "a segment is not one whole conversation (or its first SEQ + 1 ids)"
            full, codes = ref[ids]
            cut = len(full) > SEQ + 1
            assert np.array_equal(batch["targets"][r][at][:-1], batch["inputs"][r][at][1:])
            assert np.array_equal(batch["assistant"][r][at], codes[1:len(ids)])  # the codes of the targets
            assert np.array_equal(batch["truncated"][r][at], np.eye(1, len(at), dtype=np.int32)[0] * cut)
            seen.append((ids, cut))
    return seen


def _cfg(*paths: str, **kw) -> DataConfig:
    return DataConfig(source="chat", paths=tuple(map(str, paths)), **kw)


def _batches(cfg: DataConfig, n: int, **kw) -> list[dict[str, np.ndarray]]:
    it = make_train_iterator(cfg, **{**KW, **kw})
    return [next(it) for _ in range(n)]


def _equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


# ------------------------------------------------------------------- packing


def test_packed_rows_hold_whole_conversations_with_their_role_codes(chats):
    ref = _reference(chats["rows"]["chat.jsonl"])
    cfg = _cfg(chats["path"]["chat.jsonl"], eval_fraction=0.2, eval_batches=1)
    seen = [s for b in _batches(cfg, 12) for s in _check(b, ref)]
    conversations = {ids for ids, _ in seen}
    assert len(conversations) >= 30  # most of the ~38 not held out
    assert any(cut for _, cut in seen) and any(not cut for _, cut in seen)
    assert len(seen) > 12 * 4  # several conversations share rows
    held = make_eval_sets(cfg, **KW)[""]
    held_convs = {ids for b in held for ids, _ in _check(b, ref)}
    assert held_convs and not held_convs & conversations


@pytest.mark.parametrize("name", ["pr.jsonl.gz", "chat.parquet", "pr.parquet"])
def test_prompt_response_gz_and_parquet_rows(chats, name):
    ref = _reference(chats["rows"][name])
    seen = [s for b in _batches(_cfg(chats["path"][name]), 3) for s in _check(b, ref)]
    assert len({ids for ids, _ in seen}) >= 8


def test_vocabulary_and_config_checks(chats, tmp_path):
    assert vocab_size_of(_cfg(chats["path"]["chat.jsonl"])) == 256  # bytes; the template ends turns
    assert load_config("tiny", ["data.source=chat", f"data.paths=[{chats['path']['chat.jsonl']}]"]).model.vocab_size \
        == 256
    problems = {key for key, _, _ in DataConfig(source="chat").problems()}
    assert problems == {"paths"}
    assert {k for k, _, _ in _cfg("x.jsonl", chat_template="").problems()} == {"chat_template"}
    assert not _cfg("x.jsonl", tokenizer="tok.json").problems()  # a tokenizer is allowed for chat
    mixed = DataConfig(source="chat", mixture={"a": MixtureConfig(paths=("x.jsonl",)),
                                               "b": MixtureConfig(paths=("y.jsonl",), source="jsonl")})
    with pytest.raises(DataError, match=r"data\.mixture=.*a \(chat\) and b \(not chat\).*cannot be mixed"):
        mixed.check()
    with pytest.raises(DataError, match=r"data\.chat_template: no such template file"):
        vocab_size_of(_cfg(chats["path"]["chat.jsonl"], chat_template=str(tmp_path / "none.jinja")))
    with pytest.raises(DataError, match=r"sft\.train_on='some' is invalid"):
        make_train_iterator(_cfg(chats["path"]["chat.jsonl"]), **KW, train_on="some")


# ---------------------------------------------------------------- bad rows


def _write_rows(path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_without_an_assistant_turn_depend_on_train_on(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(12)]
    cfg = _cfg(_write_rows(tmp_path / "users.jsonl", rows))
    batch = _batches(cfg, 1, train_on="all")[0]
    assert batch["assistant"].sum() == 0 and (batch["segment_ids"] > 0).any()
    for train_on in ("assistant", "last_assistant"):
        with pytest.raises(DataError, match=rf"users\.jsonl:\d+: no assistant turn .*sft\.train_on={train_on}"):
            _batches(cfg, 1, train_on=train_on)


@pytest.mark.parametrize("case", ["unknown role", "no assistant turn", "template fails"])
def test_bad_rows_through_train_are_one_line_exit_2(case, tmp_path, capsys):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    args = []
    if case == "unknown role":
        msgs[0]["role"] = "narrator"
    elif case == "no assistant turn":
        msgs = msgs[:1]
    else:
        (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m.content + 1 }}{% endfor %}")
        args = [f"data.chat_template={tmp_path / 'bad.jinja'}"]
    path = _write_rows(tmp_path / "bad.jsonl", [{"messages": msgs}] * 40)
    code = cli.main(["train", "tiny", "data.source=chat", f"data.paths=[{path}]", "data.eval_fraction=0.5",
                     "train.seq_len=32", "log.progress=false", *args, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    want = {"unknown role": r"bad\.jsonl:\d+: message 0 has unknown role 'narrator'",
            "no assistant turn": r"bad\.jsonl:\d+: no assistant turn to train on",
            "template fails": r"bad\.jsonl:\d+: .*chat template .*bad\.jinja.*line 2"}[case]
    assert re.search(want, err[0]), err[0]


# ------------------------------------------------------- prepared directories


@pytest.fixture(scope="module")
def prepared(chats, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("prepared") / "chat"
    assert cli.main(["data", "prepare", chats["path"]["chat.jsonl"], chats["path"]["chat.parquet"], "--out",
                     str(out), "--bytes", "--chat", "--workers", "1", "--no-progress", "--shard-tokens", "2000"]) == 0
    return str(out)


def test_prepared_directory_gives_the_on_the_fly_batches(chats, prepared):
    files = _cfg(chats["path"]["chat.jsonl"], chats["path"]["chat.parquet"], eval_batches=2, eval_fraction=0.2)
    directory = _cfg(prepared, eval_batches=2, eval_fraction=0.2)
    assert json.load(open(f"{prepared}/meta.json"))["chat"]["origin"] == "chatml"
    assert vocab_size_of(directory) == 256
    assert _equal(_batches(files, 6), _batches(directory, 6))
    assert _equal(make_eval_sets(files, **KW)[""], make_eval_sets(directory, **KW)[""])


def test_prepared_with_a_tokenizer_and_its_template(chats, tmp_path):
    out = tmp_path / "qwen"
    assert cli.main(["data", "prepare", chats["path"]["pr.parquet"], "--out", str(out), "--tokenizer", QWEN, "--chat",
                     "--chat-template", "tokenizer", "--workers", "1", "--no-progress"]) == 0
    files = _cfg(chats["path"]["pr.parquet"], tokenizer=QWEN, chat_template="tokenizer")
    vocab = vocab_size_of(files)
    assert vocab == vocab_size_of(_cfg(out, chat_template="tokenizer")) > 256
    ref = _reference(chats["rows"]["pr.parquet"], QWEN, "tokenizer")
    on_the_fly = _batches(files, 2, vocab_size=vocab)
    assert _equal(on_the_fly, _batches(_cfg(out, chat_template="tokenizer"), 2, vocab_size=vocab))
    assert [s for b in on_the_fly for s in _check(b, ref)]
    with pytest.raises(DataError, match=r"rendered with chat template 'tokenizer:.*not data\.chat_template='chatml'"):
        vocab_size_of(_cfg(out))


def test_chat_and_plain_preparations_are_not_read_as_each_other(chats, prepared, tmp_path):
    with pytest.raises(DataError, match=r"holds chat conversations .*read it with data\.source=chat$"):
        vocab_size_of(DataConfig(source="tokens", paths=(prepared,)))
    with pytest.raises(DataError, match=r"holds chat conversations .*read it with data\.source=chat$"):
        make_train_iterator(DataConfig(source="tokens", paths=(prepared,)), **KW)
    plain = tmp_path / "plain"
    docs = _write_rows(tmp_path / "docs.jsonl", [{"text": f"document {i}"} for i in range(8)])
    assert cli.main(["data", "prepare", docs, "--out", str(plain), "--bytes", "--workers", "1", "--no-progress"]) == 0
    with pytest.raises(DataError, match=r"holds plain documents, not chat conversations; read it with "
                                        r"data\.source=tokens"):
        make_train_iterator(_cfg(plain), **KW)


# -------------------------------------------------- processes and resume


def test_process_count_invariant_and_resumes_across_counts(chats):
    cfg = _cfg(chats["path"]["chat.jsonl"])
    one = make_train_iterator(cfg, **KW)
    whole = [next(one) for _ in range(3)]
    halves = [make_train_iterator(cfg, **KW, process_index=p, process_count=2) for p in range(2)]
    for batch in whole:
        parts = [next(h) for h in halves]
        assert _equal([batch], [{k: np.concatenate([p[k] for p in parts]) for k in batch}])
    saved = json.loads(json.dumps(row_states(one, 0)))  # as a checkpoint stores it
    expected = [next(one) for _ in range(2)]
    resumed = [make_train_iterator(cfg, **KW, process_index=p, process_count=2) for p in range(2)]
    for p, it in enumerate(resumed):
        set_row_states(it, saved, 2 * p, 2)
    for batch in expected:
        parts = [next(it) for it in resumed]
        assert _equal([batch], [{k: np.concatenate([p[k] for p in parts]) for k in batch}])


def test_prepare_chat_with_workers_and_after_an_interruption_writes_the_same_files(chats, prepared, tmp_path,
                                                                                    monkeypatch):
    from jaxinfra.data import prepare as prepare_module

    inputs = [chats["path"]["chat.jsonl"], chats["path"]["chat.parquet"]]
    kw = dict(chat_template="chatml", shard_tokens=2000, progress=False, unit_bytes=2000)
    real_write, calls = prepare_module._ShardWriter._write, []

    def interrupted(self, **write_kw):
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after two shards
        calls.append(1)
        real_write(self, **write_kw)

    with monkeypatch.context() as m:
        m.setattr(prepare_module._ShardWriter, "_write", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare_module.prepare(inputs, str(tmp_path / "resumed"), workers=1, **kw)
    os.truncate(tmp_path / "resumed" / "shard-00001.roles.bin", 10)  # a damaged shard is redone
    reference = prepare_module.prepare(inputs, str(tmp_path / "ref"), workers=1, **kw)
    assert prepare_module.prepare(inputs, str(tmp_path / "resumed"), workers=1, **kw) == reference
    assert prepare_module.prepare(inputs, str(tmp_path / "two"), workers=2, **kw) == reference
    assert len(reference["shards"]) > 2 and reference["documents"] == 88
    files = {name: _files(tmp_path / name) for name in ("ref", "resumed", "two")}
    assert files["ref"] == files["resumed"] == files["two"]
    (tmp_path / "other.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(DataError, match=r"different preparation \(chat template .*chatml.* there, .*other\.jinja"):
        prepare_module.prepare(inputs, str(tmp_path / "ref"), workers=1, **{**kw, "chat_template": str(
            tmp_path / "other.jinja")})


def _files(directory) -> dict[str, bytes]:
    skip = {"prepare.json", "meta.json"}  # they name the directory's own path
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name not in skip}
