#!/usr/bin/env python3
"""Throughput of one forward config over time from idle, beside the SM clock and power nvidia-smi reads: how fast
a power-capped GPU runs the kernel once it has drawn its cap, and how long its post-idle boost lasts (docs/PERF.md
v27: on the H200 ~100 ms, 10 % above the ~615 TFLOP/s it then holds at d=128 N=8k, 1695 MHz at 700 W).

    python scripts/bench_clock_soak.py --seqlen 8192 --head-dim 128 --rounds 2

Each round idles for --idle seconds, then launches the forward back to back for --seconds, each launch between
CUDA events; it prints the mean TFLOP/s of every window of 20 launches, then the clock samples (every 100 ms).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time

import torch

from fa2tune.config.types import KernelConfig
from fa2tune.launch import launcher
from fa2tune.tune.timing import attention_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--config",
        default="128,128,4,2,ws,persistent",
        help="block_m,block_n,warps,stages[,switch words of KernelConfig.label] (KernelConfig.parse)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    cfg = KernelConfig.parse(args.config)
    d, seqlen = args.head_dim, args.seqlen
    batch, heads = max(1, 16384 // seqlen), 2048 // d
    q, k, v = (torch.randn(batch, heads, seqlen, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal=False)

    def run():
        launcher.forward(q, k, v, causal=False, scale=d**-0.5, config=cfg, out=out)

    run()  # compile outside the rounds
    torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile("w+", suffix=".csv") as log:
        query = "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu"
        smi = subprocess.Popen(["nvidia-smi", query, "--format=csv,noheader", "-lms", "100"], stdout=log)
        for round_ in range(args.rounds):
            time.sleep(args.idle)
            events, start = [], time.monotonic()
            while time.monotonic() - start < args.seconds:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                run()
                end.record()
                events.append((begin, end))
                if len(events) % 20 == 0:
                    torch.cuda.synchronize()  # keeps the queue short: each event pair times its own launch
            torch.cuda.synchronize()
            rates = [flops / b.elapsed_time(e) / 1e9 for b, e in events]
            windows = [sum(rates[i : i + 20]) / len(rates[i : i + 20]) for i in range(0, len(rates), 20)]
            print(f"round {round_}: {len(rates)} launches, TFLOP/s by 20: {' '.join(f'{w:.0f}' for w in windows)}")
        time.sleep(0.5)
        smi.terminate()
        smi.wait()
        log.seek(0)
        print(log.read())


if __name__ == "__main__":
    main()
