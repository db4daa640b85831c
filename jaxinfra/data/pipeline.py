"""The grain pipelines the train loop consumes: shard, shuffle, repeat, pack, batch."""

from __future__ import annotations

import itertools
import os
from typing import Any

import grain
import numpy as np

from jaxinfra.data import synthetic
from jaxinfra.data.chat_source import CHAT_FIELDS, ChatSource, PreparedChats, RenderedChats
from jaxinfra.data.config import TRAIN_ON, DataConfig, DataError, local_paths
from jaxinfra.data.encode import make_encoder
from jaxinfra.data.formats import input_kind, relative_names
from jaxinfra.data.mixture import MixedRows, WeightSchedule, slot_phase
from jaxinfra.data.preference import PreferenceRecords, PreferenceSource, pair_layout
from jaxinfra.data.prepared import is_chat, is_prepared, load_meta, open_prepared
from jaxinfra.data.records import DocumentWindows, RecordFiles, RecordSource
from jaxinfra.data.sources import (
    ArrayReader,
    ByteReader,
    TokenFileReader,
    WindowSource,
    common_root,
    expand_paths,
    open_token_file,
    split_documents,
    split_records,
    split_streams,
    stdlib_files,
)
from jaxinfra.data.tokenizer import tokenize_files
from jaxinfra.data.vocab import prepared_metas, vocab_size_of  # noqa: F401 - vocab_size_of re-exported

_EVAL_SEED = 0x5EED  # eval batches do not depend on the run's seed, so runs compare on the same batches
_PACKING_BINS_PER_ROW = 4  # a few open rows per slot pack short documents tightly


def make_train_iterator(cfg: DataConfig, *, seq_len: int, global_batch_size: int, vocab_size: int, seed: int,
                        process_index: int = 0, process_count: int = 1,
                        train_on: str = "assistant") -> grain.DatasetIterator:
    """An infinite iterator of this process's share of each global batch (see `get_state`/`set_state`).

    Batches are dicts of int32 [global_batch_size // process_count, seq_len] arrays:
    inputs, targets, segment_ids (1, 2, ... per packed document; 0 = padding) and positions;
    chat data adds `assistant` (the role code of each target) and `truncated` (1 at the first
    position of a conversation cut to fit). `train_on` (sft.train_on): under "assistant" and
    "last_assistant" a conversation without an assistant turn is a DataError.
    With data.mixture, each row comes whole from one source (jaxinfra/data/mixture.py).
    """
    local_batch = _check_args(cfg, seq_len, global_batch_size, vocab_size, process_index, process_count, train_on)
    train = {name: _split_sources(part, seq_len, vocab_size, seed, train_on)[0] for name, part in cfg.parts().items()}
    schedule = WeightSchedule([cfg.mixture[name].stages() for name in train]) if cfg.mixture else None
    ds = _pipeline(train, seq_len=seq_len, global_batch=global_batch_size, local_batch=local_batch, seed=seed,
                   shuffle=cfg.shuffle, process_index=process_index, process_count=process_count, what="training",
                   schedule=schedule)
    if cfg.worker_count > 0:
        _allow_absl_workers()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    return iter(ds)


def make_eval_sets(cfg: DataConfig, *, seq_len: int, global_batch_size: int, vocab_size: int, seed: int,
                   process_index: int = 0, process_count: int = 1,
                   train_on: str = "assistant") -> dict[str, list[dict[str, np.ndarray]]]:
    """`cfg.eval_batches` held-out batches per source, by mixture name ("" without a mixture).

    Each source's batches are exactly those of a config with that source alone, identical on every call."""
    local_batch = _check_args(cfg, seq_len, global_batch_size, vocab_size, process_index, process_count, train_on)
    if cfg.eval_batches == 0:
        return {}
    out = {}
    for name, part in cfg.parts().items():
        _, held = _split_sources(part, seq_len, vocab_size, seed, train_on)
        ds = _pipeline({name: held}, seq_len=seq_len, global_batch=global_batch_size, local_batch=local_batch,
                       seed=_EVAL_SEED, shuffle=True, process_index=process_index, process_count=process_count,
                       what="evaluation")
        out[name] = list(itertools.islice(iter(ds), cfg.eval_batches))
    return out


def make_eval_batches(cfg: DataConfig, *, seq_len: int, global_batch_size: int, vocab_size: int, seed: int,
                      process_index: int = 0, process_count: int = 1,
                      train_on: str = "assistant") -> list[dict[str, np.ndarray]]:
    """`cfg.eval_batches` held-out batches (same layout as training) of every source, identical on every call."""
    sets = make_eval_sets(cfg, seq_len=seq_len, global_batch_size=global_batch_size, vocab_size=vocab_size,
                          seed=seed, process_index=process_index, process_count=process_count, train_on=train_on)
    return [batch for batches in sets.values() for batch in batches]


# ---------------------------------------------------------------------- helpers


def _check_args(cfg: DataConfig, seq_len: int, global_batch_size: int, vocab_size: int,
                process_index: int, process_count: int, train_on: str = "assistant") -> int:
    cfg.check()
    if train_on not in TRAIN_ON:
        raise DataError(f"sft.train_on={train_on!r} is invalid: must be one of {list(TRAIN_ON)}")
    for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size),
                        ("vocab_size", vocab_size), ("process_count", process_count)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise DataError(f"{name}={value!r} is invalid: must be a positive integer")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} is invalid: must be in [0, {process_count})")
    if global_batch_size % process_count:
        raise DataError(
            f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}")
    return global_batch_size // process_count


def _split_sources(cfg: DataConfig, seq_len: int, vocab_size: int, seed: int,
                   train_on: str = "assistant") -> tuple[Any, Any]:
    """(train, eval) random-access sources for cfg.source."""
    cfg = local_paths(cfg)  # gs:// / s3:// data: read from a local copy
    if cfg.source == "synthetic":
        return synthetic.split(cfg.synthetic_vocab, seq_len, _seed32(seed), cfg.eval_fraction)
    if cfg.source == "tokens":
        return _token_sources(cfg, seq_len, vocab_size)
    if cfg.source == "chat":
        return _chat_sources(cfg, seq_len, vocab_size, train_on)
    if cfg.source == "preference":
        return _preference_sources(cfg, seq_len)
    for path in cfg.paths:
        if is_prepared(os.path.expanduser(path)):
            chat = os.path.exists(os.path.join(os.path.expanduser(path), "meta.json")) and \
                is_chat(load_meta(os.path.expanduser(path)))
            raise DataError(f"data.paths: {path!r} is a directory made by `jaxinfra data prepare`; read it with "
                            f"data.source={'chat' if chat else 'tokens'} (not {cfg.source})")
    if cfg.source in ("jsonl", "parquet"):
        return _record_sources(cfg)
    if cfg.paths:
        files = expand_paths(cfg.paths)
        root = common_root(files)
    else:
        root, files = stdlib_files()
    if cfg.tokenizer:
        arrays = tokenize_files(cfg.tokenizer, files)
        reader, lengths = ArrayReader(arrays), [len(a) for a in arrays]
    else:
        reader, lengths = ByteReader(files), [os.stat(f).st_size for f in files]
    usable = [i for i, n in enumerate(lengths) if n >= 2]  # a document needs one next-token pair
    names = [os.path.relpath(files[i], root) for i in usable]
    train_ids, held_ids = split_documents(names, cfg.eval_fraction)
    docs = np.asarray([(i, 0, lengths[i]) for i in usable], np.int64)
    return _window_pair(reader, docs[train_ids], docs[held_ids], seq_len, cfg)


def _token_sources(cfg: DataConfig, seq_len: int, vocab_size: int) -> tuple[WindowSource, WindowSource]:
    """Prepared directories (split by document) and plain .bin/.npy files (split at each file's end)."""
    prepared_metas(cfg)  # the tokenizer checks, also for callers that skipped config validation
    paths = [os.path.expanduser(p) for p in cfg.paths]
    files: list[str] = []
    dtypes: list[str] = []
    train, held = [], []
    for prepared in (open_prepared(p) for p in paths if is_prepared(p)):
        if prepared.vocab_size > vocab_size:
            raise DataError(f"data.paths: {prepared.directory!r} holds ids of a {prepared.vocab_size}-token "
                            f"vocabulary, more than vocab_size {vocab_size}")
        train_ids, held_ids = split_records(*prepared.record_keys(), cfg.eval_fraction)
        docs = prepared.documents + np.asarray([len(files), 0, 0])
        train.append(docs[train_ids])
        held.append(docs[held_ids])
        files += prepared.shards
        dtypes += [prepared.dtype] * len(prepared.shards)
    plain = [p for p in paths if not is_prepared(p)]
    if plain:
        plain_files = expand_paths(plain)
        streams = split_streams([len(open_token_file(f, cfg.token_dtype)) for f in plain_files], cfg.eval_fraction)
        train.append(streams[0] + np.asarray([len(files), 0, 0]))
        held.append(streams[1] + np.asarray([len(files), 0, 0]))
        files += plain_files
        dtypes += [cfg.token_dtype] * len(plain_files)
    reader = TokenFileReader(files, dtypes, vocab_size)
    return _window_pair(reader, np.concatenate(train), np.concatenate(held), seq_len, cfg)


def _record_sources(cfg: DataConfig) -> tuple[RecordSource, RecordSource]:
    """JSONL / Parquet documents, split by record, tokenized when read."""
    files = expand_paths(cfg.paths)
    for f in files:
        if input_kind(f) != cfg.source:
            wanted = ".jsonl or .jsonl.gz" if cfg.source == "jsonl" else ".parquet"
            raise DataError(f"data.paths: {f!r} is not a {wanted} file (data.source={cfg.source})")
    records = RecordFiles(files, cfg.text_key)
    encoder = make_encoder(cfg.tokenizer)
    train_ids, held_ids = split_records(relative_names(files), records.counts, cfg.eval_fraction)
    return RecordSource(records, encoder, train_ids), RecordSource(records, encoder, held_ids)


def _chat_sources(cfg: DataConfig, seq_len: int, vocab_size: int, train_on: str) -> tuple[ChatSource, ChatSource]:
    """Conversations split by record: rendered when read, or from `data prepare --chat` directories."""
    paths = [os.path.expanduser(p) for p in cfg.paths]
    prepared = [p for p in paths if is_prepared(p)]
    if prepared and len(prepared) < len(paths):
        raise DataError(f"data.paths: mixes prepared directories ({prepared[0]!r}) with chat files; prepare the "
                        f"files with `jaxinfra data prepare --chat` too, or list only files")
    conversations, train_ids, held_ids = (_prepared_chats(cfg, prepared, vocab_size) if prepared
                                          else _rendered_chats(cfg))
    return (ChatSource(conversations, train_ids, seq_len, train_on),
            ChatSource(conversations, held_ids, seq_len, train_on))


def _prepared_chats(cfg: DataConfig, directories: list[str], vocab_size: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """(conversations, train records, held-out records) of `data prepare --chat` directories."""
    prepared_metas(cfg)  # the tokenizer and kind checks, also for callers that skipped config validation
    opened = [open_prepared(d) for d in directories]
    for p in opened:
        if p.vocab_size > vocab_size:
            raise DataError(f"data.paths: {p.directory!r} holds ids of a {p.vocab_size}-token vocabulary, more "
                            f"than vocab_size {vocab_size}")
    parts, start = [], 0
    for p in opened:  # each directory splits as its inputs read on the fly split
        train_ids, held_ids = split_records(*p.record_keys(), cfg.eval_fraction)
        parts.append((train_ids + start, held_ids + start))
        start += len(p.documents)
    return PreparedChats(opened, vocab_size), *(np.concatenate([part[k] for part in parts]) for k in (0, 1))


def _rendered_chats(cfg: DataConfig) -> tuple[Any, np.ndarray, np.ndarray]:
    """(conversations, train records, held-out records) of .jsonl(.gz) / .parquet chat rows."""
    from jaxinfra.data.chat import load_chat_template

    files = expand_paths(cfg.paths)
    for f in files:
        if input_kind(f) not in ("jsonl", "parquet"):
            raise DataError(f"data.paths: {f!r} is not a .jsonl, .jsonl.gz or .parquet file (data.source=chat)")
    records = RecordFiles(files, None)
    conversations = RenderedChats(records, load_chat_template(cfg.chat_template, cfg.tokenizer),
                                  make_encoder(cfg.tokenizer))
    return conversations, *split_records(relative_names(files), records.counts, cfg.eval_fraction)


def _preference_sources(cfg: DataConfig, seq_len: int) -> tuple[PreferenceSource, PreferenceSource]:
    """Preference pairs (jaxinfra/data/preference.py) split by record, rendered when read."""
    from jaxinfra.data.chat import load_chat_template

    files = expand_paths(cfg.paths)
    for f in files:
        if input_kind(f) not in ("jsonl", "parquet"):
            raise DataError(f"data.paths: {f!r} is not a .jsonl, .jsonl.gz or .parquet file (data.source=preference)")
    records = PreferenceRecords(files, None)
    template, encoder = load_chat_template(cfg.chat_template, cfg.tokenizer), make_encoder(cfg.tokenizer)
    train_ids, held_ids = split_records(relative_names(files), records.counts, cfg.eval_fraction)
    return (PreferenceSource(records, template, encoder, train_ids, seq_len),
            PreferenceSource(records, template, encoder, held_ids, seq_len))


def _window_pair(reader: Any, train: np.ndarray, held: np.ndarray, seq_len: int,
                 cfg: DataConfig) -> tuple[WindowSource, WindowSource]:
    train_src, held_src = WindowSource(reader, train, seq_len), WindowSource(reader, held, seq_len)
    for src, what in ((train_src, "training"), (held_src, "evaluation")):
        if len(src) == 0:
            raise DataError(
                f"data.paths: no {what} tokens left after holding out data.eval_fraction={cfg.eval_fraction} "
                f"(every document needs at least 2 tokens)")
    return train_src, held_src


def _pipeline(sources: dict[str, Any], *, seq_len: int, global_batch: int, local_batch: int, seed: int,
              shuffle: bool, process_index: int, process_count: int, what: str,
              schedule: WeightSchedule | None = None) -> grain.IterDataset:
    """Batches of this process's rows, identical whatever the process count.

    Row slot r of every global batch is packed from its own sub-stream, examples
    r, r+B, r+2B, ... of the globally shuffled stream (B = global batch). A process
    builds only its own slots, so it reads only its share of the data, and the global
    batch does not depend on how many processes share it (multi-host runs equal the
    single-host run, and a restart on a different host count keeps the data order).
    With a mixture (`schedule`), every source has such sub-streams and each slot takes
    its next row from the source the schedule picks for that batch.
    """
    streams = {name: _shuffled(src, name, global_batch, seed, shuffle, what) for name, src in sources.items()}
    first = process_index * local_batch
    rows = []
    for slot in range(first, first + local_batch):
        parts = [_packed_rows(ds[slot::global_batch].repeat(None), seq_len, _seed32(seed + slot),
                              documents=isinstance(sources[name], RecordSource),
                              fields=_item_fields(sources[name])) for name, ds in streams.items()]
        rows.append(parts[0] if schedule is None else MixedRows(parts, list(streams), schedule,
                                                                  slot_phase(seed, slot)))
    return grain.experimental.ZipIterDataset(rows).map(_stack_rows)


def _shuffled(source: Any, name: str, global_batch: int, seed: int, shuffle: bool, what: str) -> grain.MapDataset:
    if len(source) < global_batch:
        where = f"data.mixture.{name}" if name else "data.paths"
        raise DataError(
            f"{where}: {len(source)} {what} {getattr(source, 'unit', 'windows')} are fewer than the {global_batch} "
            f"rows of one batch (add data, or lower train.batch_size / train.seq_len)")
    ds = grain.MapDataset.source(source)
    return ds.shuffle(seed=_seed32(seed)) if shuffle else ds  # reshuffled every epoch by repeat()


def _item_fields(source: Any) -> tuple[str, ...]:
    """The fields of a source's items that the packer carries (chat and preference items have more)."""
    if isinstance(source, ChatSource):
        return CHAT_FIELDS
    return getattr(source, "fields", ("inputs", "targets"))


def _packed_rows(ds: grain.MapDataset, seq_len: int, seed: int, documents: bool = False,
                 fields: tuple[str, ...] = ("inputs", "targets")) -> grain.IterDataset:
    # Reading a window is one small pread; threads would only fight over the GIL.
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if documents:  # whole tokenized documents (jsonl / parquet): cut into windows here
        it = grain.experimental.FlatMapIterDataset(it, DocumentWindows(seq_len))
    # Every field in length_struct is packed alongside (zero on padding). Items never exceed a row:
    # windows are seq_len long and chat items are cut to it (grain refuses longer ones).
    return grain.experimental.FirstFitPackIterDataset(
        it, length_struct=dict.fromkeys(fields, seq_len), num_packing_bins=_PACKING_BINS_PER_ROW,
        seed=seed, shuffle_bins=False)


def _stack_rows(rows: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    layouts = [_model_layout(r) for r in rows]
    return {key: np.stack([row[key] for row in layouts]) for key in layouts[0]}


def _model_layout(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if "half" in packed:  # preference pairs: two segments per pair
        return pair_layout(packed)
    layout = {
        "inputs": packed["inputs"],
        "targets": packed["targets"],
        "segment_ids": packed["inputs_segment_ids"],
        "positions": packed["inputs_positions"],
    }
    return {**layout, **{k: packed[k] for k in ("assistant", "truncated") if k in packed}}  # chat's fields


def _seed32(seed: int) -> int:
    return int(seed) % (1 << 32)


def _allow_absl_workers() -> None:
    # grain's spawned workers read absl flags; outside absl.app they are unparsed.
    try:
        from absl import flags
    except ImportError:
        return
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def row_states(it: grain.DatasetIterator, first_row: int) -> dict[str, Any]:
    """The iterator's position as {global row slot: state}, independent of the process count.

    With worker processes (`data.worker_count > 0`) grain's state is per process, so it is
    kept whole under "process<i>" and resumes exactly only on the same process layout.
    """
    state = it.get_state()
    if isinstance(state, dict) and "parents" in state:
        return {str(first_row + i): s for i, s in enumerate(state["parents"])}
    return {f"process{first_row}": state}


def set_row_states(it: grain.DatasetIterator, states: dict[str, Any], first_row: int, rows: int) -> None:
    """Inverse of `row_states` for this process's rows; DataError if the checkpoint lacks them."""
    if f"process{first_row}" in states:
        it.set_state(states[f"process{first_row}"])
        return
    missing = [r for r in range(first_row, first_row + rows) if str(r) not in states]
    if missing:
        raise DataError(f"checkpoint data state has no entry for batch rows {missing[:4]}...: "
                        f"was train.batch_size or data.worker_count changed?")
    it.set_state({"parents": [states[str(r)] for r in range(first_row, first_row + rows)]})
