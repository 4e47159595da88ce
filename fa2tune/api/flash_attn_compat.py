"""flash_attn_func() and flash_attn_varlen_func(): FlashAttention-2's (flash_attn 2.x) calls, layouts and return
conventions on fa2tune's kernels, for code written against flash_attn."""

from __future__ import annotations

import numbers
import warnings

import torch

from ..config.inputs import check_flag, check_qkv, check_scale, check_varlen, unit_last_stride
from ..config.types import Mask
from ..launch import launcher
from ..launch.launcher import Packing
from . import selection
from .attention import _apply, _mask


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """flash_attn.flash_attn_func's signature and results, on fa2tune's kernels.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim) — flash_attn's layout, not SDPA's; float16/bfloat16 (float32 too).
        k, v: (batch, seqlen_k, heads_kv, head_dim); heads_kv divides heads_q (MQA/GQA). v's head dim may be its
            own (as flash_attn 3's hdim_v: MLA's 192/128); out then has it.
        dropout_p: must be 0.0 (NotImplementedError: fa2tune has no dropout).
        softmax_scale: default 1/sqrt(head_dim).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned, as flash_attn's and
            fa2tune.attention's); a query that sees no key gets 0.
        window_size: (left, right), -1 = unbounded: keys i' - left <= j <= i' + right, i' = i + seqlen_k - seqlen_q.
        softcap, alibi_slopes: must be 0.0 and None (NotImplementedError).
        deterministic: the backward adds every sum in one fixed order. fa2tune's backward is deterministic except
            for configs that fuse dQ into the dK/dV kernel (Hopper); True runs such a config's dQ-kernel twin.
            Under torch.compile it holds only with torch.use_deterministic_algorithms(True) (warned otherwise).
        return_attn_probs: also return the logsumexp: (out, softmax_lse, None). softmax_lse is fp32
            (batch, heads_q, seqlen_q), as flash_attn's; fa2tune never forms the probabilities, so S_dmask is None.

    Returns:
        out (batch, seqlen_q, heads_q, v's head_dim), contiguous, in q's dtype; differentiable in q, k and v.
    """
    _refuse_unsupported(dropout_p, softcap, alibi_slopes)
    _check_flash_layout(q, k, v)
    q_t, k_t, v_t = (unit_last_stride(t).transpose(1, 2) for t in (q, k, v))  # SDPA's layout, read in place
    check_qkv(q_t, k_t, v_t)
    out, lse = _attend(q_t, k_t, v_t, causal, window_size, softmax_scale, None, deterministic)
    out = out.transpose(1, 2).contiguous()  # flash_attn's out is contiguous in its own layout
    return (out, lse, None) if check_flag("return_attn_probs", return_attn_probs) else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
):
    """flash_attn.flash_attn_varlen_func's signature and results, on fa2tune's kernels (fa2tune.attention_varlen).

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); v's head dim may be its own.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative sequence lengths, on q's device.
        max_seqlen_q, max_seqlen_k: the longest sequence of each.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic: as flash_attn_func,
            per sequence.
        return_attn_probs: (out, softmax_lse, None); softmax_lse fp32 (heads_q, total_q), as flash_attn 2.x's.
        block_table: must be None (NotImplementedError: a paged KV cache is flash_attn_with_kvcache's).

    Returns:
        out (total_q, heads_q, v's head_dim) in q's dtype; differentiable in q, k and v.
    """
    _refuse_unsupported(dropout_p, softcap, alibi_slopes)
    if block_table is not None:
        raise NotImplementedError(
            "block_table: fa2tune's flash_attn_varlen_func takes no paged KV cache; pass block_table=None, or decode "
            "over a paged cache with fa2tune.flash_attn_with_kvcache"
        )
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    packing = Packing(*check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    out, lse = _attend(q, k, v, causal, window_size, softmax_scale, packing, deterministic)
    return (out, lse, None) if check_flag("return_attn_probs", return_attn_probs) else out


def _refuse_unsupported(dropout_p: object, softcap: object, alibi_slopes: object) -> None:
    """NotImplementedError naming each flash_attn argument fa2tune has no kernel for, unless left at its default."""
    for name, value in (("dropout_p", dropout_p), ("softcap", softcap)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if value != 0:
            raise NotImplementedError(f"{name}={value}: fa2tune has no {name} support; pass {name}=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: fa2tune has no ALiBi bias; pass alibi_slopes=None")


def _check_flash_layout(q: object, k: object, v: object) -> None:
    """The shape rules of flash_attn's (batch, seqlen, heads, head_dim) layout, in its terms; check_qkv then checks
    dtypes, devices and strides of the transposed tensors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim) as in flash_attn_func, got shape {tuple(t.shape)}"
            )
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "q, k, v must share batch, and k, v their (seqlen, heads), in flash_attn's (batch, seqlen, heads, "
            f"head_dim) layout; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[2] == 0 and q.shape[2] != 0:
        raise ValueError(f"k and v must have at least one head (dim 2), got k {tuple(k.shape)}")
    if k.shape[2] != 0 and q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"q's heads (dim 2) must be a multiple of k/v's heads (MQA/GQA), got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}; flash_attn_func takes (batch, seqlen, heads, head_dim): for SDPA's (batch, heads, "
            "seqlen, head_dim) use fa2tune.attention or fa2tune.scaled_dot_product_attention"
        )


def _attend(q, k, v, causal, window_size, softmax_scale, packing: Packing | None, deterministic):
    """(O, logsumexp) for checked tensors: attention()'s differentiable op, or with deterministic=True its eager
    path with the backward's configs chosen as torch.use_deterministic_algorithms(True) chooses them."""
    # flash_attn's "no window" default as attention()'s None, whose mask is kept once (attention._mask)
    unbounded = isinstance(window_size, (tuple, list)) and tuple(window_size) == (-1, -1)
    mask = _mask(causal, None if unbounded else window_size, 0, "window_size")
    scale = check_scale(softmax_scale, q.shape[-1], "softmax_scale")
    if not check_flag("deterministic", deterministic) or not launcher.needs_grad(q, k, v):
        return _apply(q, k, v, mask, scale, None, packing)
    if launcher.is_eager(q, k, v):
        configs = _deterministic_configs(q, k, v, mask, packing)
        return launcher.EagerAttention.apply(q, k, v, mask, scale, packing, configs, False)
    if not torch.are_deterministic_algorithms_enabled():
        warnings.warn(
            "fa2tune: deterministic=True under torch.compile or tracing holds only with "
            "torch.use_deterministic_algorithms(True); without it a Hopper config may fuse dQ into the dK/dV "
            "kernel, whose dQ varies in its last bits from run to run",
            RuntimeWarning,
            stacklevel=3,
        )
    return _apply(q, k, v, mask, scale, None, packing)


def _deterministic_configs(q, k, v, mask: Mask, packing: Packing | None) -> tuple:
    """The call's (forward, dK/dV, dQ) configs with dQ never fused into the dK/dV kernel: the fused kernel adds dQ
    by TMA reductions in arrival order, its twin with a dQ kernel in one order (launch.fallback.deterministic)."""
    fwd, dkdv, dq = selection.for_call(selection.FORWARD_BACKWARD, q, k, v, mask, packing)
    return fwd, dkdv.without_fused_dq() if dkdv.fused_dq else dkdv, dq
