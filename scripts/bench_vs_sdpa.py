#!/usr/bin/env python3
"""TFLOP/s of fa2tune beside PyTorch SDPA's flash, cuDNN and efficient backends and FlexAttention, on one GPU.

Shapes keep batch·N = 16k tokens and heads·d = 2048 (the grid of the FlashAttention-2 and -3 papers).
FLOPs = 4·B·H·N²·d (× ~0.5 causal; × 3.5 for fwd+bwd), time = median of triton.testing.do_bench. Prints a table
and the geomean ratios last; --csv writes docs/bench/<gpu>.csv's columns; --plots writes one PNG per
(head_dim, mode).

    python scripts/bench_vs_sdpa.py --csv $OUT/nvidia-h200.csv --plots $OUT
    python scripts/bench_vs_sdpa.py --from-csv docs/bench/nvidia-h200.csv --plots docs/bench/plots   # no GPU
    python scripts/bench_vs_sdpa.py --head-dims 64 --seqlens 512 --processes 3 --merge-into docs/bench/nvidia-h200.csv

--processes N runs the whole measurement in N fresh processes, one after another, and takes each row's median:
training calls at N <= 512 wait for their host and read up to 35 % apart between processes.
--merge-into CSV replaces that file's rows for the shapes and providers measured (the rest stay) — how part of
the grid is re-measured after a change; --causal yes (or no) measures one mask's rows only:

    python scripts/bench_vs_sdpa.py --causal yes --processes 3 --merge-into docs/bench/nvidia-h200.csv

--gqa G gives every K/V head G query heads (grouped-query attention; the heads·d width is the query heads'):
SDPA and FlexAttention run with enable_gqa, the accuracy check's reference on K/V repeated G times; FLOPs are the
query heads'. Its rows carry a gqa column and never go into the MHA grid (--merge-into is refused):

    python scripts/bench_vs_sdpa.py --gqa 4 --modes fwd+bwd --providers fa2tune,sdpa_flash,sdpa_cudnn --csv gqa4.csv
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2tune
from fa2tune.tune import benchreport
from fa2tune.tune.timing import attention_flops, time_cuda
from fa2tune.tune.workload import random_qkv

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _flex(causal: bool, gqa: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    masks = {}

    def run(q, k, v):
        if not causal:
            return compiled(q, k, v, enable_gqa=gqa)
        n = q.shape[-2]
        if n not in masks:  # built once per length, outside the timed region after the first call
            masks[n] = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n, device=q.device)
        return compiled(q, k, v, block_mask=masks[n], enable_gqa=gqa)

    return run


def _provider(name: str, causal: bool, gqa: bool = False):
    """The call `name` times; gqa: K/V have fewer heads than Q (fa2tune takes that as it is)."""
    if name == "fa2tune":
        return lambda q, k, v: fa2tune.attention(q, k, v, causal=causal)
    if name == "flex":
        return _flex(causal, gqa)
    backend = SDPA_BACKENDS[name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return run


def _reference(causal: bool, group: int):
    """SDPA flash, the accuracy check's reference: under GQA on K/V repeated `group` times (autograd sums their
    gradients back), so it does not depend on a backend's own GQA support."""
    flash = _provider("sdpa_flash", causal)
    if group == 1:
        return flash
    return lambda q, k, v: flash(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def _with_backward(fn, do):
    """fwd+bwd of fn: the forward, then all three gradients (torch.autograd.grad: nothing accumulates)."""

    def run(q, k, v):
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), do)

    return run


def _measure(providers, mode, head_dim, seqlen, causal, tokens, width, gqa=1) -> list[dict]:
    batch, heads = max(1, tokens // seqlen), width // head_dim
    q, k, v = random_qkv(batch, heads, seqlen, head_dim, heads_kv=heads // gqa, requires_grad=mode != "fwd")
    do = torch.randn_like(q)
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode=mode)
    reference = _reference(causal, gqa)
    if mode != "fwd":
        reference = _with_backward(reference, do)
    ref = torch.cat([t.flatten().float() for t in _as_tuple(reference(q, k, v))])
    rows = []
    for name in providers:
        fn = _provider(name, causal, gqa > 1)
        if mode != "fwd":
            fn = _with_backward(fn, do)
        try:
            out = torch.cat([t.flatten().float() for t in _as_tuple(fn(q, k, v))])
            err = ((out - ref).norm() / ref.norm()).item()
            if not err < 2e-2:  # a provider that computes something else must not get a speed number
                raise RuntimeError(f"relative error {err:.1e} against SDPA flash")
            tflops = time_cuda(lambda fn=fn: fn(q, k, v)).tflops(flops)
        except RuntimeError as exc:  # a backend that does not support the shape
            tflops = float("nan")
            print(f"{name} {mode} d={head_dim} N={seqlen} causal={causal}: {str(exc).splitlines()[0]}")
        rows.append(
            dict(
                provider=name,
                head_dim=head_dim,
                seqlen=seqlen,
                causal=causal,
                mode=mode,
                tflops=round(tflops, 1),
                rel_err_vs_flash=f"{err:.1e}",
                **({"gqa": gqa} if gqa > 1 else {}),
            )
        )
    return rows


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--providers", default="fa2tune,sdpa_flash,sdpa_cudnn,sdpa_efficient,flex")
    parser.add_argument("--tokens", type=int, default=16384, help="batch·N")
    parser.add_argument("--width", type=int, default=2048, help="heads·d")
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both, comma-separated")
    parser.add_argument(
        "--causal",
        default="both",
        choices=("no", "yes", "both"),
        help="the masks to measure (a re-measure of the causal rows after a change to them)",
    )
    parser.add_argument("--gqa", type=int, default=1, help="query heads per K/V head (1: standard multi-head)")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--plots", default=None, help="folder for one PNG per (head_dim, mode)")
    parser.add_argument("--from-csv", default=None, help="report and plot an earlier run's CSV; measure nothing")
    parser.add_argument("--processes", type=int, default=1, help="fresh processes to measure in; each row's median")
    parser.add_argument("--merge-into", default=None, help="a grid CSV whose rows for what is measured are replaced")
    args = parser.parse_args(argv)
    if args.from_csv:
        rows = benchreport.read_rows(args.from_csv)
        if args.plots:
            print("\n".join(map(str, benchreport.write_plots(rows, args.plots, _title(args.from_csv)))))
        print("\n".join(benchreport.summary(rows)))
        return 0
    if args.processes < 1:
        print(f"--processes must be at least 1, got {args.processes}", file=sys.stderr)
        return 2
    problem = _gqa_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_vs_sdpa.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    providers = args.providers.split(",")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {__import__('triton').__version__}")
    if args.gqa > 1:
        print(f"# GQA: {args.gqa} query heads per K/V head")
    if args.processes > 1:
        runs = [_run_in_process(args, i) for i in range(args.processes)]
        rows = benchreport.median_of_runs(runs)
        print(f"# each row: the median of {args.processes} processes")
    else:
        rows = _measure_grid(args, providers)
    if args.csv:
        benchreport.write_rows(rows, args.csv)
    if args.merge_into:
        benchreport.write_rows(benchreport.merge_rows(benchreport.read_rows(args.merge_into), rows), args.merge_into)
    if args.plots:
        benchreport.write_plots(rows, args.plots, f"{torch.cuda.get_device_name()} bf16")
    print(f"\n{'mode':>8} {'d':>4} {'N':>6} {'causal':>6} " + " ".join(f"{p:>14}" for p in providers))
    for i in range(0, len(rows), len(providers)):
        group = rows[i : i + len(providers)]
        r = group[0]
        cells = " ".join(f"{g['tflops']:>14}" for g in group)
        print(f"{r['mode']:>8} {r['head_dim']:>4} {r['seqlen']:>6} {r['causal']!s:>6} {cells}")
    print("\n".join(benchreport.summary(rows)))
    return 0


_CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True)}


def _gqa_problem(args) -> str | None:
    """Why --gqa cannot run with these arguments, or None."""
    if args.gqa < 1:
        return f"--gqa must be at least 1, got {args.gqa}"
    if args.gqa > 1 and args.merge_into:
        return "--merge-into takes the multi-head grid's rows; with --gqa write them with --csv"
    for head_dim in map(int, args.head_dims.split(",")):
        heads = args.width // head_dim
        if heads % args.gqa:
            return f"--gqa {args.gqa} must divide the query heads, {heads} at d={head_dim} (--width {args.width})"
    return None


def _measure_grid(args, providers: list[str]) -> list[dict]:
    rows = []
    for mode in args.modes.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for seqlen in map(int, args.seqlens.split(",")):
                for causal in _CAUSAL[args.causal]:
                    rows += _measure(providers, mode, head_dim, seqlen, causal, args.tokens, args.width, args.gqa)
    return rows


def _run_in_process(args, index: int) -> list[dict]:
    """The grid measured by a fresh Python process running this script (its table printed as it goes): its rows."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "rows.csv")
        command = [sys.executable, os.path.abspath(__file__), "--head-dims", args.head_dims, "--seqlens", args.seqlens,
                   "--providers", args.providers, "--tokens", str(args.tokens), "--width", str(args.width), "--modes",
                   args.modes, "--causal", args.causal, "--gqa", str(args.gqa), "--csv", path]  # fmt: skip
        print(f"# process {index + 1} of {args.processes}", flush=True)
        subprocess.run(command, check=True)
        return benchreport.read_rows(path)


def _title(csv_path: str) -> str:
    from pathlib import Path

    return Path(csv_path).stem.split("-v")[0].replace("-", " ").upper() + " bf16"


if __name__ == "__main__":
    sys.exit(main())
