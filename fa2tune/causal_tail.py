"""The tail of a causal persistent forward: the tiles of the launch's last heads handed out one at a time, longest
first, so that the launch does not end with a part-empty round of work.

A causal persistent program walks work units p, p + P, … (templates/fwd_ws.py.jinja): a unit pairs a head's j-th
longest Q tile with its j-th shortest, so units take about equal time and programs that take units P apart get equal
work. The grid's unit counts are powers of two against 132 SMs, so the last round is part empty — d=128: 1,024 pairs,
7 rounds and 100 pairs, which take an 8th round while 32 SMs wait — and a launch with a full last round ran 3.0 %
faster on the H200 (docs/PERF.md v30: N = 8448 against 8192, causal). A pair cannot be cut like the split tail's
tiles (fa2tune/split_tail.py) without merging pieces; but it is two tiles of unequal length, and single tiles, longest
first, fill the programs almost evenly.

So the last `tail_heads` heads are not paired: the units before them run as ever, and their tiles, sorted by length
(row tile n_m − 1 first, each length's tiles head by head), are dealt a round of the programs' slots at a time — the
first round forward from the program after the last pair (those before it had one pair more), then backward, then
forward: a snake, under which a program's long tile of one round meets a short one of the next. The kernel computes
its slots from its program id (`_tail_item`): no table, and its counters stay in uniform registers. `plan` models
each program's K/V steps for each tail_heads up to TAIL_ROUNDS_MAX rounds of work and keeps the shortest launch;
for the grid's causal rows the model's longest program comes within 0.1–2.4 % of an even share, from 3.1–6.3 % over
it with pairs alone (docs/PERF.md v31).
"""

from __future__ import annotations

import functools
import math
import os

import torch

TILE_OVERHEAD_STEPS = 1.2  # a tile's fixed cost in K/V steps, as fitted to the grid (docs/PERF.md v29)
TAIL_ROUNDS_MAX = 4  # the tail's largest size, in rounds of the programs' pairs: beyond it the heads that the tail
# reads together no longer fit L2 (d=128 N=8k: 4 MB of K/V a head)
MIN_GAIN_STEPS = 0.5  # K/V steps of the longest program a tail, or a larger one, must save to be taken
MAX_CANDIDATES = 48  # tail sizes modelled a plan, spread evenly up to TAIL_ROUNDS_MAX rounds: the host time of a
# shape's first call


def enabled() -> bool:
    """FA2TUNE_CAUSAL_TAIL=1 turns the causal tail on; off otherwise. Off by default until it has run on a GPU: it
    was written in a session that had none (compiled for sm_90 offline, its order checked on the CPU;
    docs/PERF.md v31)."""
    return os.environ.get("FA2TUNE_CAUSAL_TAIL", "0") not in ("", "0")


def tile_costs(n_m: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Each row tile's cost in the model (float64, [n_m]): the K/V tiles it visits under the bottom-right aligned
    causal mask (the kernel's _tile: up to its last row's diagonal, at least one) plus TILE_OVERHEAD_STEPS."""
    r = torch.arange(n_m, dtype=torch.int64)
    kv_end = torch.clamp((r + 1) * block_m + seqlen_k - seqlen_q, max=seqlen_k)
    return torch.clamp(-(-kv_end // block_n), min=1).double() + TILE_OVERHEAD_STEPS


def _pair_costs(costs: torch.Tensor) -> torch.Tensor:
    """Each of a head's pairs' cost ([half]): its j-th longest tile and its j-th shortest (the middle tile of an odd
    n_m alone)."""
    n_m = costs.numel()
    j = torch.arange((n_m + 1) // 2)
    return costs[n_m - 1 - j] + torch.where(n_m - 1 - j == j, 0.0, costs[j])


def _pair_loads(first: int, last: int, programs: int, pair_costs: torch.Tensor) -> torch.Tensor:
    """Each program's cost over units first … last − 1 (unit u: program u mod P, its head's pair u mod half). The
    pattern repeats every lcm(P, half) units: those periods are summed once (a launch may have millions of units)."""
    half = pair_costs.numel()
    period = math.lcm(programs, half)
    start = first + (last - first) // period * period if last - first >= 2 * period else first
    def loads(lo: int, hi: int) -> torch.Tensor:
        u = torch.arange(lo, hi)
        return torch.bincount(u % programs, weights=pair_costs[u % half], minlength=programs).double()

    if start == first:
        return loads(first, last)
    return loads(start, last) + (start - first) // period * loads(first, first + period)  # whole periods, once


def _tail_loads(main: int, programs: int, tail_heads: int, costs: torch.Tensor) -> torch.Tensor:
    """Each program's cost over the tail's slots from unit `main` on, as the kernel's _tail_item deals them: item i
    is row tile n_m − 1 − i // tail_heads, in slot main + i of the rounds, forward in the first (partial) round,
    backward in the next, …"""
    n_m = costs.numel()
    item = torch.arange(tail_heads * n_m)
    slot = main + item
    forward = (slot // programs - main // programs) % 2 == 0
    program = torch.where(forward, slot % programs, programs - 1 - slot % programs)
    return torch.bincount(program, weights=costs[n_m - 1 - item // max(tail_heads, 1)], minlength=programs)


def program_loads(batch_heads: int, programs: int, tail_heads: int, costs: torch.Tensor) -> torch.Tensor:
    """Each program's modelled work (float64, [programs]) when the last tail_heads of batch_heads heads are the
    tail: its pairs p, p + P, … of the heads before them, then its tail slots."""
    main = (batch_heads - tail_heads) * ((costs.numel() + 1) // 2)
    return _pair_loads(0, main, programs, _pair_costs(costs)) + _tail_loads(main, programs, tail_heads, costs)


@functools.lru_cache(maxsize=256)
def plan(batch_heads: int, n_m: int, programs: int, block_m: int, block_n: int, seqlen_q: int,
         seqlen_k: int) -> tuple[int, int]:  # fmt: skip
    """(main, tail_heads): work units 0 … main − 1 are pairs (main = the pairs of the first batch_heads − tail_heads
    heads), the tiles of the last tail_heads heads the tail; (all pairs, 0) where no tail shortens the modelled
    launch by MIN_GAIN_STEPS. A larger tail is kept only if it beats the best smaller one by MIN_GAIN_STEPS too: a
    smaller one reads fewer heads' K/V together.

    Args:
        batch_heads: batch · query heads (work is numbered head by head).
        n_m: row tiles a head (cdiv(seqlen_q, block_m)).
        programs: the persistent grid's size.
        block_m, block_n, seqlen_q, seqlen_k: for each tile's K/V steps (tile_costs).
    """
    half = (n_m + 1) // 2
    costs = tile_costs(n_m, block_m, block_n, seqlen_q, seqlen_k)
    pair_costs = _pair_costs(costs)
    units = batch_heads * half
    pairs = _pair_loads(0, units, programs, pair_costs)  # every head paired
    # tail sizes up to `count` heads, at most MAX_CANDIDATES of them, all modelled at once (a first call of a shape
    # waits for this: 1–6 ms for the grid's shapes on the development machine)
    count = min(batch_heads, max(1, TAIL_ROUNDS_MAX * programs // half))
    sizes = torch.unique(torch.linspace(1, count, min(count, MAX_CANDIDATES)).round().long())
    u = torch.arange(units - count * half, units)
    back = (units - 1 - u) // half  # the unit's head, counted from the last
    paired_in_tail = torch.bincount(back * programs + u % programs, weights=pair_costs[u % half],
                                    minlength=count * programs).view(count, programs).cumsum(0)  # fmt: skip
    # every candidate's tail items at once: candidate c (of size sizes[c]) has sizes[c]·n_m items
    candidate = torch.repeat_interleave(torch.arange(sizes.numel()), sizes * n_m)
    heads = sizes[candidate]
    starts = torch.cumsum(sizes * n_m, 0) - sizes * n_m
    item = torch.arange(candidate.numel()) - starts[candidate]  # the item's index in its tail
    main = units - heads * half
    slot = main + item
    forward = (slot // programs - main // programs) % 2 == 0
    program = torch.where(forward, slot % programs, programs - 1 - slot % programs)
    tails = torch.bincount(candidate * programs + program, weights=costs[n_m - 1 - item // heads],
                           minlength=sizes.numel() * programs).view(-1, programs)  # fmt: skip
    lengths = (pairs - paired_in_tail[sizes - 1] + tails).max(1).values.tolist()
    best_length, best = pairs.max().item(), 0
    for tail_heads, length in zip(sizes.tolist(), lengths, strict=True):
        if length < best_length - MIN_GAIN_STEPS:
            best_length, best = length, tail_heads
    return units - best * half, best
