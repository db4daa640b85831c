"""The `data` section of the run config, and the error the data pipeline raises."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Literal, get_args

from jaxinfra import storage
from sharding.ranges import range_problems, ranged

Source = Literal["text", "tokens", "synthetic", "jsonl", "parquet", "chat", "preference", "prompts"]
TokenDtype = Literal["uint16", "uint32"]
SOURCES: tuple[str, ...] = get_args(Source)
TOKEN_DTYPES: tuple[str, ...] = get_args(TokenDtype)
# sources that take data.tokenizer
_TOKENIZED_SOURCES = ("text", "tokens", "jsonl", "parquet", "chat", "preference", "prompts")
_UNMIXED_SOURCES = ("preference", "prompts")  # read by the dpo / grpo extensions alone
_FILE_SOURCES = ("tokens", "jsonl", "parquet", "chat", "preference", "prompts")  # sources that need data.paths
TRAIN_ON = ("assistant", "all", "last_assistant")  # sft.train_on (the data refuses rows with nothing to train)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # mixture names become metric names (eval_loss/<name>)


class DataError(ValueError):
    """A problem with the data: one line that names the key, the file and the value."""


@dataclasses.dataclass(frozen=True)
class MixtureConfig:
    """One source of a weighted mixture (`data.mixture.<name>`)."""

    paths: tuple[str, ...] = ()
    weight: float = ranged(1.0, 0, what="a number")  # relative share of training sequences (normalised)
    # Staged weights: [[step, weight], ...], the first at step 0; [S, w] applies from the batch
    # after S completed steps. Replaces `weight` when given.
    weights: tuple[tuple[float, ...], ...] = ranged((), 0, note="steps and weights")
    source: Source | None = None  # None: data.source

    def problems(self, name: str) -> list[tuple[str, object, str]]:
        key = f"mixture.{name}"
        out: list[tuple[str, object, str]] = []
        if not _NAME.match(name):
            out.append((key, name, "a name of letters, digits, '_', '.' or '-' (it names eval_loss/<name>)"))
        if not self.paths or not all(isinstance(p, str) and p for p in self.paths):
            out.append((f"{key}.paths", self.paths, "a non-empty list of files, globs or prepared directories"))
        if self.source is not None and self.source not in SOURCES:
            out.append((f"{key}.source", self.source, f"null or one of {list(SOURCES)}"))
        if self.source == "synthetic":
            out.append((f"{key}.source", self.source, "a source that reads files (not synthetic)"))
        steps = [s[0] for s in self.weights if len(s) == 2]
        if any(len(s) != 2 or s[0] < 0 or s[0] != int(s[0]) or s[1] < 0 for s in self.weights):
            out.append((f"{key}.weights", self.weights, "a list of [step, weight] pairs, integer steps >= 0, "
                                                        "weights >= 0"))
        elif self.weights and (steps[0] != 0 or any(b <= a for a, b in itertools.pairwise(steps))):
            out.append((f"{key}.weights", self.weights, "stages in increasing step order, the first at step 0"))
        return out

    def stages(self) -> list[tuple[int, float]]:
        """[(first batch index, weight)], at least one stage, starting at 0."""
        return [(int(s), float(w)) for s, w in self.weights] if self.weights else [(0, float(self.weight))]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from and how they are split and shuffled."""

    source: Source = "text"
    # Files or globs. text: empty = the Python standard library's own .py files.
    # tokens: required (.bin raw token ids, .npy, or directories made by `jaxinfra data prepare`).
    # jsonl / parquet: .jsonl(.gz) / .parquet files, tokenized on the fly.
    # chat: .jsonl(.gz) / .parquet conversations, or directories made by `jaxinfra data prepare --chat`.
    # preference (DPO): .jsonl(.gz) / .parquet rows `prompt`, `chosen`, `rejected` (text, or chat messages).
    # prompts (GRPO): .jsonl(.gz) / .parquet rows `prompt` (text or chat messages), optional `answer`.
    paths: tuple[str, ...] = ()
    # Path to a HF tokenizer.json; None = byte-level (ids 0..255). For prepared directories
    # (tokens): when given, it must be the tokenizer the directory was prepared with.
    tokenizer: str | None = None
    # Dtype of raw nanoGPT-style .bin files; .npy files and prepared directories carry their own.
    token_dtype: TokenDtype = "uint16"
    # jsonl / parquet: the field (column) that holds each document's text.
    text_key: str = "text"
    # Share of documents (text, jsonl, parquet, prepared directories) / of each file's tokens
    # (.bin, .npy) / of sequences (synthetic) held out for evaluation.
    eval_fraction: float = ranged(0.05, 0, 1, lo_open=True, hi_open=True, what="a number")
    eval_batches: int = ranged(4, 0)  # held-out batches evaluated each time (per mixture source)
    shuffle: bool = True
    worker_count: int = ranged(0, 0, note="0 = no worker processes")  # grain worker processes (0 = in-process)
    # synthetic only: how many token ids the generated language uses.
    synthetic_vocab: int = ranged(64, 2)
    # chat only: how conversations are rendered: "chatml" (built in), "tokenizer" (the chat_template
    # of the tokenizer_config.json beside data.tokenizer) or the path of a Jinja file.
    chat_template: str = "chatml"
    # Weighted sources (`data.mixture.<name>.paths/weight/weights/source`); replaces data.paths.
    mixture: dict[str, MixtureConfig] = dataclasses.field(default_factory=dict)

    def problems(self) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out = range_problems(self)
        if self.source not in SOURCES:
            out.append(("source", self.source, f"one of {list(SOURCES)}"))
        if not isinstance(self.paths, (tuple, list)) or not all(isinstance(p, str) and p for p in self.paths):
            out.append(("paths", self.paths, "a list of non-empty file paths or globs"))
        elif self.mixture and self.paths:
            out.append(("paths", self.paths, "empty when data.mixture is set (each source has its own paths)"))
        elif self.source in _FILE_SOURCES and not self.paths and not self.mixture:
            out.append(("paths", self.paths, f"at least one file, glob or directory when data.source is "
                                             f"'{self.source}'"))
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, str) or not self.tokenizer:
                out.append(("tokenizer", self.tokenizer, "null or the path of a tokenizer.json"))
            elif self.source not in _TOKENIZED_SOURCES:
                out.append(("tokenizer", self.tokenizer,
                            f"null unless data.source is one of {list(_TOKENIZED_SOURCES)}"))
        if self.token_dtype not in TOKEN_DTYPES:
            out.append(("token_dtype", self.token_dtype, f"one of {list(TOKEN_DTYPES)}"))
        if not isinstance(self.text_key, str) or not self.text_key:
            out.append(("text_key", self.text_key, "a non-empty field name"))
        if not isinstance(self.chat_template, str) or not self.chat_template:
            out.append(("chat_template", self.chat_template, "'chatml', 'tokenizer' or the path of a Jinja file"))
        if not isinstance(self.shuffle, bool):
            out.append(("shuffle", self.shuffle, "true or false"))
        return out + self._mixture_problems()

    def _mixture_problems(self) -> list[tuple[str, object, str]]:
        if not self.mixture:
            return []
        if self.source == "synthetic":
            return [("source", self.source, "a source that reads files when data.mixture is set")]
        out = [p for name, part in self.mixture.items() for p in part.problems(name)]
        paired = sorted(n for n, part in self.mixture.items() if (part.source or self.source) in _UNMIXED_SOURCES)
        if paired:  # DPO pairs and GRPO prompts feed their own step extensions, one source each
            out.append((f"mixture.{paired[0]}.source", self.mixture[paired[0]].source or self.source,
                        f"not one of {list(_UNMIXED_SOURCES)} (those sources cannot be mixed)"))
        chat = {name: (part.source or self.source) == "chat" for name, part in sorted(self.mixture.items())}
        if not out and len(set(chat.values())) > 1:
            a, b = next(n for n, c in chat.items() if c), next(n for n, c in chat.items() if not c)
            out.append(("mixture", f"{a} (chat) and {b} (not chat)",
                        "sources of one kind: chat conversations cannot be mixed with plain documents"))
        if not out:
            steps = sorted({s for part in self.mixture.values() for s, _ in part.stages()})
            for step in steps:
                if sum(weight_at(part.stages(), step) for part in self.mixture.values()) <= 0:
                    out.append(("mixture", f"weights at step {step}", "a positive weight for at least one source"))
                    break
        return out

    def check(self) -> None:
        """Raises DataError for the first problem, if any."""
        for key, value, allowed in self.problems():
            raise DataError(f"data.{key}={value!r} is invalid: must be {allowed}")

    def parts(self) -> dict[str, DataConfig]:
        """Each mixture source as a plain one-source config, by name (sorted); {"": self} without a mixture."""
        if not self.mixture:
            return {"": self}
        return {name: dataclasses.replace(self, source=part.source or self.source, paths=tuple(part.paths),
                                          mixture={})
                for name, part in sorted(self.mixture.items())}


def local_paths(cfg: DataConfig) -> DataConfig:
    """`cfg` with each gs:// / s3:// entry of data.paths (an object, or a prefix such as a prepared
    directory) replaced by a local copy (jaxinfra/storage.py local_copy: cached, downloaded whole or not
    at all), since token files are memory-mapped; `cfg` itself when no path is a URL. One source: call it
    on `cfg.parts()`'s values."""
    if not any(storage.is_url(p) for p in cfg.paths):
        return cfg
    return dataclasses.replace(cfg, paths=tuple(storage.local_copy(p, "data.paths") for p in cfg.paths))


def weight_at(stages: list[tuple[int, float]], step: int) -> float:
    """The weight of the last stage starting at or before `step`."""
    weight = stages[0][1]
    for start, w in stages:
        if start <= step:
            weight = w
    return weight
