#!/usr/bin/env python3
"""The whole backward's time (fa2tune.api.ops.backward: δ, dK/dV, dQ or fused dQ, the casts) at dK/dV configs you
name, as `triton.testing.do_bench` medians; with --check, each after a float64 check of its gradients at a ragged
length.

profile_backward.py says where a backward's time goes (torch.profiler over ten calls) but does not resolve a few per
cent once the card has heated. This is the A/B instrument for template changes: run it from two checkouts in turn,
one process at a time, alternating, a few rounds, and compare each shape's median over the processes — the change's
effect is then apart from the card's drift between processes. Configs are named, so a template change that makes
the shipped entries stale still times the same config in both trees; where dQ is not fused into the dK/dV config,
the dQ kernel's config is the tree's own (its lookup) unless --dq-config names one.

    python scripts/time_backward.py --shape 128,8192,plain,64,128,4,2,ws,fused-dq \\
        --shape 96,8192,causal,64,128,4,2,ws,fused-dq,persistent --check

A shape is head_dim,seqlen,plain|causal,config (config: KernelConfig.parse's spelling). bf16, batch·N = 16k tokens,
16 heads (--heads): the grid's sizes; --kv-heads groups them (grouped-query attention).
"""

from __future__ import annotations

import argparse
import sys

import torch

TOKENS = 16384  # batch · N, as the project's grid
CHECK_LENGTH = 777  # not a multiple of any tile: the ragged rows and the padded statistics are exercised


def _parse_shape(text: str) -> tuple[int, int, bool, str]:
    parts = text.split(",", 3)
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in ("plain", "causal"):
        raise argparse.ArgumentTypeError(
            f"a shape is head_dim,seqlen,plain|causal,config (128,8192,causal,64,128,4,2,ws,fused-dq), got {text!r}"
        )
    return int(parts[0]), int(parts[1]), parts[2] == "causal", parts[3]


def _check(ops, head_dim: int, causal: bool, config, device: str = "cuda", group: int = 1) -> float:
    """The largest of dQ's, dK's and dV's error against float64 autograd through naive attention, relative to each
    gradient's largest value; `group` query heads a K/V head, as the timed shape has them."""
    from fa2tune.tune.reference import naive_attention
    from fa2tune.tune.workload import random_qkv

    torch.manual_seed(head_dim)
    heads_kv = max(1, 4 // group)
    q, k, v = random_qkv(2, heads_kv * group, CHECK_LENGTH, head_dim, device=device, heads_kv=heads_kv)
    do, scale = torch.randn_like(q), head_dim**-0.5
    o, lse = ops.forward(q, k, v, causal=causal, scale=scale)
    got = ops.backward(do, q, k, v, o, lse, causal=causal, scale=scale, dkdv_config=config)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(naive_attention(qd, kd, vd, causal=causal, scale=scale)[0], (qd, kd, vd), do.double())
    return max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def _time_ms(ops, head_dim: int, seqlen: int, causal: bool, config, dq_config, heads: int, rep_ms: int,
             kv_heads: int | None = None) -> float:  # fmt: skip
    """The tuner's timing (time_cuda: do_bench's median, a process's first reading discarded) of one backward of
    fresh inputs (batch · seqlen = TOKENS; K and V with kv_heads heads, None: `heads`)."""
    from fa2tune.tune.timing import time_cuda
    from fa2tune.tune.workload import random_qkv

    q, k, v = random_qkv(max(1, TOKENS // seqlen), heads, seqlen, head_dim, heads_kv=kv_heads or heads)
    do, scale = torch.randn_like(q), head_dim**-0.5
    o, lse = ops.forward(q, k, v, causal=causal, scale=scale)
    return time_cuda(
        lambda: ops.backward(do, q, k, v, o, lse, causal=causal, scale=scale, dkdv_config=config,
                             dq_config=dq_config),
        warmup_ms=100, rep_ms=rep_ms,
    ).median_ms  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=_parse_shape, action="append", required=True, help="repeatable")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="K/V heads, dividing --heads (grouped-query attention; default: --heads)")  # fmt: skip
    parser.add_argument("--check", action="store_true", help="check each config's gradients first (bf16 tolerance)")
    parser.add_argument("--rep-ms", type=int, default=600, help="do_bench's timing window a shape (default 600)")
    parser.add_argument("--dq-config", help="the dQ kernel's config where dQ is not fused (KernelConfig.parse)")
    args = parser.parse_args(argv)
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        parser.error(f"--kv-heads must divide --heads ({args.heads}); got {args.kv_heads}")
    if not torch.cuda.is_available():
        print("time_backward.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from triton.runtime.errors import OutOfResources

    from fa2tune.api import ops
    from fa2tune.config.types import KernelConfig
    from fa2tune.tune.timing import attention_flops

    print(f"{'d':>4} {'N':>6} {'mask':<6} {'dK/dV config':<40} {'ms':>8} {'TFLOP/s':>8} {'check':>9}")
    failed = False
    for head_dim, seqlen, causal, spelling in args.shape:
        config = KernelConfig.parse(spelling)
        group = args.heads // (args.kv_heads or args.heads)
        dq_config = None if args.dq_config is None or config.fused_dq else KernelConfig.parse(args.dq_config)
        try:
            error = _check(ops, head_dim, causal, config, group=group) if args.check else None
            ms = _time_ms(ops, head_dim, seqlen, causal, config, dq_config, args.heads, args.rep_ms, args.kv_heads)
        except OutOfResources as exc:  # a config past the card's shared memory or registers: the other shapes run
            print(f"{head_dim:>4} {seqlen:>6} {'causal' if causal else 'plain':<6} {config.label():<40} does not fit: "
                  f"{str(exc).splitlines()[0]}", flush=True)  # fmt: skip
            failed = True
            continue
        failed |= error is not None and error > 2e-2
        flops = attention_flops(max(1, TOKENS // seqlen), args.heads, seqlen, seqlen, head_dim, causal=causal,
                                mode="bwd")  # fmt: skip
        checked = "-" if error is None else f"{error:.1e}"
        print(f"{head_dim:>4} {seqlen:>6} {'causal' if causal else 'plain':<6} {config.label():<40} {ms:>8.4f} "
              f"{flops / ms / 1e9:>8.0f} {checked:>9}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
