#!/usr/bin/env python3
"""Does a persistent forward lose its last round? Times the shipped forward at grid shapes with the persistent grid
at the SM count, at a number of programs of your choosing, with a part-empty last round's tiles cut into pieces
(fa2tune/split_tail.py), or with a causal launch's last heads dealt out tile by tile (fa2tune/causal_tail.py),
interleaved.

A persistent program walks units p, p + P, ... (warpspec._tile): the launch lasts ceil(units / P) units, while the
work is units / P. At the grid's shapes the units are powers of two — d=128: 2048 tiles of 128 rows without a mask,
1024 causal pairs — against P = 132 SMs, so 15.5 (7.76) rounds of work take 16 (8) rounds, and 128 programs would
take 16 (8) too, leaving 4 SMs idle (docs/PERF.md v30: within the noise). Each shape's grids are timed in turn,
round after round (the order rotated a round), in one process, since a difference of 1–3 % is within what separate
processes move.

    python scripts/exp_persistent_waves.py --shapes 128:8192,128:8192:causal,64:1024:causal --programs sm,128
    python scripts/exp_persistent_waves.py --shapes 128:16384,64:4096 --programs sm,split --rounds 7
    python scripts/exp_persistent_waves.py --shapes 128:8192:causal,64:512:causal --programs sm,tail
    python scripts/exp_persistent_waves.py --shapes 128:4096:causal --programs sm,tail --mode fwd+bwd
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

import fa2tune
from fa2tune.launch import launcher, warpspec
from fa2tune.tune.timing import attention_flops, time_cuda
from fa2tune.tune.workload import random_qkv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="128:8192,128:8192:causal", help="d:N[:causal], comma-separated")
    parser.add_argument("--programs", default="sm,split", help="persistent grids: sm (one or two an SM, no cut, "
                        "causal in pairs only), split (one an SM, a part-empty last round's tiles cut: "
                        "fa2tune/split_tail.py), tail (one or two an SM, causal: the last heads tile by tile, "
                        "fa2tune/causal_tail.py) or a number (of SMs the grid is sized for, neither)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N (heads·d stays 2048)")
    parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd",
                        help="fwd+bwd: the training call, forward then backward (the tail is in both)")  # fmt: skip
    args = parser.parse_args(argv)
    sm_count, slots = warpspec._sm_count, warpspec._sm_count(0)
    grids = args.programs.split(",")

    def use(grid: str) -> None:
        """Sizes persistent grids by `grid`, cuts a last round's tiles only for "split", deals a causal tail only
        for "tail"; launch plans keep their grid, so none is kept."""
        os.environ["FA2TUNE_SPLIT_TAIL"] = "1" if grid == "split" else "0"
        os.environ["FA2TUNE_CAUSAL_TAIL"] = "1" if grid == "tail" else "0"
        warpspec._sm_count = sm_count if grid in ("sm", "split", "tail") else (lambda index, n=int(grid): n)
        launcher.clear_plans()

    readings: dict[tuple[str, str], list[float]] = {}
    for shape in args.shapes.split(","):
        d, n, *mask = shape.split(":")
        head_dim, seqlen, causal = int(d), int(n), mask == ["causal"]
        batch, heads = max(1, args.tokens // seqlen), 2048 // head_dim
        training = args.mode == "fwd+bwd"
        q, k, v = random_qkv(batch, heads, seqlen, head_dim, requires_grad=training)
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode=args.mode)
        if training:
            do = torch.randn_like(q)
            run = lambda q=q, k=k, v=v, do=do, causal=causal: torch.autograd.grad(
                fa2tune.attention(q, k, v, causal=causal), (q, k, v), do)[0]  # fmt: skip
        else:
            run = lambda q=q, k=k, v=v, causal=causal: fa2tune.attention(q, k, v, causal=causal)
        outputs = []
        for grid in grids:  # compile and run each grid's launch once, outside the timing: the same O or dQ (a split
            use(grid)        # tail merges its pieces, a fused dQ adds in arrival order: equal up to rounding)
            outputs.append(run())
            error = (outputs[-1].float() - outputs[0].float()).abs().max().item()
            scale = max(1.0, outputs[0].float().abs().max().item())
            assert error < 1e-2 * scale, f"{shape}: grid {grid} gives another output (max |difference| {error:.3g})"
        for round_ in range(args.rounds):
            for grid in grids[round_ % len(grids):] + grids[: round_ % len(grids)]:
                use(grid)
                ms = time_cuda(run).median_ms
                readings.setdefault((shape, grid), []).append(flops / (ms * 1e-3) / 1e12)
        del q, k, v, outputs, run
    warpspec._sm_count = sm_count
    os.environ.pop("FA2TUNE_SPLIT_TAIL", None)
    os.environ.pop("FA2TUNE_CAUSAL_TAIL", None)
    print(f"SMs {slots}; {args.mode} TFLOP/s, median of {args.rounds} interleaved rounds (readings)")
    for shape in args.shapes.split(","):
        base = statistics.median(readings[shape, grids[0]])
        for grid in grids:
            values = readings[shape, grid]
            print(f"{shape:>18} {grid:>9} {statistics.median(values):7.1f} {statistics.median(values) / base:6.3f}  "
                  + " ".join(f"{x:.1f}" for x in values))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
