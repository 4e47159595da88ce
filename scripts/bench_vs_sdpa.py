#!/usr/bin/env python3
"""Forward TFLOP/s of fa2tune beside PyTorch SDPA's flash, cuDNN and efficient backends, in one run on one GPU.

Shapes keep batch·N = 16k tokens and heads·d = 2048 (the PERF-NOTES grid). FLOPs = 4·B·H·N²·d (× ~0.5 causal),
time = median of triton.testing.do_bench. Prints a table last; --csv writes every number.

    python scripts/bench_vs_sdpa.py --head-dims 64,128 --seqlens 1024,4096,8192,16384 --csv $OUT/bench.csv
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2tune
from fa2tune.bench import attention_flops, random_qkv, time_cuda

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _provider(name: str, causal: bool):
    if name == "fa2tune":
        return lambda q, k, v: fa2tune.attention(q, k, v, causal=causal)
    backend = SDPA_BACKENDS[name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,8192,16384")
    parser.add_argument("--providers", default="fa2tune,sdpa_flash,sdpa_cudnn,sdpa_efficient")
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N")
    parser.add_argument("--width", type=int, default=2048, help="heads·d")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_vs_sdpa.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    providers = args.providers.split(",")
    rows = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {__import__('triton').__version__}")
    for head_dim in map(int, args.head_dims.split(",")):
        for seqlen in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                batch, heads = max(1, args.tokens // seqlen), args.width // head_dim
                q, k, v = random_qkv(batch, heads, seqlen, head_dim)
                flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                for name in providers:
                    fn = _provider(name, causal)
                    try:
                        out = fn(q, k, v)
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        timing = time_cuda(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v))
                        tflops = timing.tflops(flops)
                    except RuntimeError as exc:  # a backend that does not support the shape
                        err, tflops = float("nan"), float("nan")
                        print(f"{name} d={head_dim} N={seqlen} causal={causal}: {str(exc).splitlines()[0]}")
                    rows.append(
                        dict(provider=name, head_dim=head_dim, seqlen=seqlen, causal=causal, mode="fwd",
                             tflops=round(tflops, 1), rel_err_vs_flash=f"{err:.1e}")
                    )  # fmt: skip
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"\n{'d':>4} {'N':>6} {'causal':>6} " + " ".join(f"{p:>14}" for p in providers))
    for i in range(0, len(rows), len(providers)):
        group = rows[i : i + len(providers)]
        r = group[0]
        cells = " ".join(f"{g['tflops']:>14}" for g in group)
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {r['causal']!s:>6} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
