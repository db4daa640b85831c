"""Text -> token ids with an end-of-document id appended: byte-level or a HF tokenizer.json.

`data prepare` and the on-the-fly sources (data.source=jsonl|parquet) share this, so a
document becomes the same ids either way. End of document:
- byte-level: id 256 (bytes are 0..255), so the vocabulary is 257;
- tokenizer.json: its own end token if it has one (the first of EOD_TOKENS it knows, or
  the token given to `data prepare --eod-token`); otherwise one new id equal to the
  tokenizer's vocabulary size, and the vocabulary grows by one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence

import numpy as np

from jaxinfra.data.config import DataError
from jaxinfra.data.tokenizer import load_tokenizer

BYTE_EOD = 256
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
_TOKENIZERS: dict[tuple[str, str], object] = {}  # per process: (path, sha256) -> Tokenizer


def file_sha256(path: str, what: str = "file") -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    except OSError as e:
        raise DataError(f"cannot read {what} {path!r}: {e.strerror}") from e
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Encoder:
    """How documents become ids; picklable (worker processes load the tokenizer once each)."""

    tokenizer: str | None  # path of a tokenizer.json, None = byte-level
    sha256: str  # of the tokenizer.json file; "bytes" for byte-level
    vocab_size: int  # ids the data can hold, the end-of-document id included
    eod_id: int
    eod_token: str | None  # the tokenizer's token for eod_id; None when the id is new (or bytes)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    @property
    def name(self) -> str:
        return "bytes" if self.tokenizer is None else os.path.basename(self.tokenizer)

    def describe(self) -> dict:
        return {"kind": "bytes" if self.tokenizer is None else "tokenizer.json", "name": self.name,
                "sha256": self.sha256, "vocab_size": self.vocab_size, "eod_id": self.eod_id,
                "eod_token": self.eod_token}

    def encode(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Each text's ids (int32) followed by the end-of-document id."""
        if self.tokenizer is None:
            return [np.append(np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8),
                              BYTE_EOD).astype(np.int32) for t in texts]
        tok = self._loaded()
        strings = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast (no offsets): tokenizers >= 0.20
        out = []
        for enc in encode(strings, add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 1, np.int32)
            ids[:-1] = enc.ids
            ids[-1] = self.eod_id
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (the end-of-document id dropped); bytes that are not UTF-8 show as U+FFFD."""
        ids = [int(i) for i in ids if int(i) != self.eod_id]
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._loaded().decode(ids, skip_special_tokens=False)

    def _loaded(self):
        key = (self.tokenizer, self.sha256)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = load_tokenizer(self.tokenizer)
        return _TOKENIZERS[key]


def make_encoder(tokenizer: str | None, eod_token: str | None = None) -> Encoder:
    """The encoder for a tokenizer.json (None: byte-level), with its end-of-document id."""
    if tokenizer is None:
        if eod_token is not None:
            raise DataError("--eod-token needs --tokenizer (byte-level data ends documents with id 256)")
        return Encoder(None, "bytes", BYTE_EOD + 1, BYTE_EOD, None)
    tok = load_tokenizer(tokenizer)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    names = (eod_token,) if eod_token is not None else EOD_TOKENS
    for name in names:
        found = tok.token_to_id(name)
        if found is not None:
            return Encoder(tokenizer, file_sha256(tokenizer, "tokenizer"), vocab, int(found), name)
    if eod_token is not None:
        raise DataError(f"--eod-token {eod_token!r}: {tokenizer!r} has no such token")
    return Encoder(tokenizer, file_sha256(tokenizer, "tokenizer"), vocab + 1, vocab, None)
