#!/usr/bin/env python3
"""How evenly a persistent causal forward spreads its work over the programs, by the order it takes tiles in.

A persistent warpspec program (Schedule.persistent) walks work items first, first + programs, ...; causal Q
tiles differ in length (a head's last tile visits every K/V tile, its first one), so the order decides how long the
busiest program runs. This counts K/V tiles per program — no GPU, no timing — for two orders:
  snake : v12's fwd_ws.py.jinja order (docs/PERF.md v12): tiles head by head, longest first within a head, every
          other round of `programs` tiles reversed;
  pairs : a head's j-th longest tile and its j-th shortest as one unit of n_m + 1 K/V tiles, units head by head:
          the order of all three persistent templates since docs/PERF.md v13 (measured there: the causal forward at
          N=16k went from ~25 % slower persistent than not to 2 %).
The launch lasts about as long as its busiest program: max / mean over programs is the slowdown against a perfect
split.

    python scripts/model_persistent_order.py --head-dim 128 --block-m 128
"""

from __future__ import annotations

import argparse
import sys


def snake(q_tiles: int, heads: int, programs: int) -> list[list[tuple[int, int]]]:
    """Each program's (head, Q tile) items in the snake order."""
    total = q_tiles * heads
    owned: list[list[tuple[int, int]]] = [[] for _ in range(programs)]
    for t in range(total):
        start = t - t % programs
        w = start + min(start + programs, total) - 1 - t if (t // programs) % 2 else t
        owned[t % programs].append((w // q_tiles, q_tiles - 1 - w % q_tiles))
    return owned


def pairs(q_tiles: int, heads: int, programs: int) -> list[list[tuple[int, int]]]:
    """Each program's (head, Q tile) items when units of a long and a short tile are dealt out in turn."""
    half = (q_tiles + 1) // 2
    owned: list[list[tuple[int, int]]] = [[] for _ in range(programs)]
    for unit in range(heads * half):
        head, j = divmod(unit, half)
        owned[unit % programs] += [(head, q_tiles - 1 - j)] + ([(head, j)] if q_tiles - 1 - j != j else [])
    return owned


def imbalance(owned: list[list[tuple[int, int]]]) -> float:
    """max / mean of the K/V tiles the programs visit (Q tile r of a square causal call visits r + 1)."""
    work = [sum(r + 1 for _, r in items) for items in owned if items]
    return max(work) / (sum(work) / len(work))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-m", type=int, default=128, help="Q rows a tile (and K/V rows a K/V tile)")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N")
    parser.add_argument("--width", type=int, default=2048, help="heads·d")
    parser.add_argument("--programs", type=int, default=132, help="one per SM (the H200 has 132)")
    args = parser.parse_args(argv)
    print(f"busiest program / mean, causal, d={args.head_dim}, {args.block_m}-row tiles, {args.programs} programs")
    print(f"{'N':>6} {'tiles':>6} {'snake':>6} {'pairs':>6}")
    for n in (int(x) for x in args.seqlens.split(",")):
        q_tiles, heads = -(-n // args.block_m), max(1, args.tokens // n) * (args.width // args.head_dim)
        programs = min(args.programs, q_tiles * heads)
        row = [imbalance(order(q_tiles, heads, programs)) for order in (snake, pairs)]
        print(f"{n:>6} {q_tiles * heads:>6} " + " ".join(f"{x:6.3f}" for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
