#!/usr/bin/env python3
"""Does a persistent forward lose its last round? Times the shipped forward at grid shapes with the persistent grid
at the SM count and at the fewest programs that keep its rounds (warpspec.balanced_programs), interleaved.

A persistent program walks units p, p + P, ... (warpspec._tile): the launch lasts ceil(units / P) units, while the
work is units / P. At the grid's shapes the units are powers of two — d=128: 2048 tiles of 128 rows without a mask,
1024 causal pairs — against P = 132 SMs, so 15.5 (7.76) rounds of work take 16 (8) rounds, and 128 programs would
take 16 (8) too, leaving 4 SMs idle, which under the H200's power cap may let the others clock higher
(docs/PERF.md v30). Each shape's grids are timed in turn, round after round (the order rotated a round), in one
process, since a difference of 1–3 % is within what separate processes move.

    python scripts/exp_persistent_waves.py --shapes 128:8192,128:8192:causal,64:1024:causal --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import fa2tune
from fa2tune import launcher, warpspec
from fa2tune.bench import attention_flops, random_qkv, time_cuda


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="128:8192,128:8192:causal", help="d:N[:causal], comma-separated")
    parser.add_argument("--programs", default="sm,balanced", help="persistent grids: sm (one or two an SM), "
                        "balanced (warpspec.balanced_programs) or a number")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N (heads·d stays 2048)")
    args = parser.parse_args(argv)
    balanced, slots = warpspec.balanced_programs, warpspec._sm_count(0)
    grids = args.programs.split(",")

    def use(grid: str) -> None:
        """Makes warpspec._grid size persistent grids by `grid`; launch plans keep their grid, so none is kept."""
        if grid == "balanced":
            warpspec.balanced_programs = balanced
        else:
            fixed = None if grid == "sm" else int(grid)
            warpspec.balanced_programs = lambda units, slots_: min(units, fixed or slots_)
        launcher.clear_plans()

    readings: dict[tuple[str, str], list[float]] = {}
    for shape in args.shapes.split(","):
        d, n, *mask = shape.split(":")
        head_dim, seqlen, causal = int(d), int(n), mask == ["causal"]
        batch, heads = max(1, args.tokens // seqlen), 2048 // head_dim
        q, k, v = random_qkv(batch, heads, seqlen, head_dim)
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode="fwd")
        run = lambda q=q, k=k, v=v, causal=causal: fa2tune.attention(q, k, v, causal=causal)
        outputs = []
        for grid in grids:  # compile and run each grid's launch once, outside the timing: the same tiles, same O
            use(grid)
            outputs.append(run())
            assert torch.equal(outputs[-1], outputs[0]), f"{shape}: grid {grid} gives another output"
        for round_ in range(args.rounds):
            for grid in grids[round_ % len(grids):] + grids[: round_ % len(grids)]:
                use(grid)
                ms = time_cuda(run).median_ms
                readings.setdefault((shape, grid), []).append(flops / (ms * 1e-3) / 1e12)
        del q, k, v, outputs, run
    warpspec.balanced_programs = balanced
    print(f"SMs {slots}; TFLOP/s, median of {args.rounds} interleaved rounds (readings)")
    for shape in args.shapes.split(","):
        base = statistics.median(readings[shape, grids[0]])
        for grid in grids:
            values = readings[shape, grid]
            print(f"{shape:>18} {grid:>9} {statistics.median(values):7.1f} {statistics.median(values) / base:6.3f}  "
                  + " ".join(f"{x:.1f}" for x in values))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
