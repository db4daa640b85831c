"""What a resume may change: one rule for the run's own checkpoint and for `train --restore` (full).

The run's config is compared with the one the checkpoint was written with (its meta), and every
key that differs is listed in one note, so nothing changes unseen. The changes are of three kinds:

- the model's shapes: refused before anything moves (`checkpoint.check_fits`: another model);
- the data stream (`breaks_data_position`: every `data.*` key but `data.eval_batches` and a mixture
  source's `weight`/`weights`, and `train.seed`, `train.batch_size`, `train.seq_len`): the saved data
  position indexes the old stream,
  so applying it would silently misplace the run in the new one (or fail on it). Refused, exit 2,
  unless `train --restart-data`: then the model and optimizer continue and the data starts from
  the beginning of the new stream (the note says so);
- everything else (optimizer, schedule, train.steps, logging, checkpointing, mesh, remat, ...):
  taken as given, and listed.

An extension that feeds its own batches (GRPO) keeps its own position and checks it itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from jaxinfra.checkpoint import config_changes
from jaxinfra.config import ConfigError

# train.* keys that decide which rows the data stream yields, beside the whole data section.
_STREAM_TRAIN_KEYS = ("train.seed", "train.batch_size", "train.seq_len")
_NOT_STREAM = ("data.eval_batches",)  # evaluation only: the training stream is the same
_SHOWN = 12  # changed keys listed in the note before "and N more"


def breaks_data_position(key: str) -> bool:
    """A change of `key` makes a saved data position meaningless for the new stream. A mixture's weights
    are not such a change: each row slot keeps every source's position, new weights only pick among them
    from the resumed step on (as a staged weight does)."""
    reweighted = key.startswith("data.mixture.") and key.rsplit(".", 1)[-1] in ("weight", "weights")
    return (key.startswith("data.") and key not in _NOT_STREAM and not reweighted) or key in _STREAM_TRAIN_KEYS


@dataclasses.dataclass(frozen=True)
class ResumeChanges:
    """The keys that differ from the checkpoint's config, as 'key: saved -> now'."""

    changed: tuple[str, ...]

    @property
    def stream(self) -> tuple[str, ...]:
        return tuple(c for c in self.changed if breaks_data_position(c.split(": ", 1)[0]))


def changes(meta: dict[str, Any], current: dict[str, Any]) -> ResumeChanges:
    """What differs between the checkpoint (its meta: the config it was written with, or for an older
    checkpoint without one its batch and sequence length) and the `current` config dict."""
    text = meta.get("config")
    saved = yaml.safe_load(text) if isinstance(text, str) and text else None
    if isinstance(saved, dict):
        return ResumeChanges(tuple(config_changes(saved, current, tuple(dict.fromkeys([*saved, *current])))))
    train, found = current.get("train", {}), []
    for key, name in (("global_batch", "batch_size"), ("seq_len", "seq_len")):
        if key in meta and meta[key] != train.get(name):
            found.append(f"train.{name}: {meta[key]} -> {train.get(name)}")
    return ResumeChanges(tuple(found))


def check_resume(step: int, found: ResumeChanges, restart_data: bool, feeds_own_batches: bool) -> str | None:
    """ConfigError (exit 2) for a data-stream change without --restart-data; else the note to print
    (None: nothing changed). The caller applies the saved data position only when `found.stream` is empty."""
    stream = () if feeds_own_batches else found.stream
    if stream and not restart_data:
        raise ConfigError(
            f"checkpoint step {step} was written for another data stream ({'; '.join(stream)}): its data "
            f"position cannot carry over and nothing was changed; rerun with the checkpoint's settings, or pass "
            f"--restart-data to continue the model and optimizer with this data from its beginning")
    if not found.changed:
        return None
    shown = "; ".join(found.changed[:_SHOWN]) + (f"; and {len(found.changed) - _SHOWN} more"
                                                 if len(found.changed) > _SHOWN else "")
    tail = ", the data restarts from its beginning (--restart-data)" if stream else ""
    return f"jaxinfra: note: resuming step {step} with settings changed since that checkpoint: {shown}{tail}"
