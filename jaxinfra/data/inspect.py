"""`jaxinfra data inspect DIR [CONFIG]`: what a prepared directory holds, and whether a config can train on it.

Prints the counts, a document-length histogram, one decoded document and the checks (shard
sizes, every id fits the dtype and the vocabulary, and with a config: model.vocab_size and
data.tokenizer). A failed check ends the report with one DataError line (exit status 2).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxinfra.data.config import DataError
from jaxinfra.data.encode import Encoder, file_sha256
from jaxinfra.data.prepared import TOKENIZER, describe_tokenizer, is_chat, open_prepared
from jaxinfra.metrics.table import Column, format_table


def inspect(directory: str, cfg: Any = None, sample: int = 0, verify: bool = False) -> tuple[str, list[str]]:
    """(report text, failed checks: one line each)."""
    prepared = open_prepared(directory)  # shard sizes and offsets are checked here (DataError)
    meta = prepared.meta
    lengths = prepared.documents[:, 2] - prepared.documents[:, 1]
    ends = (f"chat conversations rendered with template {meta['chat']['origin']}, role codes beside the ids"
            if is_chat(meta) else f"end of document = id {meta['eod_id']}")
    lines = [f"{directory}: {meta['documents']:,} documents, {meta['tokens']:,} tokens in {len(meta['shards'])} "
             f"shard(s) of {meta['dtype']}; vocabulary {meta['vocab_size']} ({describe_tokenizer(meta)}, {ends})"]
    lines += [f"  input {i['name']}: {i['size']:,} bytes, {i['documents']:,} documents, {i['tokens']:,} tokens, "
              f"sha256 {i['sha256'][:12]}" for i in meta["inputs"]]
    what = "conversation length (tokens)" if is_chat(meta) else "document length (tokens, end-of-document id included)"
    lines += ["", f"{what}:", _histogram(lengths), ""]
    lines += _sample(prepared, sample)
    checks = _checks(prepared, cfg, verify)
    lines += ["", "checks:"] + [f"  {'ok  ' if ok else 'FAIL'} {text}" for ok, text in checks]
    return "\n".join(lines), [text for ok, text in checks if not ok]


def _histogram(lengths: np.ndarray) -> str:
    if not len(lengths):
        return "  (no documents)"
    buckets = np.floor(np.log2(np.maximum(lengths, 1))).astype(int)
    rows = []
    for b in range(int(buckets.max()) + 1):
        n = int((buckets == b).sum())
        if n:
            share = n / len(lengths)
            rows.append((f"{1 << b}-{(2 << b) - 1}" if b else "1", n, f"{share:.1%}", "#" * max(1, round(40 * share))))
    table = format_table(rows, [Column("length", align=">"), Column("documents", ",", ">"), Column("share", align=">"),
                                Column("")])
    stats = (f"min {int(lengths.min())}, median {int(np.median(lengths))}, mean {lengths.mean():.1f}, "
             f"max {int(lengths.max())}")
    return "\n".join("  " + line for line in [*table.splitlines(), stats])


def _encoder(prepared) -> Encoder | None:
    tok = prepared.meta["tokenizer"]
    if tok["kind"] == "bytes":
        return Encoder(None, "bytes", tok["vocab_size"], tok["eod_id"], None)
    path = os.path.join(prepared.directory, TOKENIZER)
    if not os.path.exists(path):
        return None
    return Encoder(path, tok["sha256"], tok["vocab_size"], tok["eod_id"], tok["eod_token"])


def _sample(prepared, index: int) -> list[str]:
    docs = prepared.documents
    if not len(docs):
        return []
    index = min(max(index, 0), len(docs) - 1)
    shard, start, end = (int(x) for x in docs[index])
    ids = np.memmap(prepared.shards[shard], dtype=prepared.dtype, mode="r")[start:end]
    encoder = _encoder(prepared)
    head = f"document {index} ({end - start} tokens; first ids {ids[:12].tolist()}):"
    if encoder is None:
        return [head, f"  (no {TOKENIZER} in the directory to decode with)"]
    shown = ids[:400]
    if len(shown) and int(shown.max()) >= prepared.meta["vocab_size"]:  # damaged shard: the checks report it
        return [head, f"  (not decoded: ids up to {int(shown.max())} are outside the {prepared.meta['vocab_size']}-id "
                      f"vocabulary; the shard is damaged or not this tokenizer's)"]
    text = encoder.decode(shown.tolist())
    return [head, *("  | " + line for line in text[:1200].splitlines()[:20])]


def _checks(prepared, cfg: Any, verify: bool) -> list[tuple[bool, str]]:
    meta = prepared.meta
    limit = np.iinfo(np.dtype(meta["dtype"])).max + 1
    out = [(True, "shard files match meta.json (sizes, document offsets)"),
           (meta["vocab_size"] <= limit, f"dtype {meta['dtype']} holds the {meta['vocab_size']}-id vocabulary"),
           (meta["max_id"] < meta["vocab_size"], f"largest id {meta['max_id']} < vocabulary {meta['vocab_size']}")]
    if verify:
        bad = [s["file"] for s, path in zip(meta["shards"], prepared.shards)
               if file_sha256(path, "shard") != s["sha256"]]
        out.append((not bad, f"shard sha256 match meta.json{': not ' + ', '.join(bad[:3]) if bad else ''}"))
    if cfg is not None:
        vocab = cfg.model.vocab_size
        out.append((vocab >= meta["vocab_size"], f"model.vocab_size={vocab} >= the data's {meta['vocab_size']} ids"))
        if cfg.data.tokenizer is not None:
            same = file_sha256(cfg.data.tokenizer, "data.tokenizer") == meta["tokenizer"]["sha256"]
            out.append((same, f"data.tokenizer={cfg.data.tokenizer} is the tokenizer the data was prepared with"))
        else:
            out.append((True, "data.tokenizer is null: the directory's own tokenizer is used"))
    return out


def raise_failures(failures: list[str], directory: str) -> None:
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise DataError(f"data inspect {directory}: check failed: {failures[0]}{more}")
