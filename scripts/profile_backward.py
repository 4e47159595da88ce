#!/usr/bin/env python3
"""Where fa2tune's backward spends its time: each kernel's device time (torch.profiler), at the tuned configs or
at dK/dV configs you name, beside the tensor-core rate each kernel reaches on its own matmuls.

The backward is three launches (templates/bwd.py.jinja): δ = rowsum(dO∘O), dK/dV (4 tile matmuls per step:
QKᵀ, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q) and dQ (3: QKᵀ, dO·Vᵀ, dS·K). The backward's FLOP count has 5 matmuls, so the pair
does 7/5 of the counted work; the "own" rate below counts each kernel's own matmuls.

    python scripts/profile_backward.py                                   # tuned configs, d=64/128, N=8k
    python scripts/profile_backward.py --head-dims 128 --dkdv 64,64,4,2 --dkdv 64,128,8,3 --causal
    python scripts/profile_backward.py --head-dims 128 --dkdv 64,128,4,2,ws      # the warp-specialized dK/dV (Hopper)
    python scripts/profile_backward.py --head-dims 128 --group 4 --causal          # GQA: 4 query heads a K/V head
"""

from __future__ import annotations

import argparse
import sys

import torch

MATMULS = {"dkdv": 4, "_dq": 3}  # tile matmuls per (Q tile, K tile) pair, by kernel-name fragment


def _profile(d: int, n: int, causal: bool, configs: list, group: int = 1) -> None:
    """Prints each backward kernel's time at each dK/dV config (None: the tuned one), for one head dim; `group`
    query heads a K/V head (grouped-query attention)."""
    from fa2tune.api import ops
    from fa2tune.tune.timing import attention_flops, kernel_times_ms
    from fa2tune.tune.workload import random_qkv

    batch, heads = max(1, 16384 // n), 2048 // d
    q, k, v = random_qkv(batch, heads, n, d, heads_kv=heads // group)
    do = torch.randn_like(q)
    o, lse = ops.forward(q, k, v, causal=causal, scale=d**-0.5)
    matmul_flops = attention_flops(batch, heads, n, n, d, causal=causal) / 2  # one tile matmul's FLOPs
    for config in configs:
        times = kernel_times_ms(
            lambda config=config: ops.backward(
                do, q, k, v, o, lse, causal=causal, scale=d**-0.5, dkdv_config=config
            )
        )
        label = "tuned" if config is None else config.label()
        for name, ms in sorted(times.items()):
            count = next((m for frag, m in MATMULS.items() if frag in name), 0)
            if config is not None and config.fused_dq and "dkdv" in name:
                count += 1  # dS·K too: dQ fused in
            own = f"{count * matmul_flops / ms / 1e9:.0f}" if count else "-"
            print(f"{d:>4} {label:<40} {name[:22]:<22} {ms:>7.3f} {own:>11}")
        print(f"{d:>4} {label:<40} {'total':<22} {sum(times.values()):>7.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads a K/V head (GQA); must divide each head dim's 2048 // d heads")  # fmt: skip
    parser.add_argument(
        "--dkdv",
        action="append",
        default=[],
        help="BLOCK_M,BLOCK_N,warps,stages[,switch words of KernelConfig.label] (KernelConfig.parse); repeatable",
    )
    args = parser.parse_args(argv)
    head_dims = [int(d) for d in args.head_dims.split(",")]
    uneven = [d for d in head_dims if args.group < 1 or (2048 // d) % args.group]
    if uneven:
        parser.error(f"--group must be >= 1 and divide the 2048 // d query heads of every head dim; got "
                     f"{args.group} for d = {', '.join(map(str, uneven))}")  # fmt: skip
    if not torch.cuda.is_available():
        print("profile_backward.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from fa2tune.config.types import KernelConfig

    configs = [None] + [KernelConfig.parse(c) for c in args.dkdv]
    print(f"{'d':>4} {'dK/dV config':<40} {'kernel':<22} {'ms':>7} {'own TFLOP/s':>11}")
    for d in head_dims:
        _profile(d, args.seqlen, args.causal, configs, args.group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
