#!/usr/bin/env python3
"""Experiment (issue 6): two programs an SM for the one-consumer warp-specialized forward.

A one-consumer program (block_m = 64: one consumer warpgroup and a producer warp) compiles to 255 registers a
thread, so it fills an SM's register file alone and its per-tile latencies (Q load, O store) are exposed at short
lengths. Compiled with maxnreg = 128 the consumer still gets 232 registers (setmaxnreg moves the producer's share to
it) and does not spill; a (64, 128) 2-stage program takes 82 KB of shared memory, so two fit an SM and each runs
under the other's prologue and epilogue. This script times one-consumer configs both ways, in separate processes'
worth of state (`--mode one` today's registers and grid, `--mode two` maxnreg 128 and a persistent grid of two
programs an SM), beside the shipped config and cuDNN; bf16, batch·N = 16k tokens, heads·d = 2048.

    python scripts/exp_two_programs_per_sm.py --mode one --head-dims 64
    python scripts/exp_two_programs_per_sm.py --mode two --head-dims 64

Measured on the H200 (docs/PERF.md v19): two an SM lift the one-consumer configs by 39-51 % at d=64, but beat the
shipped configs only at d=64 causal N=512 (244 against 209 TFLOP/s; cuDNN 258). Since v21 this is a config switch,
`schedule: {persistent: true, programs_per_sm: 2}` (planner.WS_TWO_AN_SM_REGISTERS, planner.programs_per_sm), which
the tuner searches and the d=64 causal N <= 1k forward entries use; this script stays as v19's measurement (its `two`
mode patches every one-consumer config, not only persistent ones).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from fa2tune.config import planner
from fa2tune.config.schedule import PER_TILE, PERSISTENT
from fa2tune.config.types import KernelConfig
from fa2tune.launch import launcher, warpspec
from fa2tune.tune.timing import attention_flops, random_qkv, time_cuda

DTYPE = torch.bfloat16
# (maxnreg of the kernel, registers of the consumer, of the producer): what `two` runs one-consumer programs with
TWO_AN_SM_REGISTERS = (128, 232, 24)


@contextlib.contextmanager
def two_programs_an_sm():
    """One-consumer warpspec programs compiled at maxnreg 128 and persistent grids of two programs an SM, undone on
    exit. Grids stay doubled for every consumer count: time one-consumer configs only inside."""
    registers, sm_count = planner.WS_REGISTERS[1], warpspec._sm_count
    planner.WS_REGISTERS[1] = TWO_AN_SM_REGISTERS
    warpspec._sm_count = lambda index: 2 * sm_count(index)
    warpspec.compiled_form.cache_clear()  # its kwargs carry maxnreg
    launcher.clear_plans()
    try:
        yield
    finally:
        planner.WS_REGISTERS[1], warpspec._sm_count = registers, sm_count
        warpspec.compiled_form.cache_clear()
        launcher.clear_plans()


def candidates() -> list[KernelConfig]:
    """One-consumer forward configs: (64, 128) 2 stages and (64, 64) 3 stages, one tile a program or persistent."""
    return [KernelConfig(64, n, 4, s, warp_specialized=True, schedule=schedule) for n, s in ((128, 2), (64, 3))
            for schedule in (PER_TILE, PERSISTENT)]  # fmt: skip


def measure(head_dim: int, seqlen: int, causal: bool) -> dict[str, float]:
    """TFLOP/s by name: cuDNN, the shipped config, each candidate (negative: its max error, past 2e-2)."""
    batch, heads = 16384 // seqlen, 2048 // head_dim
    q, k, v = random_qkv(batch, heads, seqlen, head_dim, dtype=DTYPE)
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode="fwd")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
    scale = head_dim**-0.5
    runs = {"shipped": lambda: launcher.forward(q, k, v, causal=causal, scale=scale)}
    for cfg in candidates():
        runs[cfg.label()] = lambda cfg=cfg: launcher.forward(q, k, v, causal=causal, scale=scale, config=cfg)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        found = {"cudnn": time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)).tflops(flops)}
    for name, run in runs.items():
        err = (run()[0].float() - ref).abs().max().item()
        found[name] = -err if err > 2e-2 else time_cuda(run).tflops(flops)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("one", "two"), required=True, help="programs an SM of one-consumer configs")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="512,1024,2048,8192")
    args = parser.parse_args()
    mode = two_programs_an_sm() if args.mode == "two" else contextlib.nullcontext()
    with mode:
        for d in (int(x) for x in args.head_dims.split(",")):
            for n in (int(x) for x in args.seqlens.split(",")):
                for causal in (False, True):
                    found = measure(d, n, causal)
                    print(args.mode, d, n, causal, "  ".join(f"{k} {v:.0f}" for k, v in found.items()), flush=True)


if __name__ == "__main__":
    main()
