"""Directories written by `jaxinfra data prepare`: the layout, and reading them for training.

    DIR/prepare.json         the plan: inputs (names, sizes, sha256), tokenizer, text key, shard size
    DIR/tokenizer.json       a copy of the tokenizer (absent for byte-level data)
    DIR/shard-00000.bin      token ids, raw little-endian uint16/uint32 (the nanoGPT .bin layout)
    DIR/shard-00000.docs.npy int64 document offsets into that shard: documents + 1 entries
    DIR/shard-00000.roles.bin chat only (`--chat`): one uint8 role code per token of the shard
                             (jaxinfra/data/chat.py: 0 not trained, 1 assistant, 2 last assistant turn)
    DIR/ledger.jsonl         one line per completed shard (what an interrupted run resumes from)
    DIR/meta.json            written last: counts, per-input and per-shard figures; its presence
                             means the preparation is complete

Documents never span shards and each ends with the end-of-document id (jaxinfra/data/encode.py).
A chat preparation (meta.json `chat`: the template's origin and sha256) holds one rendered
conversation per document and no end-of-document id: the template ends the turns.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxinfra.data.config import DataError

FORMAT = "jaxinfra-tokens/1"
META, PLAN, LEDGER, TOKENIZER = "meta.json", "prepare.json", "ledger.jsonl", "tokenizer.json"


def shard_names(index: int) -> tuple[str, str]:
    return f"shard-{index:05d}.bin", f"shard-{index:05d}.docs.npy"


def roles_name(index: int) -> str:
    return f"shard-{index:05d}.roles.bin"


def is_chat(meta: dict) -> bool:
    """Whether a preparation holds chat conversations (`data prepare --chat`)."""
    return bool(meta.get("chat"))


def is_prepared(path: str) -> bool:
    """A directory `data prepare` wrote into (complete or not)."""
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, META)) or
                                    os.path.exists(os.path.join(path, PLAN)))


def read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise DataError(f"cannot read {what} {path!r}: {e.strerror}") from e
    except ValueError as e:
        raise DataError(f"{what} {path!r} is not valid JSON ({e}); the preparation is damaged") from e
    if not isinstance(data, dict):
        raise DataError(f"{what} {path!r} is not a JSON object; the preparation is damaged")
    return data


def load_meta(directory: str) -> dict:
    """meta.json of a complete preparation; DataError for an unfinished or foreign one."""
    path = os.path.join(directory, META)
    if not os.path.exists(path) and not os.path.exists(os.path.join(directory, PLAN)):
        raise DataError(f"data.paths: {directory!r} is not a directory made by `jaxinfra data prepare` (no {META})")
    if not os.path.exists(path):
        raise DataError(f"data.paths: {directory!r} is an unfinished preparation (no {META}); rerun the same "
                        f"`jaxinfra data prepare` command to finish it")
    meta = read_json(path, "prepared-data metadata")
    if meta.get("format") != FORMAT:
        raise DataError(f"data.paths: {path!r} has format {meta.get('format')!r}; this jaxinfra reads {FORMAT!r}")
    return meta


@dataclasses.dataclass
class Prepared:
    """A complete preparation, checked: shard paths, their dtype, documents and split keys."""

    directory: str
    meta: dict
    shards: list[str]
    documents: np.ndarray  # [n, 3] int64: (shard index in `shards`, start, end)
    roles: list[str] = dataclasses.field(default_factory=list)  # chat: role-code shards beside `shards`

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def record_keys(self) -> tuple[list[str], list[int]]:
        """Input names and their document counts, in document order (for split_records)."""
        return [i["name"] for i in self.meta["inputs"]], [int(i["documents"]) for i in self.meta["inputs"]]


def open_prepared(directory: str) -> Prepared:
    """Load meta.json and check every shard against it (sizes and offsets, no hashing)."""
    meta = load_meta(directory)
    itemsize = np.dtype(meta["dtype"]).itemsize
    shards, docs, roles = [], [], []
    for s, shard in enumerate(meta["shards"]):
        path, offsets_path = (os.path.join(directory, shard[k]) for k in ("file", "offsets"))
        want = int(shard["tokens"]) * itemsize
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != want:
            found = "missing" if size is None else f"{size} bytes"
            raise DataError(f"data.paths: shard {path!r} is {found}, but {META} records {shard['tokens']} tokens "
                            f"({want} bytes): truncated or replaced; rerun `jaxinfra data prepare` into a new "
                            f"directory")
        offsets = _offsets(offsets_path, int(shard["documents"]), int(shard["tokens"]))
        if is_chat(meta):
            roles.append(_roles(directory, shard))
        docs.append(np.stack([np.full(len(offsets) - 1, s), offsets[:-1], offsets[1:]], axis=1))
        shards.append(path)
    documents = np.concatenate(docs) if docs else np.zeros((0, 3), np.int64)
    return Prepared(directory, meta, shards, documents.astype(np.int64), roles)


def _roles(directory: str, shard: dict) -> str:
    path = os.path.join(directory, shard.get("roles", ""))
    size = os.path.getsize(path) if shard.get("roles") and os.path.exists(path) else None
    if size != int(shard["tokens"]):
        found = "missing" if size is None else f"{size} bytes"
        raise DataError(f"data.paths: role codes {path!r} are {found}, but {META} records {shard['tokens']} tokens: "
                        f"truncated or replaced; rerun `jaxinfra data prepare --chat` into a new directory")
    return path


def _offsets(path: str, documents: int, tokens: int) -> np.ndarray:
    try:
        offsets = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"data.paths: cannot read document offsets {path!r}: {str(e).splitlines()[0]}") from e
    ok = (offsets.ndim == 1 and len(offsets) == documents + 1 and offsets[0] == 0 and offsets[-1] == tokens
          and np.all(np.diff(offsets) >= 0))
    if not ok:
        raise DataError(f"data.paths: document offsets {path!r} do not match {META} ({documents} documents, "
                        f"{tokens} tokens): damaged; rerun `jaxinfra data prepare` into a new directory")
    return offsets.astype(np.int64)


def tokenizer_of(meta: dict) -> str:
    """'bytes' or the sha256 of the tokenizer.json the data was prepared with."""
    return meta["tokenizer"]["sha256"]


def describe_tokenizer(meta: dict) -> str:
    tok = meta["tokenizer"]
    return "byte-level ids" if tok["kind"] == "bytes" else f"tokenizer {tok['name']} (sha256 {tok['sha256'][:12]})"
