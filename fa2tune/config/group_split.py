"""How many dK/dV programs share a GQA group's query heads: the backward's group split.

A dK/dV program streams every query head of its K/V head's group against one load of its K/V rows, summing their
dK and dV as it goes: one load of K/V for the group is what GQA saves. Split, a group's query heads go to `split`
programs of each K/V tile, each streaming group // split of them into a partial dK and dV of its own (the kernels'
KV_SPLIT: partial head hk reads K/V head hk // split); the partials, in the gradients' dtype, are summed after
(launch.backward). That costs the partials' memory (split times dK and dV), one read of them, and each program's
own load of K/V and store of dK/dV; each partial is rounded once to the dtype, as FlashAttention-2 rounds its
per-head dK and dV under GQA — so dK's and dV's last bits follow the split, which follows the call's shape and the
card's SM count. Two things make it pay (measured on an H100, bf16, docs/PERF.md "Grouped-query attention"):

- **The tail.** A program runs the group times its tile's causal length. Where the grid has too few programs for
  the SMs, or its longest program outlasts the work an SM gets on average, the last programs run on while other SMs
  idle. The rule estimates the grid's makespan at each split (`_makespan`: whole waves of the programs' average
  length, and no less than the longest) and splits further only where that leaves the fewer splits' estimate more
  than TAIL_GAIN times the best — 8 query heads over one K/V head, batch 1, N=16k, causal (128 programs): the
  backward unsplit 3.97 ms, split in two 2.86 (the dK/dV kernel without fused dQ) and 5.00 against 2.65 (with it);
  no mask there, where 128 equal programs fill 132 SMs in one wave, it gained nothing. A grid of whole waves without
  fused dQ gained little or lost (persistent: +6 % at d=128 GQA 32/4 N=2k, 0 … +2 % at N=8k; one program a tile:
  −1.5 % and −4 … −6 %), which the estimate, blind to the order programs run in, does not split.
- **Fused dQ under the causal mask.** The warp-specialized kernel that adds dQ in streams at most
  MAX_CAUSAL_FUSED_HEADS query heads a program: at d=128, GQA 32/4, batch·N = 16k, splitting each group of 8 in
  two took the backward from 2.42 to 2.07 ms at N=2k, and at 32/2 (16 a group) N=8k into four from 9.1 to 6.0.
  Why fused dQ loses with long programs is not measured; each of its steps also adds a 32 KB fp32 partial of dQ
  into L2.

The estimate is worked out for every head dim, length, group and card from the config's tiles and the SM count;
it is measured on an H100 only, and for the warp-specialized kernels only: the Triton template (the backward on
other GPUs) follows it untimed, counted one program an SM — fewer slots than it has, so it splits only grids that
much shorter.

FA2TUNE_DKDV_HEADS overrides the rule for debugging and A/B runs: the most query heads a program streams, under
either mask and in either kernel (a large value: never split). A launch plan's key holds it (launch.plans.plan_key), as
it changes what runs.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

DKDV_HEADS_ENV = "FA2TUNE_DKDV_HEADS"
# The most query heads a causal dK/dV program with fused dQ streams: at d=128 N=8k, 4 ran as fast as 1 (MHA), 8 ran
# 17 % slower and 16 53 %.
MAX_CAUSAL_FUSED_HEADS = 4
# A split further than the fused rule's is taken only where the fewer splits' estimated makespan is more than this
# times the best: the partials cost a few per cent (d=128, GQA 32/4, N=1k, a full grid: 1–5 % slower split).
TAIL_GAIN = 1.1


class DkdvGrid(NamedTuple):
    """An unsplit dK/dV launch's grid: one program per K/V tile (block_n rows) and K/V head, each stepping over
    the Q tiles (block_m rows) its keys see; `slots` programs run at once (SMs times programs an SM)."""

    batch_heads_kv: int
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    causal: bool
    slots: int


def dkdv_group_split(group: int, grid: DkdvGrid, *, fused_dq: bool) -> int:
    """The programs a K/V tile's group of `group` query heads is split over (1: one program streams them all), a
    divisor of `group`: FA2TUNE_DKDV_HEADS's if set, else the fewest that leave a causal program with fused dQ at
    most MAX_CAUSAL_FUSED_HEADS heads and whose estimated makespan is at most TAIL_GAIN times the best (above)."""
    forced = _forced_heads()  # read, and a bad value refused, at every grouping
    if group == 1:  # MHA: nothing to split
        return 1
    divisors = [split for split in range(1, group + 1) if group % split == 0]
    if forced is not None:
        return next(split for split in divisors if group // split <= forced)
    if grid.causal and fused_dq:
        divisors = [split for split in divisors if group // split <= MAX_CAUSAL_FUSED_HEADS]
    spans = [_makespan(group, split, grid) for split in divisors]
    best = min(spans)
    return next(split for split, span in zip(divisors, spans, strict=True) if span <= best * TAIL_GAIN)


def many_waves_heads(group: int, *, causal: bool, fused_dq: bool) -> int:
    """The query heads a dK/dV program streams (group // dkdv_group_split) in a grid of many waves, where no tail
    asks for a split: the fused rule's alone. A tune's compile example forces it (DKDV_HEADS_ENV), so that its small
    grid builds the binary of the timed calls, whose grids are full."""
    many = DkdvGrid(batch_heads_kv=1 << 20, seqlen_q=1, seqlen_k=1, block_m=1, block_n=1, causal=causal, slots=1)
    return group // dkdv_group_split(group, many, fused_dq=fused_dq)


def _makespan(group: int, split: int, grid: DkdvGrid) -> float:
    """The estimated time of the grid, in steps (one Q tile of one query head), with each group split `split`
    times: whole waves of programs of the average length, and no less than the longest program."""
    longest, total = _steps_a_head(grid.seqlen_q, grid.seqlen_k, grid.block_m, grid.block_n, grid.causal)
    tiles = -(-grid.seqlen_k // grid.block_n)
    if tiles == 0:  # no keys (a packed call's offsets are not checked under graph capture): nothing runs
        return 0.0
    heads = group // split
    programs = grid.batch_heads_kv * tiles * split
    waves = -(-programs // max(grid.slots, 1))
    return max(waves * heads * total / tiles, heads * longest)


def q_tiles_seen(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool) -> list[int]:
    """The Q tiles (block_m rows) each K/V tile (block_n keys) of a head steps over, in K/V tile order. Causal
    positions are aligned bottom-right (types.Mask): query i sees key j when j <= i + seqlen_k - seqlen_q, so a
    tile's first Q tile is its first key's, less that offset (bwd_ws.py.jinja's _tile)."""
    q_tiles = -(-seqlen_q // block_m)
    if not causal:
        return [q_tiles] * -(-seqlen_k // block_n)
    offset = seqlen_k - seqlen_q
    return [max(0, q_tiles - max(0, first_key - offset) // block_m) for first_key in range(0, seqlen_k, block_n)]


@functools.lru_cache(maxsize=256)
def _steps_a_head(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool) -> tuple[int, int]:
    """(the most, the sum) of q_tiles_seen: what the makespan estimate reads, once per shape."""
    steps = q_tiles_seen(seqlen_q, seqlen_k, block_m, block_n, causal)
    return max(steps, default=0), sum(steps)


def _forced_heads() -> int | None:
    value = os.environ.get(DKDV_HEADS_ENV)
    if value is None:
        return None
    try:
        heads = int(value)
    except ValueError:
        heads = 0
    if heads < 1:
        raise ValueError(
            f"{DKDV_HEADS_ENV} must be a positive integer (the query heads a dK/dV program streams); got {value!r}"
        )
    return heads
