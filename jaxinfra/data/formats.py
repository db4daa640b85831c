"""Documents in .jsonl / .jsonl.gz, Parquet and plain text files, with errors that name the place.

JSON Lines: one JSON object per line, the text under a key (default "text"); empty lines are
skipped (they still count in line numbers). Parquet: one document per row of a string column
(the files `datasets` writes; pyarrow is imported only when a Parquet file is read). Plain text:
each file is one document. A `.gz` suffix is decompressed on the way.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Sequence

from jaxinfra.data.config import DataError
from jaxinfra.data.sources import common_root

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")  # `datasets.Dataset.to_json` writes JSON Lines as .json
_GZIP_ERRORS = (OSError, EOFError, zlib.error)  # gzip.BadGzipFile is an OSError


def input_kind(path: str) -> str:
    """'jsonl', 'parquet' or 'text', from the file name (a trailing .gz is looked through)."""
    name = path.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        if path.lower().endswith(".gz"):
            raise DataError(f"{path}: gzipped Parquet is not supported (Parquet compresses its own pages)")
        return "parquet"
    return "text"


def is_gzip(path: str) -> bool:
    return path.lower().endswith(".gz")


def read_bytes(path: str) -> bytes:
    """The file's bytes, decompressed when it ends in .gz."""
    try:
        if is_gzip(path):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except _GZIP_ERRORS as e:
        raise DataError(f"cannot read {path!r}: {_reason(e)}") from e


def open_stream(path: str):
    """(decompressed stream, raw file) for reading a JSONL file in blocks."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path!r}: {e.strerror}") from e
    return (gzip.GzipFile(fileobj=raw, mode="rb") if is_gzip(path) else raw), raw


def read_block(stream, size: int, path: str) -> bytes:
    try:
        return stream.read(size)
    except _GZIP_ERRORS as e:
        raise DataError(f"cannot read {path!r}: {_reason(e)}") from e


def _reason(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.splitlines()[0]


# ------------------------------------------------------------------ JSON Lines


def is_blank(line: bytes) -> bool:
    return line in (b"", b"\r")


def json_object(line: bytes, name: str, line_no: int) -> dict:
    """One JSON line as an object; DataError naming the file and line otherwise."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(f"{name} line {line_no}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{name} line {line_no}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{name} line {line_no}: expected a JSON object, got {type(obj).__name__}")
    return obj


def json_text(line: bytes, name: str, line_no: int, text_key: str) -> str:
    """The document text of one JSON line; DataError naming the file and line otherwise."""
    obj = json_object(line, name, line_no)
    if text_key not in obj:
        keys = ", ".join(map(str, list(obj)[:8])) or "none"
        raise DataError(f"{name} line {line_no}: no {text_key!r} key (keys: {keys}); choose the field with "
                        f"--text-key / data.text_key")
    text = obj[text_key]
    if not isinstance(text, str):
        raise DataError(f"{name} line {line_no}: {text_key!r} holds {type(text).__name__}, not a string")
    return text


def jsonl_texts(chunk: bytes, name: str, first_line: int, text_key: str) -> list[str]:
    """The documents of a block of whole lines whose first line is number `first_line`."""
    out = []
    for i, line in enumerate(chunk.split(b"\n")):
        if not is_blank(line):
            out.append(json_text(line, name, first_line + i, text_key))
    return out


# --------------------------------------------------------------------- Parquet


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError("reading Parquet needs pyarrow (pip install 'jaxinfra[parquet]' or pyarrow)") from e
    return pq


def parquet_file(path: str, name: str, text_key: str):
    """The opened file, after checking that `text_key` is a string column."""
    pq = _pyarrow()
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read Parquet file {name}: {_reason(e)}") from e
    schema = pf.schema_arrow
    if text_key not in schema.names:
        raise DataError(f"{name} has no column {text_key!r} (columns: {', '.join(schema.names[:8]) or 'none'}); "
                        f"choose it with --text-key / data.text_key")
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{name}: column {text_key!r} holds {kind}, not strings")
    return pf


def jsonl_rows(chunk: bytes, name: str, first_line: int) -> list[tuple[dict, str]]:
    """(object, "file:line") of each non-blank line of a block whose first line is number `first_line`."""
    return [(json_object(line, name, first_line + i), f"{name}:{first_line + i}")
            for i, line in enumerate(chunk.split(b"\n")) if not is_blank(line)]


def parquet_chat_file(path: str, name: str):
    """The opened file, after checking it has chat columns: `messages`, or `prompt` and `response`."""
    pq = _pyarrow()
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read Parquet file {name}: {_reason(e)}") from e
    if not chat_columns(pf):
        raise DataError(f"{name} has neither a 'messages' column nor 'prompt' and 'response' columns (columns: "
                        f"{', '.join(pf.schema_arrow.names[:8]) or 'none'})")
    return pf


def chat_columns(pf) -> list[str]:
    """The columns a chat row is read from (empty when the file has none of them)."""
    names = pf.schema_arrow.names
    if "messages" in names:
        return ["messages"]
    return ["prompt", "response"] if "prompt" in names and "response" in names else []


def parquet_rows(pf, group: int | None, name: str, first_row: int) -> list[tuple[dict, str]]:
    """(row, "file row N") of row group `group` (None: the whole file), chat columns only."""
    import pyarrow as pa

    columns = chat_columns(pf)
    try:
        table = pf.read(columns=columns) if group is None else pf.read_row_group(group, columns=columns)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read Parquet file {name}: {_reason(e)}") from e
    return [(row, f"{name} row {first_row + i}") for i, row in enumerate(table.to_pylist())]


def parquet_texts(pf, group: int | None, name: str, first_row: int, text_key: str) -> list[str]:
    """Row group `group` (None: the whole file) of the text column; DataError naming a null row."""
    import pyarrow as pa

    try:
        table = pf.read(columns=[text_key]) if group is None else pf.read_row_group(group, columns=[text_key])
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read Parquet file {name}: {_reason(e)}") from e
    texts = table.column(0).to_pylist()
    for i, text in enumerate(texts):
        if text is None:
            raise DataError(f"{name} row {first_row + i}: {text_key!r} is null")
    return texts


def row_group_starts(pf) -> list[int]:
    md = pf.metadata
    starts, n = [], 0
    for g in range(md.num_row_groups):
        starts.append(n)
        n += md.row_group(g).num_rows
    return starts


def relative_names(files: Sequence[str]) -> list[str]:
    """Paths relative to the files' common directory: what the held-out split hashes, so moving
    the data keeps the split, and a prepared directory splits like its inputs read on the fly."""
    root = common_root([os.path.abspath(f) for f in files])
    return [os.path.relpath(os.path.abspath(f), root) for f in files]
