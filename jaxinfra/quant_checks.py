"""The quant section's checks that need to know the devices (fp8 matmul support).

Core, not `jaxinfra/quantize.py` (the `jaxinfra quantize` command, a feature): the runtime runs
them before building a training step and inference before loading a checkpoint, and the core
never imports a feature package.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxinfra.config import ConfigError
from models.quant_config import QuantConfig

FP8_GPU_CAPABILITY = 8.9  # Ada / Hopper and later have fp8 tensor cores


def fp8_dots_native(device: jax.Device) -> bool:
    """Whether XLA runs fp8 dots natively on `device` (an NVIDIA GPU of compute capability >= 8.9).
    Elsewhere (XLA:CPU, older GPUs, TPUs here) XLA converts fp8 operands to float32 and runs a float32
    dot: measured exact on XLA:CPU, and no faster than float32."""
    if device.platform != "gpu":
        return False
    try:
        return float(getattr(device, "compute_capability", "0")) >= FP8_GPU_CAPABILITY
    except ValueError:
        return False


def check_backend(quant: QuantConfig, devices: Sequence[jax.Device]) -> None:
    """fp8 on a backend without fp8 dots is refused unless quant.fp8_emulation=true (ConfigError)."""
    if quant.train != "fp8" or quant.fp8_emulation or fp8_dots_native(devices[0]):
        return
    kind = devices[0].device_kind
    raise ConfigError(f"quant.train=fp8 needs fp8 matmuls, which {kind} ({devices[0].platform}) lacks: XLA would "
                      f"upcast them to float32 dots (exact, no faster than model.dtype=float32 alone); set "
                      f"quant.fp8_emulation=true to run that emulation anyway (numerics checks), or use "
                      f"quant.train=int8, or a GPU of compute capability >= {FP8_GPU_CAPABILITY}")


def check_trainable(quant: QuantConfig, devices: Sequence[jax.Device], frozen_base: bool = False) -> None:
    """The quant section of a training run: float weights (int8 ones only as the frozen base of LoRA
    adapters: QLoRA), and fp8 only where it runs (ConfigError)."""
    if quant.weights != "none" and not frozen_base:
        raise ConfigError(f"quant.weights={quant.weights} marks an inference checkpoint (jaxinfra quantize); "
                          f"training needs float weights: train from the run it was quantized from, or "
                          f"train LoRA adapters over it (lora.rank > 0)")
    check_backend(quant, devices)
