#!/usr/bin/env python3
"""Experiment (issue 6): the backward with dQ added by atomics from the dK/dV kernel, instead of a dQ kernel.

fa2tune's backward runs two kernels (templates/bwd.py.jinja): dK/dV (one program per K tile, a loop over Q tiles)
and dQ (one program per Q tile, a loop over K tiles). Both rebuild S = QKᵀ and dP = dO·Vᵀ, so the pair issues 7
tile matmuls where the backward's FLOP count (2.5× the forward) has 5: at best 5/7 of the tensor cores' rate
reaches the FLOP count. FlashAttention-2 and -3 issue the 5 once: the dK/dV program also forms its share of dQ,
dS·K (BLOCK_M × d), and adds it into an fp32 dQ with atomics; a cast to bf16 follows.

Prediction (d=128, N=8k): the fused kernel's matmuls are 5/4 of the dK/dV kernel's, so if atomics were free it
would take 1.25× the dK/dV kernel's time, against dK/dV + dQ today. The atomics move 4·N²·d/BLOCK_N bytes per
head — 0.4/BLOCK_N bytes a FLOP, ~1.6 TB/s at 500 TFLOP/s with BLOCK_N = 128 — through the L2's atomic units,
which may be what decides it.

A minimal non-causal backward (even shapes, (batch, heads, N, d) contiguous, bf16): the dK/dV kernel with and
without its dQ share, beside fa2tune's launcher.backward at its tuned configs and cuDNN's backward (SDPA fwd+bwd
less its forward). `--ptx` prints how the atomics compile (no GPU needed).

    python scripts/exp_bwd_atomic_dq.py            # on a GPU: checks each case against SDPA, then the table
    python scripts/exp_bwd_atomic_dq.py --ptx      # no GPU needed: the atomic instructions of the fused kernel
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dkdv_dq(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ32, DQ_DESC, N, qk_scale, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    STAGGER: tl.constexpr, DOT_FP32: tl.constexpr = False,
):  # fmt: skip
    """Grid (K tiles, batch·heads): dkdv_tile for each."""
    dkdv_tile(Q, K, V, DO, LSE2, DELTA, DK, DV, DQ32, DQ_DESC, N, qk_scale, scale, tl.program_id(0),
              tl.program_id(1).to(tl.int64), BLOCK_M, BLOCK_N, D, ATOMIC_DQ, STAGGER, DOT_FP32)  # fmt: skip


@triton.jit
def dkdv_tile(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQ32, DQ_DESC, N, qk_scale, scale, pid_n, bh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    STAGGER: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """dK and dV of K/V tile pid_n of (batch, head) bh, (batch, heads, N, D) contiguous; a loop over all Q tiles.
    Also used by scripts/exp_bwd_one_launch.py.

    ATOMIC_DQ: 1: also add dS·K·scale of each Q tile into DQ32 (fp32, zeroed) with atomics from every thread;
    2: the same through DQ_DESC, a TMA descriptor of DQ32 as (batch·heads·N, d) rows — one bulk reduction per
    tile from shared memory, as FlashAttention-3 adds its dQ (Hopper only; DQ_DESC is None otherwise).
    STAGGER: program n starts its loop at the Q tile on its own diagonal, so the programs of a head add into
    different dQ rows at any one time.
    DOT_FP32: dot operands in fp32 (the CPU interpreter's bf16 dot is wrong)."""
    base = bh * N * D
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :])
    v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :])
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    num_m = N // BLOCK_M
    first = (pid_n * BLOCK_N // BLOCK_M) % num_m if STAGGER else 0
    for i in tl.range(0, num_m):
        rows = ((first + i) % num_m) * BLOCK_M + offs_m
        q = tl.load(Q + base + rows[:, None] * D + offs_d[None, :])
        do = tl.load(DO + base + rows[:, None] * D + offs_d[None, :])
        if DOT_FP32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2 = tl.load(LSE2 + bh * N + rows)
        delta = tl.load(DELTA + bh * N + rows)
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dsT = (pT * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk)
        if ATOMIC_DQ == 1:
            dq = tl.dot(tl.trans(dsT), k)
            tl.atomic_add(DQ32 + base + rows[:, None] * D + offs_d[None, :], dq * scale, sem="relaxed")
        elif ATOMIC_DQ == 2:
            dq = tl.dot(tl.trans(dsT), k)
            DQ_DESC.atomic_add([(bh * N + (first + i) % num_m * BLOCK_M).to(tl.int32), 0], dq * scale)
    tl.store(DK + base + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty))


def backward_atomic(q, k, v, o, lse, do, config, *, stagger=True, atomic_dq=1, dot_fp32=False):
    """dq, dk, dv of non-causal attention from the forward's O and natural-log logsumexp, by the fused kernel.

    atomic_dq: 0 (dQ left at zero: the dK/dV kernel alone), 1 (per-thread atomics), 2 (TMA reductions)."""
    batch, heads, n, d = q.shape
    block_m, block_n, warps, stages = config
    if n % block_m or n % block_n:
        raise ValueError(f"N={n} must be a multiple of BLOCK_M={block_m} and BLOCK_N={block_n} (even shapes only)")
    delta = (o.float() * do.float()).sum(-1)
    dq32 = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    desc = None
    if atomic_dq == 2:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor(dq32.view(-1, d), [block_m, d])
    scale = d**-0.5
    _dkdv_dq[(n // block_n, batch * heads)](
        q, k, v, do, lse * LOG2E, delta, dk, dv, dq32, desc, n, scale * LOG2E, scale,
        block_m, block_n, d, atomic_dq, stagger, dot_fp32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq32.to(q.dtype), dk, dv


CONFIGS = {  # d: (BLOCK_M, BLOCK_N, warps, stages) of the fused kernel (fa2tune's dK/dV: (64, 128, 8, 3) at d=128)
    64: [(32, 128, 8, 2), (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (64, 128, 8, 3)],
    128: [(32, 128, 8, 2), (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2)],
}


def relative_error(got, want) -> float:
    return max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, want, strict=True))


def backward_problem(d: int, seqlen: int):
    """The backward experiments' problem, non-causal bf16 with 16k tokens and heads·d = 2048: (q, k, v, o, lse, do)
    for the kernels (o and lse from fa2tune's forward), cuDNN's (dq, dk, dv) to check them against, the backward's
    FLOPs, and cuDNN's backward time in ms (its fwd+bwd less its forward). Also used by exp_bwd_one_launch.py."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa2tune.launch import launcher
    from fa2tune.tune.timing import attention_flops, time_cuda
    from fa2tune.tune.workload import random_qkv

    batch, heads = 16384 // seqlen, 2048 // d
    q, k, v = random_qkv(batch, heads, seqlen, d, requires_grad=True)
    do = torch.randn_like(q)
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal=False, mode="bwd")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do)
        fwd_ms = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v)).median_ms
        both = time_cuda(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do))
    q, k, v = q.detach(), k.detach(), v.detach()
    o, lse = launcher.forward(q, k, v, causal=False, scale=d**-0.5)
    return (q, k, v, o, lse, do), ref, flops, both.median_ms - fwd_ms


def time_cases(d: int, cases: dict, ref, flops: float, checked=lambda name: slice(0, 3)) -> list[tuple]:
    """(d, case, TFLOP/s of backward FLOPs, relative error against ref) for each case that runs; checked(name):
    which of (dq, dk, dv) that case computes. A case that cannot run is reported and skipped."""
    from fa2tune.tune.timing import time_cuda

    rows = []
    for name, fn in cases.items():
        try:
            grads = fn()
        except Exception as exc:  # a config past the shared memory, a TMA case the compiler refuses: say so, go on
            print(f"d={d} {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        part = checked(name)
        rows.append((d, name, time_cuda(fn).tflops(flops), relative_error(grads[part], ref[part])))
        print(*rows[-1], flush=True)
    return rows


def print_table(seqlen: int, rows: list[tuple]) -> None:
    width = max(len(row[1]) for row in rows)
    print(f"\nN={seqlen}, bf16, 16k tokens, heads·d=2048; TFLOP/s of the backward's FLOPs (2.5× the forward's)")
    print(f"{'d':>4} {'case':<{width}} {'TFLOP/s':>8} {'rel err':>8}")
    for d, name, tflops, err in rows:
        print(f"{d:>4} {name:<{width}} {tflops:>8.0f} {err:>8.1e}")


def _rows(d: int, seqlen: int) -> list[tuple]:
    """cuDNN's backward, fa2tune's, and each fused case, for one head dim."""
    from fa2tune.launch import launcher

    (q, k, v, o, lse, do), ref, flops, cudnn_ms = backward_problem(d, seqlen)
    cases = {"fa2tune launcher.backward (tuned)": lambda: launcher.backward(do, q, k, v, o, lse, causal=False,
                                                                          scale=d**-0.5)}  # fmt: skip
    for c in CONFIGS[d]:
        cases[f"dK/dV only {c}"] = lambda c=c: backward_atomic(q, k, v, o, lse, do, c, atomic_dq=0)
        cases[f"fused, atomic dQ {c}"] = lambda c=c: backward_atomic(q, k, v, o, lse, do, c)
        cases[f"fused, TMA-reduced dQ {c}"] = lambda c=c: backward_atomic(q, k, v, o, lse, do, c, atomic_dq=2)
        cases[f"fused, unstaggered {c}"] = lambda c=c: backward_atomic(q, k, v, o, lse, do, c, stagger=False)
    cudnn = (d, "cuDNN backward (fwd+bwd - fwd)", flops / cudnn_ms / 1e9, 0.0)
    # "dK/dV only" leaves dQ at zero: check dK and dV alone there
    return [cudnn, *time_cases(d, cases, ref, flops, lambda name: slice(int(name.startswith("dK/dV only")), 3))]


def time_table(seqlen: int) -> None:
    print_table(seqlen, [row for d in CONFIGS for row in _rows(d, seqlen)])


def atomic_ptx() -> None:
    """How tl.atomic_add of an fp32 tile compiles for sm_90: the reduction instructions in the fused kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for d, config in ((128, (32, 128, 8, 2)), (64, (64, 128, 8, 2))):
        block_m, block_n, warps, stages = config
        names = _dkdv_dq.arg_names
        signature = {a: "*bf16" for a in ("Q", "K", "V", "DO", "DK", "DV")}
        signature |= {a: "*fp32" for a in ("LSE2", "DELTA", "DQ32")} | {"N": "i32", "qk_scale": "fp32", "scale": "fp32"}
        constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "D": d, "ATOMIC_DQ": 1, "STAGGER": 1, "DOT_FP32": 0,
                      "DQ_DESC": None}  # fmt: skip
        signature |= dict.fromkeys(constexprs, "constexpr")
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("Q", "K", "V", "DO", "DQ32", "N")}
        source = ASTSource(_dkdv_dq, {a: signature[a] for a in names}, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps,
                                                                                    "num_stages": stages})  # fmt: skip
        ptx = kernel.asm["ptx"]
        ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:red|atom)\.[\w.]+)", ptx, re.M)
        per_tile = block_m * d / (32 * warps)  # fp32 values a thread adds per Q tile
        counts = {op: ops.count(op) for op in sorted(set(ops))}
        print(f"d={d} {config}: {counts}; {per_tile:.0f} values a thread per Q tile; shared {kernel.metadata.shared} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ptx", action="store_true", help="the fused kernel's atomic instructions (no GPU needed)")
    parser.add_argument("--seqlen", type=int, default=8192)
    args = parser.parse_args()
    atomic_ptx() if args.ptx else time_table(args.seqlen)


if __name__ == "__main__":
    main()
