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
from jaxinfra.distill.logits import ArrayShapes, StepArraysWriter, batch_identity, row_crcs, step_arrays

META = "dpo_reference.json"
FORMAT = 1


def is_saved_reference(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `jaxinfra dpo save-reference` (its meta file is there)."""
    return (pathlib.Path(path) / META).is_file()


class ReferenceWriter(StepArraysWriter):
    """Writes steps 1..meta['steps'] in order; continues an unfinished directory of the same meta."""

    meta_name, format_version = META, FORMAT
    kind, contents, unfinished = "save-reference", "reference log-probs", "log-probs of another reference or data"

    @staticmethod
    def shapes_of(meta: dict[str, Any]) -> ArrayShapes:
        n, b, t = meta["steps"], meta["train"]["batch_size"], meta["train"]["seq_len"]
        return {"ref_logps": ((n, b, t), "float32"), "rows": ((n, b), "uint32")}

    def write(self, step: int, ref_logps: np.ndarray, rows: np.ndarray) -> None:
        self.write_arrays(step, ref_logps=ref_logps, rows=rows)


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
            self.arrays = step_arrays(self.root, ReferenceWriter.shapes_of(self.meta), "r")
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
