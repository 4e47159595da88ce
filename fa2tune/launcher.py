"""Launchers for the generated kernels, the autograd Function, and the public attention() entry point.

Importing fa2tune does not import triton: the kernels' modules are rendered and imported on first use, so a
program (or `fa2tune --device cpu`) can still choose Triton's interpreter (TRITON_INTERPRET=1) after importing us.
"""

from __future__ import annotations

import torch

from . import codegen, planner
from .inputs import _interpreting, check_flag, check_qkv, check_scale
from .types import FwdVariant, KernelConfig

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels run the softmax on exp2


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products ("ieee"), as a user asking for fp32 expects; Triton would use tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the forward kernel on validated inputs (see inputs.check_qkv).

    Args:
        out: optional preallocated output like q (any strides with a unit last stride); written in place.

    Returns:
        O with q's shape and dtype, and the fp32 logsumexp (batch, heads_q, seqlen_q) in natural log.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    interpret = _interpreting()
    if config is None:
        config = planner.default_config(head_dim, q.dtype, causal=causal, kernel="fwd", interpret=interpret)
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    variant = FwdVariant(
        causal=causal,
        even_m=seqlen_q % config.block_m == 0,
        even_n=seqlen_k % config.block_n == 0,
        dot_fp32=interpret,
    )
    kernel = codegen.load("fwd", variant)._attn_fwd
    grid = (-(-seqlen_q // config.block_m) * batch * heads_q,)  # ceil(N_q / B_r) tiles per (batch, head)
    kernel[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, scale * LOG2E,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=planner.head_dim_padded(head_dim),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        INPUT_PRECISION=_input_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return o, lse


class FlashAttnFunction(torch.autograd.Function):
    """Autograd wrapper: the forward saves O and the logsumexp; the backward recomputes S and P from them."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, config):
        o, lse = forward(q, k, v, causal=causal, scale=scale, config=config)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        raise NotImplementedError(
            "fa2tune.attention has no backward yet (issue 3); call it under torch.no_grad() or use "
            "torch.nn.functional.scaled_dot_product_attention for training"
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q·kᵀ·scale)·v with FlashAttention-2, a drop-in for scaled_dot_product_attention.

    Args:
        q: (batch, heads_q, seqlen_q, head_dim), float16/bfloat16/float32, unit stride in head_dim.
        k, v: (batch, heads_kv, seqlen_k, head_dim), same dtype and device; heads_q % heads_kv == 0 (GQA/MQA).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned, as FlashAttention-2);
            a query that sees no key gets an output of 0 and a logsumexp of -inf.
        scale: softmax scale, default 1/sqrt(head_dim).
        return_lse: also return the fp32 logsumexp (batch, heads_q, seqlen_q) of the scaled scores.
        config: block sizes, warps and stages to launch with; default: the planner's pick.

    Returns:
        O with q's shape and dtype; with return_lse, (O, lse).
    """
    check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a fa2tune.KernelConfig or None, got {type(config).__name__}")
    o, lse = FlashAttnFunction.apply(q, k, v, causal, scale, config)
    return (o, lse) if return_lse else o
