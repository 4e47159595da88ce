"""fa2tune: exact FlashAttention-2 in Triton, with block sizes tuned per GPU and head dimension."""

from __future__ import annotations

from .launcher import FlashAttnFunction, attention, attention_varlen
from .runtime import AttentionKernel, get_kernel
from .types import KernelConfig, Mask, Variant

__all__ = [
    "AttentionKernel",
    "FlashAttnFunction",
    "KernelConfig",
    "Mask",
    "Variant",
    "attention",
    "attention_varlen",
    "get_kernel",
]
__version__ = "0.1.0"
