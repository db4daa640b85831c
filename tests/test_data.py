"""Tests for jaxinfra.data: layout of packed batches, splits, sharding, resume, errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxinfra.data import DataConfig, DataError, make_eval_batches, make_train_iterator, vocab_size_of
from jaxinfra.data.sources import ArrayReader, WindowSource

KEYS = {"inputs", "targets", "segment_ids", "positions"}


def _write_docs(tmp_path, n: int = 12, seed: int = 0) -> dict[str, bytes]:
    """Files of random bytes with varied lengths (short docs, exact fits, long docs).

    Every byte of document i is i mod 16, so any window names its document.
    """
    assert n <= 16
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 5, 17, 33, 40, 64, 65, 100, 150, 257, 400, 700, 1000]
    docs = {}
    for i in range(n):
        data = (16 * rng.integers(2, 16, size=lengths[i % len(lengths)]) + i).astype(np.uint8).tobytes()
        path = tmp_path / f"doc{i:02d}.txt"
        path.write_bytes(data)
        docs[str(path)] = data
    return docs


def _segments(batch: dict[str, np.ndarray]):
    """(row, inputs, targets, positions) for every packed document in the batch."""
    for r in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in np.unique(seg[seg > 0]):
            m = seg == s
            yield r, batch["inputs"][r][m], batch["targets"][r][m], batch["positions"][r][m]


def _check_layout(batch: dict[str, np.ndarray], rows: int, seq_len: int) -> None:
    assert set(batch) == KEYS
    for k in KEYS:
        assert batch[k].shape == (rows, seq_len), k
        assert batch[k].dtype == np.int32, k
    for r in range(rows):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        used = int((seg > 0).sum())
        assert used > 0
        # documents are laid out left to right as 1, 2, 3...; padding is a zero suffix
        assert np.all(seg[:used] > 0) and np.all(np.diff(seg[:used]) >= 0)
        assert np.array_equal(np.unique(seg[:used]), np.arange(1, seg[:used].max() + 1))
        for k in KEYS:
            assert np.all(batch[k][r][used:] == 0), k
        starts = np.flatnonzero(np.diff(seg[:used], prepend=0))
        for a, b in zip(starts, list(starts[1:]) + [used]):
            assert np.array_equal(pos[a:b], np.arange(b - a))
    for _, inp, tgt, _ in _segments(batch):
        assert np.array_equal(tgt[:-1], inp[1:])  # targets are inputs shifted by one within a document


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def _window_bytes(inp: np.ndarray, tgt: np.ndarray) -> bytes:
    return bytes(np.append(inp, tgt[-1]).astype(np.uint8))


def _owner(window: bytes, docs: dict[str, bytes]) -> str:
    """The document a window was cut from (checking that it really is a piece of it)."""
    (residue,) = {b % 16 for b in window}
    path = list(docs)[residue]
    assert window in docs[path], "a window is not a piece of its document"
    return path


def _text_cfg(tmp_path, **kw) -> DataConfig:
    return DataConfig(source="text", paths=(str(tmp_path / "*.txt"),), **kw)


# ------------------------------------------------------------------- layouts


def test_text_batches_are_windows_of_the_documents(tmp_path):
    docs = _write_docs(tmp_path)
    it = make_train_iterator(_text_cfg(tmp_path), seq_len=32, global_batch_size=4, vocab_size=256, seed=0)
    seen = 0
    for batch in _take(it, 8):
        _check_layout(batch, 4, 32)
        for _, inp, tgt, _ in _segments(batch):
            _owner(_window_bytes(inp, tgt), docs)
            seen += 1
    assert seen >= 32


def test_windows_use_every_next_token_pair_once():
    lengths = [0, 1, 2, 3, 9, 16, 17, 18, 40]
    offsets = np.cumsum([0] + lengths)
    arrays = [np.arange(offsets[i], offsets[i + 1], dtype=np.int32) for i in range(len(lengths))]
    expected = sorted((int(a[t]), int(a[t + 1])) for a in arrays for t in range(len(a) - 1))
    for seq_len in (1, 3, 8, 16, 64):
        src = WindowSource(ArrayReader(arrays), [(i, 0, n) for i, n in enumerate(lengths)], seq_len)
        pairs = []
        for k in range(len(src)):
            ex = src[k]
            assert 1 <= len(ex["inputs"]) == len(ex["targets"]) <= seq_len
            pairs += list(zip(ex["inputs"].tolist(), ex["targets"].tolist()))
        assert sorted(pairs) == expected, seq_len


def test_tokens_source_npy_and_bin(tmp_path):
    # Unique ids make the split checkable: the last eval_fraction of each file is held out.
    np.save(tmp_path / "a.npy", np.arange(0, 1000, dtype=np.int64))
    np.arange(1000, 1600, dtype=np.uint16).tofile(tmp_path / "b.bin")
    cfg = DataConfig(source="tokens", paths=(str(tmp_path / "a.npy"), str(tmp_path / "*.bin")), eval_fraction=0.1)
    assert vocab_size_of(cfg) == 0
    it = make_train_iterator(cfg, seq_len=16, global_batch_size=4, vocab_size=2000, seed=1)
    train_ids = set()
    for batch in _take(it, 20):
        _check_layout(batch, 4, 16)
        for _, inp, tgt, _ in _segments(batch):
            assert np.array_equal(tgt, inp + 1)  # consecutive ids: no pair crosses files or gaps
            train_ids.update(inp.tolist())
    held = make_eval_batches(cfg, seq_len=16, global_batch_size=4, vocab_size=2000, seed=1)
    held_ids = {int(x) for b in held for _, inp, _, _ in _segments(b) for x in inp}
    assert held_ids and all(900 <= x < 1000 or 1540 <= x < 1600 for x in held_ids)
    assert not train_ids & held_ids


def test_synthetic_batches_and_vocab():
    cfg = DataConfig(source="synthetic", synthetic_vocab=32)
    assert vocab_size_of(cfg) == 32
    it = make_train_iterator(cfg, seq_len=64, global_batch_size=4, vocab_size=128, seed=0)
    for batch in _take(it, 4):
        _check_layout(batch, 4, 64)
        assert batch["inputs"].max() < 32 and batch["targets"].max() < 32


def test_default_text_source_is_the_stdlib():
    cfg = DataConfig()
    assert vocab_size_of(cfg) == 256
    it = make_train_iterator(cfg, seq_len=128, global_batch_size=4, vocab_size=256, seed=0)
    batches = _take(it, 4)
    for batch in batches:
        _check_layout(batch, 4, 128)
    fill = np.mean([(b["segment_ids"] > 0).mean() for b in batches])
    assert fill > 0.9
    text = b"".join(bytes(b["inputs"][b["segment_ids"] > 0].astype(np.uint8)) for b in batches)
    assert text.count(b"\n") > 20  # it is source code, not noise


# --------------------------------------------------------- determinism, resume


def test_same_seed_same_batches_other_seed_differs(tmp_path):
    _write_docs(tmp_path)
    for cfg in (_text_cfg(tmp_path), DataConfig(source="synthetic")):
        make = lambda seed: _take(make_train_iterator(  # noqa: E731
            cfg, seq_len=32, global_batch_size=4, vocab_size=256, seed=seed), 5)
        assert _equal(make(3), make(3))
        assert not _equal(make(3), make(4))


def test_resume_from_state_gives_the_same_batches(tmp_path):
    _write_docs(tmp_path)
    chat = tmp_path / "chat.jsonl"  # conversations packed whole (tests/test_chat_data.py has the rest)
    chat.write_text("".join(json.dumps({"prompt": f"q{i}" * (i % 7), "response": "a" * (i % 5)}) + "\n"
                            for i in range(24)))
    for cfg in (_text_cfg(tmp_path), DataConfig(source="synthetic"), DataConfig(source="chat", paths=(str(chat),))):
        kw = dict(seq_len=32, global_batch_size=4, vocab_size=256, seed=7)
        it = make_train_iterator(cfg, **kw)
        _take(it, 13)  # more than one pass over the text files' windows
        state = it.get_state()
        expected = _take(it, 6)
        fresh = make_train_iterator(cfg, **kw)
        fresh.set_state(state)
        assert _equal(_take(fresh, 6), expected)


# -------------------------------------------------------------- splits, shards


def test_held_out_documents_are_never_trained_on(tmp_path):
    docs = _write_docs(tmp_path, n=14)
    cfg = _text_cfg(tmp_path, eval_fraction=0.3, eval_batches=3)
    kw = dict(seq_len=16, global_batch_size=4, vocab_size=256, seed=0)
    held = make_eval_batches(cfg, **kw)
    assert len(held) == 3 and _equal(held, make_eval_batches(cfg, **kw))
    held_docs = {_owner(_window_bytes(i, t), docs) for b in held for _, i, t, _ in _segments(b)}
    train_docs = set()
    for batch in _take(make_train_iterator(cfg, **kw), 60):
        train_docs.update(_owner(_window_bytes(i, t), docs) for _, i, t, _ in _segments(batch))
    assert held_docs and train_docs and not held_docs & train_docs


def test_processes_read_disjoint_shares(tmp_path):
    docs = _write_docs(tmp_path)
    windows = []
    for p in range(2):
        it = make_train_iterator(_text_cfg(tmp_path), seq_len=32, global_batch_size=8, vocab_size=256, seed=0,
                                 process_index=p, process_count=2)
        seen = set()
        for batch in _take(it, 2):  # within the first epoch (each epoch is reshuffled)
            _check_layout(batch, 4, 32)
            seen.update(_window_bytes(i, t) for _, i, t, _ in _segments(batch))
        windows.append(seen)
    assert windows[0] and windows[1] and not windows[0] & windows[1]
    for w in windows[0] | windows[1]:
        _owner(w, docs)


# ------------------------------------------------------------------- errors


def test_error_empty_glob(tmp_path):
    cfg = DataConfig(paths=(str(tmp_path / "nothing*.txt"),))
    with pytest.raises(DataError, match=r"data.paths: no files match .*nothing\*\.txt"):
        make_train_iterator(cfg, seq_len=8, global_batch_size=2, vocab_size=256, seed=0)


def test_error_token_id_out_of_vocab(tmp_path):
    ids = np.arange(400, dtype=np.int32) % 100
    ids[200] = 5000
    np.save(tmp_path / "big.npy", ids)
    cfg = DataConfig(source="tokens", paths=(str(tmp_path / "big.npy"),), shuffle=False)
    it = make_train_iterator(cfg, seq_len=64, global_batch_size=2, vocab_size=1000, seed=0)
    with pytest.raises(DataError, match=r"token id 5000 .*big\.npy.*vocab_size 1000"):
        _take(it, 4)


def test_error_tokens_without_paths(tmp_path):
    with pytest.raises(DataError, match=r"data\.paths"):
        make_train_iterator(DataConfig(source="tokens"), seq_len=8, global_batch_size=2, vocab_size=256, seed=0)
    missing = str(tmp_path / "missing.bin")
    with pytest.raises(DataError, match=r"file not found: .*missing\.bin"):
        make_train_iterator(DataConfig(source="tokens", paths=(missing,)), seq_len=8, global_batch_size=2,
                            vocab_size=256, seed=0)


def test_error_batch_not_divisible_by_processes():
    with pytest.raises(DataError, match=r"global_batch_size=7 is not divisible by process_count=2"):
        make_train_iterator(DataConfig(source="synthetic"), seq_len=8, global_batch_size=7, vocab_size=256,
                            seed=0, process_index=0, process_count=2)


def test_config_problems():
    assert DataConfig().problems() == []
    bad = DataConfig(eval_fraction=1.5, worker_count=-1, synthetic_vocab=1)
    keys = [k for k, _, _ in bad.problems()]
    assert keys == ["eval_fraction", "worker_count", "synthetic_vocab"]
    assert ("eval_fraction", 1.5, "a number in (0, 1)") in bad.problems()
    with pytest.raises(DataError, match=r"data\.eval_fraction=1\.5 is invalid"):
        vocab_size_of(bad)


def test_error_single_document_cannot_be_split(tmp_path):
    (tmp_path / "only.txt").write_bytes(b"hello world")
    with pytest.raises(DataError, match="at least 2"):
        make_train_iterator(_text_cfg(tmp_path), seq_len=8, global_batch_size=2, vocab_size=256, seed=0)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    lines = [
        "the quick brown fox jumps over the lazy dog",
        "a stitch in time saves nine and the early bird catches the worm",
        "all that glitters is not gold but the gold is in the details",
    ]
    docs = {}
    for i in range(6):
        text = "\n".join(lines[(i + j) % 3] for j in range(3 + 4 * i)) + "\n"
        (tmp_path / f"t{i}.txt").write_text(text)
        docs[str(tmp_path / f"t{i}.txt")] = text
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)

    cfg = _text_cfg(tmp_path, tokenizer=path)
    vocab = vocab_size_of(cfg)
    assert vocab == tok.get_vocab_size() and 256 < vocab <= 300
    it = make_train_iterator(cfg, seq_len=16, global_batch_size=4, vocab_size=vocab, seed=0)
    n = 0
    for batch in _take(it, 4):
        _check_layout(batch, 4, 16)
        for _, inp, tgt, _ in _segments(batch):
            text = tok.decode(np.append(inp, tgt[-1]).tolist())
            assert len(text) > 0 and any(text in d for d in docs.values())
            n += 1
    assert n >= 16

    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match=r"data\.tokenizer: cannot load .*broken\.json"):
        vocab_size_of(_text_cfg(tmp_path, tokenizer=str(tmp_path / "broken.json")))


# ---------------------------------------------------------------- synthetic


def test_synthetic_language_is_learnable():
    vocab = 64
    cfg = DataConfig(source="synthetic", synthetic_vocab=vocab)
    counts = np.zeros((vocab, vocab))
    for batch in _take(make_train_iterator(cfg, seq_len=128, global_batch_size=8, vocab_size=vocab, seed=0), 12):
        m = batch["segment_ids"] > 0
        np.add.at(counts, (batch["inputs"][m], batch["targets"][m]), 1)
    assert counts.sum() > 5000
    p_next = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h_rows = -np.nansum(np.where(p_next > 0, p_next * np.log(p_next), 0.0), axis=1)
    conditional_entropy = float((counts.sum(1) / counts.sum()) @ h_rows)
    assert conditional_entropy < 0.4 * math.log(vocab)  # a uniform guess costs log(vocab)
    # eval data is the same language, but other documents
    held = make_eval_batches(cfg, seq_len=128, global_batch_size=8, vocab_size=vocab, seed=0)
    m = held[0]["segment_ids"] > 0
    seen = counts[held[0]["inputs"][m], held[0]["targets"][m]] > 0
    assert seen.mean() > 0.97  # (a rare transition may not have shown up in training yet)


# ---------------------------------------------------------------- workers


def test_one_worker_process_matches_in_process(tmp_path):
    _write_docs(tmp_path)
    kw = dict(seq_len=32, global_batch_size=4, vocab_size=256, seed=5)
    expected = _take(make_train_iterator(_text_cfg(tmp_path), **kw), 4)
    it = make_train_iterator(_text_cfg(tmp_path, worker_count=1), **kw)
    try:
        got = _take(it, 4)
        state = it.get_state()
        assert _equal(got, expected)
        assert state is not None
    finally:
        it.close()
