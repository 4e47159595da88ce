#!/usr/bin/env python3
"""How close the tuner gets to exhaustive search, replayed over the recorded H200 forward sweeps (no GPU).

For each (head_dim, causal) of docs/bench/nvidia-h200-sweep-fwd-v1.csv and 5 seeds, the study starts from the
median config (not the planner default, which was set from this sweep) and may time a fraction of the configs.
Prints, per fraction: runs within 2 % of the best, of all runs; worst and mean (best TFLOP/s / found TFLOP/s).

    python scripts/replay_tuner.py [--batch 16]

--batch B replays the GPU tune's batched study (B configs asked, compiled together, then timed); --lookahead
keeps two batches in flight as the GPU tune does (the next asked before this one is told).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

from fa2tune.config.device import known_gpu
from fa2tune.tune import tuner
from fa2tune.tune.cost import load_sweep

SWEEP = Path(__file__).resolve().parent.parent / "docs" / "bench" / "nvidia-h200-sweep-fwd-v1.csv"

warnings.filterwarnings("ignore")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="configs per ask/compile/time round")
    parser.add_argument(
        "--lookahead",
        action="store_true",
        help="two batches in flight, as a GPU tune runs: the next asked before this one is told",
    )
    args = parser.parse_args()
    print(f"batch {args.batch}{' lookahead' if args.lookahead else ''}")
    compiled_at_once = (lambda configs: lambda cfg: None) if args.lookahead else None  # every compile succeeds
    print(f"{'fraction':>8} {'within 2%':>10} {'worst':>6} {'mean':>6}")
    for fraction in (0.25, 0.4, 0.5):
        ok, ratios = 0, []
        for head_dim, causal in [(128, False), (128, True), (64, False), (64, True)]:
            table = load_sweep(SWEEP, head_dim=head_dim, causal=causal)
            space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
            median = sorted(table, key=table.get)[len(table) // 2]
            best = min(table.values())
            for seed in range(5):
                measure = table.__getitem__  # every config of the space has a recorded timing
                result = tuner.tune(
                    tuner.Target(
                        device=known_gpu("h200"),
                        kernel="fwd",
                        head_dim=head_dim,
                        dtype=torch.bfloat16,
                        causal=causal,
                        space=space,
                        default=median,
                    ),
                    measure,
                    tuner.Options(
                        trials=max(1, int(len(space) * fraction)),
                        seed=seed,
                        remeasure_top=1,
                        batch_size=args.batch,
                        prepare=compiled_at_once,
                    ),
                )
                ok += result.best_ms <= best * 1.02
                ratios.append(best / result.best_ms)
        print(f"{fraction:>8} {ok:>6}/{len(ratios):<3} {min(ratios):>6.3f} {statistics.mean(ratios):>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
