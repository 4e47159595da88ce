#!/usr/bin/env python3
"""Compiles every planner candidate for a GPU and records what the compiler allocated: the data behind
docs/PLANNER.md and the replay test tests/test_planner.py.

Compiling for a target needs no card (see fa2tune.tune.probe), so this runs on any machine; the verdict "fits" is
Triton's own launch test, `shared <= DeviceInfo.smem_per_block_optin`. Compiles run in a process pool.

    python scripts/check_planner.py --gpu h200 --head-dims 64,128 --dtype bf16 \
        --csv docs/planner/nvidia-h200-compiler.csv

--warpspec checks the warp-specialized kernels instead: every candidate planner.check accepts at each head dim,
compiled plain and causal; a false accept is a config that fails to compile, needs more shared memory than the GPU
has, or spills (the consumers' STACK > 0: a spill the register model should have seen). Head dims that round up to
the same chunks (fa2tune.config.head_chunks) compile the same kernel: multiples of 16 cover them all.

    python scripts/check_planner.py --warpspec --head-dims $(seq -s, 16 16 256) --csv $OUT/warpspec.csv
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import sys
import time

from fa2tune.config import device, planner
from fa2tune.config.inputs import DTYPES_BY_NAME
from fa2tune.config.types import KernelConfig
from fa2tune.tune.probe import EXAMPLE_SEQLEN


def _compile(job: tuple[str, int, str, KernelConfig, tuple[int, int], bool, int]) -> dict:
    from fa2tune.tune.probe import compile_config, cuobjdump

    kernel, head_dim, dtype, cfg, capability, causal, seqlen = job
    report = compile_config(kernel, cfg, head_dim, DTYPES_BY_NAME[dtype], causal=causal, capability=capability,
                            seqlen=seqlen)  # fmt: skip
    stack = ""
    if report.cubin is not None and cfg.warp_specialized:
        usage = cuobjdump(report.cubin, "-res-usage").split()
        stack = max(int(word.split(":")[1]) for word in usage if word.startswith("STACK:"))
    return dict(
        kernel=kernel,
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        pipeline_qk=cfg.pipeline_qk,
        config=cfg.label(),
        shared_bytes=report.shared_bytes if report.shared_bytes is not None else "",
        stack_bytes=stack,
        error=report.error or "",
    )


def summarize_warpspec(rows: list[dict], gpu: str = "h200") -> str:
    """A markdown table of the warp-specialized candidates the planner accepted, by kernel: how many compiled, and its
    false accepts — compile errors, shared memory past the GPU's, spills — with the worst offenders named."""
    limit = device.known_gpu(gpu).smem_per_block
    out = ["| kernel | accepted, compiled | compile errors | over shared memory | spills (STACK > 0) | worst |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for kernel in planner.KERNELS:
        group = [r for r in rows if r["kernel"] == kernel]
        if not group:
            continue
        errors = [r for r in group if r["error"]]
        over = [r for r in group if not r["error"] and int(r["shared_bytes"]) > limit]
        spills = [r for r in group if not r["error"] and int(r["stack_bytes"] or 0) > 0]
        worst = max(spills, key=lambda r: int(r["stack_bytes"]), default=None)
        named = "-" if worst is None else f"d={worst['head_dim']} {worst['config']} causal={worst['causal']}: " \
                                          f"{worst['stack_bytes']} B"
        out.append(f"| {kernel} | {len(group)} | {len(errors)} | {len(over)} | {len(spills)} | {named} |")
    return "\n".join(out)


def summarize(csv_path: str, gpu: str = "h200") -> str:
    """A markdown table comparing the SRAM model (and the seed's rule) with the compiler's verdicts."""
    import statistics

    info = device.known_gpu(gpu)
    limit = info.smem_per_block
    with open(csv_path) as handle:
        rows = list(csv.DictReader(handle))
    out = ["| kernel | d | compiled | fit (compiler) | model: false accepts | model: false rejects | "
           "prediction / actual, configs > 25 % of the budget | seed rule: false accepts | spill rejections |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kernel in planner.KERNELS:
        for head_dim in sorted({int(r["head_dim"]) for r in rows}):
            group = [r for r in rows if r["kernel"] == kernel and int(r["head_dim"]) == head_dim]
            if not group:
                continue
            fa = fr = fits = seed_fa = spills = 0
            ratios = []
            for r in group:
                dtype = DTYPES_BY_NAME[r["dtype"]]
                cfg = KernelConfig(int(r["block_m"]), int(r["block_n"]), int(r["num_warps"]), int(r["num_stages"]))
                shared = int(r["shared_bytes"])
                predicted = planner.sram_bytes(cfg, head_dim, dtype, kernel)
                actual_fits, model_fits = shared <= limit, predicted <= limit
                fits += actual_fits
                fa += model_fits and not actual_fits
                fr += actual_fits and not model_fits
                seed_fa += planner.seed_rule_bytes(cfg, head_dim, dtype) <= limit and not actual_fits
                reason = planner.check(cfg, info, head_dim, dtype, kernel)
                spills += reason is not None and reason.startswith("registers")
                if shared > limit // 4:
                    ratios.append(predicted / shared)
            spread = "-"
            if ratios:
                spread = f"{min(ratios):.2f} – {max(ratios):.2f} (median {statistics.median(ratios):.2f})"
            out.append(f"| {kernel} | {head_dim} | {len(group)} | {fits} | {fa} | {fr} ({fr / max(fits, 1):.0%}) | "
                       f"{spread} | {seed_fa} | {spills} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h200", help=f"one of {sorted(device.KNOWN_GPUS)}")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES_BY_NAME))
    parser.add_argument("--kernels", default=",".join(planner.KERNELS))
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--csv", required=True)
    parser.add_argument("--summarize", action="store_true", help="only print the comparison table of an existing CSV")
    parser.add_argument("--warpspec", action="store_true",
                        help="the warp-specialized candidates the planner accepts, plain and causal (see above)")
    parser.add_argument("--seqlen", type=int, default=EXAMPLE_SEQLEN,
                        help="the example call's length the compiles specialize for: one that is not a multiple of 16 "
                             "compiles the code such calls run (fa2tune.tune.probe.compile_config)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.csv, args.gpu))
        return 0
    info = device.known_gpu(args.gpu)
    if args.warpspec:
        dtype = DTYPES_BY_NAME[args.dtype]
        jobs = [
            (kernel, head_dim, args.dtype, cfg, info.capability, causal, args.seqlen)
            for kernel in args.kernels.split(",")
            for head_dim in map(int, args.head_dims.split(","))
            for cfg in planner.candidates(kernel, head_dim)
            if cfg.warp_specialized and planner.check(cfg, info, head_dim, dtype, kernel) is None
            for causal in (False, True)
        ]
    else:
        jobs = [
            (kernel, head_dim, args.dtype, cfg, info.capability, True, args.seqlen)
            for kernel in args.kernels.split(",")
            for head_dim in map(int, args.head_dims.split(","))
            for cfg in planner.candidates()
            if not cfg.warp_specialized
        ]
    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    rows = []
    with mp.get_context("spawn").Pool(args.workers) as pool, open(args.csv, "w", newline="") as handle:
        writer = None
        for i, row in enumerate(pool.imap(_compile, jobs, chunksize=4)):
            if writer is None:
                writer = csv.DictWriter(handle, fieldnames=list(row))
                writer.writeheader()
            writer.writerow(row)  # row by row: a long run that is stopped keeps what it compiled
            handle.flush()
            rows.append(row)
            if (i + 1) % 100 == 0:
                print(f"{i + 1}/{len(jobs)} compiled, {time.time() - start:.0f} s", flush=True)
    failed = sum(1 for r in rows if r["error"])
    print(f"{len(rows)} configs compiled for {info.name} in {time.time() - start:.0f} s; {failed} failed to compile")
    print(summarize_warpspec(rows, args.gpu) if args.warpspec else summarize(args.csv, args.gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
