#!/usr/bin/env python3
"""Host (CPU) time fa2tune spends per call outside the kernels: the Python path of attention() and its backward.

The kernel launches are replaced by no-ops, so the figure is fa2tune's own overhead (argument checks, config
lookup, autograd), not Triton's launcher or the GPU. For a short sequence this decides the speed: a forward at
N=128 runs ~40-100 µs on an H200, and a GPU that finishes before the host has launched the next kernel waits.

    python scripts/bench_host_overhead.py            # the eager path attention() takes
    python scripts/bench_host_overhead.py --op       # the custom op torch.compile sees, called directly
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU needed: nothing is launched

import torch

import fa2tune
from fa2tune import launcher
from fa2tune.types import Mask


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _time_us(fn, repeats: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="store_true", help="call the custom op (the torch.compile path) instead")
    args = parser.parse_args(argv)
    launcher._kernel = lambda *a, **k: _NoLaunch()
    q, k, v = (torch.randn(1, 2, 64, 128, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    if args.op:
        attend = lambda *t: launcher._apply_op(*t, Mask(causal=True), 0.1, None)[0]
    else:
        attend = lambda *t: fa2tune.attention(*t, causal=True)
    detached = [t.detach() for t in (q, k, v)]
    rows = {
        "forward, no grad": lambda: attend(*detached),
        "forward, grad": lambda: attend(q, k, v),
        "forward + backward": lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), do),
    }
    print(f"# host µs per call, {'custom op' if args.op else 'attention()'}, kernels not launched")
    for name, fn in rows.items():
        print(f"{name:>20} {_time_us(fn):8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
