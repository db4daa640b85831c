"""`jaxinfra data prepare`: tokenize a corpus once into token shards a loader reads by random access.

    meta = prepare(["data/*.jsonl.gz"], "prepared/web", tokenizer="tokenizer.json", workers=8)

Inputs are read in order (files sorted) and cut into units (jaxinfra/data/units.py) that worker
processes tokenize; the results come back in order, so the output does not depend on the worker
count. A shard closes after the document that brings it to `shard_tokens`; each shard is written
to a temporary name, synced and renamed, then recorded in ledger.jsonl with the position after
it. A rerun of the same command resumes from the ledger; a different preparation in the same
directory is refused. meta.json is written last (the layout: jaxinfra/data/prepared.py).
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxinfra.atomic import atomic_copy, atomic_write_bytes, is_temporary
from jaxinfra.data.config import DataError
from jaxinfra.data.encode import Encoder, file_sha256, make_encoder
from jaxinfra.data.formats import input_kind, parquet_chat_file, parquet_file, relative_names
from jaxinfra.data.prepared import FORMAT, LEDGER, META, PLAN, TOKENIZER, read_json, roles_name, shard_names
from jaxinfra.data.sources import expand_paths
from jaxinfra.data.tokenizer import tokenizer_vocab_size
from jaxinfra.data.units import UNIT_BYTES, Unit, encode_unit, init_worker, iter_units

DEFAULT_SHARD_TOKENS = 50_000_000  # 100 MB of uint16 ids per shard
# where a tokenizer's chat template is stored (jaxinfra/data/chat.py looks in this order, the config last)
TEMPLATE_FILES = ("chat_template.jinja", os.path.join("additional_chat_templates", "default.jinja"),
                  "tokenizer_config.json")


def prepare(inputs: Sequence[str], out: str, *, tokenizer: str | None = None, text_key: str = "text",
            workers: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS, eod_token: str | None = None,
            progress: bool = True, unit_bytes: int = UNIT_BYTES, chat_template: str | None = None) -> dict[str, Any]:
    """Tokenize `inputs` into `out` (tokenizer None: byte-level) and return its meta.json contents.

    With `chat_template` (a data.chat_template value) the inputs are chat rows: each becomes one
    rendered conversation, with a parallel shard of role codes (`data prepare --chat`)."""
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens} is invalid: must be a positive integer")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise DataError(f"--workers {workers} is invalid: must be a positive integer")
    inside = os.path.join(os.path.abspath(out), "")
    files = [f for f in expand_paths(inputs, what="data prepare") if not f.startswith(inside)]  # not our output
    if not files:
        raise DataError(f"data prepare: no input files besides --out {out!r}")
    template = _chat_template(chat_template, tokenizer, eod_token)
    text_key = None if template is not None else text_key  # chat rows are read whole
    units = sum(_check_input(path, text_key, unit_bytes) for path in files)
    encoder = make_encoder(tokenizer, eod_token)
    plan = _plan(files, encoder, text_key, shard_tokens, unit_bytes, template)
    fresh = not os.path.exists(out) or (os.path.isdir(out) and not os.listdir(out))
    created = not os.path.exists(out)
    done = _open_output(out, plan, encoder)
    if done is not None:
        return done
    try:
        return _run(out, plan, encoder, files, (text_key, template), workers, units, unit_bytes, progress)
    except DataError:
        if fresh:  # bad input found midway: what this run wrote must not block the corrected rerun
            _discard(out, created)
        raise


def _run(out: str, plan: dict, encoder: Encoder, files: list[str], how: tuple, workers: int, units: int,
         unit_bytes: int, progress: bool) -> dict[str, Any]:
    """Tokenize into `out` (resuming its ledger) and write meta.json last; `how`: (text_key, template)."""
    text_key, template = how
    writer = _ShardWriter(out, plan, encoder.dtype)
    started = time.perf_counter()
    with tqdm(total=sum(i["size"] for i in plan["inputs"]), unit="B", unit_scale=True, disable=not progress,
              file=sys.stderr, desc=f"prepare {os.path.basename(os.path.normpath(out))}") as bar:
        todo = iter_units(files, text_key, unit_bytes)
        for unit, result in _encoded(todo, (encoder, text_key, template), min(workers, units), writer.next_unit):
            if result is not None:
                writer.add(unit, *result)
            bar.update(unit.progress)
            bar.set_postfix({"tok/s": f"{writer.session_tokens / (time.perf_counter() - started):.3g}"},
                            refresh=False)
        writer.finish()
    return _write_meta(out, plan, writer.entries)


def _chat_template(spec: str | None, tokenizer: str | None, eod_token: str | None) -> Any:
    if spec is None:
        return None
    if eod_token is not None:
        raise DataError("--eod-token has no meaning with --chat: the chat template ends the turns")
    from jaxinfra.data.chat import load_chat_template

    return load_chat_template(spec, tokenizer)


def _check_input(path: str, text_key: str | None, unit_bytes: int) -> int:
    """Refuse what can be refused before anything is written (an empty file, Parquet without the
    column); returns about how many units the file makes. text_key None: chat rows."""
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"data prepare: {path!r} is empty (no documents)")
    kind = input_kind(path)
    if text_key is None and kind not in ("jsonl", "parquet"):
        raise DataError(f"data prepare --chat: {path!r} is not a .jsonl, .jsonl.gz or .parquet file")
    if kind == "parquet":
        pf = parquet_file(path, path, text_key) if text_key else parquet_chat_file(path, path)
        if pf.metadata.num_rows == 0:
            raise DataError(f"data prepare: {path!r} has no rows (no documents)")
        return pf.metadata.num_row_groups
    return -(-size // unit_bytes) if kind == "jsonl" else 1


def _plan(files: list[str], encoder: Encoder, text_key: str | None, shard_tokens: int, unit_bytes: int,
          template: Any = None) -> dict:
    """What this preparation is: another one with the same plan writes the same bytes."""
    inputs = [{"name": name, "path": path, "size": os.path.getsize(path), "sha256": file_sha256(path, "input")}
              for name, path in zip(relative_names(files), files)]
    plan = {"format": FORMAT, "inputs": inputs, "tokenizer": encoder.describe(), "vocab_size": encoder.vocab_size,
            "dtype": encoder.dtype.name, "eod_id": encoder.eod_id, "text_key": text_key,
            "shard_tokens": shard_tokens, "unit_bytes": unit_bytes}
    if template is None:
        return plan
    from jaxinfra.data.chat_source import template_identity

    # chat: no end-of-document id (the template ends turns), so the ids are the tokenizer's own
    vocab = 256 if encoder.tokenizer is None else tokenizer_vocab_size(encoder.tokenizer)
    tok = {**plan["tokenizer"], "vocab_size": vocab, "eod_id": None, "eod_token": None}
    return {**plan, "tokenizer": tok, "vocab_size": vocab, "eod_id": None, "chat": template_identity(template)}


def plan_difference(old: dict, new: dict) -> str | None:
    """The first thing that differs between two plans, in words; None when they are the same."""
    if old.get("format") != new["format"]:
        return f"format {old.get('format')!r} there, {new['format']!r} here"
    a, b = old.get("inputs", []), new["inputs"]
    if [i["name"] for i in a] != [i["name"] for i in b]:
        only = sorted({i["name"] for i in a} ^ {i["name"] for i in b})
        return f"other input files ({len(a)} there, {len(b)} here; differing: {', '.join(only[:3]) or 'order'})"
    for x, y in zip(a, b):
        for key in ("size", "sha256"):
            if x[key] != y[key]:
                return f"input {y['name']!r} has {key} {str(x[key])[:12]} there, {str(y[key])[:12]} here"
    t, u = old.get("tokenizer", {}), new["tokenizer"]
    if t.get("sha256") != u["sha256"] or t.get("eod_id") != u["eod_id"]:
        return (f"tokenizer {t.get('name')} (sha256 {str(t.get('sha256'))[:12]}, eod {t.get('eod_id')}) there, "
                f"{u['name']} (sha256 {u['sha256'][:12]}, eod {u['eod_id']}) here")
    if old.get("chat") != new.get("chat"):
        return f"chat template {old.get('chat')} there, {new.get('chat')} here"
    for key in ("text_key", "shard_tokens", "unit_bytes"):
        if old.get(key) != new[key]:
            return f"{key} {old.get(key)!r} there, {new[key]!r} here"
    return None


def _discard(out: str, created: bool) -> None:
    """Remove what a failed fresh preparation wrote (the directory too when it made it)."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in os.listdir(out):
        path = os.path.join(out, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def _open_output(out: str, plan: dict, encoder: Encoder) -> dict | None:
    """Create `out`, or check it holds this same preparation; its meta.json when already complete.
    An unfinished preparation without one completed shard holds nothing to keep: it is started over."""
    plan_path = os.path.join(out, PLAN)
    if os.path.isfile(plan_path):
        diff = plan_difference(read_json(plan_path, "preparation plan"), plan)
        complete = os.path.exists(os.path.join(out, META))
        ledger = os.path.join(out, LEDGER)
        if diff is not None and not complete and not (os.path.isfile(ledger) and os.path.getsize(ledger)):
            _discard(out, created=False)  # nothing done yet: start over below
        elif diff is not None:
            state = "a complete" if complete else "an unfinished"
            raise DataError(f"data prepare: --out {out!r} holds {state} different preparation ({diff}); use "
                            f"another --out, or delete it to prepare again")
        else:
            return read_json(os.path.join(out, META), "prepared-data metadata") if complete else None
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise DataError(f"data prepare: --out {out!r} exists and is not a jaxinfra preparation; give a new or "
                        f"empty directory")
    os.makedirs(out, exist_ok=True)
    if encoder.tokenizer is not None:  # a copy travels with the data (decoding, data.tokenizer)
        _atomic_copy(encoder.tokenizer, os.path.join(out, TOKENIZER))
        for name in TEMPLATE_FILES if plan.get("chat") else ():  # data.chat_template=tokenizer finds them there
            if os.path.isfile(os.path.join(os.path.dirname(encoder.tokenizer), name)):
                os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
                _atomic_copy(os.path.join(os.path.dirname(encoder.tokenizer), name), os.path.join(out, name))
    _atomic_write(plan_path, json.dumps(plan, indent=1).encode())
    return None


def _encoded(units: Iterator[Unit], how: tuple, workers: int,
             first_unit: int) -> Iterator[tuple[Unit, tuple | None]]:
    """(unit, encode_unit(unit, *how) result) in unit order; None for the units before `first_unit`
    (done already). `how`: (encoder, text_key, chat template or None)."""
    if workers == 1:
        for unit in units:
            yield unit, encode_unit(unit, *how) if unit.index >= first_unit else None
        return
    # forkserver, preloading only the worker's module: each worker starts in milliseconds, without the
    # jax that the parent (the CLI, a test session) may have imported and started threads for.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["jaxinfra.data.units"])
    pool = ctx.Pool(workers, initializer=init_worker)
    try:
        pending: collections.deque = collections.deque()
        for unit in units:
            work = pool.apply_async(encode_unit, (unit, *how)) if unit.index >= first_unit else None
            pending.append((unit, work))
            while pending and (pending[0][1] is None or len(pending) > 2 * workers):
                done, work = pending.popleft()  # bounded: the reader never runs far ahead of the workers
                yield done, None if work is None else work.get()
        while pending:
            done, work = pending.popleft()
            yield done, None if work is None else work.get()
    finally:
        pool.terminate()
        pool.join()


class _ShardWriter:
    """Documents in, shards out; the ledger records each completed shard and where to resume."""

    def __init__(self, out: str, plan: dict, dtype: np.dtype):
        self.out, self.dtype, self.shard_tokens = out, dtype, plan["shard_tokens"]
        self.chat = bool(plan.get("chat"))  # role codes beside the ids
        self.names = [i["name"] for i in plan["inputs"]]
        self.entries = _read_ledger(out, dtype)
        last = self.entries[-1] if self.entries else None
        self.next_unit, self.skip = (last["next_unit"], last["next_doc"]) if last else (0, 0)
        self.per_input = [list(x) for x in last["inputs"]] if last else [[0, 0] for _ in self.names]
        self.pieces: list[tuple] = []  # (ids, lengths, role codes or None) not yet in a shard
        self.buffered = 0
        self.session_tokens = 0

    def add(self, unit: Unit, tokens: np.ndarray, lengths: np.ndarray, codes: np.ndarray | None = None) -> None:
        """A unit's documents (the first `skip` of them are in a shard already); chat: their role codes."""
        ends = np.cumsum(lengths)
        start_doc = self.skip if unit.index == self.next_unit else 0
        self.skip = 0
        self.session_tokens += len(tokens)
        doc = start_doc
        while doc < len(lengths):
            begin = int(ends[doc - 1]) if doc else 0
            # documents of this unit that fill the shard: the first whose end reaches the target
            need = self.shard_tokens - self.buffered
            stop = int(np.searchsorted(ends, begin + need, side="left")) + 1
            stop = min(max(stop, doc + 1), len(lengths))
            end = int(ends[stop - 1])
            self._take(unit, tokens[begin:end], lengths[doc:stop], None if codes is None else codes[begin:end])
            doc = stop
            if self.buffered >= self.shard_tokens:
                self._write(next_unit=unit.index + (doc == len(lengths)), next_doc=doc % len(lengths))
        if unit.last and self.per_input[unit.input][0] == 0:
            raise DataError(f"data prepare: {unit.path!r} holds no documents")
        if doc >= len(lengths):
            self.next_unit = unit.index + 1

    def _take(self, unit: Unit, ids: np.ndarray, lengths: np.ndarray, codes: np.ndarray | None) -> None:
        self.pieces.append((ids, lengths, codes))
        self.buffered += len(ids)
        self.per_input[unit.input][0] += len(lengths)
        self.per_input[unit.input][1] += len(ids)

    def finish(self) -> None:
        if self.pieces:
            self._write(next_unit=self.next_unit, next_doc=0)

    def _write(self, next_unit: int, next_doc: int) -> None:
        index = len(self.entries)
        ids = np.concatenate([p[0] for p in self.pieces]).astype(self.dtype, copy=False)
        lengths = np.concatenate([p[1] for p in self.pieces])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        bin_name, docs_name = shard_names(index)
        _atomic_write(os.path.join(self.out, bin_name), ids.tobytes())
        offsets_bytes = _npy_bytes(offsets)
        _atomic_write(os.path.join(self.out, docs_name), offsets_bytes)
        roles = self._write_roles(index) if self.chat else {}
        first_document = sum(e["documents"] for e in self.entries)
        entry = {"shard": index, "file": bin_name, "offsets": docs_name, "tokens": len(ids),
                 "documents": len(lengths), "first_document": first_document,
                 "max_id": int(ids.max()) if len(ids) else -1,
                 "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
                 "offsets_sha256": hashlib.sha256(offsets_bytes).hexdigest(),
                 **roles, "next_unit": next_unit, "next_doc": next_doc, "inputs": [list(x) for x in self.per_input]}
        _append_line(os.path.join(self.out, LEDGER), json.dumps(entry))
        self.entries.append(entry)
        self.pieces, self.buffered = [], 0

    def _write_roles(self, index: int) -> dict:
        codes = np.concatenate([p[2] for p in self.pieces]).astype(np.uint8, copy=False).tobytes()
        _atomic_write(os.path.join(self.out, roles_name(index)), codes)
        return {"roles": roles_name(index), "roles_sha256": hashlib.sha256(codes).hexdigest()}


def _read_ledger(out: str, dtype: np.dtype) -> list[dict]:
    """Completed shards whose files are intact; anything after the first damaged one is redone."""
    entries: list[dict] = []
    path = os.path.join(out, LEDGER)
    lines = open(path, encoding="utf-8").read().splitlines() if os.path.exists(path) else []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            break  # a torn last line: that shard is redone
        bin_path = os.path.join(out, entry["file"])
        if entry["shard"] != len(entries) or not os.path.exists(bin_path) or \
                os.path.getsize(bin_path) != entry["tokens"] * dtype.itemsize or \
                not os.path.exists(os.path.join(out, entry["offsets"])) or not _roles_intact(out, entry):
            break
        entries.append(entry)
    if len(entries) != len(lines):
        _atomic_write(path, "".join(json.dumps(e) + "\n" for e in entries).encode())
    for name in os.listdir(out):  # shards written after the last ledger line, and temporary files
        if is_temporary(name) or (name.startswith("shard-") and int(name[6:11]) >= len(entries)):
            os.remove(os.path.join(out, name))
    return entries


def _roles_intact(out: str, entry: dict) -> bool:
    """A chat shard's role codes are there, one byte per token (plain shards have none)."""
    if "roles" not in entry:
        return True
    path = os.path.join(out, entry["roles"])
    return os.path.exists(path) and os.path.getsize(path) == entry["tokens"]


def _write_meta(out: str, plan: dict, entries: list[dict]) -> dict:
    last = entries[-1]["inputs"] if entries else [[0, 0] for _ in plan["inputs"]]
    inputs = [{**i, "documents": docs, "tokens": tokens} for i, (docs, tokens) in zip(plan["inputs"], last)]
    shards = [{k: e[k] for k in ("file", "offsets", "tokens", "documents", "first_document", "max_id", "sha256",
                                 "offsets_sha256", "roles", "roles_sha256") if k in e} for e in entries]
    meta = {**plan, "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "max_id": max((s["max_id"] for s in shards), default=-1), "inputs": inputs, "shards": shards}
    _atomic_write(os.path.join(out, META), json.dumps(meta, indent=1).encode())
    return meta


# ------------------------------------------------------------------ files


def _atomic_write(path: str, data: bytes) -> None:
    atomic_write_bytes(path, data, replace=True)  # a resumed preparation rewrites its own files


def _atomic_copy(src: str, dst: str) -> None:
    atomic_copy(src, dst, replace=True)


def _append_line(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


