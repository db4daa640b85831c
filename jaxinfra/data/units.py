"""The work of `data prepare`, cut into units: ~1 MiB of JSON lines, one Parquet row group, or one
text file. Units are numbered the same way on every run (they depend only on the inputs), so a
resumed preparation skips the units its completed shards hold. `encode_unit` runs in worker
processes: it parses, tokenizes and returns the unit's ids and document lengths.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxinfra.data.encode import Encoder
from jaxinfra.data.formats import (
    input_kind,
    jsonl_rows,
    jsonl_texts,
    open_stream,
    parquet_chat_file,
    parquet_file,
    parquet_rows,
    parquet_texts,
    read_block,
    read_bytes,
    row_group_starts,
)

UNIT_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Unit:
    index: int  # position in the run's unit sequence
    input: int  # which input file
    kind: str  # jsonl | parquet | text
    path: str
    first: int = 0  # number of the first line (jsonl, 1-based) or row (parquet, 0-based)
    data: bytes = b""  # jsonl: whole lines; text: the file's bytes
    group: int = -1  # parquet row group
    progress: int = 0  # bytes of the input file this unit accounts for (the progress bar)
    last: bool = False  # the input's last unit


def iter_units(files: Sequence[str], text_key: str | None, unit_bytes: int = UNIT_BYTES) -> Iterator[Unit]:
    """Every unit of the inputs, in order (text_key None: chat rows)."""
    index = 0
    for f, path in enumerate(files):
        kind = input_kind(path)
        if kind == "jsonl":
            pieces = _jsonl_pieces(path, unit_bytes)
        elif kind == "parquet":
            pieces = _parquet_pieces(path, text_key)
        else:
            pieces = iter([{"data": read_bytes(path), "progress": os.path.getsize(path)}])
        previous = None
        for piece in pieces:
            if previous is not None:
                yield Unit(index, f, kind, path, **previous)
                index += 1
            previous = piece
        if previous is not None:
            yield Unit(index, f, kind, path, last=True, **previous)
            index += 1


def _jsonl_pieces(path: str, unit_bytes: int) -> Iterator[dict]:
    """Blocks of whole lines, about unit_bytes each (a longer line is one block)."""
    stream, raw = open_stream(path)
    with raw, stream:
        buf, line, reported = bytearray(), 1, 0
        while True:
            block = read_block(stream, unit_bytes, path)
            if not block:  # the end: what is left is the last line, without its newline
                if buf:
                    yield {"data": bytes(buf), "first": line, "progress": raw.tell() - reported}
                return
            searched = len(buf)
            buf += block
            cut = buf.rfind(b"\n", searched) + 1
            if not cut:  # no line ends in this block: keep reading
                continue
            chunk = bytes(buf[:cut])
            del buf[:cut]
            position = raw.tell()
            yield {"data": chunk, "first": line, "progress": position - reported}
            reported = position
            line += chunk.count(b"\n")


def _parquet_pieces(path: str, text_key: str | None) -> Iterator[dict]:
    pf = parquet_file(path, path, text_key) if text_key else parquet_chat_file(path, path)
    rows, size = pf.metadata.num_rows, os.path.getsize(path)
    starts = row_group_starts(pf)
    for group, (start, end) in enumerate(zip(starts, [*starts[1:], rows])):  # progress: a share of the file
        yield {"first": start, "group": group, "progress": size * end // rows - size * start // rows}


def encode_unit(unit: Unit, encoder: Encoder, text_key: str | None,
                template: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(ids of the unit's documents back to back, each document's length, None), ids in encoder.dtype.

    With a chat template (jaxinfra/data/chat.py): each row is one conversation, and the third item
    is the role code (uint8) of every id."""
    if template is not None:
        return _encode_chat_unit(unit, encoder, template)
    if unit.kind == "jsonl":
        texts: list = jsonl_texts(unit.data, unit.path, unit.first, text_key)
    elif unit.kind == "parquet":
        texts = parquet_texts(parquet_file(unit.path, unit.path, text_key), unit.group, unit.path, unit.first,
                              text_key)
    else:
        texts = [unit.data]
    arrays = encoder.encode(texts)
    lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
    tokens = np.concatenate(arrays).astype(encoder.dtype) if arrays else np.zeros(0, encoder.dtype)
    return tokens, lengths, None


def _encode_chat_unit(unit: Unit, encoder: Encoder, template: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from jaxinfra.data.chat import encode_chat, messages_of

    if unit.kind == "jsonl":
        rows = jsonl_rows(unit.data, unit.path, unit.first)
    else:
        rows = parquet_rows(parquet_chat_file(unit.path, unit.path), unit.group, unit.path, unit.first)
    pairs = [encode_chat(template, encoder, messages_of(row, where), where) for row, where in rows]
    lengths = np.fromiter((len(ids) for ids, _ in pairs), np.int64, len(pairs))
    if not pairs:
        return np.zeros(0, encoder.dtype), lengths, np.zeros(0, np.uint8)
    return (np.concatenate([ids for ids, _ in pairs]).astype(encoder.dtype), lengths,
            np.concatenate([codes for _, codes in pairs]).astype(np.uint8))


def init_worker() -> None:
    # One tokenizer thread per worker process: the workers are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
