#!/usr/bin/env python3
"""Times every block config of a small grid for one kernel at one shape: the data behind defaults.default_config.

Configs are compiled first in a pool of processes (compile_pool.precompile; Triton's disk cache keeps the binaries),
then timed one at a time in this process (workload.make_measure, the tuner's own objective). A config that fails
to compile is reported with its reason, never stops the sweep.
For a backward kernel the other backward kernel keeps its default config, and the time is the whole backward.
--rounds R times every config R times, round by round, each round starting one config further on, and reports the
median: on the H200 a config's reading moves 3–10 % with its place in the order (the first timed reads high, the
clock dips every ~1.3 s under load), which a single pass in a fixed order turns into rankings.

    python scripts/sweep_configs.py --kernel fwd --head-dims 64,128 --seqlen 8192 --csv $OUT/sweep_fwd.csv
    python scripts/sweep_configs.py --kernel fwd --head-dims 128 --seqlen 1024 --block-m 128 --block-n 64,128 \
        --warps 4 --stages 2,3 --switches ws,ws+pingpong,ws+persistent   # one tile per program, or one program per SM
    python scripts/sweep_configs.py --kernel fwd --head-dims 64 --seqlen 8192 --causal yes --heads 32 --kv-heads 8 \
        --block-m 128,192 --block-n 128 --warps 4 --stages 3 --switches ws+persistent --rounds 3   # a GQA model's
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fa2tune.config.types import PARAM_NAMES, KernelConfig
from fa2tune.tune import compile_pool, timing, workload


def _outputs(kernel: str, cfg, x: workload.KernelInputs, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, ours) flattened: SDPA's output or gradients against fa2tune's with cfg."""
    gqa = x.k.shape[1] != x.q.shape[1]
    if kernel == "fwd":
        return F.scaled_dot_product_attention(x.q, x.k, x.v, is_causal=causal, enable_gqa=gqa), workload.run_kernel(
            kernel, cfg, x, causal
        )[0]
    leaves = [t.detach().requires_grad_() for t in (x.q, x.k, x.v)]
    grads = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa), leaves,
                                x.do)  # fmt: skip
    ours = workload.run_kernel(kernel, cfg, x, causal)
    return torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ours])


def _label(row: dict) -> str:
    """The row's config as logs name it (KernelConfig.label: "128x128 w4 s2 ws pingpong persistent")."""
    return KernelConfig.from_params({name: row[name] for name in PARAM_NAMES}).label()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="fwd", choices=["fwd", "bwd_dkdv", "bwd_dq"])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--block-m", default="64,128,256")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument(
        "--switches",
        default="",
        help="the switch sets to sweep, comma-separated, each KernelConfig.label's words joined by + (qk, ws, "
        "pingpong, fused-dq, drain-before-dq, split-roles, pad-head-dim, persistent, x2, no-split-tail; empty: the "
        "Triton template without), e.g. "
        ",qk or ws,ws+pingpong,ws+persistent; grid points that break the kernel's rules (num_warps 4, block sizes "
        "of 64 rows per consumer) are left out",
    )
    parser.add_argument("--causal", default="both", choices=["no", "yes", "both"],
                        help="which masks to sweep (a change that touches one mask's code need not time the other)")
    parser.add_argument("--rounds", type=int, default=1, help="time each config this many times, in rotated orders")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N (heads·d stays 2048)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 2048 // d)")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="K/V heads, dividing the query heads: fewer is grouped-query attention, as `fa2tune tune "
                             "--kv-heads` times it (default: as many as the query heads)")  # fmt: skip
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 (a smoke test)")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]
    # (query heads, K/V heads) at a head dim: the grid's unless given, as `fa2tune tune --heads --kv-heads` takes them
    counts = lambda d: ((args.heads or max(1, 2048 // d)), args.kv_heads or args.heads or max(1, 2048 // d))
    for head_dim in ints(args.head_dims):
        query, kv = counts(head_dim)
        if query % kv:
            parser.error(f"--kv-heads must divide the query heads, got {query} and {kv} at d={head_dim}")
    grid = itertools.product(ints(args.block_m), ints(args.block_n), ints(args.warps), ints(args.stages),
                             [words.replace("+", ",") for words in args.switches.split(",")])  # fmt: skip
    configs = [KernelConfig.parse(",".join(map(str, values)).rstrip(",")) for values in grid]
    configs = [cfg for cfg in configs if cfg.combination_error(args.kernel) is None]
    masks = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    cases = itertools.product(ints(args.head_dims), masks, configs)
    jobs = [(args.kernel, d, causal, cfg, args.seqlen) for d, causal, cfg in cases]
    failures = {}
    started = time.time()
    progress = lambda what: print(f"[{time.time() - started:6.1f} s] {what}", file=sys.stderr, flush=True)
    for kernel, head_dim, causal in {(k, d, c) for k, d, c, _, _ in jobs}:
        group = [cfg for k, d, c, cfg, _ in jobs if (k, d, c) == (kernel, head_dim, causal)]
        query, kv = counts(head_dim)
        failed = compile_pool.precompile(kernel, head_dim, torch.bfloat16, causal, group, seqlens=(args.seqlen,),
                                         device=args.device, workers=args.workers, group=query // kv)  # fmt: skip
        failures.update({(kernel, head_dim, causal, cfg): reason for cfg, reason in failed.items()})
        progress(f"compiled {len(group)} configs of {kernel} d={head_dim} causal={causal}")
    mode = "fwd" if args.kernel == "fwd" else "bwd"
    rows, measures, readings = [], {}, {}
    for index, (kernel, head_dim, causal, cfg, seqlen) in enumerate(jobs):
        row = dict(kernel=kernel, head_dim=head_dim, causal=causal, **cfg.params(), tflops=float("nan"))
        row["error"] = failures.get((kernel, head_dim, causal, cfg), "")
        if not row["error"]:
            if (head_dim, causal) not in measures:  # one set of random inputs per shape, shared by its configs
                measures[head_dim, causal] = workload.make_measure(
                    kernel, head_dim, torch.bfloat16, causal, seqlens=(seqlen,), device=args.device, tokens=args.tokens,
                    heads=counts(head_dim),
                )
            ref, out = _outputs(kernel, cfg, measures[head_dim, causal].inputs[0], causal)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                row["error"] = f"wrong result: rel err {err:.2e}"
            else:
                readings[index] = []
        rows.append(row)
    # Round r times the configs that ran right from the r-th on (wrapping), so none is always first or last.
    timed = sorted(readings)
    for round_ in range(max(1, args.rounds)):
        start = round_ % max(1, len(timed))
        for index in timed[start:] + timed[:start]:
            kernel, head_dim, causal, cfg, seqlen = jobs[index]
            batch, heads = max(1, args.tokens // seqlen), counts(head_dim)[0]  # as make_measure lays them out
            flops = timing.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode=mode)
            readings[index].append(round(flops / (measures[head_dim, causal](cfg) * 1e-3) / 1e12, 1))
            progress(f"round {round_ + 1} {_label(rows[index])} d={head_dim} causal={causal}: {readings[index][-1]}")
    for index, row in enumerate(rows):
        if index in readings:
            row["tflops"] = statistics.median(readings[index])
        row["readings"] = " ".join(map(str, readings.get(index, [])))
        if row["error"]:
            progress(f"{_label(row)} d={row['head_dim']} causal={row['causal']}: {row['error']}")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    for head_dim in ints(args.head_dims):
        for causal in masks:
            group = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal]
            ok = sorted((r for r in group if r["tflops"] == r["tflops"]), key=lambda r: -r["tflops"])
            bad = [r for r in group if r["tflops"] != r["tflops"]]
            print(f"\n{args.kernel} d={head_dim} causal={causal} N={args.seqlen}: {len(ok)} ran, {len(bad)} failed")
            for r in ok[:4]:
                print(f"  {_label(r)}  {r['tflops']}")
            if ok:
                print(f"  median {ok[len(ok) // 2]['tflops']}  worst {ok[-1]['tflops']}")
            for name in PARAM_NAMES[4:]:  # the switches and the schedule
                for switch in sorted({r[name] for r in ok}) if len({r[name] for r in ok}) > 1 else []:
                    best = next(r for r in ok if r[name] == switch)
                    print(f"  best with {name}={switch}: {_label(best)}  {best['tflops']}")
            for r in bad[:2]:
                print(f"  failed {_label(r)}: {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
