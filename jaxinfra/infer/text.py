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

    path = pathlib.Path(data.tokenizer)
    beside_run = run_dir is not None and (pathlib.Path(run_dir) / path).is_file()
    if not path.is_file() and not path.is_absolute() and beside_run:
        path = pathlib.Path(run_dir) / path
    tok = load_tokenizer(str(path))
    return (lambda text: list(tok.encode(text, add_special_tokens=False).ids),
            lambda ids: tok.decode(list(ids)))
