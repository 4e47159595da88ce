"""The public attention() and attention_varlen(): their arguments checked, the configs resolved, then the launch —
directly for eager calls (EagerAttention), through the custom op (fa2tune.api.ops) when torch.compile or a
tracing mode runs the call. FlashAttnFunction is the same for code written against an autograd.Function."""

from __future__ import annotations

import torch

from ..config.inputs import check_flag, check_prefix_len, check_qkv, check_scale, check_varlen, check_window
from ..config.types import KernelConfig, Mask
from ..launch import launcher, short_query
from ..launch.launcher import Packing
from . import ops, selection


def apply_eager(q, k, v, mask: Mask, scale: float, config: KernelConfig | None, packing: Packing | None = None,
                chosen: bool = True):  # fmt: skip
    """(O, logsumexp) through the eager autograd path (launcher.EagerAttention), the configs the caller left out
    resolved as attention() resolves them: the forward's, and the backward's for the backward to come. chosen: as
    _apply's."""
    if config is None:
        configs = selection.for_call(selection.FORWARD_BACKWARD, q, k, v, mask, packing)
    else:
        configs = (config, *selection.for_call(selection.BACKWARD, q, k, v, mask, packing))
    return launcher.EagerAttention.apply(q, k, v, mask, scale, packing, configs, config is not None and chosen)


def _apply(q, k, v, mask: Mask, scale: float, config: KernelConfig | None, packing: Packing | None = None,
           chosen: bool = True):  # fmt: skip
    """The eager path when nothing traces the call, else the custom op (which resolves its configs when it runs,
    never while torch.compile traces). chosen: the caller chose `config` (attention()'s argument): the call runs it
    as given, and one it cannot run is an error; False: it was resolved for the caller (a get_kernel() kernel's), so
    a decode step leaves it for the decode kernels and a call it cannot run (a misaligned tensor for a
    warp-specialized config) falls back, as a call without one does; traced calls (the custom op) alike."""
    if launcher.is_eager(q, k, v):
        if launcher.needs_grad(q, k, v):
            return apply_eager(q, k, v, mask, scale, config, packing, chosen)
        # Nothing to differentiate (inference, torch.no_grad, inputs without grad): the forward alone. The
        # autograd.Function's own host time (14 µs of a trivial one on the development machine) would buy nothing,
        # and a short inference call waits for its host.
        if (config is None or not chosen) and short_query.takes(q, k, v, mask, packing):  # a decode step
            return ops.decode_step(q, k, v, mask, scale, packing)
        fwd = selection.for_call(selection.FORWARD, q, k, v, mask, packing)[0] if config is None else config
        return launcher.checked_forward(q, k, v, mask, scale, fwd, config is not None and chosen, packing)
    return ops.apply_op(q, k, v, mask, scale, config, packing, chosen)


class FlashAttnFunction:
    """`FlashAttnFunction.apply(q, k, v, causal_or_mask, scale, config[, packing])` -> (O, logsumexp), both
    differentiable: the differentiable op behind attention(), for code written against an autograd.Function."""

    @staticmethod
    def apply(q, k, v, mask, scale, config, packing=None):
        if packing is None:
            check_qkv(q, k, v)
        elif isinstance(packing, Packing):
            packing = Packing(*check_varlen(q, k, v, packing.cu_seqlens_q, packing.cu_seqlens_k,
                                            packing.max_seqlen_q, packing.max_seqlen_k))  # fmt: skip
        else:
            raise TypeError(
                f"packing must be a fa2tune.launch.launcher.Packing or None, got {type(packing).__name__}"
            )
        if isinstance(mask, Mask):  # checked as attention() checks its parts
            mask = Mask(causal=check_flag("causal", mask.causal), window=check_window(mask.window),
                        prefix_len=check_prefix_len(mask.prefix_len))  # fmt: skip
        elif isinstance(mask, bool):
            mask = Mask(causal=mask)
        else:
            raise TypeError(f"mask must be True or False (causal) or a fa2tune.Mask, got {mask!r}")
        return _apply(q, k, v, mask, check_scale(scale, q.shape[-1]), _check_config(config), packing)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    prefix_len: int = 0,
    return_lse: bool = False,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q·kᵀ·scale)·v by FlashAttention-2, in scaled_dot_product_attention's layout but not
    its signature: fa2tune.scaled_dot_product_attention and fa2tune.flash_attn_func take those calls as they are.

    Args:
        q: (batch, heads_q, seqlen_q, head_dim), float16/bfloat16/float32, unit stride in head_dim. Sizes alone
            cannot tell this from flash_attn's (batch, seqlen, heads, head_dim): such a tensor gives a wrong result
            whenever its shapes happen to fit; pass its .transpose(1, 2), or call fa2tune.flash_attn_func.
        k, v: (batch, heads_kv, seqlen_k, head_dim), same dtype and device; heads_q % heads_kv == 0 (GQA/MQA).
            v's head dim may be its own (1..256; MLA-style models: 192 for q and k, 128 for v).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned, as FlashAttention-2);
            a query that sees no key gets an output of 0 and a logsumexp of -inf.
        scale: softmax scale, default 1/sqrt(head_dim).
        window: (left, right), FlashAttention-2's window_size: query i sees keys i' - left <= j <= i' + right,
            i' = i + seqlen_k - seqlen_q; -1 leaves a side unbounded; with causal, right is 0.
        prefix_len: prefix-LM: keys [0, prefix_len) are visible to every query, causal after them (implies
            causal; combines with a left window).
        return_lse: also return the fp32 logsumexp (batch, heads_q, seqlen_q) of the scaled scores; it is
            differentiable too (a loss may use it, e.g. to merge attention over chunks of keys).
        config: forward block sizes, warps and stages; default: the tuned or the planner's pick.

    Returns:
        O with q's shape (v's head dim) and dtype; with return_lse, (O, lse). Differentiable in q, k and v.
    """
    check_qkv(q, k, v)
    return checked_apply(q, k, v, causal, scale, window, prefix_len, return_lse, config, None)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    prefix_len: int = 0,
    return_lse: bool = False,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences, as FlashAttention-2's flash_attn_varlen_func: nothing attends across a
    sequence boundary, and no padding is computed.

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); v's head dim may be its own.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative lengths starting at 0, on q's device: sequence b
            is rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k/v.
        max_seqlen_q, max_seqlen_k: the longest sequence of each (they size the launch grid).
        causal, scale, window, prefix_len: as attention(), per sequence (bottom-right aligned within it).
        return_lse: also return the fp32 logsumexp, (heads_q, total_q) as FlashAttention-2 returns it.

    Returns:
        O (total_q, heads_q, v's head_dim) in q's dtype; with return_lse, (O, lse). Differentiable in q, k and v.
    """
    packing = Packing(*check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return checked_apply(q, k, v, causal, scale, window, prefix_len, return_lse, config, packing)


def checked_apply(q, k, v, causal, scale, window, prefix_len, return_lse, config, packing, chosen=True):
    """The keyword arguments attention() and attention_varlen() share, checked; then the differentiable op (chosen:
    as _apply's)."""
    mask = _mask(causal, window, prefix_len)
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    o, lse = _apply(q, k, v, mask, scale, _check_config(config), packing, chosen)
    return (o, lse) if return_lse else o


def _check_config(config: object) -> KernelConfig | None:
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a fa2tune.KernelConfig or None, got {type(config).__name__}")
    return config


# The masks of most calls, built once: checking the arguments and building a Mask costs 2 µs, and a kept mask
# compares by identity in the lookups of the call's configs and plan.
_PLAIN_MASKS = {False: Mask(causal=False), True: Mask(causal=True)}


def _mask(causal: object, window: object, prefix_len: object, window_name: str = "window") -> Mask:
    """attention()'s mask arguments, checked, as a Mask; window_name: the window's argument as the caller's API
    spells it (flash_attn's window_size)."""
    if window is None and type(prefix_len) is int and prefix_len == 0 and type(causal) is bool:
        return _PLAIN_MASKS[causal]
    return Mask(causal=check_flag("causal", causal), window=check_window(window, window_name),
                prefix_len=check_prefix_len(prefix_len))  # fmt: skip
