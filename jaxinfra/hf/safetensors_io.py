"""Reading and writing safetensors one tensor at a time (no torch; numpy only).

Reading opens the file with `safe_open(framework="numpy")` for each tensor and closes it
right after: the file is memory-mapped, and pages touched through a mapping that stays
open count in the process's resident set, so keeping one mapping for the whole import
would make RSS grow to the checkpoint size even though every tensor is read once.

Writing computes the header (names, dtypes, shapes, offsets) from the shapes alone, then
appends each tensor's bytes as it is produced, so only one tensor is ever on the host.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfra.atomic import atomic_file
from jaxinfra.exits import CorruptFileError
from jaxinfra.hf.families import HFError

# transformers 5.x holds MoE experts fused in memory; a checkpoint saved that way stores e.g.
# `...mlp.experts.gate_up_proj` [E, 2F, d] and `...mlp.experts.down_proj` [E, d, F] instead of
# the Hub's per-expert `...experts.{j}.w1.weight`. Per-expert names are resolved into slices of those.
_PER_EXPERT = re.compile(r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.weight$")


ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's adapter weights (jaxinfra/hf/adapters.py)


def _text_decoder_names(name: str) -> list[str]:
    """Where an image + text checkpoint (Gemma3ForConditionalGeneration) keeps a text decoder's tensor:
    transformers 5's `model.language_model.*`, 4.x's (the Hub's) `language_model.model.*`, `language_model.lm_head`."""
    if name.startswith("model."):
        rest = name[len("model."):]
        return [f"model.language_model.{rest}", f"language_model.model.{rest}"]
    return [f"language_model.{name}"] if name == "lm_head.weight" else []


@contextlib.contextmanager
def _open(path: pathlib.Path, framework: str = "numpy") -> Iterator[Any]:
    """safe_open, with a file safetensors cannot decode (a garbage or truncated file) reported as
    CorruptFileError naming it (one line, exit 74) instead of a bare SafetensorError."""
    try:
        with safe_open(path, framework=framework) as st:
            yield st
    except SafetensorError as e:
        raise CorruptFileError(path, f"not a readable safetensors file: {e}") from e


class SafetensorsDir:
    """The tensors of an HF directory (one model.safetensors or an index of shards)."""

    def __init__(self, directory: str | pathlib.Path, only: str | None = None):
        """Every *.safetensors of `directory` but a PEFT adapter beside the model (`hf export --adapters`
        writes both); `only`: just that file (the adapter)."""
        self.directory = pathlib.Path(directory)
        files = sorted(f for f in self.directory.glob("*.safetensors")
                       if (f.name == only if only else f.name != ADAPTER_FILE))
        if not files:
            raise HFError(f"{self.directory}: no *.safetensors files (only safetensors checkpoints are supported)")
        self.files = [f.name for f in files]
        self.where: dict[str, pathlib.Path] = {}
        for f in files:
            with _open(f, framework="numpy") as st:
                for key in st.keys():
                    self.where[key] = f
        self.used: set[str] = set()
        if only is None:
            self._check_index()

    def _check_index(self) -> None:
        """A sharded checkpoint whose index names a shard file that is not here: say which, before any tensor
        is read (each of its tensors would otherwise be reported missing, one at a time)."""
        index = self.directory / "model.safetensors.index.json"
        if not index.is_file():
            return
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (json.JSONDecodeError, AttributeError) as e:
            raise HFError(f"{index}: not a safetensors index ({e})") from None
        for name, file in weight_map.items():
            if isinstance(file, str) and not (self.directory / file).is_file():
                raise HFError(f"missing tensor {name} in {self.describe()}: {index.name} puts it in {file}, "
                              f"which is not in {self.directory}")

    def describe(self) -> str:
        return f"{self.directory} ({', '.join(self.files)})"

    def read(self, name: str) -> np.ndarray:
        """One tensor (or a fused tensor's slice standing in for it, or its MXFP4 blocks and scales dequantized),
        as a numpy array."""
        pair = self.mxfp4_pair(name)
        if pair is not None:  # gpt-oss's MXFP4 experts
            self.used.update(pair)
            return dequantize_mxfp4(*(self._get(key, None) for key in pair))
        found = self._locate(name)
        if found is None:
            raise HFError(f"missing tensor {name} in {self.describe()}")
        key, index = found
        self.used.add(key)
        return self._get(key, index)

    def has(self, name: str) -> bool:
        """Whether `read(name)` finds the tensor (reads no data)."""
        return self._locate(name) is not None or self.mxfp4_pair(name) is not None

    def _locate(self, name: str) -> tuple[str, tuple | None] | None:
        """(the stored tensor, the index of the slice standing for `name` or None), or None when absent."""
        if name in self.where:
            return name, None
        renamed = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral as transformers 5.x names it in memory
        if renamed != name and renamed in self.where:
            return renamed, None
        for wrapped in _text_decoder_names(name):  # the text decoder of an image + text checkpoint
            if wrapped in self.where:
                return wrapped, None
        return self._fused(name)

    def read_experts(self, name: str, rows: slice) -> np.ndarray:
        """Rows `rows` of the leading (experts) axis of a tensor stored whole per layer (gpt-oss's experts), read
        without the others: MXFP4 blocks and scales are sliced before they are dequantized."""
        pair = self.mxfp4_pair(name)
        if pair is not None:
            self.used.update(pair)
            return dequantize_mxfp4(*(self._get(key, (rows,)) for key in pair))
        if name not in self.where:
            raise HFError(f"missing tensor {name} in {self.describe()}")
        self.used.add(name)
        return self._get(name, (rows,))

    def mxfp4_pair(self, name: str) -> tuple[str, str] | None:
        """(`name`_blocks, `name`_scales) when the tensor is stored MXFP4-quantized instead (gpt-oss's experts)."""
        pair = (f"{name}_blocks", f"{name}_scales")
        return pair if name not in self.where and all(key in self.where for key in pair) else None

    def _fused(self, name: str) -> tuple[str, tuple] | None:
        m = _PER_EXPERT.match(name)
        if not m:
            return None
        prefix, j, which = m.group(1), int(m.group(2)), m.group(3)
        if which in ("w2", "down_proj"):
            key = f"{prefix}.mlp.experts.down_proj"
            return (key, (j,)) if key in self.where else None
        key = f"{prefix}.mlp.experts.gate_up_proj"
        if key not in self.where:
            return None
        with _open(self.where[key], framework="numpy") as st:
            f = st.get_slice(key).get_shape()[1] // 2
        half = slice(0, f) if which in ("w1", "gate_proj") else slice(f, 2 * f)
        return key, (j, half)

    def _get(self, key: str, index: tuple | None) -> np.ndarray:
        path = self.where[key]
        with _open(path, framework="numpy") as st:  # opened per tensor: see the module docstring
            if index is None:
                out = st.get_tensor(key)
            else:
                out = st.get_slice(key)[index]
        return np.array(out, copy=True)  # own the bytes before the mapping closes

    def shape(self, key: str) -> list[int]:
        with _open(self.where[key], framework="numpy") as st:
            return list(st.get_slice(key).get_shape())

    def bytes_on_disk(self) -> int:
        return sum((self.directory / f).stat().st_size for f in self.files)


# MXFP4 (OCP Microscaling): FP4 e2m1 codes, the low nibble of each byte first, in blocks of 32 sharing one
# E8M0 scale (2 ** (byte - 127)); these are the 16 values a code stands for (sign bit 3).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's `*_blocks` [E, rows, G, 16] uint8 + `*_scales` [E, rows, G] uint8 -> float32 [E, G * 32, rows],
    value by value what transformers' mxfp4 integration (convert_moe_packed_tensors) computes: each code's FP4
    value times 2 ** (scale - 127) (torch.ldexp multiplies by that power of two; exact in float32), then the last
    two axes swapped into the layout of the unquantized gate_up_proj [E, d, 2I] / down_proj [E, I, d]."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise HFError(f"MXFP4 tensors of dtypes {blocks.dtype}/{scales.dtype} and shapes {blocks.shape}/"
                      f"{scales.shape}: expected uint8 blocks [..., G, 16] and uint8 scales [..., G]")
    values = _BYTE_VALUES[blocks].reshape(*scales.shape, 2 * blocks.shape[-1])  # one lookup per byte: (low, high)
    values *= np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)[..., None]
    return np.ascontiguousarray(np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2))


# Byte b -> (value of its low nibble, value of its high nibble): the two FP4 codes it packs, in order.
_BYTE_VALUES = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], axis=-1)


_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16"}


def write_safetensors(path: pathlib.Path, specs: list[tuple[str, tuple[int, ...], np.dtype]],
                      tensors: Iterator[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> int:
    """Write one safetensors file whose tensors are `specs` (name, shape, dtype), with the data
    coming from `tensors` in the same order. Returns the bytes written."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _DTYPES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with atomic_file(path, "wb", replace=True) as out:  # never a truncated file under the final name
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for (name, shape, dtype), (got, array) in zip(specs, tensors, strict=True):
            if got != name or tuple(array.shape) != tuple(shape) or array.dtype != dtype:
                raise ValueError(f"tensor {got} {array.shape} {array.dtype} does not match its header entry "
                                 f"{name} {shape} {dtype}")
            out.write(np.ascontiguousarray(array).tobytes())
    return 8 + len(blob) + offset


def plan_shards(specs: Iterable[tuple[str, tuple[int, ...], np.dtype]],
                max_bytes: int) -> list[list[tuple[str, tuple[int, ...], np.dtype]]]:
    """Split tensors (in order) into files of at most max_bytes each (a bigger tensor gets its own)."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        n = int(np.prod(spec[1], dtype=np.int64)) * np.dtype(spec[2]).itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards
