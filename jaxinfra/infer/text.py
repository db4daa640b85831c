"""The run's text codec for `generate --prompt`: byte-level UTF-8 or its tokenizer.json."""

from __future__ import annotations

import json
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


def generation_stop_ids(cfg: Config, run_dir: str | pathlib.Path | None) -> list[int]:
    """The eos_token_id(s) of the generation_config.json an `hf import` carried (in the run dir, or beside
    the run's tokenizer.json): `generate`'s stop ids when --stop-ids is not given, as transformers stops."""
    from jaxinfra.infer.chat import run_file

    folders = [pathlib.Path(run_dir)] if run_dir is not None else []
    if cfg.data.tokenizer is not None:
        folders.append(pathlib.Path(run_file(cfg.data.tokenizer, run_dir)).parent)
    path = next((f / "generation_config.json" for f in folders if (f / "generation_config.json").is_file()), None)
    if path is None:
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError):
        raise InferenceError(f"{path}: not a JSON object with eos_token_id") from None
    eos = eos if isinstance(eos, list) else [eos]
    return [int(e) for e in eos if isinstance(e, int) and not isinstance(e, bool)]


def text_ids(cfg: Config, run_dir: str | pathlib.Path | None, path: str) -> list[int]:
    """A UTF-8 text file's ids under the run's codec (its tokenizer.json, or bytes): `eval --text`."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InferenceError(f"--text: cannot read {path!r} as UTF-8 text ({e})") from None
    return text_codec(cfg, run_dir)[0](text)
