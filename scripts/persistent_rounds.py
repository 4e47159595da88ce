#!/usr/bin/env python3
"""How full a backward launch's SMs are, by count (no GPU): the dK/dV kernel's work units over the programs, at each
length — persistent, or (--per-tile) a causal grid of one program a tile as the hardware hands its slots out.

A persistent launch runs one program an SM; program p takes units p, p + programs, ... (templates/bwd_ws.py.jinja).
Without a mask a unit is one K/V tile of `--rows` rows; causal, a unit pairs a head's j-th K/V tile with its j-th
last, so units are equally long (an odd tile count leaves a middle tile alone, about half a unit). The busy fraction
is the work over programs × the busiest program's work: 1.0 when the last round is full. docs/PERF.md, "Lengths that
are not a multiple of a tile", quotes these numbers.

    python scripts/persistent_rounds.py --seqlens 2048,3000,4096 --causal
    python scripts/persistent_rounds.py --seqlens 512:16384:64 --causal     # the median and worst over a range

--per-tile: the causal grid of one program a tile, whose K/V tile j of N/rows sees the Q tiles from its diagonal on
(of --q-rows rows) for each of --group query heads. Its slots start in launch order, each on the SM that frees first
(a list schedule; each program also pays --overhead steps, the fixed cost a Q-tile step is worth, as
split_tail.PIECE_OVERHEAD_STEPS was fitted). The warp-specialized kernel's launch order (templates/_ws_macros.jinja's
work_units) is head by head, each head's longest tile first (--interleave 1); --interleave N models the heads'
tiles interleaved N heads at a time, as the Triton template launches them (N=4, _macros.jinja's interleaved_slot):

    python scripts/persistent_rounds.py --per-tile --seqlens 8192 --heads 4 --group 8 --interleave 1
    python scripts/persistent_rounds.py --per-tile --seqlens 8192 --heads 4 --group 8 --interleave 4

The count is of SMs left idle, not of time: on an H100 the warp-specialized d=128 causal grid interleaved 2 or 4
heads at a time gained 0-3 % where this count gives 5-11 % more busy SMs, and lost at other lengths (docs/PERF.md,
"Grouped-query attention"); time an order before choosing it.
"""

from __future__ import annotations

import argparse
import heapq
import math
import statistics

from fa2tune.config.group_split import q_tiles_seen


def busy(seqlen: int, tokens: int, heads: int, rows: int, programs: int, causal: bool) -> float:
    """The busy fraction of the launch at `seqlen` (batch = tokens // seqlen, at least 1)."""
    batch, tiles = max(1, tokens // seqlen), math.ceil(seqlen / rows)
    per_head = [1.0] * (tiles // 2) + ([0.5] if tiles % 2 else []) if causal else [1.0] * tiles
    loads = [0.0] * programs
    for index, work in enumerate(per_head * (batch * heads)):
        loads[index % programs] += work
    return sum(loads) / (programs * max(loads))


def per_tile_busy(seqlen: int, tokens: int, heads: int, rows: int, programs: int, *, group: int, q_rows: int,
                  interleave: int, overhead: float) -> float:  # fmt: skip
    """The busy fraction of a causal grid of one program a K/V tile (batch = tokens // seqlen, at least 1, times
    `heads` K/V heads), its slots taken in launch order by the SM that frees first."""
    batch = max(1, tokens // seqlen)
    work = [group * steps + overhead for steps in q_tiles_seen(seqlen, seqlen, q_rows, rows, True)]  # longest first
    tiles = len(work)
    order = []
    for lead in range(0, batch * heads, interleave):  # sets of `interleave` heads, their j-th tiles together
        order += [work[j] for j in range(tiles) for _ in range(min(interleave, batch * heads - lead))]
    free = [0.0] * programs
    heapq.heapify(free)
    for w in order:
        heapq.heappush(free, heapq.heappop(free) + w)
    return sum(order) / (programs * max(free))


def _seqlens(text: str) -> list[int]:
    if ":" in text:
        start, stop, step = map(int, text.split(":"))
        return list(range(start, stop + 1, step))
    return [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=_seqlens, default=_seqlens("2048,3000,4096"),
                        help="comma-separated, or start:stop:step")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=16384, help="batch · N (the grid's 16k)")
    parser.add_argument("--heads", type=int, default=16, help="K/V heads")
    parser.add_argument("--rows", type=int, default=128, help="K/V rows a tile (two consumers of 64)")
    parser.add_argument("--programs", type=int, default=132, help="programs: the H200's SMs")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--per-tile", action="store_true", help="a causal grid of one program a tile (above)")
    parser.add_argument("--group", type=int, default=1, help="--per-tile: query heads a K/V head")
    parser.add_argument("--q-rows", type=int, default=64, help="--per-tile: Q rows a step")
    parser.add_argument("--interleave", type=int, default=1,
                        help="--per-tile: heads interleaved in launch order "
                        "(1: head by head, the warp-specialized kernel's; 4: the Triton template's)")
    parser.add_argument("--overhead", type=float, default=1.2, help="--per-tile: a program's fixed cost in steps")
    args = parser.parse_args(argv)
    if args.interleave < 1:
        parser.error(f"--interleave must be at least 1 (1: head by head); got {args.interleave}")
    if args.per_tile:
        fractions = [per_tile_busy(n, args.tokens, args.heads, args.rows, args.programs, group=args.group,
                                   q_rows=args.q_rows, interleave=args.interleave, overhead=args.overhead)
                     for n in args.seqlens]  # fmt: skip
    else:
        fractions = [busy(n, args.tokens, args.heads, args.rows, args.programs, args.causal) for n in args.seqlens]
    for n, fraction in zip(args.seqlens, fractions, strict=True):
        print(f"N={n:>6}  busy {fraction:.3f}")
    if len(fractions) > 3:
        print(f"lost: median {1 - statistics.median(fractions):.1%}, worst {1 - min(fractions):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
