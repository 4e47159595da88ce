"""attention()'s forward over a few query tokens on the decode kernels: a generation step (one new token against the
keys so far, as a Hugging Face model's attention sees it without a KV-cache API) is a decode step.

The forward kernels give each (batch, query head) programs of 64–128 query rows: with one query token a program
computes one row in 64, and a K/V head's tiles are read once per query head of its group. The decode kernels
(fa2tune.launch.decode) pack the query heads of a K/V head into one tile (GQA packing) and split the keys over
programs when too few would run, reading each K/V tile once per K/V head (docs/PERF.md, "Decode": 0.92–0.99× cuDNN's
K/V bandwidth where the forward kernel reads 0.1–0.3×). attention()'s K and V are read in place, as a cache of one
entry a batch row that holds every key.
"""

from __future__ import annotations

import torch

from ..config.decode_plan import SHORT_QUERY_TOKENS
from ..config.kvcache_inputs import KVCache
from ..config.types import Mask
from .decode import Resolve, decode


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> bool:
    """Whether a forward-only attention() call of SDPA's layout (batch, heads, seqlen, head_dim) runs on the decode
    kernels: at most SHORT_QUERY_TOKENS query tokens, V's head dim Q's (a cache holds one), no prefix (the decode
    kernels take causal and windowed masks)."""
    return q.shape[2] <= SHORT_QUERY_TOKENS and v.shape[-1] == q.shape[-1] and mask.prefix_len == 0


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
