"""Which kernel configs to use. For now: the single place that picks the default config of each kernel.

The SRAM-budget model, candidate enumeration and compiler cross-check grow here (issue 4); every other
module asks this one and never hard-codes block sizes.
"""

from __future__ import annotations

import torch

from .types import KernelConfig

MAX_HEAD_DIM = 256
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")


def head_dim_padded(head_dim: int) -> int:
    """Head dim rounded up to the power of two >= 16 that the kernels compute on (tl.dot needs K >= 16)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def default_config(
    head_dim: int, dtype: torch.dtype, *, causal: bool = False, kernel: str = "fwd", interpret: bool = False
) -> KernelConfig:
    """The config used before any tuning.

    The GPU picks are the fastest of a 54-config sweep on the H200 (bf16, N=8k; docs/bench/
    nvidia-h200-sweep-fwd-v1.csv, scripts/sweep_fwd.py); they also run everywhere the sweep ran.

    Args:
        head_dim: per-head dimension d (1..256).
        dtype: element type of q/k/v.
        causal: causal masking; the best d=128 tile differs with it.
        kernel: "fwd", "bwd_dkdv" (one program per K/V tile: block_n rows owned, block_m Q rows streamed) or
            "bwd_dq" (one program per Q tile: block_m rows owned, block_n K/V rows streamed).
        interpret: True under TRITON_INTERPRET=1, where small tiles keep the CPU interpreter quick and let
            tests cross many tile boundaries at small sequence lengths.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if interpret:
        return KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    d = head_dim_padded(head_dim)
    if kernel != "fwd":
        return _default_bwd_config(d, dtype, kernel)
    if dtype == torch.float32:  # 4-byte elements: half the tile fits in the same shared memory
        return KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if d <= 64:
        return KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)  # 440 / 408 causal
    if d <= 128:
        if causal:
            return KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)  # 455
        return KernelConfig(block_m=256, block_n=64, num_warps=8, num_stages=4)  # 527
    return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def _default_bwd_config(d: int, dtype: torch.dtype, kernel: str) -> KernelConfig:
    # Each backward program holds two fp32 accumulators' worth of state (dK and dV, or dQ with Q and dO), so
    # tiles are smaller than the forward's. The owned tile is the wider side; the streamed side stays at 32-64.
    if dtype == torch.float32 or d > 128:
        return KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if kernel == "bwd_dkdv":  # fastest of 24 in docs/bench/nvidia-h200-sweep-bwd_dkdv-v1.csv (N=8k, bf16)
        return KernelConfig(block_m=32, block_n=128 if d <= 64 else 64, num_warps=4, num_stages=3)
    # bwd_dq: fastest over causal and not of 16 in docs/bench/nvidia-h200-sweep-bwd_dq-v1.csv (N=8k, bf16)
    return KernelConfig(block_m=128, block_n=64, num_warps=4 if d <= 64 else 8, num_stages=3)
