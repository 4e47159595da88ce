#!/usr/bin/env python3
"""The backward with dQ fused into the dK/dV kernel (KernelConfig.fused_dq) beside the shipped two-kernel backward and
cuDNN's, on a Hopper GPU: first every fused candidate's gradients against float64 autograd (and beside the shipped
path's error), then TFLOP/s of backward FLOPs (2.5 × the forward's) at 16k tokens, heads·d = 2048, bf16.

This is how docs/PERF.md v18's A/B tables were measured (there by one-off copies of it).

    python scripts/bench_fused_dq.py                       # check, then time d=128 and d=64 at N = 1k, 2k, 8k, 16k
    python scripts/bench_fused_dq.py --head-dims 64 --seqlens 8192 --no-check
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from fa2tune.config import planner
from fa2tune.config.device import known_gpu
from fa2tune.config.schedule import PER_TILE, PERSISTENT
from fa2tune.config.types import KernelConfig
from fa2tune.launch import launcher

DTYPE = torch.bfloat16


def candidates(head_dim: int) -> dict[str, KernelConfig]:
    """The fused (64, 128) configs the H200's planner accepts at this head dim, by a short name."""
    h200 = known_gpu("h200")
    found = {}
    for stages in (2, 3):
        for schedule in (PER_TILE, PERSISTENT):
            cfg = KernelConfig(64, 128, 4, stages, warp_specialized=True, fused_dq=True, schedule=schedule)
            if planner.check(cfg, h200, head_dim, DTYPE, "bwd_dkdv") is None:
                found[f"fused s{stages}{' p' if schedule.persistent else ''}"] = cfg
    return found


def _reference(q, k, v, do, causal, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = (q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q.shape[2], device=q.device)[:, None] + (k.shape[2] - q.shape[2])
        s = s.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > rows, float("-inf"))
    (torch.softmax(s, -1).nan_to_num(0.0) @ v64.repeat_interleave(group, 1)).backward(do.double())
    return q64.grad, k64.grad, v64.grad


def check(head_dims) -> bool:
    """Every candidate's gradients against float64, within twice the shipped path's error (1e-2 at least)."""
    ok = True
    shapes = [(1, 2, 2, 256, 256), (2, 4, 2, 1000, 1000), (1, 2, 1, 300, 700), (1, 2, 2, 700, 300), (1, 2, 2, 1, 1)]
    for d in head_dims:
        for causal in (False, True):
            for name, cfg in candidates(d).items():
                for b, hq, hk, nq, nk in shapes:
                    q, do = (torch.randn(b, hq, nq, d, device="cuda", dtype=DTYPE) for _ in range(2))
                    k, v = (torch.randn(b, hk, nk, d, device="cuda", dtype=DTYPE) for _ in range(2))
                    o, lse = launcher.forward(q, k, v, causal=causal, scale=d**-0.5)
                    fused = launcher.backward(do, q, k, v, o, lse, causal=causal, scale=d**-0.5, dkdv_config=cfg)
                    shipped = launcher.backward(do, q, k, v, o, lse, causal=causal, scale=d**-0.5)
                    for got, base, ref in zip(fused, shipped, _reference(q, k, v, do, causal, d**-0.5), strict=True):
                        scale = ref.abs().max().item() + 1e-6
                        err, base_err = ((t.double() - ref).abs().max().item() / scale for t in (got, base))
                        if err > max(2 * base_err, 1e-2) or not torch.isfinite(got).all():
                            ok = False
                            print(f"BAD d={d} causal={causal} {name} {(b, hq, hk, nq, nk)}: {err:.2e} ({base_err:.2e})")
    print("check:", "all within" if ok else "FAILED")
    return ok


def row(d: int, causal: bool, n: int) -> dict[str, float]:
    """Backward TFLOP/s at one shape: the shipped configs, each fused candidate (the dQ config then unused), cuDNN."""
    batch, heads = 16384 // n, 2048 // d
    q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=DTYPE) for _ in range(4))
    o, lse = launcher.forward(q, k, v, causal=causal, scale=d**-0.5)
    flops = 4 * batch * heads * n * n * d * 2.5 * (0.5 if causal else 1)
    tflops = {}
    for name, cfg in {"shipped": None, **candidates(d)}.items():
        run = lambda cfg=cfg: launcher.backward(do, q, k, v, o, lse, causal=causal, scale=d**-0.5, dkdv_config=cfg)
        tflops[name] = flops / triton.testing.do_bench(run, warmup=50, rep=300) / 1e9
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        ms = triton.testing.do_bench(lambda: out.backward(do, retain_graph=True), warmup=50, rep=300,
                                     grad_to_none=[qs, ks, vs])  # fmt: skip
    tflops["cudnn"] = flops / ms / 1e9
    return tflops


def bench(head_dims, seqlens) -> None:
    print(f"{'d':>4} {'causal':>6} {'N':>6}  backward TFLOP/s by provider")
    for d in head_dims:
        for causal in (False, True):
            for n in seqlens:
                line = "  ".join(f"{name} {value:.0f}" for name, value in row(d, causal, n).items())
                print(f"{d:>4} {causal!s:>6} {n:>6}  {line}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="1024,2048,8192,16384")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("bench_fused_dq.py needs a Hopper GPU (the warp-specialized kernels)")
    head_dims = [int(d) for d in args.head_dims.split(",")]
    torch.manual_seed(0)
    if not args.no_check and not check(head_dims):
        return 1
    bench(head_dims, [int(n) for n in args.seqlens.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
