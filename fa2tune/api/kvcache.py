"""flash_attn_with_kvcache(): FlashAttention's decoding call — attention of a few query tokens over a KV cache,
contiguous or paged, with an optional append of new keys — on fa2tune's decode kernels (fa2tune.launch.decode), and
check_kvcache(), the host-side check of a call's lengths and block table.

Eager calls launch the kernels directly; under torch.compile or a tracing mode the call goes through the custom op
fa2tune::kvcache (which declares that it writes k_cache and v_cache), so a compiled graph keeps the append in order.
"""

from __future__ import annotations

import numbers

import torch

from ..config.inputs import check_flag, check_scale, check_window, unit_last_stride
from ..config.kvcache_inputs import (
    KVCache,
    check_call,
    check_splits,
    check_unshared,
    check_values,
    check_writable,
    values_checked_per_call,
)
from ..config.types import Mask
from ..launch import launcher
from .selection import decode_config


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """flash_attn.flash_attn_with_kvcache's arguments (in flash_attn 2.x's order), layouts and results.

    Args:
        q: (batch, seqlen_q, heads, head_dim), float16/bfloat16 (float32 too); head_dim 1..256.
        k_cache, v_cache: (batch_cache >= batch, seqlen_cache, kv_heads, head_dim), entry b in row b; or, with a
            block_table, paged: (num_pages, page_size, kv_heads, head_dim). kv_heads divides heads (GQA/MQA). A
            unit last stride; written in place when k, v are given.
        k, v: (batch, seqlen_new, kv_heads, head_dim) new keys and values, or None: written into the caches at key
            positions cache_seqlens[b] … cache_seqlens[b] + seqlen_new − 1 before the attention, which then sees
            them (needs cache_seqlens).
        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes: must be None; softcap must be 0.0
            (NotImplementedError naming the argument). rotary_interleaved is read only with rotary tables.
        cache_seqlens: int32 (batch,) keys cached per entry before the append, or one int for every entry; None:
            every entry holds the whole cache (seqlen_cache keys, or pages per entry × page_size).
        block_table: int32 (batch, pages per entry): entry b's key j is in page block_table[b, j // page_size].
        softmax_scale: default 1/sqrt(head_dim).
        causal: query i sees keys j <= i + seqlen_k − seqlen_q, seqlen_k = the entry's keys after the append
            (bottom-right aligned, as flash_attn's).
        window_size: (left, right), −1 unbounded: keys i' − left <= j <= i' + right, i' = i + seqlen_k − seqlen_q.
        num_splits: programs sharing an entry's keys (split-KV, merged exactly); 0: the rule of
            fa2tune.config.decode_plan.num_splits, with the parameters of the config the call runs (the tuned entry
            for the GPU, head dim and dtype, else the default: fa2tune.api.selection.resolve_decode); at most
            decode_plan.MAX_SPLITS.
        return_softmax_lse: also return the logsumexp.

    Returns:
        out (batch, seqlen_q, heads, head_dim) contiguous in q's dtype, and with return_softmax_lse the fp32
        softmax_lse (batch, heads, seqlen_q). A query that sees no key (an empty entry) gets 0 and −inf. No gradient
        flows through the result (flash_attn's has no backward either).

    Reads no tensor's values on the host, so it works in CUDA graphs and under torch.compile; the lengths and pages
    are clamped into the caches by the kernels. fa2tune.check_kvcache checks them (a host sync), and so does every
    call with FA2TUNE_CHECK_KVCACHE=1.
    """
    _refuse_unsupported(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                        cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes, softcap=softcap)  # fmt: skip
    check_flag("rotary_interleaved", rotary_interleaved)
    q = unit_last_stride(q)
    cache = check_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    scale = check_scale(softmax_scale, q.shape[-1], "softmax_scale")
    left, right, _ = Mask(causal=check_flag("causal", causal), window=check_window(window_size, "window_size")).bounds(
        q.shape[1], cache.capacity)
    splits = check_splits(num_splits)
    if values_checked_per_call():
        check_values(cache)
    if launcher.is_eager(q, k_cache, v_cache):
        if cache.k_new is not None:
            check_writable(k_cache, v_cache)
        out, lse = launcher.decode(q, cache, scale=scale, window=(left, right), splits=splits, resolve=decode_config)
        if cache.k_new is not None:
            _written_in_place(k_cache, v_cache)
    else:
        out, lse = torch.ops.fa2tune.kvcache(q, cache.k_cache, cache.v_cache, cache.k_new, cache.v_new,
                                             cache.cache_seqlens, cache.block_table, cache.seqlen, scale,
                                             [left, right], splits)  # fmt: skip
    return (out, lse) if check_flag("return_softmax_lse", return_softmax_lse) else out


def check_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> None:
    """Checks a flash_attn_with_kvcache call's tensors and values, raising ValueError/TypeError naming what is
    wrong: its shapes, dtypes and devices (as every call does) and, reading them back to the host (a sync),
    that each entry's cache_seqlens leaves room for the appended keys in the cache and that every page an entry
    uses (the first ⌈(length + seqlen_new) / page_size⌉ of its block_table row) is a page of the cache. Call it
    where a sync costs nothing (tests, a serving loop's admission of a request); flash_attn_with_kvcache does not
    read the values (FA2TUNE_CHECK_KVCACHE=1 makes every call outside a CUDA graph capture check them)."""
    cache = check_call(unit_last_stride(q), k_cache, v_cache, k, v, cache_seqlens, block_table)
    if cache.k_new is not None:
        check_writable(k_cache, v_cache)
    check_values(cache)


def _written_in_place(*caches: torch.Tensor) -> None:
    """Bumps the caches' version counters after an eager append, as an in-place op of PyTorch's does (the custom op
    declares its writes instead): a tensor an earlier op saved for its backward then fails that backward with
    PyTorch's error rather than giving a gradient of values it no longer holds. Inference tensors keep no counter."""
    for cache in caches:
        if not cache.is_inference():
            torch.autograd.graph.increment_version(cache)


def _refuse_unsupported(**arguments: object) -> None:
    """NotImplementedError naming each flash_attn argument fa2tune has no kernel for, unless left at its default
    (None; 0.0 for softcap)."""
    for name, value in arguments.items():
        if name == "softcap":
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"softcap must be a float, got {type(value).__name__}")
            if value != 0:
                raise NotImplementedError(f"softcap={value}: fa2tune has no logit soft-capping; pass softcap=0.0")
        elif value is not None:
            raise NotImplementedError(f"{name}: fa2tune's flash_attn_with_kvcache does not take it; pass {name}=None")


# ---- the custom op: what torch.compile sees ------------------------------------------------------------------


@torch.library.custom_op("fa2tune::kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    seqlen: int,
    scale: float,
    window: list[int],
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if k is not None:  # the eager path checked this and more (check_writable); a dispatch mode's call has not
        check_unshared(k_cache, v_cache)
    cache = KVCache(k_cache, v_cache, block_table, cache_seqlens, seqlen, k, v)
    return launcher.decode(q, cache, scale=scale, window=(window[0], window[1]), splits=num_splits,
                           resolve=decode_config)


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, seqlen, scale, window, num_splits):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
