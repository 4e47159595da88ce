"""Launchers for the generated kernels, the autograd Function, and the public attention() entry point.

Importing fa2tune does not import triton: the kernels' modules are rendered and imported on first use, so a
program (or `fa2tune --device cpu`) can still choose Triton's interpreter (TRITON_INTERPRET=1) after importing us.

The launchers are registered as torch custom ops (fa2tune::fwd, fa2tune::bwd) with fake implementations, so
torch.compile sees two opaque ops with known output shapes instead of tracing into Triton launches.
"""

from __future__ import annotations

import contextlib

import torch

from . import codegen, planner, selection
from .inputs import check_flag, check_qkv, check_scale, interpreting
from .types import KernelConfig, Variant

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels run the softmax on exp2


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products ("ieee"), as a user asking for fp32 expects; Triton would use tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel(template: str, name: str, causal: bool, seqlen_q: int, seqlen_k: int, config: KernelConfig):
    variant = Variant(
        causal=causal,
        even_m=seqlen_q % config.block_m == 0,
        even_n=seqlen_k % config.block_n == 0,
        dot_fp32=interpreting(),
    )
    return getattr(codegen.load(template, variant), name)


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' own (cuda:1 inputs, current device 0)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _config(config: KernelConfig | None, kernel: str, q: torch.Tensor, causal: bool) -> KernelConfig:
    if config is not None:
        return config
    return selection.resolve(kernel, q.shape[-1], q.dtype, causal, q.device)[0]


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
    config = _config(config, "fwd", q, causal)
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    kernel = _kernel("fwd", "_attn_fwd", causal, seqlen_q, seqlen_k, config)
    grid = (_cdiv(seqlen_q, config.block_m) * batch * heads_q,)
    with _on_device(q):
        _launch_fwd(kernel, grid, q, k, v, o, lse, heads_q, heads_kv, seqlen_q, seqlen_k, scale, head_dim, config)
    return o, lse


def _launch_fwd(kernel, grid, q, k, v, o, lse, heads_q, heads_kv, seqlen_q, seqlen_k, scale, head_dim, config):
    kernel[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, scale * LOG2E,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=planner.head_dim_padded(head_dim),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, INPUT_PRECISION=_input_precision(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dkdv_config: KernelConfig | None = None,
    dq_config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of O = attention(q, k, v) given dO, recomputing S and P from the saved logsumexp.

    Returns:
        (dq, dk, dv), contiguous, with the shapes and dtypes of q, k, v; dk/dv summed over the query heads that
        share each K/V head (GQA).
    """
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if do.stride(-1) != 1:
        do = do.contiguous()  # e.g. the stride-0 gradient of out.sum()
    dkdv_config = _config(dkdv_config, "bwd_dkdv", q, causal)
    dq_config = _config(dq_config, "bwd_dq", q, causal)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty_like(lse)

    with _on_device(q):
        _launch_bwd(q, k, v, o, lse, do, dq, dk, dv, delta, causal, scale, dkdv_config, dq_config)
    return dq, dk, dv


def _launch_bwd(q, k, v, o, lse, do, dq, dk, dv, delta, causal, scale, dkdv_config, dq_config):
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=planner.head_dim_padded(head_dim))
    precision = _input_precision(q.dtype)
    pre = _kernel("bwd", "_attn_bwd_preprocess", causal, seqlen_q, seqlen_k, dq_config)
    pre[(_cdiv(seqlen_q, dq_config.block_m) * batch * heads_q,)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        heads_q, seqlen_q, **common, BLOCK_M=dq_config.block_m,
    )  # fmt: skip
    strides = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
    )  # fmt: skip
    sizes = (heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, scale, scale * LOG2E)

    dkdv = _kernel("bwd", "_attn_bwd_dkdv", causal, seqlen_q, seqlen_k, dkdv_config)
    dkdv[(_cdiv(seqlen_k, dkdv_config.block_n) * batch * heads_kv,)](
        q, k, v, do, lse, delta, dk, dv, *strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), *sizes,
        **common, BLOCK_M=dkdv_config.block_m, BLOCK_N=dkdv_config.block_n, INPUT_PRECISION=precision,
        num_warps=dkdv_config.num_warps, num_stages=dkdv_config.num_stages,
    )  # fmt: skip
    dq_kernel = _kernel("bwd", "_attn_bwd_dq", causal, seqlen_q, seqlen_k, dq_config)
    dq_kernel[(_cdiv(seqlen_q, dq_config.block_m) * batch * heads_q,)](
        q, k, v, do, lse, delta, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2), *sizes,
        **common, BLOCK_M=dq_config.block_m, BLOCK_N=dq_config.block_n, INPUT_PRECISION=precision,
        num_warps=dq_config.num_warps, num_stages=dq_config.num_stages,
    )  # fmt: skip


# ---- torch custom ops: what torch.compile sees -------------------------------------------------------------
# Configs cross the op boundary as plain int lists (custom-op schemas take no dataclasses).


def _to_ints(config: KernelConfig) -> list[int]:
    return [config.block_m, config.block_n, config.num_warps, config.num_stages]


def _from_ints(config: list[int]) -> KernelConfig | None:
    # [] means "resolve inside the op": the store lookup (file I/O) then runs at call time, never while
    # torch.compile traces the caller.
    return KernelConfig(*config) if config else None


@torch.library.custom_op("fa2tune::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, config: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, causal=causal, scale=scale, config=_from_ints(config))


@_fwd_op.register_fake
def _fwd_fake(q, k, v, causal, scale, config):
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op("fa2tune::bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    dkdv_config: list[int],
    dq_config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(
        do, q, k, v, o, lse, causal=causal, scale=scale,
        dkdv_config=_from_ints(dkdv_config), dq_config=_from_ints(dq_config),
    )  # fmt: skip


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, o, lse, causal, scale, dkdv_config, dq_config):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


class FlashAttnFunction(torch.autograd.Function):
    """Autograd wrapper: the forward saves O and the logsumexp (O(N) memory); the backward recomputes S and P."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, config):
        o, lse = torch.ops.fa2tune.fwd(q, k, v, causal, scale, _to_ints(config) if config is not None else [])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.fa2tune.bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, [], [])
        return dq, dk, dv, None, None, None


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
    """Exact attention softmax(q·kᵀ·scale)·v by FlashAttention-2: a drop-in for scaled_dot_product_attention.

    Args:
        q: (batch, heads_q, seqlen_q, head_dim), float16/bfloat16/float32, unit stride in head_dim.
        k, v: (batch, heads_kv, seqlen_k, head_dim), same dtype and device; heads_q % heads_kv == 0 (GQA/MQA).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned, as FlashAttention-2);
            a query that sees no key gets an output of 0 and a logsumexp of -inf.
        scale: softmax scale, default 1/sqrt(head_dim).
        return_lse: also return the fp32 logsumexp (batch, heads_q, seqlen_q) of the scaled scores.
        config: forward block sizes, warps and stages; default: the planner's pick.

    Returns:
        O with q's shape and dtype; with return_lse, (O, lse). Differentiable in q, k and v.
    """
    check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a fa2tune.KernelConfig or None, got {type(config).__name__}")
    o, lse = FlashAttnFunction.apply(q, k, v, causal, scale, config)
    return (o, lse) if return_lse else o
