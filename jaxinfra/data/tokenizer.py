"""Hugging Face tokenizer.json support for the text source (`tokenizers` is imported lazily)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxinfra.data.config import DataError

_CHUNK_FILES = 64  # files per encode_batch call: bounds the memory of Encoding objects


def load_tokenizer(path: str) -> Any:
    """The `tokenizers.Tokenizer` in `path`; DataError when it cannot be loaded."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise DataError(f"data.tokenizer={path!r} needs the 'tokenizers' package (pip install tokenizers)") from e
    if os.path.isdir(path):  # a directory is not "not found": point to the file a HF model dir holds
        inside = os.path.join(path, "tokenizer.json")
        hint = f"; give {inside!r}" if os.path.isfile(inside) else "; give the path of a tokenizer.json file"
        raise DataError(f"data.tokenizer: {path!r} is a directory, not a file{hint}")
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer: file not found: {path!r}")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises bare Exception subclasses for bad JSON
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data.tokenizer: cannot load {path!r}: {reason}") from e


def tokenizer_vocab_size(path: str) -> int:
    """Number of ids the tokenizer can produce, added tokens included."""
    return int(load_tokenizer(path).get_vocab_size(with_added_tokens=True))


def tokenize_files(tokenizer_path: str, files: Sequence[str]) -> list[np.ndarray]:
    """Each file's text as int32 token ids (no special tokens added); cached per file set."""
    stamp = tuple((os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files)
    tok_stat = os.stat(tokenizer_path)
    return _tokenize(tokenizer_path, (tok_stat.st_size, tok_stat.st_mtime_ns), tuple(files), stamp)


# train and eval both need the tokenized files: tokenize once per process.
@functools.lru_cache(maxsize=2)
def _tokenize(tokenizer_path: str, _tok_stamp: tuple, files: tuple[str, ...], _stamp: tuple) -> list[np.ndarray]:
    tokenizer = load_tokenizer(tokenizer_path)
    out: list[np.ndarray] = []
    for i in range(0, len(files), _CHUNK_FILES):
        texts = []
        for f in files[i:i + _CHUNK_FILES]:
            try:
                with open(f, encoding="utf-8", errors="replace") as fh:
                    texts.append(fh.read())
            except OSError as e:
                raise DataError(f"data.paths: cannot read {f!r}: {e.strerror}") from e
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # _fast: tokenizers >= 0.20
        for enc in encode(texts, add_special_tokens=False):
            out.append(np.asarray(enc.ids, np.int32))
    return out
