"""data.source=jsonl|parquet: documents read and tokenized when grain asks for them.

Meant for quick experiments: nothing is written, but the files are indexed at start (the
byte range of every JSON line; a .jsonl.gz file is decompressed into memory, and a Parquet
file's text column is loaded on first use), and a bad record is found only when it is read.
For large corpora, `jaxinfra data prepare` once and train on the directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import grain
import numpy as np

from jaxinfra.data.config import DataError
from jaxinfra.data.encode import Encoder
from jaxinfra.data.formats import (
    chat_columns,
    input_kind,
    is_gzip,
    json_object,
    json_text,
    parquet_chat_file,
    parquet_file,
    read_bytes,
)
from jaxinfra.data.sources import window_counts

_SCAN_BYTES = 1 << 26  # newline scan block


def index_lines(data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, 1-based line numbers) of the non-empty lines of a bytes-like object."""
    size = len(data)
    newlines = [np.flatnonzero(np.frombuffer(data, np.uint8, count=min(_SCAN_BYTES, size - at), offset=at) == 10) + at
                for at in range(0, size, _SCAN_BYTES)]
    nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    starts = np.concatenate([[0], nl + 1]).astype(np.int64)
    ends = np.concatenate([nl, [size]]).astype(np.int64)
    lengths = ends - starts
    ends_in_cr = np.zeros(len(ends), bool)
    one = np.flatnonzero(lengths == 1)
    if len(one):
        ends_in_cr[one] = np.frombuffer(data, np.uint8)[starts[one]] == 13
    keep = (lengths > 0) & ~ends_in_cr  # formats.is_blank: "" and "\r" are skipped
    return starts[keep], ends[keep], np.flatnonzero(keep) + 1


class RecordFiles:
    """Random access to the records of .jsonl(.gz) and .parquet files: one text per record (`text`),
    or, with text_key None (chat), the whole row (`row`)."""

    def __init__(self, files: Sequence[str], text_key: str | None):
        self.files = list(files)
        self.text_key = text_key
        self.kinds = [input_kind(f) for f in self.files]
        self._lines: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._cache: dict[int, object] = {}  # decompressed .gz bytes / Parquet text columns
        self.counts = [self._index(f) for f in range(len(self.files))]
        self.ends = np.cumsum(self.counts)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": {}}  # worker processes reload what they read

    def _index(self, f: int) -> int:
        path, kind = self.files[f], self.kinds[f]
        if kind == "parquet":
            n = self._parquet(f).metadata.num_rows
        elif kind == "jsonl":
            if is_gzip(path):
                data = self._cache[f] = read_bytes(path)
                self._lines[f] = index_lines(data)
            else:
                self._lines[f] = index_lines(np.memmap(path, np.uint8, mode="r") if os.path.getsize(path) else b"")
            n = len(self._lines[f][0])
        else:
            raise DataError(f"data.paths: {path!r} is not a .jsonl, .jsonl.gz or .parquet file")
        if n == 0:
            raise DataError(f"data.paths: {path!r} holds no documents")
        return n

    def _parquet(self, f: int):
        path = self.files[f]
        return parquet_file(path, path, self.text_key) if self.text_key else parquet_chat_file(path, path)

    def _row_columns(self, pf) -> list[str]:
        """The Parquet columns a row holds (chat's; data/preference.py reads its own)."""
        return chat_columns(pf)

    def _locate(self, index: int) -> tuple[int, int]:
        """(file, record within it) of global record `index` (files in order)."""
        f = int(np.searchsorted(self.ends, index, side="right"))
        return f, index - (int(self.ends[f - 1]) if f else 0)

    def row(self, index: int) -> tuple[dict, str]:
        """(the row of global record `index`, where it is: "file:line" or "file row N"); Parquet rows
        hold the chat columns (formats.chat_columns)."""
        f, i = self._locate(index)
        path = self.files[f]
        if self.kinds[f] == "parquet":
            table = self._cache.get(f)
            if table is None:
                pf = self._parquet(f)
                table = self._cache[f] = pf.read(columns=self._row_columns(pf))  # loaded once, like a text column
            return {name: table.column(name)[i].as_py() for name in table.column_names}, f"{path} row {i}"
        starts, ends, numbers = self._lines[f]
        line = int(numbers[i])
        return json_object(self._line(f, int(starts[i]), int(ends[i])), path, line), f"{path}:{line}"

    def text(self, index: int) -> str:
        """The text of global record `index` (files in order)."""
        f, i = self._locate(index)
        path = self.files[f]
        if self.kinds[f] == "parquet":
            column = self._cache.get(f)
            if column is None:
                table = parquet_file(path, path, self.text_key).read(columns=[self.text_key])
                column = self._cache[f] = table.column(0).combine_chunks()
            text = column[i].as_py()
            if text is None:
                raise DataError(f"{path} row {i}: {self.text_key!r} is null")
            return text
        starts, ends, numbers = self._lines[f]
        return json_text(self._line(f, int(starts[i]), int(ends[i])), path, int(numbers[i]), self.text_key)

    def _line(self, f: int, start: int, end: int) -> bytes:
        if is_gzip(self.files[f]):
            data = self._cache.get(f)
            if data is None:
                data = self._cache[f] = read_bytes(self.files[f])
            return data[start:end]
        fd = os.open(self.files[f], os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)


class RecordSource:
    """Random access to a subset of records, each tokenized (end-of-document id appended) on read."""

    unit = "documents"

    def __init__(self, files: RecordFiles, encoder: Encoder, records: np.ndarray):
        self._files = files
        self._encoder = encoder
        self._records = np.asarray(records, np.int64)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> np.ndarray:
        return self._encoder.encode([self._files.text(int(self._records[index]))])[0]

    def __repr__(self) -> str:
        return f"RecordSource(documents={len(self)}, encoder={self._encoder.name})"


class DocumentWindows(grain.experimental.FlatMapTransform):
    """A document's (seq_len + 1)-token windows, overlapping by one token, as WindowSource cuts them."""

    max_fan_out = 1 << 31  # only FlatMapMapDataset reads it; documents may be long

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def flat_map(self, tokens: np.ndarray) -> list[dict[str, np.ndarray]]:
        out = []
        for k in range(int(window_counts([len(tokens)], self.seq_len)[0])):
            window = tokens[k * self.seq_len:(k + 1) * self.seq_len + 1]
            out.append({"inputs": window[:-1], "targets": window[1:]})
        return out
