#!/usr/bin/env python3
"""Experiment (issue 6): the backward's dK/dV and dQ programs in one launch, as FlexAttention runs them, or two.

fa2tune launches its dK/dV kernel, then its dQ kernel (templates/bwd.py.jinja). FlexAttention's backward — also
Triton — puts both kinds of program in one grid (a program id below the dK/dV count takes a K/V tile, the rest a
Q tile), and it beat fa2tune's backward by ~6 % at d=128 without a mask (docs/PERF.md v9). Prediction: one
launch saves the first kernel's tail (its last wave runs part-empty while the second kernel waits: up to half a
wave of ~15 at N=8k, ~3 %) and one launch gap; it costs the dQ programs the dK/dV programs' warps and stages, and
whichever kind needs more shared memory sets the occupancy of both.

A minimal non-causal backward (even shapes, (batch, heads, N, d) contiguous, bf16; the dK/dV tile of
scripts/exp_bwd_atomic_dq.py without atomics, and a dQ tile), timed as two launches, one launch (dK/dV programs
first) and one launch with the dQ programs first, beside fa2tune's launcher.backward.

    python scripts/exp_bwd_one_launch.py          # on a GPU: checks each case against cuDNN, then the table
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

# scripts/ is on the path when a script of it runs
from exp_bwd_atomic_dq import LOG2E, backward_problem, dkdv_tile, print_table, time_cases


@triton.jit
def dq_tile(
    Q, K, V, DO, LSE2, DELTA, DQ, N, qk_scale, scale, pid_m, bh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """dQ of Q tile pid_m of (batch, head) bh: a loop over all K/V tiles, rebuilding P and dP."""
    base = bh * N * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :])
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE2 + bh * N + offs_m)
    delta = tl.load(DELTA + bh * N + offs_m)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        cols = start + offs_n
        k = tl.load(K + base + cols[:, None] * D + offs_d[None, :])
        v = tl.load(V + base + cols[:, None] * D + offs_d[None, :])
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        ds = (p * (tl.dot(do, tl.trans(v)) - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq)
    tl.store(DQ + base + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty))


@triton.jit
def _bwd(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ, N, BH, qk_scale, scale,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    D: tl.constexpr, ROLE: tl.constexpr, DOT_FP32: tl.constexpr = False,
):  # fmt: skip
    """1-D grid, tiles fastest within a head. ROLE "dkdv" or "dq": every program is that kind (two launches);
    "dkdv+dq": the first (N/BLOCK_N1)·BH programs are dK/dV tiles, the rest dQ tiles; "dq+dkdv": dQ tiles first;
    "by head": head by head, each head's dK/dV tiles then its dQ tiles (FlexAttention's order: its grid is
    (dK/dV tiles + dQ tiles, batch, heads)), so both kinds of program read one head's Q, K, V, dO at a time."""
    pid = tl.program_id(0)
    num_n = N // BLOCK_N1
    num_m = N // BLOCK_M2
    if ROLE == "by head":
        head = pid // (num_n + num_m)
        within = pid % (num_n + num_m)
        kv_pid = tl.where(within < num_n, head * num_n + within, -1)
        q_pid = tl.where(within < num_n, -1, head * num_m + within - num_n)
    elif ROLE == "dkdv+dq":
        kv_pid = pid
        q_pid = pid - num_n * BH
    elif ROLE == "dq+dkdv":
        q_pid = pid
        kv_pid = pid - num_m * BH
    elif ROLE == "dkdv":
        kv_pid = pid
        q_pid = -1
    else:
        q_pid = pid
        kv_pid = -1
    if kv_pid >= 0 and kv_pid < num_n * BH:
        dkdv_tile(Q, K, V, DO, LSE2, DELTA, DK, DV, DQ, None, N, qk_scale, scale, kv_pid % num_n,
                  (kv_pid // num_n).to(tl.int64), BLOCK_M1, BLOCK_N1, D, 0, False, DOT_FP32)  # fmt: skip
    elif q_pid >= 0 and q_pid < num_m * BH:
        dq_tile(Q, K, V, DO, LSE2, DELTA, DQ, N, qk_scale, scale, q_pid % num_m, (q_pid // num_m).to(tl.int64),
                BLOCK_M2, BLOCK_N2, D, DOT_FP32)  # fmt: skip


def backward(q, k, v, o, lse, do, dkdv_config, dq_config, layout: str, *, dot_fp32=False):
    """dq, dk, dv of non-causal attention from the forward's O and natural-log logsumexp.

    layout: "two launches" (each kernel at its own warps and stages), "dkdv+dq", "dq+dkdv" or "by head" (one
    launch, at dkdv_config's warps and stages)."""
    batch, heads, n, d = q.shape
    (m1, n1, warps1, stages1), (m2, n2, warps2, stages2) = dkdv_config, dq_config
    if any(n % b for b in (m1, n1, m2, n2)):
        raise ValueError(f"N={n} must be a multiple of every block size (even shapes only)")
    bh = batch * heads
    delta = (o.float() * do.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = d**-0.5
    args = (q, k, v, do, lse * LOG2E, delta, dk, dv, dq, n, bh, scale * LOG2E, scale, m1, n1, m2, n2, d)
    if layout == "two launches":
        _bwd[(n // n1 * bh,)](*args, "dkdv", dot_fp32, num_warps=warps1, num_stages=stages1)
        _bwd[(n // m2 * bh,)](*args, "dq", dot_fp32, num_warps=warps2, num_stages=stages2)
    elif layout in ("dkdv+dq", "dq+dkdv", "by head"):
        _bwd[(n // n1 * bh + n // m2 * bh,)](*args, layout, dot_fp32, num_warps=warps1, num_stages=stages1)
    else:
        raise ValueError(f"layout must be 'two launches', 'dkdv+dq', 'dq+dkdv' or 'by head', got {layout!r}")
    return dq, dk, dv


CONFIGS = {  # d: [(dK/dV config, dQ config)]: fa2tune's tuned pair (N=8k "all" entries), and FlexAttention-like
    128: [((64, 128, 8, 3), (128, 128, 8, 2)), ((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 64, 4, 3), (64, 64, 4, 3))],
    64: [((32, 128, 4, 3), (128, 64, 4, 3)), ((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 8, 3), (128, 64, 8, 3))],
}
LAYOUTS = ("two launches", "dkdv+dq", "dq+dkdv", "by head")


def _rows(d: int, seqlen: int) -> list[tuple]:
    """fa2tune's backward and each (configs, layout) case, for one head dim."""
    from fa2tune.launch import launcher

    (q, k, v, o, lse, do), ref, flops, _ = backward_problem(d, seqlen)
    cases = {"fa2tune launcher.backward (tuned)": lambda: launcher.backward(do, q, k, v, o, lse, causal=False,
                                                                          scale=d**-0.5)}  # fmt: skip
    for kv, qc in CONFIGS[d]:
        for layout in LAYOUTS:
            cases[f"{layout} {kv} {qc}"] = lambda kv=kv, qc=qc, layout=layout: backward(q, k, v, o, lse, do, kv, qc,
                                                                                      layout)  # fmt: skip
    return time_cases(d, cases, ref, flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=8192)
    args = parser.parse_args()
    print_table(args.seqlen, [row for d in CONFIGS for row in _rows(d, args.seqlen)])


if __name__ == "__main__":
    main()
