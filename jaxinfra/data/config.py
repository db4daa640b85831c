"""The `data` section of the run config, and the error the data pipeline raises."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

Source = Literal["text", "tokens", "synthetic"]
TokenDtype = Literal["uint16", "uint32"]
SOURCES: tuple[str, ...] = get_args(Source)
TOKEN_DTYPES: tuple[str, ...] = get_args(TokenDtype)


class DataError(ValueError):
    """A problem with the data: one line that names the key, the file and the value."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from and how they are split and shuffled."""

    source: Source = "text"
    # Files or globs. text: empty = the Python standard library's own .py files.
    # tokens: required (.bin raw token ids, or .npy).
    paths: tuple[str, ...] = ()
    # text only: path to a HF tokenizer.json; None = byte-level (ids 0..255).
    tokenizer: str | None = None
    # Dtype of raw nanoGPT-style .bin files; .npy files carry their own dtype.
    token_dtype: TokenDtype = "uint16"
    # Share of documents (text) / of each file's tokens (tokens) / of sequences
    # (synthetic) held out for evaluation.
    eval_fraction: float = 0.05
    eval_batches: int = 4  # held-out batches evaluated each time
    shuffle: bool = True
    worker_count: int = 0  # grain worker processes (0 = in-process)
    # synthetic only: how many token ids the generated language uses.
    synthetic_vocab: int = 64

    def problems(self) -> list[tuple[str, object, str]]:
        """Inconsistent values as (key, value, what is allowed); empty when valid."""
        out: list[tuple[str, object, str]] = []
        if self.source not in SOURCES:
            out.append(("source", self.source, f"one of {list(SOURCES)}"))
        if not isinstance(self.paths, (tuple, list)) or not all(isinstance(p, str) and p for p in self.paths):
            out.append(("paths", self.paths, "a list of non-empty file paths or globs"))
        elif self.source == "tokens" and not self.paths:
            out.append(("paths", self.paths, "at least one .bin or .npy file or glob when data.source is 'tokens'"))
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, str) or not self.tokenizer:
                out.append(("tokenizer", self.tokenizer, "null or the path of a tokenizer.json"))
            elif self.source != "text":
                out.append(("tokenizer", self.tokenizer, "null unless data.source is 'text'"))
        if self.token_dtype not in TOKEN_DTYPES:
            out.append(("token_dtype", self.token_dtype, f"one of {list(TOKEN_DTYPES)}"))
        if not _is_number(self.eval_fraction) or not 0 < self.eval_fraction < 1:
            out.append(("eval_fraction", self.eval_fraction, "a number in (0, 1)"))
        if not _is_int(self.eval_batches) or self.eval_batches < 0:
            out.append(("eval_batches", self.eval_batches, "an integer >= 0"))
        if not isinstance(self.shuffle, bool):
            out.append(("shuffle", self.shuffle, "true or false"))
        if not _is_int(self.worker_count) or self.worker_count < 0:
            out.append(("worker_count", self.worker_count, "an integer >= 0 (0 = no worker processes)"))
        if not _is_int(self.synthetic_vocab) or self.synthetic_vocab < 2:
            out.append(("synthetic_vocab", self.synthetic_vocab, "an integer >= 2"))
        return out

    def check(self) -> None:
        """Raises DataError for the first problem, if any."""
        for key, value, allowed in self.problems():
            raise DataError(f"data.{key}={value!r} is invalid: must be {allowed}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
