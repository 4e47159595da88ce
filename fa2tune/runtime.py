"""get_kernel(): the attention kernel tuned for one GPU, head dim, dtype and mask, ready to call."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import planner, selection
from .inputs import DTYPE_NAMES
from .launcher import attention
from .types import DeviceInfo, KernelConfig


@dataclass(frozen=True)
class AttentionKernel:
    """A resolved kernel: call it as ``kernel(q, k, v)``.

    Attributes:
        head_dim, dtype, causal: what it was resolved for; calls with anything else are refused.
        device: the GPU it was resolved for.
        config: the forward config; bwd_dkdv_config / bwd_dq_config: the backward's.
        source: where the forward config came from — a YAML file path, or "planner-default".
        bwd_source: the same for the backward configs.
    """

    head_dim: int
    dtype: torch.dtype
    causal: bool
    device: DeviceInfo
    torch_device: str
    config: KernelConfig
    source: str
    bwd_dkdv_config: KernelConfig
    bwd_dq_config: KernelConfig
    bwd_source: str

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, return_lse: bool = False
    ):
        """attention(q, k, v) with this kernel's configs (the backward's come from the same store)."""
        if q.shape[-1] != self.head_dim or q.dtype != self.dtype:
            raise ValueError(
                f"this kernel was resolved for head_dim={self.head_dim}, dtype={self.dtype}; "
                f"got q with head_dim={q.shape[-1]}, dtype={q.dtype}: call fa2tune.get_kernel for that"
            )
        return attention(q, k, v, causal=self.causal, scale=scale, return_lse=return_lse, config=self.config)


@functools.cache
def _resolved(head_dim: int, device: str, dtype: torch.dtype, causal: bool, config_dir: str | None) -> AttentionKernel:
    fwd, source = selection.resolve("fwd", head_dim, dtype, causal, device)
    dkdv, bwd_source = selection.resolve("bwd_dkdv", head_dim, dtype, causal, device)
    dq, _ = selection.resolve("bwd_dq", head_dim, dtype, causal, device)
    return AttentionKernel(
        head_dim, dtype, causal, selection.device_info(device), device, fwd, source, dkdv, dq, bwd_source
    )


def get_kernel(
    head_dim: int, *, device: str | torch.device = "cuda:0", dtype: torch.dtype = torch.bfloat16, causal: bool = False
) -> AttentionKernel:
    """The attention kernel for a GPU, head dim, dtype and mask, with its configs and where they came from.

    Lookup order for each config: $FA2TUNE_CONFIG_DIR, the user cache dir (~/.cache/fa2tune/configs), the shipped
    tuned_configs/, then the planner's default. A missing, corrupt or stale file warns once and falls back.
    Resolved kernels are cached per process.
    """
    import os

    if not isinstance(head_dim, int) or not 1 <= head_dim <= planner.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be an int in 1..{planner.MAX_HEAD_DIM}, got {head_dim!r}")
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    device = str(torch.device(device))
    return _resolved(head_dim, device, dtype, causal, os.environ.get("FA2TUNE_CONFIG_DIR"))


def clear_cache() -> None:
    """Forget resolved kernels and configs (after tuning wrote new entries)."""
    _resolved.cache_clear()
    selection.clear_cache()
