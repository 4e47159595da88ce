#!/usr/bin/env python3
"""Short sequences: fwd+bwd with and without the length-bucket entries, and where a short call's time goes.

At N <= 1k a fwd+bwd call's kernels take a few hundred µs, the same order as the host's part of the call, so
single readings swing. This times fa2tune's fwd+bwd with the length-bucket entries ("short" for N <= 1k, "medium"
for 1k < N <= 4k: `--seqlens 2048,4096` measures those) and with them switched off (lengths.buckets_for patched to
"all" only, which also gives a head dim without entries the long-length defaults instead of its bucket's),
alternating, several rounds; then, with --profile, compares do_bench's
time with the sum of the kernels' times from torch.profiler: the difference is time the GPU waited for the host.
Shapes as in `fa2tune bench --preset grid`: batch·N = 16k tokens, heads·d = 2048, bf16.

    python scripts/bench_short_lengths.py --rounds 3 --profile
    python scripts/bench_short_lengths.py --graph    # each call also replayed from a CUDA graph, beside cuDNN's
    python scripts/bench_short_lengths.py --threads  # with autograd's device threads and without, beside SDPA's

--graph captures each fwd+bwd call (fa2tune's and SDPA cuDNN's) in a CUDA graph after a warm-up and times its
replay beside the eager call: a replay launches the call's kernels with no host work, so the difference is what the
host costs a call that waits for it — and what a user who captures the step gets back.

--threads times each fwd+bwd call with autograd's device threads (PyTorch's default: a GPU's backward runs on a
thread of its own) and with torch.autograd.set_multithreading_enabled(False) (on the calling thread): moving a
call's Python between two threads, and the CPU caches between two cores, costs a short call a large share of its
host time.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _case(head_dim: int, seqlen: int, causal: bool, tokens: int, width: int, provider: str = "fa2tune"):
    """(one fwd+bwd call, its FLOPs) at this shape; provider "fa2tune", "sdpa_cudnn" or "sdpa_flash" (SDPA with
    that backend)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa2tune
    from fa2tune.tune.timing import attention_flops

    batch, heads = max(1, tokens // seqlen), width // head_dim
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    do = torch.randn_like(q)
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode="fwd+bwd")
    if provider == "fa2tune":
        return (lambda: torch.autograd.grad(fa2tune.attention(q, k, v, causal=causal), (q, k, v), do)), flops

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}[provider]

    def sdpa():
        with sdpa_kernel(backend):
            return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), do)

    return sdpa, flops


def _graphed(fn):
    """fn captured in a CUDA graph, after a warm-up on a side stream (compiles, kept launches, allocations);
    returns the graph's replay, which launches the call's kernels again with no host work."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _graph_table(head_dims, seqlens, tokens: int, width: int) -> None:
    import triton

    print("\nfwd+bwd TFLOP/s, eager call | replayed from a CUDA graph: fa2tune, SDPA cuDNN")
    for head_dim in head_dims:
        for causal in (True, False):
            for seqlen in seqlens:
                fn, flops = _case(head_dim, seqlen, causal, tokens, width)
                cudnn, _ = _case(head_dim, seqlen, causal, tokens, width, provider="sdpa_cudnn")
                calls = (fn, _graphed(fn), cudnn, _graphed(cudnn))
                row = [flops / triton.testing.do_bench(call, warmup=50, rep=200) / 1e9 for call in calls]
                print(f"d={head_dim:<3} N={seqlen:<5} causal={causal!s:<5} fa2tune {row[0]:5.0f} | {row[1]:5.0f}   "
                      f"cuDNN {row[2]:5.0f} | {row[3]:5.0f}", flush=True)  # fmt: skip


def _threads_table(head_dims, seqlens, tokens: int, width: int, rounds: int) -> None:
    """fwd+bwd with autograd's device threads (PyTorch's default: the backward runs on a thread of its own per
    GPU) and without (torch.autograd.set_multithreading_enabled(False): on the calling thread), alternating."""
    import triton

    providers = ("fa2tune", "sdpa_cudnn", "sdpa_flash")
    print(f"\nfwd+bwd TFLOP/s, median of {rounds} rounds: autograd's device thread (default) | the calling thread")
    for head_dim in head_dims:
        for causal in (True, False):
            for seqlen in seqlens:
                cells = []
                for provider in providers:
                    fn, flops = _case(head_dim, seqlen, causal, tokens, width, provider=provider)
                    readings = {True: [], False: []}
                    for _ in range(rounds):
                        for threads in (True, False):
                            with torch.autograd.set_multithreading_enabled(threads):
                                ms = triton.testing.do_bench(fn, warmup=50, rep=200)
                            readings[threads].append(flops / ms / 1e9)
                    mid = {t: sorted(xs)[len(xs) // 2] for t, xs in readings.items()}
                    cells.append(f"{provider} {mid[True]:5.0f} | {mid[False]:5.0f}")
                print(f"d={head_dim:<3} N={seqlen:<5} causal={causal!s:<5} " + "   ".join(cells), flush=True)


def _use_bucket_entries(on: bool, real) -> None:
    """Bucket entries (short and medium) on, or every call resolved from the "all" entries (and, without one, the
    long-length default: selection.resolve hands defaults.default_config the bucket it looked up)."""
    from fa2tune.api import selection
    from fa2tune.config import lengths

    lengths.buckets_for = real if on else (lambda seqlen: ("all",))
    selection.clear_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="256,512,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--profile", action="store_true", help="also split d × N=512 causal into kernel and idle time")
    parser.add_argument("--graph", action="store_true", help="also each call replayed from a CUDA graph (see above)")
    parser.add_argument("--threads", action="store_true", help="also with autograd's device threads on and off")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_short_lengths.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import triton

    from fa2tune.config import lengths

    real = lengths.buckets_for
    head_dims, seqlens = [int(d) for d in args.head_dims.split(",")], [int(n) for n in args.seqlens.split(",")]
    print("fwd+bwd TFLOP/s, one reading per round: with the length bucket's entries | 'all' entries only")
    for head_dim in head_dims:
        for causal in (True, False):
            for seqlen in seqlens:
                fn, flops = _case(head_dim, seqlen, causal, args.tokens, args.width)
                readings = {True: [], False: []}
                for _ in range(args.rounds):
                    for on in (True, False):
                        _use_bucket_entries(on, real)
                        fn()
                        readings[on].append(flops / triton.testing.do_bench(fn, warmup=50, rep=200) / 1e9)
                fmt = lambda xs: " ".join(f"{x:5.0f}" for x in xs)
                print(
                    f"d={head_dim:<3} N={seqlen:<5} causal={causal!s:<5} {fmt(readings[True])} | "
                    f"{fmt(readings[False])}",
                    flush=True,
                )
    _use_bucket_entries(True, real)
    if args.graph:
        _graph_table(head_dims, seqlens, args.tokens, args.width)
    if args.threads:
        _threads_table(head_dims, seqlens, args.tokens, args.width, args.rounds)
    if args.profile:
        from fa2tune.tune.timing import kernel_times_ms

        for head_dim in head_dims:
            fn, _ = _case(head_dim, 512, True, args.tokens, args.width)
            fn()
            ms = triton.testing.do_bench(fn, warmup=50, rep=200)
            kernels = kernel_times_ms(fn, reps=20)
            busy = sum(kernels.values())
            print(
                f"\nd={head_dim} N=512 causal fwd+bwd: do_bench {ms:.3f} ms, kernels {busy:.3f} ms, GPU idle "
                f"{ms - busy:.3f} ms per call"
            )
            for name, t in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"  {t:.3f} ms  {name[:80]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
