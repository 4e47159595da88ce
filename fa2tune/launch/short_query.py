"""attention()'s forward over a few query tokens on the decode kernels: a generation step (one new token against the
keys so far, as a Hugging Face model's attention sees it without a KV-cache API) is a decode step.

The forward kernels give each (batch, query head) programs of 64–128 query rows: with one query token a program
computes one row in 64, and a K/V head's tiles are read once per query head of its group. The decode kernels
(fa2tune.launch.decode) pack the query heads of a K/V head into one tile (GQA packing) and split the keys over
programs when too few would run, reading each K/V tile once per K/V head (docs/PERF.md, "Decode": 0.92–0.99× cuDNN's
K/V bandwidth where the forward kernel reads 0.1–0.3×). attention()'s K and V are read in place, as a cache of one
entry a batch row that holds every key; attention_varlen()'s packed K and V (a padded batch unpadded, as the Hugging
Face integration passes a generation step) as a paged cache of one-key pages, each sequence's pages its rows.
"""

from __future__ import annotations

import torch

from ..config.decode_plan import SHORT_QUERY_TOKENS
from ..config.inputs import check_offsets
from ..config.kvcache_inputs import KVCache
from ..config.types import Mask
from .decode import Resolve, decode
from .layout import Packing


def few_tokens(tokens: int, head_dim: int, head_dim_v: int) -> bool:
    """Whether a forward-only call of `tokens` query tokens a sequence is a decode step: at most SHORT_QUERY_TOKENS,
    and V's head dim Q's (a cache holds one)."""
    return tokens <= SHORT_QUERY_TOKENS and head_dim_v == head_dim


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, packing: Packing | None = None) -> bool:
    """Whether a forward-only call runs on the decode kernels: few_tokens — in SDPA's layout (batch, heads, seqlen,
    head_dim), or packed with every sequence as many (total_q = batch · max_seqlen_q: no sequence is longer than
    max_seqlen_q, so each is that long) —, no prefix (the decode kernels take causal and windowed masks)."""
    if mask.prefix_len != 0:
        return False
    if packing is None:
        return few_tokens(q.shape[2], q.shape[-1], v.shape[-1])
    tokens = packing.max_seqlen_q
    return 0 < tokens and few_tokens(tokens, q.shape[-1], v.shape[-1]) and q.shape[0] == packing.batch * tokens


def one_key_table(starts: torch.Tensor, width: int, pages: torch.Tensor | None = None) -> torch.Tensor:
    """The int32 (len(starts), max(width, 1)) block table of a cache of one-key pages, made on the device: sequence
    b's key j is page starts[b] + j, or with `pages` (the page of each packed key) pages[starts[b] + j]. Entries
    past a sequence's keys are never read (its cache_seqlens); with `pages` they repeat its last page, so that the
    lookup stays inside `pages`."""
    index = starts[:, None].long() + torch.arange(max(width, 1), device=starts.device)
    if pages is not None:
        index = pages[index.clamp_(max=max(pages.numel() - 1, 0))]
    return index.to(torch.int32)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float,
            resolve: Resolve | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O, logsumexp) of attention(q, k, v) for a call `takes` admits: O (batch, heads, seqlen_q, head_dim)
    contiguous, the fp32 logsumexp (batch, heads, seqlen_q), as the forward kernels give them. resolve: the decode
    config of a call signature seen first (None: decode_plan.default_config)."""
    cache = KVCache(k_cache=k.transpose(1, 2), v_cache=v.transpose(1, 2), block_table=None, cache_seqlens=None,
                    seqlen=k.shape[2])  # fmt: skip
    left, right, _ = mask.bounds(q.shape[2], k.shape[2])
    out, lse = decode(q.transpose(1, 2), cache, scale=scale, window=(left, right), resolve=resolve)
    if q.shape[2] == 1:  # (batch, 1, heads, d) holds its values in (batch, heads, 1, d)'s order: a view, no copy
        return out.view(q.shape), lse
    return out.transpose(1, 2).contiguous(), lse


def forward_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float, packing: Packing,
                   resolve: Resolve | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O, logsumexp) of attention_varlen for a packed call `takes` admits: O (total_q, heads, head_dim), the fp32
    logsumexp (heads, total_q), as the varlen forward gives them. The offsets are checked on the host as that
    forward checks them (once per offsets tensor); sequence b's keys, rows cu_seqlens_k[b] … of k and v, are its
    pages of one key, found through a block table made on the device."""
    check_offsets(packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q, packing.max_seqlen_k,
                  q.shape[0], k.shape[0])  # fmt: skip
    batch, tokens = packing.batch, packing.max_seqlen_q
    starts, ends = packing.cu_seqlens_k[:-1], packing.cu_seqlens_k[1:]
    table = one_key_table(starts, packing.max_seqlen_k)
    cache = KVCache(k_cache=k.unsqueeze(1), v_cache=v.unsqueeze(1), block_table=table,
                    cache_seqlens=(ends - starts).to(torch.int32), seqlen=packing.max_seqlen_k)  # fmt: skip
    left, right, _ = mask.bounds(tokens, packing.max_seqlen_k)
    out, lse = decode(q.view(batch, tokens, *q.shape[1:]), cache, scale=scale, window=(left, right),
                      resolve=resolve)  # fmt: skip
    # contiguous: with one token a sequence the reshape is a transposed view, and a backward reads a packed
    # logsumexp with unit token stride (layout.lse_strides), as the op's fake promises
    return out.view(q.shape), lse.permute(1, 0, 2).reshape(q.shape[1], q.shape[0]).contiguous()
