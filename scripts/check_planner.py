#!/usr/bin/env python3
"""Compiles every planner candidate for a GPU and records what the compiler allocated: the data behind
docs/PLANNER.md and the replay test tests/test_planner.py.

Compiling for a target needs no card (see fa2tune.probe), so this runs on any machine; the verdict "fits" is
Triton's own launch test, `shared <= DeviceInfo.smem_per_block_optin`. Compiles run in a process pool.

    python scripts/check_planner.py --gpu h200 --head-dims 64,128 --dtype bf16 \
        --csv docs/planner/nvidia-h200-compiler.csv
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import sys
import time

import torch

from fa2tune import device, planner
from fa2tune.types import KernelConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _compile(job: tuple[str, int, str, KernelConfig, tuple[int, int]]) -> dict:
    from fa2tune.probe import compile_config

    kernel, head_dim, dtype, cfg, capability = job
    report = compile_config(kernel, cfg, head_dim, DTYPES[dtype], causal=True, capability=capability)
    return dict(
        kernel=kernel,
        head_dim=head_dim,
        dtype=dtype,
        **cfg.to_dict(),
        shared_bytes=report.shared_bytes if report.shared_bytes is not None else "",
        error=report.error or "",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h200", help=f"one of {sorted(device.KNOWN_GPUS)}")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--kernels", default=",".join(planner.KERNELS))
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--csv", required=True)
    args = parser.parse_args(argv)
    info = device.known_gpu(args.gpu)
    jobs = [
        (kernel, head_dim, args.dtype, cfg, info.capability)
        for kernel in args.kernels.split(",")
        for head_dim in map(int, args.head_dims.split(","))
        for cfg in planner.candidates()
    ]
    start = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        rows = []
        for i, row in enumerate(pool.imap(_compile, jobs, chunksize=4)):
            rows.append(row)
            if (i + 1) % 100 == 0:
                print(f"{i + 1}/{len(jobs)} compiled, {time.time() - start:.0f} s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    failed = sum(1 for r in rows if r["error"])
    print(f"{len(rows)} configs compiled for {info.name} in {time.time() - start:.0f} s; {failed} failed to compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
