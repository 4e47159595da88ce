#!/usr/bin/env python3
"""Peak extra GPU memory of causal fwd+bwd as N grows: fa2tune and SDPA's flash keep O(N), standard attention O(N²).

B=1, H=16, d=128, bf16. "Extra" = peak allocated during forward+backward minus what the inputs and dO hold.

    python scripts/bench_memory.py --seqlens 1024,4096,8192,16384,32768
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2tune
from fa2tune.tune.workload import random_qkv

PROVIDERS = {
    "fa2tune": lambda q, k, v: fa2tune.attention(q, k, v, causal=True),
    "sdpa_math (standard)": lambda q, k, v: _sdpa(SDPBackend.MATH, q, k, v),
    "sdpa_flash": lambda q, k, v: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v),
}


def _sdpa(backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def peak_extra_mib(fn, seqlen: int) -> float:
    q, k, v = random_qkv(1, 16, seqlen, 128, requires_grad=True)
    do = torch.randn_like(q)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v), do)
    torch.cuda.synchronize()
    del grads
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="1024,4096,8192,16384,32768")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_memory.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}: peak extra MiB of causal fwd+bwd, B=1 H=16 d=128 bf16")
    print(f"{'N':>7} " + " ".join(f"{name:>22}" for name in PROVIDERS))
    for seqlen in map(int, args.seqlens.split(",")):
        cells = []
        for fn in PROVIDERS.values():
            try:
                cells.append(f"{peak_extra_mib(fn, seqlen):>22,.0f}")
            except torch.OutOfMemoryError:
                cells.append(f"{'out of memory':>22}")
            torch.cuda.empty_cache()
        print(f"{seqlen:>7} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
