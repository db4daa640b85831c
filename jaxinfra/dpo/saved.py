"""The saved reference log-probs of `jaxinfra dpo save-reference`, read by a DPO run as dpo.reference.

    DIR/dpo_reference.json  what they were made from (the reference's path and step, the data
                            settings that fix the batches: jaxinfra/distill/logits.py batch_identity)
                            and how far the command got (`steps_written`, `complete`); this file is
                            how a dpo.reference directory is recognised as saved log-probs
    DIR/ref_logps.npy       [steps, batch, seq] float32 the reference's log-prob of every target
    DIR/rows.npy            [steps, batch] uint32 CRC32 of each batch row (inputs, targets, segments)

Entry s - 1 belongs to the batch of training step s (the data order is a function of the data
section, seq_len, global batch and seed, as for saved distillation logits): a run with other
settings is refused in one line, and each row's CRC is checked against its batch. The arrays are
memory-mapped: each process reads only its rows. The run needs no reference model in memory.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from jaxinfra.checkpoint import CheckpointError, config_changes
from jaxinfra.config import Config, ConfigError
from jaxinfra.data import DataError
from jaxinfra.distill.logits import _write_json, batch_identity, row_crcs

META = "dpo_reference.json"
FORMAT = 1


def is_saved_reference(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `jaxinfra dpo save-reference` (its meta file is there)."""
    return (pathlib.Path(path) / META).is_file()


def _arrays(root: pathlib.Path, meta: dict[str, Any], mode: str) -> dict[str, np.ndarray]:
    n, b, t = meta["steps"], meta["train"]["batch_size"], meta["train"]["seq_len"]
    shapes = {"ref_logps": ((n, b, t), "float32"), "rows": ((n, b), "uint32")}
    if mode == "r":
        return {k: np.load(root / f"{k}.npy", mmap_mode="r") for k in shapes}
    return {k: np.lib.format.open_memmap(root / f"{k}.npy", mode=mode, dtype=dt, shape=s)
            for k, (s, dt) in shapes.items()}


class ReferenceWriter:
    """Writes steps 1..meta['steps'] in order; continues an unfinished directory of the same meta."""

    def __init__(self, root: str | os.PathLike, meta: dict[str, Any]):
        self.root = pathlib.Path(root)
        self.meta = {**meta, "format": FORMAT, "steps_written": 0, "complete": False}
        old = self._existing()
        self.root.mkdir(parents=True, exist_ok=True)
        if old is not None:
            self.meta["steps_written"] = old["steps_written"]
        self.arrays = _arrays(self.root, self.meta, "r+" if old is not None else "w+")
        _write_json(self.root / META, self.meta)

    def _existing(self) -> dict[str, Any] | None:
        path = self.root / META
        if not path.is_file():
            if self.root.exists() and any(self.root.iterdir()):
                raise DataError(f"--out {self.root} exists and is not a save-reference directory; choose a new one")
            return None
        old = json.loads(path.read_text())
        if old.get("complete"):
            raise DataError(f"--out {self.root} already holds complete reference log-probs; choose a new directory")
        drop = ("steps_written", "complete")
        if {k: v for k, v in old.items() if k not in drop} != {k: v for k, v in self.meta.items() if k not in drop}:
            raise DataError(f"--out {self.root} holds unfinished log-probs of another reference or data; choose a "
                            f"new directory")
        return old

    @property
    def next_step(self) -> int:
        return self.meta["steps_written"] + 1

    def write(self, step: int, ref_logps: np.ndarray, rows: np.ndarray) -> None:
        self.arrays["ref_logps"][step - 1] = ref_logps
        self.arrays["rows"][step - 1] = rows
        self.meta["steps_written"] = step

    def finish(self) -> None:
        for a in self.arrays.values():
            a.flush()
        self.meta["complete"] = self.meta["steps_written"] == self.meta["steps"]
        _write_json(self.root / META, self.meta)


class SavedReference:
    """A complete save-reference directory opened for reading (dpo.reference)."""

    def __init__(self, path: str | os.PathLike):
        self.root = pathlib.Path(path)
        try:
            self.meta = json.loads((self.root / META).read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"dpo.reference={path}: unreadable {META} ({e})") from None
        if self.meta.get("format") != FORMAT or not self.meta.get("complete"):
            raise DataError(f"dpo.reference={path} is unfinished ({self.meta.get('steps_written')} of "
                            f"{self.meta.get('steps')} steps) or of another format: rerun the same save-reference "
                            f"command to complete it")
        try:
            self.arrays = _arrays(self.root, self.meta, "r")
        except (OSError, ValueError) as e:
            raise DataError(f"dpo.reference={path}: unreadable arrays ({e})") from None

    def check_run(self, cfg: Config) -> None:
        """ConfigError naming the first differences between the run's batches and the saved ones."""
        changes = config_changes(self.meta, batch_identity(cfg), ("data", "train", "model"))
        if changes:
            raise ConfigError(f"dpo.reference={self.root} was saved for other batches than this run's "
                              f"({'; '.join(changes[:3])}, saved -> this run): rerun save-reference with this "
                              f"run's data settings")
        if cfg.train.steps > self.meta["steps"]:
            raise ConfigError(f"dpo.reference={self.root} holds {self.meta['steps']} steps of reference log-probs "
                              f"but train.steps={cfg.train.steps}: save more steps or train fewer")

    def rows(self, step: int, first_row: int, count: int, batch: dict[str, np.ndarray]) -> np.ndarray:
        """ref_logps of rows [first_row, first_row + count) of step `step`, after the rows' CRC check."""
        i, rows = step - 1, slice(first_row, first_row + count)
        saved, got = self.arrays["rows"][i, rows], row_crcs(batch)
        if not np.array_equal(saved, got):
            r = first_row + int(np.flatnonzero(saved != got)[0])
            raise DataError(f"dpo.reference={self.root}: the batch of step {step} (row {r}) is not the one its "
                            f"reference log-probs were saved for: the data files changed since save-reference?")
        try:
            return np.asarray(self.arrays["ref_logps"][i, rows])
        except OSError as e:
            raise CheckpointError(f"dpo.reference={self.root}: cannot read step {step} ({e})") from None
