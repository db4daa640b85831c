"""The run's text codec for `generate --prompt`: byte-level UTF-8 or its tokenizer.json."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from jaxinfra.config import Config
from jaxinfra.infer.loading import InferenceError


def text_codec(cfg: Config, run_dir: str | pathlib.Path | None = None) -> tuple[Callable[[str], list[int]],
                                                                                 Callable[[list[int]], str]]:
    """(encode, decode) for the run's data config: byte-level UTF-8 (ids 0..255) or its tokenizer.json."""
    data = cfg.data
    if data.source != "text":
        raise InferenceError(f"the run's data.source={data.source!r} has no text tokenizer: use --prompt-ids")
    if data.tokenizer is None:
        return (lambda text: list(text.encode("utf-8")),
                lambda ids: bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace"))
    from jaxinfra.data.tokenizer import load_tokenizer
    from jaxinfra.infer.chat import run_file

    tok = load_tokenizer(run_file(data.tokenizer, run_dir))
    return (lambda text: list(tok.encode(text, add_special_tokens=False).ids),
            lambda ids: tok.decode(list(ids)))
