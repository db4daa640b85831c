"""What ids a data config can produce, and that all its sources share one tokenizer.

Runs at config validation (before anything compiles), so it reads only small files:
prepared directories' meta.json and the tokenizer.json.
"""

from __future__ import annotations

import os

from jaxinfra.data.config import DataConfig, DataError, local_paths
from jaxinfra.data.encode import BYTE_EOD, file_sha256, make_encoder
from jaxinfra.data.prepared import TOKENIZER, describe_tokenizer, is_chat, is_prepared, load_meta, tokenizer_of
from jaxinfra.data.tokenizer import tokenizer_vocab_size

_BYTES = "bytes"


def vocab_size_of(cfg: DataConfig) -> int:
    """Token ids the data can contain; 0 for plain token files alone (checked per window when read).

    Also checks that prepared directories were made with data.tokenizer (when it is set) and
    that every source of the config uses the same tokenizer: one DataError line otherwise."""
    cfg.check()
    found = {name: _vocab_and_identity(part) for name, part in cfg.parts().items()}
    identities = {name: ident for name, (_, ident) in found.items() if ident is not None}
    if len({key for key, _ in identities.values()}) > 1:
        (a, (_, da)), (b, (_, db)) = _two_different(identities)
        raise DataError(f"data.mixture: sources must share one tokenizer, but {a!r} has {da} and {b!r} has {db}")
    return max(vocab for vocab, _ in found.values())


def _vocab_and_identity(cfg: DataConfig) -> tuple[int, tuple[str, str] | None]:
    """(vocabulary, (key, description) of the ids the source holds, None when unknown)."""
    cfg = local_paths(cfg)  # prepared directories on a bucket: their meta.json, from the local copy
    if cfg.source == "synthetic":
        return cfg.synthetic_vocab, None
    if cfg.source == "tokens":
        metas = prepared_metas(cfg)
        if not metas:
            return 0, None
        meta = next(iter(metas.values()))
        return max(int(m["vocab_size"]) for m in metas.values()), (tokenizer_of(meta), describe_tokenizer(meta))
    if cfg.source == "chat":
        return _chat_vocab_and_identity(cfg)
    if cfg.tokenizer is None:
        ident = (_BYTES, "byte-level ids")
        # text and GRPO prompts append no end-of-document id (a prompt is encoded as is)
        return (256 if cfg.source in ("text", "prompts") else BYTE_EOD + 1), ident
    sha = file_sha256(cfg.tokenizer, "data.tokenizer")
    ident = (sha, f"tokenizer {os.path.basename(cfg.tokenizer)} (sha256 {sha[:12]})")
    if cfg.source in ("text", "prompts"):  # no end-of-document id appended
        return tokenizer_vocab_size(cfg.tokenizer), ident
    return make_encoder(cfg.tokenizer).vocab_size, ident


def _chat_vocab_and_identity(cfg: DataConfig) -> tuple[int, tuple[str, str]]:
    """Chat ids: 256 bytes (the template ends turns: no end-of-document id) or the tokenizer's
    vocabulary; a prepared chat directory says its own, and must have used data.chat_template."""
    metas = prepared_metas(cfg)
    for path, meta in metas.items():
        check_chat_template(cfg, path, meta)
    if metas:
        meta = next(iter(metas.values()))
        return max(int(m["vocab_size"]) for m in metas.values()), (tokenizer_of(meta), describe_tokenizer(meta))
    from jaxinfra.data.chat import load_chat_template

    load_chat_template(cfg.chat_template, cfg.tokenizer)  # a bad template spec fails before anything compiles
    if cfg.tokenizer is None:
        return 256, (_BYTES, "byte-level ids")
    sha = file_sha256(cfg.tokenizer, "data.tokenizer")
    name = os.path.basename(cfg.tokenizer)
    return tokenizer_vocab_size(cfg.tokenizer), (sha, f"tokenizer {name} (sha256 {sha[:12]})")


def check_chat_template(cfg: DataConfig, path: str, meta: dict) -> None:
    """A prepared chat directory was rendered with the template data.chat_template names (the run's
    `generate --chat` renders with it too); DataError otherwise."""
    from jaxinfra.data.chat import load_chat_template
    from jaxinfra.data.chat_source import template_identity

    tokenizer = cfg.tokenizer
    if tokenizer is None and meta["tokenizer"]["kind"] != "bytes":
        tokenizer = os.path.join(path, TOKENIZER)  # the copy that travels with the data
    want = template_identity(load_chat_template(cfg.chat_template, tokenizer))
    have = meta["chat"]
    if have.get("sha256") != want["sha256"]:
        raise DataError(f"data.paths: {path!r} was rendered with chat template {have.get('origin')!r} (sha256 "
                        f"{str(have.get('sha256'))[:12]}), not data.chat_template={cfg.chat_template!r} (sha256 "
                        f"{want['sha256'][:12]}); set data.chat_template to the one it was prepared with")


def kind_mismatch(path: str, meta: dict) -> str:
    """The one line for a chat preparation read as tokens, or a plain one read as chat."""
    if is_chat(meta):
        return (f"data.paths: {path!r} holds chat conversations (made by `jaxinfra data prepare --chat`); read it "
                f"with data.source=chat")
    return (f"data.paths: {path!r} holds plain documents, not chat conversations; read it with data.source=tokens, "
            f"or prepare the conversations with `jaxinfra data prepare --chat`")


def prepared_metas(cfg: DataConfig) -> dict[str, dict]:
    """meta.json of each prepared directory in cfg.paths, checked against data.tokenizer."""
    metas = {p: load_meta(p) for p in (os.path.expanduser(p) for p in cfg.paths) if is_prepared(p)}
    for path, meta in metas.items():
        if is_chat(meta) != (cfg.source == "chat"):
            raise DataError(kind_mismatch(path, meta))
    if cfg.tokenizer is not None:
        want = file_sha256(cfg.tokenizer, "data.tokenizer")
        for path, meta in metas.items():
            if tokenizer_of(meta) != want:
                raise DataError(f"data.paths: {path!r} was prepared with {describe_tokenizer(meta)}, not "
                                f"data.tokenizer={cfg.tokenizer!r} (sha256 {want[:12]}); prepare it again with "
                                f"that tokenizer, or set data.tokenizer to {os.path.join(path, 'tokenizer.json')}")
    kinds = {tokenizer_of(m): (p, m) for p, m in metas.items()}
    if len(kinds) > 1:
        (pa, ma), (pb, mb) = list(kinds.values())[:2]
        raise DataError(f"data.paths: {pa!r} was prepared with {describe_tokenizer(ma)} and {pb!r} with "
                        f"{describe_tokenizer(mb)}; one run reads one tokenizer's ids")
    return metas


def _two_different(identities: dict[str, tuple[str, str]]) -> list:
    first = next(iter(identities.items()))
    other = next(item for item in identities.items() if item[1][0] != first[1][0])
    return [first, other]
