#!/usr/bin/env python3
"""Times every block config of a small grid for one kernel at one shape: the data behind planner.default_config.

Configs are compiled first in a pool of processes (Triton's disk cache keeps the binaries), then timed one at a
time in this process. A config that fails to compile is reported with its reason, never stops the sweep.
For a backward kernel the other backward kernel keeps its default config, and the time is the whole backward.

    python scripts/sweep_configs.py --kernel fwd --head-dims 64,128 --seqlen 8192 --csv $OUT/sweep_fwd.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import multiprocessing as mp
import sys
from functools import partial

import torch
import torch.nn.functional as F

from fa2tune import launcher
from fa2tune.bench import attention_flops, random_qkv, time_cuda
from fa2tune.types import KernelConfig


def _runner(kernel: str, q, k, v, causal: bool, cfg: KernelConfig):
    """A no-argument callable running the kernel under test with cfg, and a function giving its output."""
    scale = q.shape[-1] ** -0.5
    if kernel == "fwd":
        return partial(launcher.forward, q, k, v, causal=causal, scale=scale, config=cfg)
    o, lse = launcher.forward(q, k, v, causal=causal, scale=scale)
    do = torch.randn_like(o)
    key = "dkdv_config" if kernel == "bwd_dkdv" else "dq_config"
    return partial(launcher.backward, do, q, k, v, o, lse, causal=causal, scale=scale, **{key: cfg})


def _reference(kernel: str, q, k, v, causal: bool, run):
    if kernel == "fwd":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal), run()[0]
    do = run.args[0]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, do)
    ours = run()
    return torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ours])


def _compile(job: tuple[str, int, bool, KernelConfig, int]) -> str | None:
    kernel, head_dim, causal, cfg, seqlen = job
    try:
        # Same constexprs and Jinja switches (multiples of the blocks) as the timed shape.
        q, k, v = random_qkv(1, 2, 256 if seqlen % 256 == 0 else seqlen, head_dim)
        _runner(kernel, q, k, v, causal, cfg)()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # failures are data: report the reason
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="fwd", choices=["fwd", "bwd_dkdv", "bwd_dq"])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--block-m", default="64,128,256")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]
    grid = itertools.product(ints(args.block_m), ints(args.block_n), ints(args.warps), ints(args.stages))
    configs = [KernelConfig(bm, bn, w, s) for bm, bn, w, s in grid]
    cases = itertools.product(ints(args.head_dims), (False, True), configs)
    jobs = [(args.kernel, d, causal, cfg, args.seqlen) for d, causal, cfg in cases]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        failures = pool.map(_compile, jobs)
    mode = "fwd" if args.kernel == "fwd" else "bwd"
    rows = []
    for (kernel, head_dim, causal, cfg, seqlen), failure in zip(jobs, failures, strict=True):
        batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
        row = dict(kernel=kernel, head_dim=head_dim, causal=causal, **cfg.to_dict(), tflops=float("nan"))
        row["error"] = failure or ""
        if failure is None:
            q, k, v = random_qkv(batch, heads, seqlen, head_dim)
            run = _runner(kernel, q, k, v, causal, cfg)
            ref, out = _reference(kernel, q, k, v, causal, run)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                row["error"] = f"wrong result: rel err {err:.2e}"
            else:
                flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode=mode)
                row["tflops"] = round(time_cuda(run).tflops(flops), 1)
        rows.append(row)
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    for head_dim in ints(args.head_dims):
        for causal in (False, True):
            group = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal]
            ok = sorted((r for r in group if r["tflops"] == r["tflops"]), key=lambda r: -r["tflops"])
            bad = [r for r in group if r["tflops"] != r["tflops"]]
            print(f"\n{args.kernel} d={head_dim} causal={causal} N={args.seqlen}: {len(ok)} ran, {len(bad)} failed")
            for r in ok[:4]:
                print(f"  {r['block_m']:>4} {r['block_n']:>4} w{r['num_warps']} s{r['num_stages']}  {r['tflops']}")
            if ok:
                print(f"  median {ok[len(ok) // 2]['tflops']}  worst {ok[-1]['tflops']}")
            for r in bad[:2]:
                print(f"  failed {r['block_m']} {r['block_n']} w{r['num_warps']} s{r['num_stages']}: {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
