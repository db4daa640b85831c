"""A learnable synthetic language: documents from a sparse random Markov chain.

Every token has a few likely successors, so the next-token entropy is about
1 nat against log(vocab) for a uniform guess: a small model learns it in tens
of steps. Documents are generated on demand from (seed, index).
"""

from __future__ import annotations

import numpy as np

NUM_DOCUMENTS = 1 << 20  # virtual size of the corpus; documents are never stored
# Probability of each token's 1st, 2nd, ... successor.
SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)


class SyntheticSource:
    """Documents [start, start + length) of the language with this seed, each one window long."""

    def __init__(self, vocab: int, seq_len: int, seed: int, start: int, length: int):
        rng = np.random.default_rng([seed, 0])
        k = min(len(SUCCESSOR_PROBS), vocab)
        probs = np.asarray(SUCCESSOR_PROBS[:k]) / sum(SUCCESSOR_PROBS[:k])
        self._successors = [rng.choice(vocab, size=k, replace=False).tolist() for _ in range(vocab)]
        self._cum = np.cumsum(probs)
        self._cum[-1] = 1.0
        self._vocab = vocab
        self._seq_len = seq_len
        self._min_tokens = max(2, (seq_len + 1) // 4)
        self._seed = seed
        self._start = start
        self._length = length

    def __len__(self) -> int:
        return self._length

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` (seq_len // 4 to seq_len + 1 of them)."""
        rng = np.random.default_rng([self._seed, 1, self._start + index])
        n = int(rng.integers(self._min_tokens, self._seq_len + 2))
        ranks = np.searchsorted(self._cum, rng.random(n - 1), side="right").tolist()
        tok = int(rng.integers(self._vocab))
        out = [tok]
        for r in ranks:
            tok = self._successors[tok][r]
            out.append(tok)
        return np.asarray(out, np.int32)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        doc = self.document(index)
        return {"inputs": doc[:-1], "targets": doc[1:]}

    def __repr__(self) -> str:
        return f"SyntheticSource(vocab={self._vocab}, documents={self._length})"


def split(vocab: int, seq_len: int, seed: int, eval_fraction: float) -> tuple[SyntheticSource, SyntheticSource]:
    """(train, eval) sources: the first eval_fraction of the documents are held out."""
    n_eval = max(1, int(NUM_DOCUMENTS * eval_fraction))
    return (SyntheticSource(vocab, seq_len, seed, n_eval, NUM_DOCUMENTS - n_eval),
            SyntheticSource(vocab, seq_len, seed, 0, n_eval))
