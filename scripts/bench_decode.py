#!/usr/bin/env python3
"""Decode steps over a KV cache: fa2tune.flash_attn_with_kvcache beside SDPA's cuDNN and flash backends (and
flash_attn's flash_attn_with_kvcache where installed), in GB/s of K and V read; and fa2tune.attention() on the same
K and V ("fa2tune_attention": an inference call of a few query tokens, which runs the decode kernels too), and the
Hugging Face integration's step of a left-padded batch ("fa2tune_hf", K and V read in place; "fa2tune_unpad", the
integration's gathering fallback).

GB/s = 2 · batch · keys · kv_heads · head_dim · bytes per element / time: the bytes of K and V a step must read,
over the median of triton.testing.do_bench (L2 flushed between runs). A decode step is bound by that read; the
H200's copy ceiling is about 4,300 GB/s. Every entry holds `keys` keys (cache_seqlens = keys). SDPA reads the cache
as (batch, kv_heads, keys, head_dim) views with enable_gqa; it has no paged cache, so a paged row's SDPA numbers are
those of the contiguous cache. All providers run without a causal mask: over 4 of 8k keys it changes no bytes read,
and SDPA's is_causal is aligned top-left, not as decoding needs. Each provider's output is checked against fa2tune's
first (relative error < 2e-2); one that differs or raises gets no number and a note.

Default shapes (issue 45): d=128, bf16, 32 query heads over 8 K/V heads, one query token at batch 32 × 8k keys,
8 × 32k and 1 × 128k, four tokens at 32 × 8k; each with a contiguous cache and a paged one (--page-size, 256).

    python scripts/bench_decode.py --csv $OUT/decode.csv
    python scripts/bench_decode.py --shapes 64x4096x1 --head-dim 64
    python scripts/bench_decode.py --shapes 1x131072x1 --page-size 0 --num-splits 8,16,33,66   # the split count
    python scripts/bench_decode.py --device cpu      # tiny shapes through Triton's interpreter: checks the script
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

from fa2tune.cli.arguments import positive_ints

DEFAULT_SHAPES = "32x8192x1,8x32768x1,1x131072x1,32x8192x4"  # batch x keys x query tokens
CPU_SHAPES = "2x64x1,1x100x4"
CPU_LIMITS = dict(batch=2, keys=256, heads=4)  # what the interpreter runs in seconds


def _parse_shapes(text: str) -> list[tuple[int, int, int]]:
    try:
        shapes = [tuple(int(part) for part in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 3 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"shapes are batch x keys x query tokens, e.g. 32x8192x1, got {text!r}")
    return shapes


def _cache(batch, keys, kv_heads, head_dim, dtype, device):
    """(k_cache, v_cache, None, cache_seqlens): every entry holds `keys` random keys."""
    k, v = (torch.randn((batch, keys, kv_heads, head_dim), device=device, dtype=dtype) for _ in "kv")  # GBs: on device
    return k, v, None, torch.full((batch,), keys, dtype=torch.int32, device=device)


def _paged(contiguous, page_size, gen):
    """The same keys as a paged cache: entry b's i-th page of page_size keys at page table[b, i], the pages of all
    entries spread over the cache in a random order (the last page of an entry padded with zeros)."""
    k, v, _, seqlens = contiguous
    batch, keys, kv_heads, head_dim = k.shape
    per_entry = -(-keys // page_size)
    order = torch.randperm(batch * per_entry, generator=gen).to(k.device)
    paged = []
    for cache in (k, v):
        padded = cache.new_zeros((batch, per_entry * page_size, kv_heads, head_dim))
        padded[:, :keys] = cache
        pages = torch.empty_like(padded).view(batch * per_entry, page_size, kv_heads, head_dim)
        pages[order] = padded.view(batch * per_entry, page_size, kv_heads, head_dim)
        paged.append(pages)
    return *paged, order.view(batch, per_entry).to(torch.int32), seqlens


def _providers(q, k_cache, v_cache, table, seqlens, contiguous, num_splits=()):
    """name -> step(): fa2tune on this cache (and at each forced split count, "fa2tune/sN"); attention() and SDPA's
    backends (and flash_attn) on the contiguous one."""
    import fa2tune

    steps = {}
    for splits in (0, *num_splits):
        name = f"fa2tune/s{splits}" if splits else "fa2tune"
        steps[name] = lambda splits=splits: fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                                            block_table=table, num_splits=splits)
    q_t, k_t, v_t = q.transpose(1, 2), contiguous[0].transpose(1, 2), contiguous[1].transpose(1, 2)

    def attention_step():
        with torch.no_grad():  # inference: the decode kernels (fa2tune.launch.short_query)
            return fa2tune.attention(q_t, k_t, v_t).transpose(1, 2)

    steps["fa2tune_attention"] = attention_step
    if table is None:  # the integration reads a model's cache, never a paged one
        steps.update(_hf_steps(q_t, contiguous))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
    if q.device.type == "cpu":
        backends = {"sdpa_math": SDPBackend.MATH}
    for name, backend in backends.items():
        def step(backend=backend):
            with sdpa_kernel([backend]):
                return sdpa(q_t, k_t, v_t, enable_gqa=True).transpose(1, 2)

        steps[name] = step
    try:
        from flash_attn import flash_attn_with_kvcache as flash_kvcache
    except ImportError:
        return steps
    steps["flash_attn"] = lambda: flash_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    return steps


def _hf_steps(q_t, contiguous) -> dict:
    """The Hugging Face integration's step of a left-padded batch on the same keys, the cache in transformers'
    layout (batch, kv_heads, keys, head_dim), where the other rows read (batch, keys, kv_heads, head_dim):
    "fa2tune_hf" as a model runs it (K and V read in place), "fa2tune_unpad" as it runs where the cache's strides
    allow no in-place read (the kept keys gathered into attention_varlen's layout, the output scattered back). Each
    row of the cache gets one padding key in front, so the keys attended are the other providers'."""
    import contextlib

    from fa2tune.integrations import transformers as fa2tune_hf
    from fa2tune.integrations.hf_masks import MaskPlan, Pattern, Rows

    k, v = (torch.nn.functional.pad(t.transpose(1, 2), (0, 0, 1, 0)) for t in contiguous[:2])  # (b, h, 1 + keys, d)
    batch, _, length, _ = k.shape
    valid = torch.ones(batch, length, dtype=torch.bool, device=k.device)
    valid[:, 0] = False
    rows = Rows.from_valid(torch.ones(batch, q_t.shape[2], dtype=torch.bool, device=k.device), valid)
    plan = MaskPlan(Pattern(causal=False), batch, q_t.shape[2], length, rows)

    def hf_step():
        with torch.no_grad():
            return fa2tune_hf.attention_forward(None, q_t, k, v, plan, scaling=q_t.shape[-1] ** -0.5)[0]

    @contextlib.contextmanager
    def no_page_view():  # the integration's own fallback, whole: what a cache without the view's strides runs
        real, fa2tune_hf._one_key_pages = fa2tune_hf._one_key_pages, lambda key, value: None
        try:
            yield
        finally:
            fa2tune_hf._one_key_pages = real

    def unpad_step():
        with no_page_view():
            return hf_step()

    return {"fa2tune_hf": hf_step, "fa2tune_unpad": unpad_step}


def _time_ms(step, device) -> float:
    if device.type == "cuda":
        from fa2tune.tune.timing import time_cuda

        return time_cuda(step).median_ms
    readings = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        readings.append((time.perf_counter() - start) * 1e3)
    return statistics.median(readings)


def rows_for(shape, args, device) -> list[dict]:
    """Every provider's row for one (batch, keys, query tokens) shape, contiguous and paged."""
    from fa2tune.tune.timing import kv_read_bytes

    batch, keys, seqlen_q = shape
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator().manual_seed(0)  # the page order's
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, args.heads, args.head_dim, device=device, dtype=dtype)
    contiguous = _cache(batch, keys, args.kv_heads, args.head_dim, dtype, device)
    gigabytes = kv_read_bytes(batch, keys, args.kv_heads, args.head_dim, itemsize=dtype.itemsize) / 1e9
    rows = []
    for page_size in (0, args.page_size) if args.page_size else (0,):
        k_cache, v_cache, table, seqlens = _paged(contiguous, page_size, gen) if page_size else contiguous
        steps = _providers(q, k_cache, v_cache, table, seqlens, contiguous, args.num_splits)
        reference = steps["fa2tune"]().float()
        for name, step in steps.items():
            row = dict(provider=name, batch=batch, keys=keys, seqlen_q=seqlen_q, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                       cache=f"paged{page_size}" if page_size else "contiguous", ms=float("nan"),
                       gbps=float("nan"), note="")  # fmt: skip
            try:
                error = ((step().float() - reference).norm() / reference.norm()).item()
            except Exception as exc:  # a backend that cannot run this shape: its row says why
                rows.append({**row, "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"})
                continue
            if not error < 2e-2:
                rows.append({**row, "note": f"wrong result (rel err {error:.1e})"})
                continue
            ms = _time_ms(step, device)
            rows.append({**row, "ms": round(ms, 4), "gbps": float(f"{gigabytes / (ms * 1e-3):.4g}"),
                         "note": f"rel err {error:.1e}"})  # fmt: skip
    return rows


def _environment(device) -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    return f"{name}, torch {torch.__version__}, triton {triton.__version__}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=_parse_shapes, default=None,
                        help=f"batch x keys x query tokens, comma-separated (default {DEFAULT_SHAPES}; "
                             f"--device cpu: {CPU_SHAPES})")  # fmt: skip
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 32; cpu: 4)")
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default 8; cpu: 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; cpu: 32)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--page-size", type=int, default=None,
                        help="keys a page of the paged cache holds; 0: contiguous only (default 256; cpu: 16)")
    parser.add_argument("--num-splits", type=positive_ints, default=(),
                        help="also time fa2tune at these split counts, e.g. 8,16,33 (rows fa2tune/sN; default: only "
                             "the split rule's choice)")  # fmt: skip
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes, interpreter)")
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    for name, gpu, small in (("shapes", _parse_shapes(DEFAULT_SHAPES), _parse_shapes(CPU_SHAPES)), ("heads", 32, 4),
                             ("kv_heads", 8, 2), ("head_dim", 128, 32), ("page_size", 256, 16)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, small if cpu else gpu)
    too_large = [s for s in args.shapes if s[0] > CPU_LIMITS["batch"] or s[1] > CPU_LIMITS["keys"]]
    if cpu and (too_large or args.heads > CPU_LIMITS["heads"]):
        parser.error(f"--device cpu runs through Triton's interpreter: at most {CPU_LIMITS}, e.g. --shapes "
                     f"{CPU_SHAPES}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton builds a kernel
    device = torch.device(args.device)
    rows = [row for shape in args.shapes for row in rows_for(shape, args, device)]
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(_environment(device))
    print(f"{'batch x keys x q':>18} {'cache':>10} {'provider':>17} {'ms':>9} {'GB/s':>8}  note")
    for r in rows:
        shape = f"{r['batch']}x{r['keys']}x{r['seqlen_q']}"
        print(f"{shape:>18} {r['cache']:>10} {r['provider']:>17} {r['ms']:>9} {r['gbps']:>8}  {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
