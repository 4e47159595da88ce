#!/usr/bin/env python3
"""fastlaunch's direct launches vs Triton's launch path, end to end at short lengths (docs/PERF.md v7).

For d ∈ {128, 64} × causal × N ∈ {256, 512, 1k, 2k} (batch·N = 16k tokens, heads·d = 2048, bf16) × {fwd,
fwd+bwd}: fa2tune with fastlaunch on and off, alternating within each round, beside SDPA's flash and cuDNN
backends; TFLOP/s from do_bench's median, the median over rounds. Prints a Markdown table last.

    python scripts/bench_direct_launch.py --rounds 3
"""

from __future__ import annotations

import argparse
import sys

import torch


def _providers(q, k, v, do, causal: bool, mode: str):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa2tune

    def ours():
        out = fa2tune.attention(q, k, v, causal=causal)
        return out if mode == "fwd" else torch.autograd.grad(out, (q, k, v), do)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return out if mode == "fwd" else torch.autograd.grad(out, (q, k, v), do)

        return run

    return ours, {"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqlens", default="256,512,1024,2048")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_direct_launch.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import triton

    from fa2tune.launch import fastlaunch
    from fa2tune.tune.timing import attention_flops

    rows = []
    for head_dim in (128, 64):
        for causal in (False, True):
            for seqlen in (int(n) for n in args.seqlens.split(",")):
                batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
                q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))  # fmt: skip
                do = torch.randn_like(q)
                for mode in ("fwd", "fwd+bwd"):
                    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode=mode)
                    ours, others = _providers(q, k, v, do, causal, mode)
                    readings: dict[str, list[float]] = {}
                    tflops = lambda fn: flops / triton.testing.do_bench(fn, warmup=50, rep=200) / 1e9  # noqa: B023
                    for _ in range(args.rounds):
                        for name, direct in (("Triton launch", False), ("direct", True)):
                            fastlaunch._enabled = direct
                            ours()
                            readings.setdefault(name, []).append(tflops(ours))
                        for name, fn in others.items():
                            fn()
                            readings.setdefault(name, []).append(tflops(fn))
                    median = {name: sorted(xs)[len(xs) // 2] for name, xs in readings.items()}
                    rows.append((head_dim, seqlen, causal, mode, median))
                    print(f"d={head_dim} N={seqlen} causal={causal} {mode}: "
                          + " ".join(f"{name}={x:.0f}" for name, x in median.items()), flush=True)  # fmt: skip
    print(f"# direct launches taken: {fastlaunch.direct_launches}")
    print("\n| d | N | causal | mode | Triton launch | direct | direct / Triton | SDPA flash | cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for head_dim, seqlen, causal, mode, m in rows:
        print(f"| {head_dim} | {seqlen} | {causal} | {mode} | {m['Triton launch']:.0f} | {m['direct']:.0f} | "
              f"{m['direct'] / m['Triton launch']:.2f} | {m['SDPA flash']:.0f} | {m['cuDNN']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
