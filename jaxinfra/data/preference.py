"""data.source=preference (DPO): one packed item per preference pair, [prompt+chosen | prompt+rejected].

Rows of .jsonl(.gz) / .parquet files hold `prompt`, `chosen` and `rejected`:
- chat: `prompt` is a list of {role, content} messages (or a string: one user message) and
  `chosen` / `rejected` are the assistant's reply (a string, or a list of messages that continue
  the prompt). Each half is the conversation prompt + reply rendered through `data.chat_template`
  (jaxinfra/data/chat.py, as data.source=chat); its completion is the reply's assistant tokens,
  end-of-turn included (SFT's assistant mask, limited to the tokens after the rendered prompt);
- plain text (all three strings): the prompt's ids, then the completion's ids followed by the
  end-of-document id (so the policy learns where a completion stops, as documents end in
  data.source=jsonl); the end-of-document id is a completion token.

An item is both halves back to back, so a pair never splits over rows, shards or microbatches.
Fields: inputs, targets, completion (1 where the TARGET is a completion token), truncated (1 at the
first position when a completion was cut), and two the packer carries for the layout: `half` (1
chosen, 2 rejected) and `position_in_half` (positions restarting at each half; no field may end in
`_positions` or `_segment_ids`: the packer writes those names for every field). In the packed row
(jaxinfra/data/pipeline.py) pair k's chosen half gets segment id 2k - 1 and its rejected half 2k.

A pair longer than seq_len + 2 ids (seq_len targets over both halves) keeps both prompts and cuts
the ends of the completions: both halves to one common length when both are long, else only the
longer one. When the prompt alone leaves no completion target in a half, the row is a DataError
naming file:row (a pair is never dropped silently: shorten it or raise train.seq_len).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jaxinfra.data.chat import ChatTemplate, encode_chat, messages_of
from jaxinfra.data.config import DataError
from jaxinfra.data.encode import Encoder
from jaxinfra.data.records import RecordFiles

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
PREFERENCE_FIELDS = ("inputs", "targets", "completion", "truncated", "half", "position_in_half")


class PreferenceRecords(RecordFiles):
    """RecordFiles whose Parquet rows are read as the preference columns."""

    def _parquet(self, f: int):
        from jaxinfra.data.formats import _pyarrow

        path = self.files[f]
        pf = _pyarrow().ParquetFile(path)
        missing = [c for c in PREFERENCE_COLUMNS if c not in pf.schema_arrow.names]
        if missing:
            raise DataError(f"{path} has no {missing[0]!r} column (a preference row needs prompt, chosen and rejected)")
        return pf

    def _row_columns(self, pf) -> list[str]:
        return list(PREFERENCE_COLUMNS)


def _is_messages(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _reply(value: object, where: str, key: str) -> list[dict[str, str]]:
    """A chosen / rejected value as messages that continue the prompt."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return messages_of({"messages": value}, f"{where} ({key})")


def _chat_half(template: ChatTemplate, encoder: Encoder, prompt: list[dict[str, str]],
               reply: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, completion flag per id) of prompt + reply: the reply's assistant tokens."""
    ids, codes = encode_chat(template, encoder, [*prompt, *reply], where)
    prompt_ids, _ = encode_chat(template, encoder, prompt, where)
    n = min(len(ids), len(prompt_ids))
    common = int(np.argmin(np.append(ids[:n] == prompt_ids[:n], False)))  # the rendered prompt's prefix
    flags = (codes > 0).astype(np.int32)
    flags[:common] = 0
    return ids.astype(np.int32), flags


def encode_pair(row: Mapping, where: str, template: ChatTemplate,
                encoder: Encoder) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((ids, completion flags) of the chosen half, the same of the rejected half) of one row."""
    for key in PREFERENCE_COLUMNS:
        if row.get(key) is None:
            raise DataError(f"{where}: no {key!r} (a preference row needs prompt, chosen and rejected)")
    prompt, chosen, rejected = (row[k] for k in PREFERENCE_COLUMNS)
    if any(_is_messages(v) for v in (prompt, chosen, rejected)):
        messages = (messages_of({"messages": prompt}, f"{where} (prompt)") if _is_messages(prompt)
                    else [{"role": "user", "content": str(prompt)}])
        halves = tuple(_chat_half(template, encoder, messages, _reply(v, where, k), where)
                       for k, v in (("chosen", chosen), ("rejected", rejected)))
    else:
        for key in PREFERENCE_COLUMNS:
            if not isinstance(row[key], str):
                raise DataError(f"{where}: {key!r} is a {type(row[key]).__name__}, not text or messages")
        prompt_ids = encoder.encode([prompt])[0][:-1]
        halves = tuple((np.concatenate([prompt_ids, c]).astype(np.int32),
                        np.concatenate([np.zeros(len(prompt_ids), np.int32), np.ones(len(c), np.int32)]))
                       for c in encoder.encode([chosen, rejected]))
    for (_, flags), key in zip(halves, ("chosen", "rejected")):
        if not np.any(flags[1:]):
            raise DataError(f"{where}: the {key} half has no completion token after the prompt (empty {key}, or an "
                            f"empty prompt)")
    return halves


def _cap(lengths: tuple[int, int], seq_len: int) -> int:
    """The most ids a half may keep so that both halves give at most seq_len targets."""
    room, small = seq_len + 2, min(lengths)
    return room // 2 if small >= room // 2 else room - small


def pair_item(halves: tuple[tuple[np.ndarray, np.ndarray], ...], where: str, seq_len: int) -> dict[str, np.ndarray]:
    """The packable item of one pair, its completions cut to fit seq_len (module doc)."""
    cap = _cap((len(halves[0][0]), len(halves[1][0])), seq_len)
    cut = any(len(ids) > cap for ids, _ in halves)
    parts = []
    for (ids, flags), key in zip(halves, ("chosen", "rejected")):
        first = int(np.argmax(flags))  # the prompt's length in ids
        ids, flags = ids[:cap], flags[:cap]
        if not np.any(flags[1:]):
            raise DataError(f"{where}: the prompt ({first} tokens) leaves no room for a {key} completion token "
                            f"within train.seq_len={seq_len} (both halves of a pair share one row): shorten the "
                            f"prompt or raise train.seq_len")
        parts.append((ids, flags))
    (c, cf), (r, rf) = parts
    truncated = np.zeros(len(c) + len(r) - 2, np.int32)
    truncated[0] = int(cut)
    return {"inputs": np.concatenate([c[:-1], r[:-1]]), "targets": np.concatenate([c[1:], r[1:]]),
            "completion": np.concatenate([cf[1:], rf[1:]]), "truncated": truncated,
            "half": np.concatenate([np.ones(len(c) - 1, np.int32), np.full(len(r) - 1, 2, np.int32)]),
            "position_in_half": np.concatenate([np.arange(len(c) - 1), np.arange(len(r) - 1)]).astype(np.int32)}


class PreferenceSource:
    """Random access to a subset of preference rows, each an item of PREFERENCE_FIELDS."""

    unit = "preference pairs"
    fields = PREFERENCE_FIELDS

    def __init__(self, files: RecordFiles, template: ChatTemplate, encoder: Encoder, records: np.ndarray,
                 seq_len: int):
        self._files, self._template, self._encoder = files, template, encoder
        self._records = np.asarray(records, np.int64)
        self._seq_len = seq_len

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row, where = self._files.row(int(self._records[index]))
        return pair_item(encode_pair(row, where, self._template, self._encoder), where, self._seq_len)

    def __repr__(self) -> str:
        return f"PreferenceSource(pairs={len(self)}, seq_len={self._seq_len})"


def pair_layout(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's fields of a packed preference row: pair k's halves get segment ids 2k - 1 and 2k,
    positions restart at each half."""
    seg = packed["inputs_segment_ids"]
    return {"inputs": packed["inputs"], "targets": packed["targets"],
            "segment_ids": np.where(seg > 0, 2 * seg - 2 + packed["half"], 0).astype(np.int32),
            "positions": packed["position_in_half"], "completion": packed["completion"],
            "truncated": packed["truncated"]}
