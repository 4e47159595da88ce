"""fa2tune: exact FlashAttention-2 in Triton, with block sizes tuned per GPU and head dimension."""

from __future__ import annotations

from .launcher import FlashAttnFunction, attention
from .runtime import AttentionKernel, get_kernel
from .types import KernelConfig, Variant

__all__ = ["AttentionKernel", "FlashAttnFunction", "KernelConfig", "Variant", "attention", "get_kernel"]
__version__ = "0.1.0"
