"""The run's tokenizer as lm-eval needs it: encode/decode, the end-of-text id, the chat template."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence

from jaxinfra.config import Config
from jaxinfra.infer.text import generation_stop_ids, text_codec

# Data sources whose documents are text under data.tokenizer (or bytes): the model reads text as they did.
# `tokens` / `synthetic` runs have ids with no text: text_codec refuses them (exit 2).
TEXT_SOURCES = ("text", "jsonl", "parquet", "chat", "preference", "prompts")


@dataclasses.dataclass
class RunTokenizer:
    """What JaxinfraLM tokenizes with. `eot_id` ends a generation (and its text joins `until`, as
    lm-eval's HF model adds the EOS text); `prefix_id` prefixes rolling windows and empty contexts."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eot_id: int
    stop_ids: list[int]  # ids that end generate_until early (the eot, an imported eos list)
    name: str  # the tokenizer's identity, for lm-eval's request cache fingerprint
    cfg: Config
    run_dir: pathlib.Path | None
    eot_string: str = ""  # the end-of-text id's text, special tokens spelled out (HF: skip_special_tokens=False)
    prefix_id: int | None = None  # what precedes an empty context / a rolling window: the BOS, else the eot

    def eot_text(self) -> str:
        return self.eot_string

    def chat_text(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The messages rendered by the run's chat template (jaxinfra/infer/chat.py run_chat_template)."""
        from jaxinfra.data.chat import render
        from jaxinfra.infer.chat import run_chat_template

        template, _ = run_chat_template(self.cfg, self.run_dir)
        return render(template, messages, add_generation_prompt=add_generation_prompt)[0]

    def template_source(self) -> str | None:
        """The chat template's Jinja source, or None when the run has none."""
        from jaxinfra.infer.chat import run_chat_template
        from jaxinfra.infer.loading import InferenceError

        try:
            return run_chat_template(self.cfg, self.run_dir)[0].source
        except InferenceError:
            return None


def run_tokenizer(cfg: Config, run_dir: str | pathlib.Path | None = None) -> RunTokenizer:
    """The tokenizer of a run: its data.tokenizer (tokenizer.json) or byte-level UTF-8 (ids 0..255).

    The end-of-text id: an `hf import`'s generation_config eos, else tokenizer_config.json's eos_token,
    else the data's end-of-document id
    (jaxinfra/data/encode.py: the tokenizer's EOD token, or 256 for `data prepare --bytes`) when the
    vocabulary holds it, else 0 (a byte-level model trained on raw text has no such id: NUL stands in,
    as the byte-level HF tokenizer of tests/fixtures/lm_eval/ declares it)."""
    from jaxinfra.data.encode import make_encoder
    from jaxinfra.infer.chat import run_file

    run_dir = pathlib.Path(run_dir) if run_dir is not None else None
    codec_cfg = cfg  # text_codec reads the tokenizer (or bytes) of a plain-text run only
    if cfg.data.source in TEXT_SOURCES:
        codec_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="text"))
    encode, decode = text_codec(codec_cfg, run_dir)
    tokenizer = run_file(cfg.data.tokenizer, run_dir) if cfg.data.tokenizer is not None else None
    stops = generation_stop_ids(cfg, run_dir)
    vocab = cfg.model.vocab_size
    candidates = (*stops, _config_token(tokenizer), make_encoder(tokenizer).eod_id)
    found = [i for i in candidates if i is not None and i < vocab]
    eot = found[0] if found else 0
    name = "bytes" if tokenizer is None else str(pathlib.Path(tokenizer).resolve())
    bos = _config_token(tokenizer, "bos_token")  # lm-eval's HF model: the BOS when the tokenizer has one
    return RunTokenizer(encode, decode, eot, sorted({eot, *stops}), name, cfg, run_dir,
                        eot_string=_spelled(tokenizer, eot, decode),
                        prefix_id=bos if bos is not None and bos < vocab else eot)


def _spelled(tokenizer: str | None, token: int, decode: Callable[[list[int]], str]) -> str:
    if tokenizer is None:
        return decode([token])
    from jaxinfra.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).decode([token], skip_special_tokens=False)


def _config_token(tokenizer: str | None, key: str = "eos_token") -> int | None:
    """The id of tokenizer_config.json's `key` token beside a tokenizer.json (None: no file, no token)."""
    if tokenizer is None:
        return None
    path = pathlib.Path(tokenizer).parent / "tokenizer_config.json"
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    from jaxinfra.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).token_to_id(eos)
