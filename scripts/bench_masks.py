#!/usr/bin/env python3
"""Sliding-window and packed-sequence attention on one GPU: fa2tune beside FlexAttention with the same mask.

Windowed: N = 16k, d = 128, bf16, batch·N = 16k tokens, heads·d = 2048, causal with window (1024, 0) — query i
sees keys i-1024..i. FlexAttention gets the same rule as a block mask. FLOPs count the visible pairs only
(fa2tune.tune.timing.attention_flops), so a kernel that computed skipped tiles would show it as lower TFLOP/s.
Also printed: dense causal fa2tune at the same N (what the window saves).

Packed: 8 sequences of random lengths summing to 16k tokens, causal, through attention_varlen, beside FlexAttention
with a document mask over the packed batch, and SDPA flash on the same sequences padded to the longest.

Every provider is checked against fa2tune's output first (relative error < 2e-2). Prints a table last.

    python scripts/bench_masks.py --csv $OUT/masks.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys

import torch
import torch.nn.functional as F

import fa2tune
from fa2tune.config.types import Mask
from fa2tune.tune.timing import attention_flops, time_cuda
from fa2tune.tune.workload import random_qkv


def _flex(mask_mod, n_q, n_k, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, None, None, n_q, n_k, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _fwd_bwd(fn, do):
    def run(q, k, v):
        return torch.autograd.grad(fn(q, k, v), (q, k, v), do)

    return run


def _flat(out):
    out = out if isinstance(out, tuple) else (out,)
    return torch.cat([t.flatten().float() for t in out])


def _rows(case, providers, inputs, flops_fwd, reference="fa2tune"):
    """Times every provider, fwd and fwd+bwd, after checking it against the reference provider's result."""
    rows = []
    q, k, v = inputs
    do = torch.randn_like(providers[reference](q, k, v))
    for mode in ("fwd", "fwd+bwd"):
        wrap = (lambda f: f) if mode == "fwd" else (lambda f: _fwd_bwd(f, do))
        ref = _flat(wrap(providers[reference])(q, k, v))
        for name, fn in providers.items():
            fn = wrap(fn)
            err = ((_flat(fn(q, k, v)) - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                rows.append(dict(case=case, provider=name, mode=mode, ms=float("nan"), tflops=float("nan"),
                                 note=f"wrong result (rel err {err:.1e})"))  # fmt: skip
                continue
            t = time_cuda(lambda fn=fn: fn(q, k, v))
            flops = flops_fwd * (3.5 if mode == "fwd+bwd" else 1.0)
            rows.append(dict(case=case, provider=name, mode=mode, ms=round(t.median_ms, 4),
                             tflops=round(t.tflops(flops), 1), note=f"rel err {err:.1e}"))  # fmt: skip
    return rows


def windowed(seqlen: int, window: int, head_dim: int) -> list[dict]:
    batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
    q, k, v = random_qkv(batch, heads, seqlen, head_dim, requires_grad=True)
    mask = Mask(causal=True, window=(window, -1))
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=mask)
    providers = {
        "fa2tune": lambda q, k, v: fa2tune.attention(q, k, v, causal=True, window=(window, -1)),
        "flex": _flex(lambda b, h, i, j: (j <= i) & (i - j <= window), seqlen, seqlen, q.device),
    }
    rows = _rows(f"window{window} N{seqlen} d{head_dim}", providers, (q, k, v), flops)
    # Dense causal at the same length: what skipping the tiles outside the window saves (same FLOP count basis,
    # so its TFLOP/s here is "useful" TFLOP/s).
    dense = {"fa2tune-causal-dense": lambda q, k, v: fa2tune.attention(q, k, v, causal=True)}
    t = time_cuda(lambda: dense["fa2tune-causal-dense"](q, k, v))
    rows.append(dict(case=f"window{window} N{seqlen} d{head_dim}", provider="fa2tune-causal-dense", mode="fwd",
                     ms=round(t.median_ms, 4), tflops=round(t.tflops(flops), 1), note="useful FLOPs only"))  # fmt: skip
    return rows


def packed(total: int, sequences: int, head_dim: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    cuts = torch.randperm(total - 1, generator=gen)[: sequences - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, total]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    heads = 2048 // head_dim
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    longest = max(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    flops = sum(attention_flops(1, heads, n, n, head_dim, causal=True) for n in lengths)
    doc = torch.repeat_interleave(torch.arange(sequences, device="cuda"), torch.tensor(lengths, device="cuda"))
    flex = _flex(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), total, total, "cuda")

    def flex_packed(q, k, v):  # (total, H, d) as one (1, H, total, d) batch with a document mask
        return flex(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)

    def sdpa_padded(q, k, v):  # what a user without varlen does: pad every sequence to the longest
        def pad(t):
            pairs = itertools.pairwise(bounds)
            return torch.stack([F.pad(t[a:b].transpose(0, 1), (0, 0, 0, longest - (b - a))) for a, b in pairs])

        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True)
        return torch.cat([out[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)])

    providers = {
        "fa2tune": lambda q, k, v: fa2tune.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True),
        "flex": flex_packed,
        "sdpa_padded": sdpa_padded,
    }
    return _rows(f"varlen {sequences}seqs {total}tok d{head_dim} (longest {longest})", providers, (q, k, v), flops)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=None)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    rows = windowed(args.seqlen, args.window, args.head_dim) + packed(16384, 8, args.head_dim)
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"{'case':>44} {'provider':>22} {'mode':>8} {'ms':>9} {'TFLOP/s':>8}  note")
    for r in rows:
        print(f"{r['case']:>44} {r['provider']:>22} {r['mode']:>8} {r['ms']:>9} {r['tflops']:>8}  {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
