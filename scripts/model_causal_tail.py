#!/usr/bin/env python3
"""How evenly the causal persistent kernels spread their work, with pairs alone and with the causal tail
(fa2tune/causal_tail.py), at the shipped configs — the model behind docs/PERF.md v31's tables. No GPU, no timing.

For each kernel (fwd, bwd_dkdv, bwd_dq), head dim and length, the shipped bf16 causal entry of the length's bucket
(tuned_configs/nvidia-h200.yaml, or --configs), when it is persistent: the longest program's modelled steps over an
even share (causal_tail.program_loads: each tile its K/V or Q steps plus causal_tail.TILE_OVERHEAD_STEPS) with every
tile in a pair, and with the tail causal_tail.plan picks. Shapes as the issue-6 grid: batch·N = --tokens, heads·d =
--width, on --sms SMs.

    python scripts/model_causal_tail.py                                  # the grid's lengths, a row each
    python scripts/model_causal_tail.py --kernels fwd --seqlens 500:16384:125 --summary
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from fa2tune.config import lengths, planner, store
from fa2tune.launch import causal_tail

SHIPPED = Path(__file__).resolve().parents[1] / "tuned_configs" / "nvidia-h200.yaml"


def _lengths(spec: str) -> list[int]:
    """"512,1024" or "start:stop:step" (stop included)."""
    if ":" in spec:
        start, stop, step = (int(x) for x in spec.split(":"))
        return list(range(start, stop + 1, step))
    return [int(x) for x in spec.split(",")]


def row(kernel: str, head_dim: int, seqlen: int, configs: dict, tokens: int, width: int, sms: int):
    """(config, tail heads, pairs-alone / even, with-tail / even) for one shape, or None where the shipped entry of
    its bucket is not a causal persistent one (it has no tail) or, for bwd_dq, does not run."""
    bucket = lengths.bucket_of(seqlen)
    config = configs.get((kernel, head_dim, bucket))
    if config is None or not config.schedule.persistent:
        return None
    dkdv = configs.get(("bwd_dkdv", head_dim, bucket))
    if kernel == "bwd_dq" and dkdv is not None and dkdv.fused_dq:
        return None  # that backward fuses dQ into its dK/dV kernel: no dQ kernel runs
    heads = width // head_dim
    batch_heads = max(1, tokens // seqlen) * heads
    programs = planner.programs_per_sm(config) * sms
    if kernel == "bwd_dkdv":
        tiles = -(-seqlen // config.block_n)
        costs = causal_tail.dkdv_costs(tiles, config.block_n, config.block_m, seqlen, seqlen, 1)
    else:
        tiles = -(-seqlen // config.block_m)
        costs = causal_tail.forward_costs(tiles, config.block_m, config.block_n, seqlen, seqlen)
    programs = min(programs, tiles * batch_heads)  # warpspec._grid: no more programs than tiles
    _, tail_heads = causal_tail.plan(batch_heads, programs, costs)
    weights = torch.tensor(costs, dtype=torch.float64)
    even = weights.sum().item() * batch_heads / programs
    alone = causal_tail.program_loads(batch_heads, programs, 0, weights).max().item() / even
    tail = causal_tail.program_loads(batch_heads, programs, tail_heads, weights).max().item() / even
    return config, tail_heads, alone, tail


def shipped_configs(path: Path) -> dict:
    """{(kernel, head_dim, bucket): config} of the file's bf16 causal entries without band or packed variants."""
    _, entries = store.read_file(path)
    return {(e.key.kernel, e.key.head_dim, e.key.seqlen_bucket): e.config for e in entries
            if e.key.dtype == "bf16" and e.key.causal and not e.key.window and not e.key.varlen}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="fwd,bwd_dkdv,bwd_dq")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help='"a,b,…" or "start:stop:step"')
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N")
    parser.add_argument("--width", type=int, default=2048, help="heads·d")
    parser.add_argument("--sms", type=int, default=132, help="the H200 has 132")
    parser.add_argument("--configs", type=Path, default=SHIPPED, help="a tuned-config file")
    parser.add_argument("--summary", action="store_true", help="median and max over the lengths, not a row each")
    args = parser.parse_args(argv)
    configs = shipped_configs(args.configs)
    print(f"longest program / even share, causal, {args.tokens} tokens, heads·d {args.width}, {args.sms} SMs")
    for kernel in args.kernels.split(","):
        for head_dim in (int(d) for d in args.head_dims.split(",")):
            rows = [(n, row(kernel, head_dim, n, configs, args.tokens, args.width, args.sms))
                    for n in _lengths(args.seqlens)]  # fmt: skip
            rows = [(n, r) for n, r in rows if r is not None]
            if args.summary and rows:
                alone, tail = [r[2] for _, r in rows], [r[3] for _, r in rows]
                print(f"{kernel:>8} d={head_dim:<3} {len(rows)} lengths: pairs alone median "
                      f"{statistics.median(alone):.3f} max {max(alone):.3f}; with the tail median "
                      f"{statistics.median(tail):.3f} max {max(tail):.3f}")  # fmt: skip
                continue
            for n, (config, tail_heads, alone, tail) in rows:
                print(f"{kernel:>8} d={head_dim:<3} N={n:<6} {config.label():<28} pairs alone {alone:.3f}  "
                      f"tail of {tail_heads:>3} heads {tail:.3f}  ({alone / tail - 1:+.1%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
