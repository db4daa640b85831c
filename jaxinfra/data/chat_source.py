"""data.source=chat: one conversation per item, as token ids and the role code of each id.

Conversations come from .jsonl(.gz) / .parquet rows rendered through the chat template when
grain asks for them (`RenderedChats`), or from a directory `jaxinfra data prepare --chat` wrote
(`PreparedChats`: ids shards plus parallel uint8 role-code shards). Either way an item is
{inputs, targets, assistant, truncated}: ids[:-1], ids[1:], the role codes of the targets
(codes[1:]) and a flag at the first position when the conversation was cut to seq_len + 1 ids.
The packer (jaxinfra/data/pipeline.py) puts whole items into rows, so a conversation is split
only by that truncation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from jaxinfra.data.chat import ChatTemplate, encode_chat, messages_of
from jaxinfra.data.config import DataError
from jaxinfra.data.encode import Encoder
from jaxinfra.data.prepared import Prepared
from jaxinfra.data.records import RecordFiles
from jaxinfra.data.sources import TokenFileReader

# conversations(record) -> (ids int32, role codes uint8, where the record is, for errors)
Conversations = Callable[[int], tuple[np.ndarray, np.ndarray, str]]
CHAT_FIELDS = ("inputs", "targets", "assistant", "truncated")


def template_identity(template: ChatTemplate) -> dict[str, str]:
    """Where the template came from and the sha256 of its text (what a prepared directory records)."""
    return {"origin": str(template.origin), "sha256": hashlib.sha256(template.source.encode("utf-8")).hexdigest()}


class RenderedChats:
    """Rows of .jsonl(.gz) / .parquet files, rendered and tokenized when read."""

    def __init__(self, files: RecordFiles, template: ChatTemplate, encoder: Encoder):
        self.files, self.template, self.encoder = files, template, encoder

    def __call__(self, record: int) -> tuple[np.ndarray, np.ndarray, str]:
        row, where = self.files.row(record)
        ids, codes = encode_chat(self.template, self.encoder, messages_of(row, where), where)
        return ids, codes, where


class PreparedChats:
    """Conversations of directories written by `jaxinfra data prepare --chat`, read by random access."""

    def __init__(self, prepared: Sequence[Prepared], vocab_size: int):
        shards, dtypes, roles, docs, names = [], [], [], [], []
        for p in prepared:
            docs.append(p.documents + np.asarray([len(shards), 0, 0]))
            shards += p.shards
            dtypes += [p.dtype] * len(p.shards)
            roles += p.roles
            names += [(p.directory, i["name"], int(i["documents"])) for i in p.meta["inputs"]]
        self.reader = TokenFileReader(shards, dtypes, vocab_size)
        self.roles = roles
        self.documents = np.concatenate(docs) if docs else np.zeros((0, 3), np.int64)
        self.inputs = names  # (directory, input name, conversations) in document order
        self.input_ends = np.cumsum([n for _, _, n in names])
        self._maps: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}  # worker processes reopen the memory maps

    def __call__(self, record: int) -> tuple[np.ndarray, np.ndarray, str]:
        f, start, end = (int(x) for x in self.documents[record])
        ids = self.reader(f, start, end - start)
        if f not in self._maps:
            self._maps[f] = np.memmap(self.roles[f], np.uint8, mode="r")  # a shard holds >= 1 conversation
        codes = np.asarray(self._maps[f][start:end])
        k = int(np.searchsorted(self.input_ends, record, side="right"))
        directory, name, _ = self.inputs[k]
        within = record - (int(self.input_ends[k - 1]) if k else 0)
        return ids, codes, f"{directory}: conversation {within} of input {name}"


class ChatSource:
    """Random access to a subset of conversations, each an item of CHAT_FIELDS cut to seq_len + 1 ids."""

    unit = "conversations"

    def __init__(self, conversations: Conversations, records: np.ndarray, seq_len: int, train_on: str):
        self._conversations = conversations
        self._records = np.asarray(records, np.int64)
        self._seq_len = seq_len
        self._train_on = train_on

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        ids, codes, where = self._conversations(int(self._records[index]))
        return chat_item(ids, codes, where, self._seq_len, self._train_on)

    def __repr__(self) -> str:
        return f"ChatSource(conversations={len(self)}, seq_len={self._seq_len})"


def chat_item(ids: np.ndarray, codes: np.ndarray, where: str, seq_len: int, train_on: str) -> dict[str, np.ndarray]:
    """One conversation as a packable item; DataError when it has nothing sft.train_on could train on."""
    if len(ids) < 2:
        raise DataError(f"{where}: the conversation renders to {len(ids)} token(s); at least 2 are needed")
    if train_on != "all" and not np.any(codes):
        raise DataError(f"{where}: no assistant turn to train on (sft.train_on={train_on} trains only on "
                        f"assistant tokens); drop the row, or set sft.train_on=all")
    cut = len(ids) > seq_len + 1  # the packer needs items that fit a row: the end of a long one is dropped
    ids, codes = ids[:seq_len + 1].astype(np.int32), codes[:seq_len + 1].astype(np.int32)
    truncated = np.zeros(len(ids) - 1, np.int32)
    truncated[0] = int(cut)
    return {"inputs": ids[:-1], "targets": ids[1:], "assistant": codes[1:], "truncated": truncated}
