"""An HF model's tokenizer, chat template and generation defaults, carried through import and export.

`hf import` copies these files (those present) byte for byte into OUT and points the run's data
section at OUT/tokenizer.json (data.source=text, data.tokenizer; data.chat_template=tokenizer when a
template is there), so `generate --prompt / --chat`, `eval --text`, the chat data source (train
OUT/config.yaml data.source=chat ...) and `hf export` use them by default. The generation defaults
(generation_config.json's eos_token_id) end `generate` when --stop-ids is not given
(jaxinfra/infer/text.py: generation_stop_ids).
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

# What transformers' save_pretrained writes beside the weights for the tokenizer and generation.
CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
           "chat_template.jinja", "additional_chat_templates")


def carried_files(folder: pathlib.Path) -> list[str]:
    """The CARRIED names present in `folder`, in CARRIED's order."""
    return [name for name in CARRIED if (folder / name).exists()]


def has_chat_template(folder: pathlib.Path) -> bool:
    """Whether transformers would find a chat template here (jaxinfra/data/chat.py reads it the same way)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "additional_chat_templates").is_dir():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (ValueError, AttributeError):
        return False


def data_defaults(hf_dir: pathlib.Path, overrides: Sequence[str], vocab_size: int) -> dict[str, Any]:
    """The data keys an import sets so its runs use the HF tokenizer (empty: no tokenizer.json, one whose
    ids do not fit the model's vocabulary, or overrides that choose the tokenizer / synthetic data)."""
    from jaxinfra.data.tokenizer import tokenizer_vocab_size

    tokenizer = hf_dir / "tokenizer.json"
    chosen = any(o.startswith("data.tokenizer=") for o in overrides) or "data.source=synthetic" in overrides
    if chosen or not tokenizer.is_file() or tokenizer_vocab_size(str(tokenizer)) > vocab_size:
        return {}
    out: dict[str, Any] = {"source": "text", "tokenizer": str(tokenizer.absolute())}
    if has_chat_template(hf_dir):
        out["chat_template"] = "tokenizer"
    return out


def copy_carried(src: pathlib.Path, dst: pathlib.Path, names: Sequence[str]) -> list[str]:
    """Copies `names` from src to dst byte for byte (a folder as a tree); returns them."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name, dirs_exist_ok=True)
        else:
            shutil.copyfile(src / name, dst / name)
    return list(names)

