"""data.source=prompts: the prompts GRPO rolls out from, in a deterministic order.

Rows (.jsonl / .jsonl.gz / .parquet) hold `prompt`, either text (encoded as is) or a list of chat
messages (rendered with data.chat_template and its generation prompt, `encode_chat_prompt`), and
an optional `answer` (a string handed to the reward functions, e.g. the exact sum). The file is
small next to a corpus, so every row is read, checked and encoded once, when the run starts: a
bad row is found before anything compiles (DataError naming file:row).

Order: an infinite sequence, epoch e being a permutation of the rows seeded by (train.seed, e);
rollout k takes positions [k * P, (k + 1) * P) with P = train.batch_size / grpo.group_size, so
the data position is a function of the rollout index alone (jaxinfra/grpo/extension.py records
it in the checkpoint and checks it on resume).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import numpy as np

from jaxinfra.data.chat import ChatTemplate, encode_chat_prompt, end_of_turn_ids, load_chat_template, messages_of
from jaxinfra.data.config import DataConfig, DataError
from jaxinfra.data.encode import Encoder, make_encoder
from jaxinfra.data.formats import input_kind, json_object, read_bytes
from jaxinfra.data.records import index_lines
from jaxinfra.data.sources import expand_paths


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # the tokens the sampler continues (no end-of-document id)
    text: str  # what the reward functions see: the text, or the last message's content
    answer: str | None
    where: str  # "file:line" / "file row N"


@dataclasses.dataclass
class PromptSet:
    prompts: list[Prompt]
    encoder: Encoder
    template: ChatTemplate | None  # set when a row holds chat messages
    stop_ids: tuple[int, ...]  # the end-of-document id, and the end-of-turn when it is one token
    stop_sequence: tuple[int, ...]  # a several-token end-of-turn (byte-level)

    def __len__(self) -> int:
        return len(self.prompts)

    def completion_text(self, ids: Sequence[int]) -> str:
        """A completion's text, cut before the end-of-turn (byte-level: invalid UTF-8 shows as U+FFFD)."""
        # ids past the data's vocabulary (a model vocabulary padded beyond it) have no text
        text = self.encoder.decode([int(i) for i in ids if 0 <= int(i) < self.encoder.vocab_size])
        eot = self.template.end_of_turn if self.template is not None else ""
        return text.split(eot, 1)[0] if eot else text


def _file_rows(path: str) -> list[tuple[dict, str]]:
    """(row, where) of every row of a .jsonl(.gz) or .parquet file."""
    kind = input_kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return [(row, f"{path} row {i}") for i, row in enumerate(table.to_pylist())]
    if kind != "jsonl":
        raise DataError(f"data.paths: {path!r} is not a .jsonl, .jsonl.gz or .parquet file (data.source=prompts)")
    data = read_bytes(path)  # the whole file (decompressed when .gz): prompt files are small
    starts, ends, numbers = index_lines(data)
    return [(json_object(bytes(data[s:e]), path, int(n)), f"{path}:{int(n)}") for s, e, n in zip(starts, ends, numbers)]


def _prompt(row: Mapping, where: str, encoder: Encoder, template: ChatTemplate | None) -> Prompt:
    if "prompt" not in row or row["prompt"] is None:
        raise DataError(f"{where}: no 'prompt' (data.source=prompts rows hold 'prompt' and an optional 'answer'; "
                        f"keys: {sorted(row)[:8]})")
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = json.dumps(answer) if not isinstance(answer, int | float) else str(answer)
    raw = row["prompt"]
    if isinstance(raw, str):
        ids, text = encoder.encode([raw])[0][:-1], raw
    else:
        messages = messages_of({"messages": raw}, where)
        ids, text = encode_chat_prompt(template, encoder, messages), messages[-1]["content"]
    if len(ids) == 0:
        raise DataError(f"{where}: the prompt encodes to no tokens")
    return Prompt(tuple(int(i) for i in ids), text, answer, where)


def load_prompts(data: DataConfig, seq_len: int, max_new_tokens: int) -> PromptSet:
    """Every prompt of data.paths, encoded; DataError naming file:row for a bad one or one too long
    for train.seq_len with grpo.max_new_tokens."""
    encoder = make_encoder(data.tokenizer)
    rows = [r for f in expand_paths(data.paths) for r in _file_rows(f)]
    chat = any(not isinstance(row.get("prompt"), str | None) for row, _ in rows)
    template = load_chat_template(data.chat_template, data.tokenizer) if chat else None
    prompts = [_prompt(row, where, encoder, template) for row, where in rows]
    for p in prompts:  # prompt + completion - 1 targets must fit one row
        if len(p.ids) + max_new_tokens > seq_len + 1:
            raise DataError(f"{p.where}: the prompt has {len(p.ids)} tokens; with grpo.max_new_tokens="
                            f"{max_new_tokens} it does not fit train.seq_len={seq_len}")
    eot = [int(i) for i in end_of_turn_ids(template, encoder)] if template is not None else []
    stop_ids = (encoder.eod_id, *eot) if len(eot) == 1 else (encoder.eod_id,)
    return PromptSet(prompts, encoder, template, stop_ids, tuple(eot) if len(eot) > 1 else ())


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of the rows for one epoch (seeded by train.seed and the epoch)."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, 0x6770])).permutation(n)


def rollout_indices(n: int, seed: int, rollout: int, per_rollout: int) -> list[int]:
    """The rows of rollout `rollout`: positions [rollout * P, (rollout + 1) * P) of the infinite order."""
    out, cache = [], {}
    for pos in range(rollout * per_rollout, (rollout + 1) * per_rollout):
        epoch = pos // n
        if epoch not in cache:
            cache[epoch] = epoch_order(n, seed, epoch)
        out.append(int(cache[epoch][pos % n]))
    return out
