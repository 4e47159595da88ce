"""The tail of a causal persistent launch: the tiles of its last heads handed out one at a time, longest first, so
that the launch does not end with a part-empty round of work. The forward, the dK/dV and the dQ kernels take it.

A causal persistent program walks work units p, p + P, … (templates/*_ws.py.jinja): a unit pairs a head's j-th
longest tile with its j-th shortest, so units take about equal time and programs that take units P apart get equal
work. The grid's unit counts are powers of two against 132 SMs, so the last round is part empty — d=128: 1,024 pairs,
7 rounds and 100 pairs, which take an 8th round while 32 SMs wait — and a forward with a full last round ran 3.0 %
faster on the H200 (N = 8448 against 8192, causal). A pair cannot be cut like the split tail's tiles
(fa2tune/launch/split_tail.py) without merging pieces; but it is two tiles of unequal length, and single tiles,
longest first, fill the programs almost evenly. Which launches deal a tail: Schedule.deals_causal_tail (causal and
persistent; its causal_tail switch, FA2TUNE_CAUSAL_TAIL for debugging).

So the last `tail_heads` heads are not paired: the units before them run as ever, and their tiles, sorted by length
(each head's longest first, each length's tiles head by head), are dealt a round of the programs' slots at a time —
the first round forward from the program after the last pair (those before it had one pair more), then backward,
then forward: a snake, under which a program's long tile of one round meets a short one of the next. The kernels
compute their slots from the program id (`_tail_item`, templates/_ws_common.py.jinja): no table, and their counters
stay in uniform registers. `plan` models each program's steps for tail sizes up to TAIL_ROUNDS_MAX rounds of work
and keeps the shortest launch; for the grid's causal forward rows the model's longest program comes within 0.1–2.4 %
of an even share, from 3.1–6.3 % over it with pairs alone.
"""

from __future__ import annotations

import functools
import math

import torch

TILE_OVERHEAD_STEPS = 1.2  # a tile's fixed cost in K/V steps, as fitted to the grid's timings
TAIL_ROUNDS_MAX = 4  # the tail's largest size, in rounds of the programs' pairs. Its heads' K/V are read together
# (d=128 N=8k: 4 MB a head, 16 heads in 4 rounds: past the H200's 50 MB of L2), which the model leaves out; the
# grid's plans stay within a round at d=128 (4–16 MB) and take 3.7 at d=64 N=8k (22 heads of 2 MB)
MIN_GAIN_STEPS = 0.5  # K/V steps of the longest program a tail, or a larger one, must save to be taken
MAX_CANDIDATES = 48  # tail sizes modelled a plan, spread evenly up to TAIL_ROUNDS_MAX rounds: the host time of a
# shape's first call


def forward_costs(n_m: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> tuple[float, ...]:
    """The forward's (and the dQ kernel's) row tiles' costs by rank, longest first (rank k is row tile n_m − 1 − k):
    the K/V tiles each visits under the bottom-right aligned causal mask — up to its last row's diagonal, at least
    one (the forward's loop runs a step even for rows that see no key; the dQ kernel's runs none, a difference of a
    step a tile that only rows before every key make) — plus TILE_OVERHEAD_STEPS."""
    r = torch.arange(n_m - 1, -1, -1)
    kv_end = torch.clamp((r + 1) * block_m + seqlen_k - seqlen_q, max=seqlen_k)
    return tuple((torch.clamp(-(-kv_end // block_n), min=1).double() + TILE_OVERHEAD_STEPS).tolist())


def dkdv_costs(n_kv: int, block_n: int, block_m: int, seqlen_q: int, seqlen_k: int,
               group: int) -> tuple[float, ...]:  # fmt: skip
    """The dK/dV kernel's K/V tiles' costs by rank, longest first (rank k is K/V tile k: the first keys are seen by
    the most queries): the Q tiles from the first that sees the tile's first key to the end, for each of the group's
    query heads, plus TILE_OVERHEAD_STEPS (templates/bwd_ws.py.jinja's _tile)."""
    r = torch.arange(n_kv)
    i_start = torch.clamp(r * block_n - (seqlen_k - seqlen_q), min=0) // block_m
    q_tiles = torch.clamp(-(-seqlen_q // block_m) - i_start, min=0)
    return tuple((group * q_tiles.double() + TILE_OVERHEAD_STEPS).tolist())


def _pair_costs(costs: torch.Tensor) -> torch.Tensor:
    """Each of a head's pairs' cost ([half]): ranks j and n − 1 − j, its j-th longest tile and its j-th shortest
    (the middle tile of an odd count alone)."""
    n = costs.numel()
    j = torch.arange((n + 1) // 2)
    return costs[n - 1 - j] + torch.where(n - 1 - j == j, 0.0, costs[j])


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
    """Each program's cost over the tail's slots from unit `main` on, as the kernels' _tail_item deals them: item i
    is rank i // tail_heads of its head, in slot main + i of the rounds, forward in the first (partial) round,
    backward in the next, …"""
    item = torch.arange(tail_heads * costs.numel())
    slot = main + item
    forward = (slot // programs - main // programs) % 2 == 0
    program = torch.where(forward, slot % programs, programs - 1 - slot % programs)
    return torch.bincount(program, weights=costs[item // max(tail_heads, 1)], minlength=programs).double()


def program_loads(batch_heads: int, programs: int, tail_heads: int, costs: torch.Tensor) -> torch.Tensor:
    """Each program's modelled work (float64, [programs]) when the last tail_heads of batch_heads heads are the
    tail: its pairs p, p + P, … of the heads before them, then its tail slots."""
    main = (batch_heads - tail_heads) * ((costs.numel() + 1) // 2)
    return _pair_loads(0, main, programs, _pair_costs(costs)) + _tail_loads(main, programs, tail_heads, costs)


def candidate_lengths(batch_heads: int, programs: int, costs: torch.Tensor) -> list[tuple[int, float]]:
    """[(tail_heads, the longest program's modelled work)] for up to MAX_CANDIDATES tail sizes, spread evenly up to
    TAIL_ROUNDS_MAX rounds of pairs, all modelled at once (program_loads' model, vectorised over the sizes: a first
    call of a shape waits for this, 0.3–2.5 ms for the grid's shapes on the development machine)."""
    n = costs.numel()
    half = (n + 1) // 2
    pair_costs = _pair_costs(costs)
    units = batch_heads * half
    pairs = _pair_loads(0, units, programs, pair_costs)  # every head paired
    count = min(batch_heads, max(1, TAIL_ROUNDS_MAX * programs // half))
    sizes = torch.unique(torch.linspace(1, count, min(count, MAX_CANDIDATES)).round().long())
    # the pairs of the last c heads, for every c: row c − 1 of a cumulative sum over heads from the last
    u = torch.arange(units - count * half, units)
    back = (units - 1 - u) // half
    paired_in_tail = torch.bincount(back * programs + u % programs, weights=pair_costs[u % half],
                                    minlength=count * programs).view(count, programs).cumsum(0)  # fmt: skip
    # every size's tail items, one after another: size c's items are its tail's 0 … c·n − 1 (_tail_loads)
    candidate = torch.repeat_interleave(torch.arange(sizes.numel()), sizes * n)
    heads = sizes[candidate]
    item = torch.arange(candidate.numel()) - (torch.cumsum(sizes * n, 0) - sizes * n)[candidate]
    main = units - heads * half
    slot = main + item
    forward = (slot // programs - main // programs) % 2 == 0
    program = torch.where(forward, slot % programs, programs - 1 - slot % programs)
    tails = torch.bincount(candidate * programs + program, weights=costs[item // heads],
                           minlength=sizes.numel() * programs).view(-1, programs)  # fmt: skip
    lengths = (pairs - paired_in_tail[sizes - 1] + tails).max(1).values
    return list(zip(sizes.tolist(), lengths.tolist(), strict=True))


@functools.lru_cache(maxsize=256)
def plan(batch_heads: int, programs: int, tile_costs: tuple[float, ...]) -> tuple[int, int]:
    """(main, tail_heads): work units 0 … main − 1 are pairs (main = the pairs of the first batch_heads − tail_heads
    heads), the tiles of the last tail_heads heads the tail; (all pairs, 0) where no tail shortens the modelled
    launch by MIN_GAIN_STEPS. A larger tail is kept only if it beats the best smaller one by MIN_GAIN_STEPS too: a
    smaller one reads fewer heads' K/V together.

    Args:
        batch_heads: batch · heads the kernel's tiles are numbered over (query heads; K/V heads for dK/dV).
        programs: the persistent grid's size.
        tile_costs: a head's tiles' costs by rank, longest first (forward_costs, dkdv_costs).
    """
    costs = torch.tensor(tile_costs, dtype=torch.float64)
    best_length, best = program_loads(batch_heads, programs, 0, costs).max().item(), 0
    for tail_heads, length in candidate_lengths(batch_heads, programs, costs):
        if length < best_length - MIN_GAIN_STEPS:
            best_length, best = length, tail_heads
    return (batch_heads - best) * ((len(tile_costs) + 1) // 2), best
