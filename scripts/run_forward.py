#!/usr/bin/env python3
"""Runs fa2tune.attention's forward a few times at one of the benchmark grid's shapes (bf16, batch·N tokens,
heads·d = 2048, the shipped configs): the program a profiler wraps, so a profile names the shape it measured.

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:_attn_fwd \
        --launch-skip 2 --launch-count 1 python3 scripts/run_forward.py --head-dim 64 --seqlen 512 --causal
"""

from __future__ import annotations

import argparse
import sys

import torch

import fa2tune
from fa2tune.tune.workload import random_qkv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N (heads·d stays 2048)")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    batch, heads = max(1, args.tokens // args.seqlen), max(1, 2048 // args.head_dim)
    q, k, v = random_qkv(batch, heads, args.seqlen, args.head_dim, device=args.device)
    for _ in range(args.calls):
        out = fa2tune.attention(q, k, v, causal=args.causal)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    print(f"d={args.head_dim} N={args.seqlen} causal={args.causal} batch={batch} heads={heads}: "
          f"{args.calls} forward calls, |O| mean {out.float().abs().mean().item():.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
