"""`jaxinfra data prepare` / `inspect` and the sources that read documents (prepared, jsonl, parquet).

The round trip is checked against the inputs themselves: every document the loader yields
decodes back to exactly one input document (ids equal to an independent tokenization, the end
of document where it belongs), and train + eval together hold every document once.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re

import numpy as np
import pytest

from jaxinfra import cli
from jaxinfra.config import ConfigError, load_config
from jaxinfra.data import (
    DataConfig,
    DataError,
    make_eval_batches,
    make_eval_sets,
    make_train_iterator,
    vocab_size_of,
)
from jaxinfra.data.config import MixtureConfig
from jaxinfra.data.encode import BYTE_EOD, make_encoder
from jaxinfra.data.prepare import prepare
from jaxinfra.data.records import DocumentWindows
from jaxinfra.data.sources import ArrayReader, WindowSource

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "café", "naïve", "中文", "🙂", "\n", "  "]


def _documents(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(0, 40)))) for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """A .jsonl, a .jsonl.gz and a Parquet file (3 row groups) written with pyarrow, and a tokenizer.json."""
    root = tmp_path_factory.mktemp("corpus")
    docs = {"a.jsonl": _documents(25, 1), "b.jsonl.gz": _documents(20, 2), "c.parquet": _documents(30, 3)}
    with open(root / "a.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(docs["a.jsonl"]):
            f.write(json.dumps({"id": i, "text": text}) + ("\n\n" if i == 3 else "\n"))  # a blank line is skipped
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t, "meta": {"n": 1}}, ensure_ascii=False) + "\n" for t in docs["b.jsonl.gz"])
    pq.write_table(pa.table({"text": docs["c.parquet"], "n": list(range(30))}), root / "c.parquet", row_group_size=11)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([t for d in docs.values() for t in d], tokenizers.trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>"]))
    tok.save(str(root / "tokenizer.json"))
    bare = tokenizers.Tokenizer(tokenizers.models.BPE())  # the same without an end-of-text token
    bare.pre_tokenizer, bare.decoder = tok.pre_tokenizer, tok.decoder
    bare.train_from_iterator(docs["a.jsonl"], tokenizers.trainers.BpeTrainer(
        vocab_size=290, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bare.save(str(root / "bare.json"))
    return {"root": root, "docs": docs, "files": [str(root / n) for n in docs], "tok": tok}


def _reference_ids(tokenizer, text: str) -> list[int]:
    """Independent of jaxinfra.data.encode: the tokenizers library's ids plus the end-of-document id."""
    if tokenizer is None:
        return [*text.encode("utf-8"), BYTE_EOD]
    return [*tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.token_to_id("<|endoftext|>")]


def _segments(batches) -> list[list[int]]:
    """Every packed document's ids: inputs plus the last target."""
    out = []
    for b in batches:
        for r in range(b["inputs"].shape[0]):
            seg = b["segment_ids"][r]
            for s in np.unique(seg[seg > 0]):
                m = seg == s
                out.append([*b["inputs"][r][m].tolist(), int(b["targets"][r][m][-1])])
    return out


def _read_all(cfg: DataConfig, vocab: int, seq_len: int, n_eval: int, documents: int) -> tuple[list, list]:
    """Segments of `n_eval` eval batches, and of training batches until every document not held out was seen."""
    kw = dict(seq_len=seq_len, global_batch_size=2, vocab_size=vocab, seed=0)
    held = _segments(make_eval_batches(dataclasses.replace(cfg, eval_batches=n_eval), **kw))
    train, seen, it = [], set(), make_train_iterator(cfg, **kw)
    for _ in range(100):
        if len(seen) + len({tuple(s) for s in held}) >= documents:
            break
        train += _segments([next(it)])
        seen = {tuple(s) for s in train}
    return train, held


def _check_round_trip(cfg: DataConfig, corpus: dict, tokenizer) -> tuple[set, set, int]:
    """Train and eval segments are whole documents, each decodes to one input, and together they are all."""
    texts = [t for d in corpus["docs"].values() for t in d]
    want = {tuple(_reference_ids(tokenizer, t)): t for t in texts}
    seq_len = max(len(k) for k in want)  # every document fits one window: segments are whole documents
    vocab = vocab_size_of(cfg)
    train, held = _read_all(cfg, vocab, seq_len, n_eval=12, documents=len(want))
    decode = (lambda ids: bytes(ids).decode("utf-8")) if tokenizer is None else tokenizer.decode
    for seg in train + held:
        assert tuple(seg) in want, "a segment is not exactly one input document"
        assert decode(seg[:-1]) == want[tuple(seg)]
    train_docs, held_docs = {tuple(s) for s in train}, {tuple(s) for s in held}
    assert train_docs | held_docs == set(want) and not train_docs & held_docs
    return train_docs, held_docs, seq_len


@pytest.mark.parametrize("kind", ["bytes", "tokenizer"])
def test_prepare_then_load_round_trip(corpus, tmp_path, kind):
    tok_path = None if kind == "bytes" else str(corpus["root"] / "tokenizer.json")
    tokenizer = None if kind == "bytes" else corpus["tok"]
    meta = prepare(corpus["files"], str(tmp_path / "out"), tokenizer=tok_path, shard_tokens=300, workers=1,
                   progress=False)
    assert meta["documents"] == 75 and [i["documents"] for i in meta["inputs"]] == [25, 20, 30]
    assert len(meta["shards"]) > 3 and all(s["tokens"] >= 300 for s in meta["shards"][:-1])
    assert meta["eod_id"] == (BYTE_EOD if tokenizer is None else tokenizer.token_to_id("<|endoftext|>"))
    assert meta["vocab_size"] == (257 if tokenizer is None else tokenizer.get_vocab_size())
    assert meta["tokens"] == sum(len(_reference_ids(tokenizer, t)) for d in corpus["docs"].values() for t in d)
    prepared = DataConfig(source="tokens", paths=(str(tmp_path / "out"),), tokenizer=tok_path, eval_fraction=0.2)
    _, held_prepared, seq_len = _check_round_trip(prepared, corpus, tokenizer)
    # The same files read on the fly (a mixture of a jsonl and a parquet source) give the same split.
    root = corpus["root"]
    on_the_fly = DataConfig(source="jsonl", tokenizer=tok_path, eval_fraction=0.2, eval_batches=12, mixture={
        "j": MixtureConfig(paths=(str(root / "a.jsonl"), str(root / "b.jsonl.gz"))),
        "p": MixtureConfig(paths=(str(root / "c.parquet"),), source="parquet")})
    assert vocab_size_of(on_the_fly) == meta["vocab_size"]
    kw = dict(seq_len=seq_len, global_batch_size=2, vocab_size=meta["vocab_size"], seed=0)
    held_fly = {tuple(s) for batches in make_eval_sets(on_the_fly, **kw).values() for s in _segments(batches)}
    assert held_fly == held_prepared


def test_on_the_fly_sources_round_trip(corpus):
    root = corpus["root"]
    for source, paths in (("jsonl", ("a.jsonl", "b.jsonl.gz")), ("parquet", ("c.parquet",))):
        cfg = DataConfig(source=source, paths=tuple(str(root / p) for p in paths), eval_fraction=0.2)
        sub = {"root": root, "docs": {p: corpus["docs"][p] for p in paths}}
        _check_round_trip(cfg, sub, None)


def test_document_windows_match_window_source():
    """The on-the-fly sources cut long documents exactly as WindowSource cuts prepared ones."""
    for n in (0, 1, 2, 3, 9, 16, 17, 18, 40):
        doc = np.arange(n, dtype=np.int32)
        src = WindowSource(ArrayReader([doc]), [(0, 0, n)], 8)
        flat = DocumentWindows(8).flat_map(doc)
        assert len(flat) == len(src)
        for a, k in zip(flat, range(len(src))):
            assert all(np.array_equal(a[key], src[k][key]) for key in ("inputs", "targets"))


def test_workers_and_resume_give_identical_shards(corpus, tmp_path, monkeypatch):
    reference = prepare(corpus["files"], str(tmp_path / "ref"), shard_tokens=500, workers=1, progress=False)
    assert prepare(corpus["files"], str(tmp_path / "two"), shard_tokens=500, workers=2, progress=False) == reference
    assert _files(tmp_path / "two") == _files(tmp_path / "ref")
    from jaxinfra.data import prepare as prepare_module

    real_write, calls = prepare_module._ShardWriter._write, []

    def interrupted(self, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after two shards
        calls.append(1)
        real_write(self, **kw)

    with monkeypatch.context() as m:
        m.setattr(prepare_module._ShardWriter, "_write", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare(corpus["files"], str(tmp_path / "resumed"), shard_tokens=500, workers=1, progress=False)
    assert not (tmp_path / "resumed" / "meta.json").exists()
    with pytest.raises(DataError, match="unfinished preparation"):  # never read as if complete
        make_train_iterator(DataConfig(source="tokens", paths=(str(tmp_path / "resumed"),)), seq_len=8,
                            global_batch_size=2, vocab_size=257, seed=0)
    (tmp_path / "resumed" / "shard-00002.bin.tmp-99").write_bytes(b"torn")
    assert prepare(corpus["files"], str(tmp_path / "resumed"), shard_tokens=500, workers=1, progress=False) == reference
    assert _files(tmp_path / "resumed") == _files(tmp_path / "ref")
    # A rerun of a complete preparation changes nothing; a different one is refused in one line.
    assert prepare(corpus["files"], str(tmp_path / "ref"), shard_tokens=500, workers=1, progress=False) == reference
    with pytest.raises(DataError, match=r"complete different preparation \(shard_tokens 500 there, 400 here\)"):
        prepare(corpus["files"], str(tmp_path / "ref"), shard_tokens=400, workers=1, progress=False)
    tok = str(corpus["root"] / "tokenizer.json")
    with pytest.raises(DataError, match=r"different preparation \(tokenizer bytes .* tokenizer\.json"):
        prepare(corpus["files"], str(tmp_path / "ref"), tokenizer=tok, shard_tokens=500, workers=1, progress=False)


def _files(directory) -> dict[str, bytes]:
    skip = {"prepare.json", "meta.json"}  # they name the directory's own input paths: compared above
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name not in skip}


def test_tokenizer_without_end_token_gets_a_new_id(corpus):
    enc = make_encoder(str(corpus["root"] / "bare.json"))
    vocab = tokenizers.Tokenizer.from_file(str(corpus["root"] / "bare.json")).get_vocab_size()
    assert (enc.eod_id, enc.vocab_size, enc.eod_token) == (vocab, vocab + 1, None)
    assert enc.encode(["the fox"])[0][-1] == vocab


def test_inspect_reports_and_checks_against_a_config(corpus, tmp_path, capsys):
    prepare(corpus["files"], str(tmp_path / "out"), shard_tokens=1000, workers=1, progress=False)
    assert cli.main(["data", "inspect", str(tmp_path / "out"), "tiny", "model.vocab_size=264", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "75 documents" in out and "length" in out and "| doc 1-0: " in out
    assert "FAIL" not in out and "shard sha256 match" in out
    # tiny leaves model.vocab_size unset (it takes the data's 257); an explicit 256 fails the check.
    assert cli.main(["data", "inspect", str(tmp_path / "out"), "tiny"]) == 0
    capsys.readouterr()
    assert cli.main(["data", "inspect", str(tmp_path / "out"), "tiny", "model.vocab_size=256"]) == 2
    captured = capsys.readouterr()
    assert "FAIL model.vocab_size=256" in captured.out
    assert captured.err.strip().splitlines() == [
        f"jaxinfra: error: data inspect {tmp_path / 'out'}: check failed: model.vocab_size=256 >= the data's 257 ids"]


# ------------------------------------------------------------------ bad data


def _write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


BAD_INPUTS = {
    "malformed_json": ('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n', r"bad\.jsonl line 3: invalid JSON"),
    "missing_key": ('{"text": "a"}\n{"body": "b"}\n', r"bad\.jsonl line 2: no 'text' key \(keys: body\)"),
    "not_a_string": ('{"text": 3}\n', r"bad\.jsonl line 1: 'text' holds int, not a string"),
    "empty_file": ("", r"bad\.jsonl' is empty \(no documents\)"),
    "blank_lines_only": ("\n\n", r"bad\.jsonl' holds no documents"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_jsonl_is_one_line_exit_2_and_nothing_complete(case, corpus, tmp_path, capsys):
    text, pattern = BAD_INPUTS[case]
    bad = _write(tmp_path / "bad.jsonl", text)
    out = tmp_path / "out"
    assert cli.main(["data", "prepare", corpus["files"][0], bad, "--out", str(out), "--bytes", "--workers", "1",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfra: error: ")
    assert re.search(pattern, err[0]), err[0]
    assert not (out / "meta.json").exists()


def test_bad_parquet_and_empty_parquet(tmp_path):
    pq.write_table(pa.table({"content": ["x", "y"]}), tmp_path / "nocol.parquet")
    with pytest.raises(DataError, match=r"nocol\.parquet has no column 'text' \(columns: content\)"):
        prepare([str(tmp_path / "nocol.parquet")], str(tmp_path / "o1"), progress=False, workers=1)
    pq.write_table(pa.table({"text": ["x", None, "z"]}), tmp_path / "null.parquet")
    with pytest.raises(DataError, match=r"null\.parquet row 1: 'text' is null"):
        prepare([str(tmp_path / "null.parquet")], str(tmp_path / "o2"), progress=False, workers=1)
    assert not (tmp_path / "o2" / "meta.json").exists()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty\.parquet' has no rows"):
        prepare([str(tmp_path / "empty.parquet")], str(tmp_path / "o3"), progress=False, workers=1)
    with pytest.raises(DataError, match=r"nocol\.parquet has no column 'text'"):  # also when read on the fly
        make_train_iterator(DataConfig(source="parquet", paths=(str(tmp_path / "nocol.parquet"),)), seq_len=8,
                            global_batch_size=1, vocab_size=257, seed=0)


def test_malformed_line_read_on_the_fly_names_file_and_line(tmp_path):
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(40)]
    lines[17] = '{"text": broken'
    path = _write(tmp_path / "fly.jsonl", "\n".join(lines) + "\n")
    cfg = DataConfig(source="jsonl", paths=(path,), shuffle=False, eval_batches=40)
    kw = dict(seq_len=64, global_batch_size=1, vocab_size=257, seed=0)
    it = make_train_iterator(cfg, **kw)
    with pytest.raises(DataError, match=r"fly\.jsonl line 18: invalid JSON"):
        for _ in range(40):  # the line is in the training or in the held-out part
            next(it)
        make_eval_batches(cfg, **kw)


@pytest.fixture()
def prepared_bytes(corpus, tmp_path):
    out = tmp_path / "prepared"
    prepare(corpus["files"], str(out), shard_tokens=1000, workers=1, progress=False)
    return out


def test_model_vocab_smaller_than_the_data_is_refused(prepared_bytes):
    data = ["data.source=tokens", f"data.paths=[{prepared_bytes}]"]
    with pytest.raises(ConfigError, match=r"model\.vocab_size=256 is smaller than the data's vocabulary \(257"):
        load_config("tiny", [*data, "model.vocab_size=256"])
    assert load_config("tiny", [*data, "model.vocab_size=264"]).model.vocab_size == 264
    assert load_config("tiny", data).model.vocab_size == 257  # unset: raised to the data's vocabulary
    assert load_config("tiny", ["data.source=synthetic"]).model.vocab_size == 256  # never lowered (64 ids)


def test_bytes_output_trains_with_the_tiny_preset_as_is(corpus, tmp_path, capsys):
    # `data prepare --bytes` ends documents with id 256 (257 ids) while the default text source
    # has 256: tiny leaves model.vocab_size unset, so it takes the prepared data's 257.
    out = tmp_path / "prepared"
    assert cli.main(["data", "prepare", *corpus["files"], "--out", str(out), "--bytes", "--workers", "1",
                     "--no-progress"]) == 0
    run = tmp_path / "run"
    assert cli.main(["train", "tiny", "data.source=tokens", f"data.paths=[{out}]", "train.steps=3", "log.every=1",
                     "train.batch_size=8", "train.seq_len=32", "train.eval_every=0", "schedule.warmup_steps=1",
                     "--run-dir", str(run)]) == 0
    assert load_config(str(run / "config.yaml")).model.vocab_size == 257
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_token_id_out_of_range_in_a_shard_names_it(prepared_bytes):
    shard = prepared_bytes / "shard-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    ids[5] = 60000
    ids.tofile(shard)
    it = make_train_iterator(DataConfig(source="tokens", paths=(str(prepared_bytes),), shuffle=False, eval_fraction=0.01),
                             seq_len=512, global_batch_size=1, vocab_size=257, seed=0)
    with pytest.raises(DataError, match=r"token id 60000 at position 5 of .*shard-00000\.bin.*vocab_size 257"):
        for _ in range(20):
            next(it)


def test_truncated_shard_is_refused(prepared_bytes):
    shard = prepared_bytes / "shard-00001.bin"
    os.truncate(shard, os.path.getsize(shard) - 2)
    with pytest.raises(DataError, match=r"shard .*shard-00001\.bin' is \d+ bytes, but meta\.json records"):
        make_train_iterator(DataConfig(source="tokens", paths=(str(prepared_bytes),)), seq_len=8,
                            global_batch_size=1, vocab_size=264, seed=0)


def test_directory_prepared_with_another_tokenizer_is_refused(prepared_bytes, corpus, tmp_path):
    tok = str(corpus["root"] / "tokenizer.json")
    with pytest.raises(DataError, match=r"prepared with byte-level ids, not data\.tokenizer=.*tokenizer\.json"):
        vocab_size_of(DataConfig(source="tokens", paths=(str(prepared_bytes),), tokenizer=tok))
    other = tmp_path / "other"
    prepare(corpus["files"][:1], str(other), tokenizer=str(corpus["root"] / "bare.json"), workers=1, progress=False)
    with pytest.raises(DataError, match=r"prepared with tokenizer bare\.json .*not data\.tokenizer=.*tokenizer\.json"):
        make_train_iterator(DataConfig(source="tokens", paths=(str(other),), tokenizer=tok), seq_len=8,
                            global_batch_size=1, vocab_size=512, seed=0)
    with pytest.raises(DataError, match=r"one run reads one tokenizer's ids"):
        vocab_size_of(DataConfig(source="tokens", paths=(str(prepared_bytes), str(other))))


def test_train_refuses_a_truncated_shard_in_one_line(prepared_bytes, tmp_path, capsys):
    shard = prepared_bytes / "shard-00000.bin"
    os.truncate(shard, os.path.getsize(shard) - 1)
    args = ["train", "tiny", "--run-dir", str(tmp_path / "run"), "data.source=tokens",
            f"data.paths=[{prepared_bytes}]", "model.vocab_size=264", "log.progress=false"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"shard-00000\.bin' is \d+ bytes, but meta\.json records", err[0]), err
