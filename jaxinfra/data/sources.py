"""Random-access example sources: documents cut into (seq_len + 1)-token windows.

A document is a range of tokens in one file: (file index, start, end). A
`WindowSource` numbers the windows of all its documents so grain can shuffle and
shard them by index; a window is read only when grain asks for it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Callable, Sequence

import numpy as np

from jaxinfra.data.config import DataError

# reader(file index, start, count) -> int32 tokens
Reader = Callable[[int, int, int], np.ndarray]

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


# ------------------------------------------------------------------ file lists


def expand_paths(patterns: Sequence[str], what: str = "data.paths") -> list[str]:
    """Files named by paths, globs or directories: sorted, deduplicated, readable."""
    files: set[str] = set()
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if any(c in path for c in "*?["):
            matches = [m for m in glob.glob(path, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise DataError(f"{what}: no files match {pattern!r}")
        elif os.path.isdir(path):
            matches = _walk(path, suffix="")
            if not matches:
                raise DataError(f"{what}: directory {pattern!r} holds no files")
        elif os.path.isfile(path):
            matches = [path]
        else:
            raise DataError(f"{what}: file not found: {pattern!r}")
        files.update(os.path.abspath(m) for m in matches)
    for f in files:
        if not os.access(f, os.R_OK):
            raise DataError(f"{what}: cannot read {f!r} (permission denied)")
    return sorted(files)


def stdlib_files() -> tuple[str, list[str]]:
    """(root, files): the standard library's own .py files, without installed packages."""
    root = sysconfig.get_paths()["stdlib"]
    files = _walk(root, suffix=".py")
    if not files:
        raise DataError(f"data.paths: is empty and the standard library at {root!r} holds no .py files")
    return root, files


def _walk(root: str, suffix: str) -> list[str]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS and not x.startswith(".")]
        out.extend(os.path.join(d, n) for n in names if n.endswith(suffix) and not n.startswith("."))
    return sorted(out)


def common_root(files: Sequence[str]) -> str:
    """Directory the split hashes paths relative to, so moving the data keeps the split."""
    root = os.path.commonpath(files)
    return os.path.dirname(root) if os.path.isfile(root) else root


# -------------------------------------------------------------------- splitting


def split_documents(names: Sequence[str], eval_fraction: float) -> tuple[list[int], list[int]]:
    """(train, eval) document indices, by a stable hash of each name; both non-empty."""
    if len(names) < 2:
        raise DataError(
            f"data.paths: {len(names)} usable document(s); at least 2 are needed to hold out whole "
            "documents for evaluation")
    scores = [int.from_bytes(hashlib.sha1(n.encode()).digest()[:8], "big") / 2.0**64 for n in names]
    held = {i for i, s in enumerate(scores) if s < eval_fraction}
    if not held:  # the eval split must not be empty
        held = {min(range(len(names)), key=scores.__getitem__)}
    if len(held) == len(names):  # nor the train split
        held.discard(max(range(len(names)), key=scores.__getitem__))
    train = [i for i in range(len(names)) if i not in held]
    return train, sorted(held)


def split_records(names: Sequence[str], counts: Sequence[int], eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) global record indices (file by file) for files of `counts` records.

    A record is held out by a stable hash of (file name, record index), so the split does not
    depend on the other files, and a prepared directory splits exactly like its inputs read on
    the fly. Both parts are non-empty."""
    total = int(sum(counts))
    if total < 2:
        raise DataError(f"data.paths: {total} document(s); at least 2 are needed to hold out documents for "
                        "evaluation")
    scores = np.concatenate([_uniform(n, int(c)) for n, c in zip(names, counts)])
    held = scores < eval_fraction
    if not held.any():
        held[np.argmin(scores)] = True
    if held.all():
        held[np.argmax(scores)] = False
    return np.flatnonzero(~held), np.flatnonzero(held)


def _uniform(name: str, count: int) -> np.ndarray:
    """[0, 1) scores of records 0..count-1 of file `name` (splitmix64 of a name key + the index)."""
    key = np.uint64(int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big"))
    z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def window_counts(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of each document: ceil((n - 1) / seq_len), none for fewer than 2 tokens."""
    lengths = np.asarray(lengths, np.int64)
    return np.where(lengths >= 2, (lengths - 2) // seq_len + 1, 0)


def split_streams(lengths: Sequence[int], eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document ranges: the last eval_fraction of each stream is held out."""
    train, held = [], []
    for f, n in enumerate(lengths):
        n_eval = int(round(n * eval_fraction))
        train.append((f, 0, n - n_eval))
        held.append((f, n - n_eval, n))
    return np.asarray(train, np.int64).reshape(-1, 3), np.asarray(held, np.int64).reshape(-1, 3)


# ---------------------------------------------------------------------- readers


class ByteReader:
    """Reads a file's bytes as token ids 0..255, without keeping files open."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)

    def __call__(self, f: int, start: int, count: int) -> np.ndarray:
        path = self.paths[f]
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.pread(fd, count, start)  # no seek: safe from several threads
            finally:
                os.close(fd)
        except OSError as e:
            raise DataError(f"data.paths: cannot read {path!r}: {e.strerror}") from e
        if len(data) != count:
            raise DataError(f"data.paths: {path!r} shrank while training (wanted {count} bytes at {start})")
        return np.frombuffer(data, np.uint8).astype(np.int32)


class ArrayReader:
    """Tokens already in memory, one array per file."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = list(arrays)

    def __call__(self, f: int, start: int, count: int) -> np.ndarray:
        return self.arrays[f][start:start + count]


class TokenFileReader:
    """Memory-mapped token files; checks each window's ids against the vocabulary.

    `token_dtype`: the raw .bin dtype, one for all files or one per file."""

    def __init__(self, paths: Sequence[str], token_dtype: str | Sequence[str], vocab_size: int):
        self.paths = list(paths)
        self.dtypes = [token_dtype] * len(self.paths) if isinstance(token_dtype, str) else list(token_dtype)
        self.vocab_size = vocab_size
        self._maps: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        # Memory maps would pickle as full copies; workers reopen them.
        return {**self.__dict__, "_maps": {}}

    def array(self, f: int) -> np.ndarray:
        arr = self._maps.get(f)
        if arr is None:
            arr = self._maps[f] = open_token_file(self.paths[f], self.dtypes[f])
        return arr

    def __call__(self, f: int, start: int, count: int) -> np.ndarray:
        raw = np.asarray(self.array(f)[start:start + count])
        bad = (raw >= self.vocab_size) | (raw < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(
                f"data.paths: token id {int(raw[i])} at position {start + i} of {self.paths[f]!r} is out of "
                f"range for vocab_size {self.vocab_size} (ids must be in [0, {self.vocab_size}))")
        return raw.astype(np.int32)


def open_token_file(path: str, token_dtype: str) -> np.ndarray:
    """A 1-D read-only view of a .npy or raw .bin token file (not read into memory)."""
    try:
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            if not np.issubdtype(arr.dtype, np.integer):
                raise DataError(f"data.paths: {path!r} holds {arr.dtype} values; token ids must be integers")
            return arr.reshape(-1)
        dtype = np.dtype(token_dtype)
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise DataError(
                f"data.paths: {path!r} is {size} bytes, not a whole number of {token_dtype} tokens "
                "(check data.token_dtype)")
        if size == 0:
            return np.zeros(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r")
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"data.paths: cannot read tokens from {path!r}: {str(e).splitlines()[0]}") from e


# ----------------------------------------------------------------------- source


class WindowSource:
    """Random access to the windows of a set of documents.

    A document of n tokens gives ceil((n - 1) / seq_len) windows of at most
    seq_len + 1 tokens, overlapping by one, so each next-token pair is used once.
    """

    def __init__(self, reader: Reader, docs: np.ndarray, seq_len: int):
        docs = np.asarray(docs, np.int64).reshape(-1, 3)
        counts = window_counts(docs[:, 2] - docs[:, 1], seq_len)
        self._reader = reader
        self._docs = docs
        self._seq_len = seq_len
        self._ends = np.cumsum(counts)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        d = int(np.searchsorted(self._ends, index, side="right"))
        k = index - (int(self._ends[d - 1]) if d else 0)
        f, doc_start, doc_end = (int(x) for x in self._docs[d])
        start = doc_start + k * self._seq_len
        window = self._reader(f, start, min(self._seq_len + 1, doc_end - start))
        return {"inputs": window[:-1], "targets": window[1:]}

    def __repr__(self) -> str:
        return f"WindowSource(docs={len(self._docs)}, windows={len(self)}, seq_len={self._seq_len})"
