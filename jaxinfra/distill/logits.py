"""The offline logits directory written by `jaxinfra distill save-logits` and read by training.

    DIR/meta.json        what it was made from (teacher path and step, data config, seq_len,
                         batch size, seed, vocabulary, k) and how far it got (`steps_written`)
    DIR/ids.npy          [steps, batch, seq, k] the teacher's top-k token ids (uint16 or int32),
                         most likely first
    DIR/values.npy       [steps, batch, seq, k] float32 the teacher's logits there (temperature 1)
    DIR/teacher_ce.npy   [steps, batch, seq] float32 the teacher's cross-entropy on each target
    DIR/rows.npy         [steps, batch] uint32 CRC32 of each batch row (inputs, targets, segments)

Entry s - 1 belongs to the batch of training step s: the data pipeline's order is a function
of the data config, seq_len, global batch size and seed, so a run with the same ones sees the
same batches (a restart included). The training run refuses a directory made for other ones in
one line, and checks every row's CRC against its batch, so a changed corpus cannot slip through.
Arrays are memory-mapped: each process reads only its own rows of each step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxinfra.atomic import atomic_write_text
from jaxinfra.checkpoint import CheckpointError, config_changes
from jaxinfra.config import Config, ConfigError
from jaxinfra.data import DataError
from jaxinfra.metrics import ProgressBar
from jaxinfra.storage import local_copy

FORMAT = 1
# Keys of the data section that do not change the training batches.
_DATA_KEYS_IGNORED = ("worker_count", "eval_batches")


class LogitsError(DataError):
    """A logits directory that cannot serve this run: one line naming the problem."""


def batch_identity(cfg: Config) -> dict[str, Any]:
    """What fixes the training batches of a run: its data section, seq_len, global batch, seed, vocab."""
    data = {k: v for k, v in cfg.to_dict()["data"].items() if k not in _DATA_KEYS_IGNORED}
    return {"data": data, "train": {"seq_len": cfg.train.seq_len, "batch_size": cfg.train.batch_size,
                                    "seed": cfg.train.seed}, "model": {"vocab_size": cfg.model.vocab_size}}


def row_crcs(batch: dict[str, np.ndarray]) -> np.ndarray:
    """[rows] uint32: CRC32 of each row's inputs, targets and segment ids."""
    parts = [np.ascontiguousarray(batch[k], np.int32) for k in ("inputs", "targets", "segment_ids")]
    return np.array([zlib.crc32(b"".join(p[r].tobytes() for p in parts)) for r in range(len(parts[0]))],
                    np.uint32)


def _write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(value, indent=1, sort_keys=True), replace=True)  # the command's own files


ArrayShapes = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype) of each DIR/<name>.npy


def step_arrays(root: pathlib.Path, shapes: ArrayShapes, mode: str) -> dict[str, np.ndarray]:
    """The memory-mapped DIR/<name>.npy arrays: read-only ("r"), created ("w+") or continued ("r+")."""
    if mode == "r":
        return {name: np.load(root / f"{name}.npy", mmap_mode="r") for name in shapes}
    return {name: np.lib.format.open_memmap(root / f"{name}.npy", mode=mode, dtype=dtype, shape=shape)
            for name, (shape, dtype) in shapes.items()}


class StepArraysWriter:
    """Per-step arrays of a run's training batches (entry s - 1: step s), written in step order into
    memory-mapped .npy files with a JSON meta that says what they were made from and how far the
    writer got; an interrupted writer continues an unfinished directory of the same meta, and the
    meta is replaced last, so a reader never sees half a directory. Subclasses name the meta file,
    their arrays' shapes and the nouns of their errors (saved distillation logits, DPO reference
    log-probs)."""

    meta_name = "meta.json"
    kind, contents, unfinished = "logits", "logits", "logits of another teacher, data or size"
    error: type[Exception] = DataError
    format_version = FORMAT

    def __init__(self, root: str | os.PathLike, meta: dict[str, Any], flush_every: int = 50):
        self.root = pathlib.Path(root)
        self.meta = {**meta, "format": self.format_version, "steps_written": 0, "complete": False}
        self.flush_every = flush_every
        old = self._existing()
        if old is not None:
            self.meta["steps_written"] = old["steps_written"]
        self.root.mkdir(parents=True, exist_ok=True)
        self.arrays = step_arrays(self.root, self.shapes_of(self.meta), "r+" if old is not None else "w+")
        _write_json(self.root / self.meta_name, self.meta)

    @staticmethod
    def shapes_of(meta: dict[str, Any]) -> ArrayShapes:
        raise NotImplementedError

    def _existing(self) -> dict[str, Any] | None:
        path = self.root / self.meta_name
        if self.root.exists() and not self.root.is_dir():
            raise self.error(f"--out {self.root} is a file; give a new directory")
        if not path.is_file():
            if self.root.exists() and any(self.root.iterdir()):
                raise self.error(f"--out {self.root} exists and is not a {self.kind} directory; choose a new one")
            return None
        old = json.loads(path.read_text())
        if old.get("complete"):
            raise self.error(f"--out {self.root} already holds complete {self.contents}; choose a new directory")
        same = {k: v for k, v in old.items() if k not in ("steps_written", "complete")}
        if same != {k: v for k, v in self.meta.items() if k not in ("steps_written", "complete")}:
            raise self.error(f"--out {self.root} holds unfinished {self.unfinished}; choose a new directory")
        return old

    @property
    def next_step(self) -> int:
        return self.meta["steps_written"] + 1

    def write_arrays(self, step: int, **arrays: np.ndarray) -> None:
        if step != self.next_step:
            raise ValueError(f"{self.contents} of step {step} written after step {self.meta['steps_written']}")
        for name, value in arrays.items():
            self.arrays[name][step - 1] = value
        self.meta["steps_written"] = step
        if step % self.flush_every == 0:
            self._flush()

    def write_batches(self, batches: Iterator[dict[str, np.ndarray]], steps: int,
                      compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], progress: bool = True) -> None:
        """Steps 1..steps of the run's batches: `compute(batch)` gives a step's arrays (all but `rows`,
        each row's CRC, added here); steps an interrupted run wrote are read (the data order) but skipped."""
        bar = ProgressBar(steps, initial=self.next_step - 1, enabled=progress)
        for step in range(1, steps + 1):
            local = next(batches)
            if step < self.next_step:  # written by an earlier, interrupted run of the command
                continue
            self.write_arrays(step, **compute(local), rows=row_crcs(local))
            bar.update(step, {})
        bar.close()

    def _flush(self) -> None:
        for a in self.arrays.values():
            a.flush()
        _write_json(self.root / self.meta_name, self.meta)

    def finish(self, **extra: Any) -> None:
        """Flush, then mark complete (the meta is replaced last: a reader never sees half a directory)."""
        self.meta.update(extra, complete=self.meta["steps_written"] == self.meta["steps"])
        self._flush()


class LogitsWriter(StepArraysWriter):
    """Writes steps 1..meta['steps'] in order; continues an unfinished directory of the same meta."""

    error = LogitsError

    @staticmethod
    def shapes_of(meta: dict[str, Any]) -> ArrayShapes:
        n, b, t, k = meta["steps"], meta["train"]["batch_size"], meta["train"]["seq_len"], meta["top_k"]
        return {"ids": ((n, b, t, k), meta["ids_dtype"]), "values": ((n, b, t, k), "float32"),
                "teacher_ce": ((n, b, t), "float32"), "rows": ((n, b), "uint32")}

    def write(self, step: int, ids: np.ndarray, values: np.ndarray, teacher_ce: np.ndarray,
              rows: np.ndarray) -> None:
        self.write_arrays(step, ids=ids, values=values, teacher_ce=teacher_ce, rows=rows)


@dataclasses.dataclass
class LogitsDir:
    """A complete logits directory opened for reading."""

    root: pathlib.Path
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @classmethod
    def open(cls, path: str | os.PathLike) -> LogitsDir:
        root = pathlib.Path(local_copy(str(path), "distill.logits"))  # a bucket's: memory-mapped from a local copy
        try:
            meta = json.loads((root / "meta.json").read_text())
        except FileNotFoundError:
            raise LogitsError(f"distill.logits={path}: no meta.json there (not written by `jaxinfra distill "
                              f"save-logits`?)") from None
        except (OSError, ValueError) as e:
            raise LogitsError(f"distill.logits={path}: unreadable meta.json ({e})") from None
        if meta.get("format") != FORMAT:
            raise LogitsError(f"distill.logits={path}: format {meta.get('format')!r}, this version reads {FORMAT}")
        if not meta.get("complete"):
            raise LogitsError(f"distill.logits={path} is unfinished ({meta.get('steps_written')} of "
                              f"{meta.get('steps')} steps): rerun the same save-logits command to complete it")
        try:
            arrays = step_arrays(root, LogitsWriter.shapes_of(meta), "r")
        except (OSError, ValueError) as e:
            raise LogitsError(f"distill.logits={path}: unreadable arrays ({e})") from None
        return cls(root, meta, arrays)

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    @property
    def steps(self) -> int:
        return int(self.meta["steps"])

    def check_run(self, cfg: Config) -> None:
        """ConfigError naming the first differences between the run and what the logits were made for."""
        changes = config_changes(self.meta, batch_identity(cfg), ("data", "train", "model"))
        if changes:
            raise ConfigError(f"distill.logits={self.root} was saved for other batches than this run's "
                              f"({'; '.join(changes[:3])}, saved -> this run): rerun save-logits with this "
                              f"run's data settings, or use those")
        if cfg.train.steps > self.steps:
            raise ConfigError(f"distill.logits={self.root} holds {self.steps} steps of logits but train.steps="
                              f"{cfg.train.steps}: save more steps (save-logits --steps) or train fewer")
        if cfg.distill.top_k > self.top_k:
            raise ConfigError(f"distill.top_k={cfg.distill.top_k} is more than the {self.top_k} logits per token "
                              f"saved in {self.root}")

    def rows(self, step: int, first_row: int, count: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The teacher arrays of rows [first_row, first_row + count) of step `step`'s batch, after
        checking that `batch` (those rows) is the one they were saved for."""
        i, rows = step - 1, slice(first_row, first_row + count)
        saved, got = self.arrays["rows"][i, rows], row_crcs(batch)
        if not np.array_equal(saved, got):
            r = first_row + int(np.flatnonzero(saved != got)[0])
            raise LogitsError(f"distill.logits={self.root}: the batch of step {step} (row {r}) is not the one its "
                              f"logits were saved for: the data files changed since save-logits?")
        try:
            return {"teacher_ids": np.asarray(self.arrays["ids"][i, rows]),
                    "teacher_values": np.asarray(self.arrays["values"][i, rows]),
                    "teacher_ce": np.asarray(self.arrays["teacher_ce"][i, rows])}
        except OSError as e:
            raise CheckpointError(f"distill.logits={self.root}: cannot read step {step} ({e})") from None
