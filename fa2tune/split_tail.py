"""The split tail of a persistent forward: the tiles of a launch's part-empty last round cut into pieces of their
K/V tiles, so that every program has work to the end, and the merge of the pieces' partial results.

A persistent program walks work units p, p + P, … (templates/fwd_ws.py.jinja). The grid's tile counts are powers of
two against 132 SMs, so the last round is part empty — 2,048 tiles: 15 rounds and 68 tiles, which take a 16th round
while 64 SMs wait — and a launch with a full last round ran 2–3 % faster on the H200 (docs/PERF.md v30: N = 8448,
2,112 tiles, against N = 8192 at d=128). Cut, the launch gained +2.8 % at d=128 N=16k and +1.1 % at d=64 N=4k,
less elsewhere (v30), the pieces' fp32 stores and the merge taking back part of what the cut saves.

The t = tiles mod P tiles after the full rounds are each cut into k pieces of consecutive K/V tiles: k·t pieces over
P programs take ceil(k·t / P) pieces of 1/k of a tile each (plus a piece's own start and end) instead of one whole
tile. Each piece writes O over its keys, normalised, and the
logsumexp of those keys (fp32); `merge` combines a tile's pieces as the softmax over all its keys:

    lse = log Σ_i exp(lse_i),   O = Σ_i exp(lse_i − lse) · O_i

which is exact up to float rounding (FlashDecoding's split-KV merge).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_SPLIT = 4  # pieces a tile: more makes each piece's start and end (a K/V step or so) a larger share
PIECE_OVERHEAD_STEPS = 1.2  # a tile's (or piece's) fixed cost in K/V steps, as fitted to the grid (docs/PERF.md v29)
MIN_PIECE_STEPS = 2  # K/V tiles a piece at least visits
# Tiles shorter than this are not cut: the pieces' stores and the merge (a launch of its own) cost about what the cut
# saves there — at d=128 N=2k (16 steps of 128 keys) a split tail measured 0.9 % slower, at 4k (32) about even,
# at d=64 N=2k +0.9 % (docs/PERF.md v30)
MIN_KV_STEPS = 32


def enabled() -> bool:
    """FA2TUNE_SPLIT_TAIL=0 turns the split tail off (the A/B of docs/PERF.md v30); on otherwise."""
    return os.environ.get("FA2TUNE_SPLIT_TAIL", "1") not in ("", "0")


def plan(tiles: int, programs: int, kv_steps: int) -> tuple[int, int]:
    """(main, split): work units 0 … main − 1 are whole tiles, and each of the tiles − main tiles after them is cut
    into `split` pieces; (tiles, 1) where no cut shortens the launch.

    The launch's length in K/V steps, for `programs` programs over `tiles` tiles of kv_steps steps each (each tile or
    piece also paying PIECE_OVERHEAD_STEPS): full rounds of whole tiles, then ceil(split·t / programs) pieces of
    ~kv_steps / split steps. The split with the shortest launch wins; no split if none is shorter by more than a
    step.

    Args:
        tiles: the launch's tiles (persistent, no mask: its work units).
        programs: the persistent grid's size.
        kv_steps: K/V tiles a tile visits (cdiv(N_K, block_n)).
    """
    tail = tiles % programs
    if tail == 0 or tiles < programs or kv_steps < MIN_KV_STEPS:
        return tiles, 1
    whole = kv_steps + PIECE_OVERHEAD_STEPS  # the last round as it is: one whole tile

    def last_round(split: int) -> float:
        return -(-split * tail // programs) * (kv_steps / split + PIECE_OVERHEAD_STEPS)

    splits = [s for s in range(2, MAX_SPLIT + 1) if kv_steps // s >= MIN_PIECE_STEPS]
    best = min(splits, key=last_round, default=None)
    if best is None or last_round(best) > whole - 1:
        return tiles, 1
    return tiles - tail, best


@triton.jit
def _merge_pieces(PART_O, PART_LSE, OUT, LSE, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, MAIN, SPLIT, n_m,
                  H_Q, N_Q, HEAD_DIM: tl.constexpr, TILE_M: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Program (i, j): rows j·ROWS … of split tile MAIN + i, from its SPLIT pieces (PART_O: [piece, TILE_M,
    HEAD_DIM], PART_LSE: [piece, TILE_M], fp32) into OUT (its dtype, unit last stride) and LSE (fp32)."""
    i = tl.program_id(0)
    tile = MAIN + i
    bh = tile // n_m
    b = bh // H_Q
    h = bh % H_Q
    local = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # rows of the tile
    rows = (tile % n_m) * TILE_M + local  # rows of the sequence
    cols = tl.arange(0, HEAD_DIM)
    first = i * SPLIT
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(SPLIT):
        m = tl.maximum(m, tl.load(PART_LSE + (first + s) * TILE_M + local))
    # every piece sees at least one key of every row (no mask), so m is finite
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for s in range(SPLIT):
        w = tl.exp(tl.load(PART_LSE + (first + s) * TILE_M + local) - m)
        part = tl.load(PART_O + ((first + s) * TILE_M + local)[:, None] * HEAD_DIM + cols[None, :])
        acc += w[:, None] * part
        total += w
    acc = acc / total[:, None]
    seen = rows < N_Q
    o_ptrs = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows.to(tl.int64)[:, None] * stride_om
    tl.store(o_ptrs + cols[None, :], acc.to(OUT.dtype.element_ty), mask=seen[:, None])
    tl.store(LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + rows, m + tl.log(total), mask=seen)


def pieces(tiles: int, main: int, split: int) -> int:
    """How many pieces a launch planned as (main, split) writes."""
    return (tiles - main) * split


def workspace(tiles: int, main: int, split: int, tile_m: int, head_dim: int, device) -> tuple[torch.Tensor, ...]:
    """(PART_O, PART_LSE) for the pieces of a launch: fp32 [pieces, tile_m, head_dim] and [pieces, tile_m]."""
    count = max(1, pieces(tiles, main, split))
    return (torch.empty((count, tile_m, head_dim), device=device, dtype=torch.float32),
            torch.empty((count, tile_m), device=device, dtype=torch.float32))  # fmt: skip


def merge(part_o: torch.Tensor, part_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *, tiles: int, main: int,
          split: int, n_m: int, heads_q: int, seqlen_q: int) -> None:  # fmt: skip
    """Writes the split tiles' rows of o (batch, heads_q, seqlen_q, head_dim) and lse (batch, heads_q, seqlen_q)
    from their pieces (part_o, part_lse as the forward kernel wrote them)."""
    tile_m, head_dim = part_o.shape[1], part_o.shape[2]
    rows = min(32, tile_m)
    _merge_pieces[(tiles - main, tile_m // rows)](
        part_o, part_lse, o, lse, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), main, split,
        n_m, heads_q, seqlen_q, HEAD_DIM=head_dim, TILE_M=tile_m, ROWS=rows, num_warps=4,
    )  # fmt: skip
