"""What ids a data config can produce, and that all its sources share one tokenizer.

Runs at config validation (before anything compiles), so it reads only small files:
prepared directories' meta.json and the tokenizer.json.
"""

from __future__ import annotations

import os

from jaxinfra.data.config import DataConfig, DataError
from jaxinfra.data.encode import BYTE_EOD, file_sha256, make_encoder
from jaxinfra.data.prepared import describe_tokenizer, is_prepared, load_meta, tokenizer_of
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
    if cfg.source == "synthetic":
        return cfg.synthetic_vocab, None
    if cfg.source == "tokens":
        metas = prepared_metas(cfg)
        if not metas:
            return 0, None
        meta = next(iter(metas.values()))
        return max(int(m["vocab_size"]) for m in metas.values()), (tokenizer_of(meta), describe_tokenizer(meta))
    if cfg.tokenizer is None:
        ident = (_BYTES, "byte-level ids")
        return (256 if cfg.source == "text" else BYTE_EOD + 1), ident
    sha = file_sha256(cfg.tokenizer, "data.tokenizer")
    ident = (sha, f"tokenizer {os.path.basename(cfg.tokenizer)} (sha256 {sha[:12]})")
    if cfg.source == "text":  # the text source appends no end-of-document id
        return tokenizer_vocab_size(cfg.tokenizer), ident
    return make_encoder(cfg.tokenizer).vocab_size, ident


def prepared_metas(cfg: DataConfig) -> dict[str, dict]:
    """meta.json of each prepared directory in cfg.paths, checked against data.tokenizer."""
    metas = {p: load_meta(p) for p in (os.path.expanduser(p) for p in cfg.paths) if is_prepared(p)}
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
