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



def import_dir(restore: str | None) -> pathlib.Path | None:
    """The `hf import` output a --restore path names (OUT or OUT/checkpoints/N) when it carries a
    tokenizer.json, else None (other runs, bucket URLs)."""
    if restore is None or "://" in str(restore):
        return None
    path = pathlib.Path(restore)
    for candidate in (path, path.parent.parent):
        if (candidate / "config.yaml").is_file() and (candidate / "tokenizer.json").is_file():
            return candidate
    return None


def restore_defaults(cfg: Any, restore: str | None, overrides: Sequence[str]) -> tuple[Any, str | None]:
    """A run that starts from an import (`train --restore OUT`) with a byte-level data section reads its
    text with the import's tokenizer, and renders chat / preference / prompt data with the model's own
    template unless data.chat_template is given on the command line. Returns (config, a note or None)."""
    import dataclasses

    from jaxinfra.config import validate

    found = import_dir(restore)
    data = cfg.data
    if found is None or data.tokenizer is not None or data.source in ("synthetic", "tokens"):
        return cfg, None
    changes = {"tokenizer": str((found / "tokenizer.json").absolute())}
    chatty = data.source in ("chat", "preference", "prompts")
    if chatty and has_chat_template(found) and not any(o.startswith("data.chat_template=") for o in overrides):
        changes["chat_template"] = "tokenizer"
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(data, **changes))
    validate(cfg)
    return cfg, "from the import " + str(found) + ": " + ", ".join(f"data.{k}={v}" for k, v in changes.items())
