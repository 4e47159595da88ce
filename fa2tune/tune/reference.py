"""The oracle: standard attention, and the seed's tiled FlashAttention-2 algorithm, in plain torch.

Both run in whatever dtype they are given (float64 for checking kernels) and share the kernels' conventions:
SDPA's layout, GQA by head groups, causal aligned bottom-right (query i sees keys j <= i + N_k - N_q), and a
query that sees no key gets output 0 and logsumexp -inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def causal_visible(seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask: True where query i may see key j (j <= i + seqlen_k - seqlen_q)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def band_visible(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    prefix_len: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask of fa2tune.config.types.Mask, written out directly from its definition:
    query i (aligned position i' = i + seqlen_k - seqlen_q) sees key j when j < prefix_len or
    i' - left <= j <= i' + right, with -1 unbounded and a right bound of 0 under causal or a prefix."""
    aligned = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    left, right = window
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= cols >= aligned - left
    if causal or prefix_len > 0:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        visible &= cols <= aligned + right
    return visible | (cols < prefix_len)


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if q.dim() < 3:
        return t  # one head, no head axis
    group = q.shape[-3] // t.shape[-3]
    return t.repeat_interleave(group, dim=-3) if group > 1 else t


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    prefix_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard attention: S = q kᵀ·scale, P = softmax(S), O = P v, materialising the N_q × N_k matrix.

    Args:
        q: (..., heads_q, N_q, d); k, v: (..., heads_kv, N_k, d) with heads_q % heads_kv == 0; or one head (N, d).
        causal, window, prefix_len: the mask, as fa2tune.attention (band_visible).

    Returns:
        (O, lse): O like q with v's head dim; lse (..., heads_q, N_q) = logsumexp of each row of S.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal or window != (-1, -1) or prefix_len > 0:
        visible = band_visible(
            q.shape[-2], k.shape[-2], causal=causal, window=window, prefix_len=prefix_len, device=q.device
        )
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # rows with no key: all zeros
    return p @ v, lse


@dataclass(frozen=True)
class InnerStep:
    """One inner step (i, j) of the seed's algorithm, with the statistics after the update (0-based i, j)."""

    i: int
    j: int
    s: torch.Tensor  # S_ij = Q_i K_jᵀ (masked entries -inf)
    m_local: torch.Tensor  # m_ij = rowmax(S_ij)
    p: torch.Tensor  # P̃_ij = exp(S_ij - m_ij)
    l_local: torch.Tensor  # ℓ_ij = rowsum(P̃_ij)
    m: torch.Tensor  # running m_i after the update
    l: torch.Tensor  # noqa: E741 — running ℓ_i after the update, the seed's name
    o: torch.Tensor  # running unnormalised Õ_i after the update


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_r: int,
    block_c: int,
    causal: bool = False,
    scale: float | None = None,
    trace: list[InnerStep] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's FlashAttention-2 forward for one head: Q in B_r-row tiles, K/V in B_c-row tiles, online softmax.

    Args:
        q: (N_q, d); k, v: (N_k, d).
        block_r, block_c: B_r and B_c.
        causal: skip K tiles wholly in the future (the loop bound), mask the tiles that straddle the diagonal.
        scale: multiplies S; default 1/sqrt(d) (the seed's worked example uses 1.0).
        trace: if given, every inner step is appended to it.

    Returns:
        (O, lse) for this head: O (N_q, d), lse (N_q,).
    """
    if q.dim() != 2 or k.dim() != 2 or v.dim() != 2:
        raise ValueError(f"tiled_attention takes one head: q, k, v must be 2-D, got {q.dim()}, {k.dim()}, {v.dim()}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n_q, n_k = q.shape[0], k.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty(n_q, dtype=q.dtype, device=q.device)
    neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    for i, r0 in enumerate(range(0, n_q, block_r)):
        r1 = min(r0 + block_r, n_q)
        q_i = q[r0:r1]
        m_i = torch.full((r1 - r0,), float("-inf"), dtype=q.dtype, device=q.device)
        l_i = torch.zeros(r1 - r0, dtype=q.dtype, device=q.device)
        o_i = torch.zeros(r1 - r0, q.shape[1], dtype=q.dtype, device=q.device)
        # Option B: keys beyond what the tile's last row may see are never visited.
        hi = max(0, min(n_k, r1 + n_k - n_q)) if causal else n_k
        for j, c0 in enumerate(range(0, hi, block_c)):
            c1 = min(c0 + block_c, n_k)
            s_ij = (q_i @ k[c0:c1].T) * scale
            if causal:
                s_ij = torch.where(causal_visible(n_q, n_k, q.device)[r0:r1, c0:c1], s_ij, neg_inf)
            m_ij = s_ij.max(dim=1).values
            m_ij_safe = torch.where(torch.isinf(m_ij), 0.0, m_ij)  # a row with no visible key in this tile
            p_ij = torch.exp(s_ij - m_ij_safe[:, None])
            l_ij = p_ij.sum(dim=1)
            m_new = torch.maximum(m_i, m_ij)
            m_new_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            old_scale = torch.exp(m_i - m_new_safe)  # e^(m_old - m_new)
            new_scale = torch.exp(m_ij - m_new_safe)  # e^(m_ij - m_new)
            l_i = old_scale * l_i + new_scale * l_ij
            o_i = old_scale[:, None] * o_i + new_scale[:, None] * (p_ij @ v[c0:c1])
            m_i = m_new
            if trace is not None:
                trace.append(InnerStep(i, j, s_ij, m_ij, p_ij, l_ij, m_i.clone(), l_i.clone(), o_i.clone()))
        seen = l_i > 0
        out[r0:r1] = o_i / torch.where(seen, l_i, 1.0)[:, None]
        lse[r0:r1] = torch.where(seen, m_i + torch.log(torch.where(seen, l_i, 1.0)), neg_inf)
    return out, lse


def tiled_attention_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_r: int,
    block_c: int,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """tiled_attention over every (batch, head) of SDPA-layout tensors, GQA included."""
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            out[b, h], lse[b, h] = tiled_attention(
                q[b, h], k[b, h], v[b, h], block_r=block_r, block_c=block_c, causal=causal, scale=scale
            )
    return out, lse


def naive_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    **mask,
) -> tuple[torch.Tensor, torch.Tensor]:
    """naive_attention on each packed sequence alone: q (total_q, H, d), k/v (total_k, H_kv, d) (v's d may be its
    own).

    Returns (O (total_q, H, v's d), lse (H, total_q)), FlashAttention-2's varlen layout.
    """
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype, device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
        if q1 == q0:
            continue
        o_b, lse_b = naive_attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1), **mask
        )
        out[q0:q1] = o_b.transpose(0, 1)
        lse[:, q0:q1] = lse_b
    return out, lse
