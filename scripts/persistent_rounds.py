#!/usr/bin/env python3
"""How full a persistent backward launch's rounds are, by count (no GPU): the dK/dV kernel's work units over the
programs, at each length.

A persistent launch runs one program an SM; program p takes units p, p + programs, ... (templates/bwd_ws.py.jinja).
Without a mask a unit is one K/V tile of `--rows` rows; causal, a unit pairs a head's j-th K/V tile with its j-th
last, so units are equally long (an odd tile count leaves a middle tile alone, about half a unit). The busy fraction
is the work over programs × the busiest program's work: 1.0 when the last round is full. docs/PERF.md, "Lengths that
are not a multiple of a tile", quotes these numbers.

    python scripts/persistent_rounds.py --seqlens 2048,3000,4096 --causal
    python scripts/persistent_rounds.py --seqlens 512:16384:64 --causal     # the median and worst over a range
"""

from __future__ import annotations

import argparse
import math
import statistics


def busy(seqlen: int, tokens: int, heads: int, rows: int, programs: int, causal: bool) -> float:
    """The busy fraction of the launch at `seqlen` (batch = tokens // seqlen, at least 1)."""
    batch, tiles = max(1, tokens // seqlen), math.ceil(seqlen / rows)
    per_head = [1.0] * (tiles // 2) + ([0.5] if tiles % 2 else []) if causal else [1.0] * tiles
    loads = [0.0] * programs
    for index, work in enumerate(per_head * (batch * heads)):
        loads[index % programs] += work
    return sum(loads) / (programs * max(loads))


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
    args = parser.parse_args(argv)
    fractions = [busy(n, args.tokens, args.heads, args.rows, args.programs, args.causal) for n in args.seqlens]
    for n, fraction in zip(args.seqlens, fractions, strict=True):
        print(f"N={n:>6}  busy {fraction:.3f}")
    if len(fractions) > 3:
        print(f"lost: median {1 - statistics.median(fractions):.1%}, worst {1 - min(fractions):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
