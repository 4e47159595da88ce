#!/usr/bin/env python3
"""Where fused attention starts to beat standard attention: forward time (µs) against N, 16k tokens in all.

Providers: SDPA's math backend (standard attention in PyTorch), matmul-softmax-matmul written out in plain torch,
fa2tune, SDPA flash, cuDNN. The seed claims standard attention is competitive up to N ≈ 512; on the H200 with
bf16 it is slower than the fused kernels at every N from 128. Prints a table and, per provider, the ratio to
fa2tune. Needs a CUDA GPU.

    python scripts/bench_crossover.py --seqlens 128,256,512,1024,2048 --head-dim 64
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2tune
from fa2tune.tune.timing import time_cuda
from fa2tune.tune.workload import random_qkv


def _sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def _plain(q, k, v):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v


PROVIDERS = {
    "sdpa_math": _sdpa(SDPBackend.MATH),
    "plain_torch": _plain,
    "fa2tune": lambda q, k, v: fa2tune.attention(q, k, v),
    "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="128,256,512,1024,2048")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_crossover.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}: forward µs, {args.tokens} tokens, {args.heads} heads, d={args.head_dim}")
    print(f"{'N':>6} " + " ".join(f"{name:>12}" for name in PROVIDERS))
    for seqlen in map(int, args.seqlens.split(",")):
        q, k, v = random_qkv(max(1, args.tokens // seqlen), args.heads, seqlen, args.head_dim)
        cells = []
        for fn in PROVIDERS.values():
            try:
                cells.append(f"{time_cuda(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v)).median_ms * 1e3:>12.0f}")
            except RuntimeError as exc:  # a backend that does not take the shape
                cells.append(f"{'n/a':>12}")
                print(f"  {str(exc).splitlines()[0]}", file=sys.stderr)
        print(f"{seqlen:>6} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
