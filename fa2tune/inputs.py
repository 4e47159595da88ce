"""Checks of what users pass to attention(): every error names the argument, what was expected and what came."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .planner import MAX_HEAD_DIM

# The dtypes the kernels take, and the short names used in YAML, the CLI and Triton signatures.
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
SUPPORTED_DTYPES = tuple(DTYPE_NAMES)


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention call, in SDPA's layout (batch, heads, seqlen, head_dim)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_qkv(q: object, k: object, v: object) -> AttentionShape:
    """Validates q, k, v (batch, heads, seqlen, head_dim) and returns their sizes.

    Raises:
        TypeError: a non-tensor, a non-float dtype, or mixed dtypes.
        ValueError: wrong rank, mismatched sizes, GQA heads that do not divide, head_dim > 256,
            a non-unit last stride, tensors on different devices, or CPU tensors without the interpreter.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seqlen, head_dim) as in scaled_dot_product_attention, "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(
                f"{name} must have unit stride in its last dimension (head_dim), got strides {tuple(t.stride())}; "
                "call .contiguous() on it"
            )
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(
            "q is on the CPU, but fa2tune's kernels run on CUDA devices; move the tensors to a GPU, or set "
            "TRITON_INTERPRET=1 before importing triton to run them through Triton's interpreter (slow, for tests)"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q must be on a CUDA device, got {q.device}")

    batch, heads_q, seqlen_q, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"q, k and v must have the same batch size, got {batch}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got k={k.shape[1]}, v={v.shape[1]}")
    heads_kv = k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"q's heads must be a multiple of k/v's heads (GQA/MQA), got q heads={heads_q}, k/v heads={heads_kv}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same sequence length, got k={k.shape[2]}, v={v.shape[2]}")
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"q, k and v must have the same head_dim, got q={head_dim}, k={k.shape[3]}, v={v.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    return AttentionShape(batch, heads_q, heads_kv, seqlen_q, k.shape[2], head_dim)


def check_scale(scale: object, head_dim: int) -> float:
    """Returns the softmax scale: 1/sqrt(head_dim) when None, else a positive finite float."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value
