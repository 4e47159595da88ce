"""The split tail of a persistent forward: the tiles of a launch's part-empty last round cut into pieces of their
K/V tiles, so that every program has work to the end, and the merge of the pieces' partial results.

A persistent program walks work units p, p + P, … (templates/fwd_ws.py.jinja). The grid's tile counts are powers of
two against 132 SMs, so the last round is part empty — 2,048 tiles: 15 rounds and 68 tiles, which take a 16th round
while 64 SMs wait — and a launch with a full last round ran 2–3 % faster on the H200 (N = 8448, 2,112 tiles, against
N = 8192 at d=128). Cut, the launch gained +0.95 % on average over 20 readings of the rows it cuts (d=128 N ≥ 4k,
d=64 N=4k; −1.1 … +3.1 %, timed interleaved): the pieces' fp32 stores, the merge (a launch of its own) and each
piece's start and end take back part of what the cut saves. Which launches cut: Schedule.splits_tail (a forward
without a mask, persistent, one program an SM; its split_tail switch, FA2TUNE_SPLIT_TAIL for debugging).

The t = tiles mod P tiles after the full rounds are each cut into k pieces of consecutive K/V tiles: k·t pieces over
P programs take ceil(k·t / P) pieces of 1/k of a tile each instead of one whole tile. Each piece writes O over its
keys, normalised, and the logsumexp of those keys (fp32); `Merge` launches the forward module's _merge_pieces, which
combines a tile's pieces as the softmax over all its keys:

    lse = log Σ_i exp(lse_i),   O = Σ_i exp(lse_i − lse) · O_i

which is exact up to float rounding (FlashDecoding's split-KV merge).
"""

from __future__ import annotations

import torch

from . import fastlaunch
from .layout import in_units

MAX_SPLIT = 4  # pieces a tile: more makes each piece's start and end (a K/V step or so) a larger share
PIECE_OVERHEAD_STEPS = 1.2  # a tile's (or piece's) fixed cost in K/V steps, as fitted to the grid's timings
MIN_PIECE_STEPS = 2  # K/V tiles a piece at least visits
# Tiles shorter than this are not cut: the pieces' stores and the merge (a launch of its own) cost about what the cut
# saves there — at d=128 N=2k (16 steps of 128 keys) a split tail measured 0.9 % slower, at 4k (32) about even,
# at d=64 N=2k +0.9 %
MIN_KV_STEPS = 32


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


def pieces(tiles: int, main: int, split: int) -> int:
    """How many pieces a launch planned as (main, split) writes."""
    return (tiles - main) * split


def workspace(tiles: int, main: int, split: int, tile_m: int, width: int, device) -> tuple[torch.Tensor, ...]:
    """(PART_O, PART_LSE) for the pieces of a launch: fp32 [pieces, tile_m, width] and [pieces, tile_m]; width: the
    O columns the kernel computes (its head-dim chunks, at least O's head dim)."""
    count = pieces(tiles, main, split)
    return (torch.empty((count, tile_m, width), device=device, dtype=torch.float32),
            torch.empty((count, tile_m), device=device, dtype=torch.float32))  # fmt: skip


class Merge:
    """merge(part_o, part_lse, o, lse) for one launch plan's split tiles: writes their rows of o (batch, heads_q,
    seqlen_q, head_dim) and lse (batch, heads_q, seqlen_q) from their pieces (part_o, part_lse as the forward kernel
    wrote them) with `kernel`, the forward module's _merge_pieces (templates/fwd_ws.py.jinja).

    The launch is worked out once per o and lse strides (a plan's outputs always have the same ones) and goes
    through fastlaunch.Launcher: `kernel[grid](...)` would bind its arguments again on every call.

    Args:
        tiles, main, split: the launch's tiles and its split_tail.plan.
        n_m: Q tiles a (batch, head); tile_m: their rows.
        width: the pieces' columns (the kernel's head-dim chunks); head_dim: O's.
    """

    __slots__ = ("_grid", "_kernel", "_launchers", "_options", "_scalars")

    def __init__(self, kernel, *, tiles: int, main: int, split: int, n_m: int, heads_q: int, seqlen_q: int,
                 tile_m: int, width: int, head_dim: int):  # fmt: skip
        rows = min(32, tile_m)
        self._kernel = kernel
        self._grid = (tiles - main, tile_m // rows)
        self._scalars = (main, split, n_m, heads_q, seqlen_q)
        cols = 1 << (width - 1).bit_length()  # a power of two over the pieces' columns (and so O's)
        self._options = dict(HEAD_DIM=head_dim, PART_WIDTH=width, COLS=cols, TILE_M=tile_m, ROWS=rows, num_warps=4)
        self._launchers: dict[tuple, fastlaunch.Launcher] = {}

    def __call__(self, part_o: torch.Tensor, part_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        strides = (o.stride(), lse.stride())
        launch = self._launchers.get(strides)
        if launch is None:
            units, o_strides = in_units(O=o.stride()[:3])  # the kernel multiplies them back
            launch = self._launchers[strides] = fastlaunch.Launcher(
                self._kernel, self._grid, (*o_strides, lse.stride(0), lse.stride(1), *self._scalars),
                {**self._options, **units},
            )  # fmt: skip
        launch(part_o, part_lse, o, lse)
