"""Attention kernels behind one entry point, `kernels.attention`."""

from kernels.attention import IMPLEMENTATIONS, attention, validate_attention_args

__all__ = ["IMPLEMENTATIONS", "attention", "validate_attention_args"]
