"""Training data: text, token files or a synthetic language, packed into fixed-size batches.

    it = make_train_iterator(cfg, seq_len=..., global_batch_size=..., vocab_size=..., seed=...)
    batch = next(it)  # inputs, targets, segment_ids, positions: int32 [local_batch, seq_len]
"""

from jaxinfra.data.config import DataConfig, DataError
from jaxinfra.data.pipeline import (make_eval_batches, make_train_iterator, row_states, set_row_states,
                                    vocab_size_of)

__all__ = ["DataConfig", "DataError", "make_eval_batches", "make_train_iterator", "row_states", "set_row_states",
           "vocab_size_of"]
