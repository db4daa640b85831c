"""The attention implementation names, without jax: `models/config.py` (and so the run config)
names them, and loading a config must not import jax or Pallas (tests/test_layout.py checks it).
`kernels/attention.py` dispatches on them; the list is derived from the Literal, one source."""

from __future__ import annotations

from typing import Literal, get_args

AttentionImpl = Literal["xla", "auto", "pallas_triton", "pallas_mosaic_tpu", "pallas_mosaic_gpu", "cudnn"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(AttentionImpl)
