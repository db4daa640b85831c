"""Training data: text, JSONL/Parquet, token files (prepared or not), chat conversations, a synthetic
language, or a weighted mixture of them, packed into fixed-size batches.

    it = make_train_iterator(cfg, seq_len=..., global_batch_size=..., vocab_size=..., seed=...)
    batch = next(it)  # inputs, targets, segment_ids, positions: int32 [local_batch, seq_len]
                      # (chat adds assistant and truncated: jaxinfra/data/chat_source.py)
"""

from typing import Any

from jaxinfra.data.config import DataConfig, DataError
from jaxinfra.data.vocab import vocab_size_of

_PIPELINE = ("make_eval_batches", "make_eval_sets", "make_train_iterator", "row_states", "set_row_states")
__all__ = ["DataConfig", "DataError", "vocab_size_of", *_PIPELINE]


def __getattr__(name: str) -> Any:
    # The pipeline (and grain) load on first use: config validation, inference and
    # benchmarks that feed their own batches never need them.
    if name in _PIPELINE:
        from jaxinfra.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
