"""What the decode tuner times: the representative decode steps (`workloads`), their inputs, one step with a config,
its readings (`DecodeBench`), and the call that builds a config's kernels ahead of its timing (`build_kernels`).

The steps are issue 45's: one query token at batch × keys 32 × 8k, 8 × 32k and 1 × 128k, and four tokens at
32 × 8k, each over a contiguous cache and a paged one of PAGE_SIZE keys a page; every entry holds all its keys.
Under the interpreter (`--device cpu`) they are tiny, as the other tunes' are: the run checks the pipeline, not speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config.kvcache_inputs import KVCache, check_call
from ..config.types import Mask
from .timing import Timing, kv_read_bytes, time_cuda

# (batch, keys, query tokens) of the timed steps: long and short batches of one token — the split rule splits the
# two short ones' keys —, and a few speculative tokens
SHAPES = ((32, 8192, 1), (8, 32768, 1), (1, 131072, 1), (32, 8192, 4))
PAGE_SIZE = 256  # keys a page of the paged cache holds (vLLM's and SGLang's large-page setting)
# The interpreter's: a few steps of its 32-key blocks, two K/V heads of a GQA group of 2
CPU_SHAPES = ((2, 40, 1), (1, 72, 2))
CPU_PAGE_SIZE = 16
CPU_HEADS = (4, 2)  # query and K/V heads
# Readings while searching: a decode step takes 0.05-0.5 ms, so 50 ms of repeats are 100+ runs, a stable median; the
# finish times its top few again with time_cuda's defaults
SEARCH_WARMUP_MS, SEARCH_REP_MS = 10, 50


@dataclass(frozen=True)
class Workload:
    """One timed decode step: `batch` entries of `keys` keys each, `seqlen_q` query tokens; page_size 0 for a
    contiguous cache."""

    batch: int
    keys: int
    seqlen_q: int
    page_size: int

    @property
    def capacity(self) -> int:
        """Keys an entry's cache holds: `keys`, rounded up to whole pages in a paged cache."""
        return -(-self.keys // self.page_size) * self.page_size if self.page_size else self.keys


def workloads(cpu: bool) -> tuple[Workload, ...]:
    """The steps a decode tune times: each shape over a contiguous and a paged cache."""
    shapes, page = (CPU_SHAPES, CPU_PAGE_SIZE) if cpu else (SHAPES, PAGE_SIZE)
    return tuple(Workload(batch, keys, seqlen_q, size) for batch, keys, seqlen_q in shapes for size in (0, page))


@dataclass(frozen=True)
class DecodeInputs:
    """One step's tensors, checked as flash_attn_with_kvcache checks them, its window bounds and softmax scale."""

    q: torch.Tensor
    cache: KVCache
    window: tuple[int, int]
    scale: float


def make_inputs(w: Workload, *, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> DecodeInputs:
    """Fresh random inputs of workload `w`: a paged cache's pages are dealt to the entries in a random order."""
    q = torch.randn(w.batch, w.seqlen_q, heads, head_dim, device=device, dtype=dtype)
    table = None
    if w.page_size:
        per_entry = w.capacity // w.page_size
        rows = (w.batch * per_entry, w.page_size)
        table = torch.randperm(rows[0], device=device).view(w.batch, per_entry).to(torch.int32)
    else:
        rows = (w.batch, w.keys)
    k_cache, v_cache = (torch.randn(*rows, kv_heads, head_dim, device=device, dtype=dtype) for _ in "kv")
    lengths = torch.full((w.batch,), w.keys, dtype=torch.int32, device=device)
    cache = check_call(q, k_cache, v_cache, None, None, lengths, table)
    left, right, _ = Mask().bounds(w.seqlen_q, cache.capacity)
    return DecodeInputs(q, cache, (left, right), head_dim**-0.5)


def run_step(config, x: DecodeInputs, splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of `x` with `config` (a DecodeConfig), splits from the config's rule unless given."""
    from ..launch.decode import decode

    return decode(x.q, x.cache, scale=x.scale, window=x.window, splits=splits, config=config)


class DecodeBench:
    """The workloads' inputs on one device, and their readings with a config.

    Attributes:
        inputs: the timed steps' inputs, in their order.
        gigabytes: each step's K and V read (timing.kv_read_bytes), GB.
    """

    def __init__(self, steps: tuple[Workload, ...], *, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:  # fmt: skip
        self.device, self.on_gpu = device, str(device).startswith("cuda")
        self.inputs = [make_inputs(w, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
                       for w in steps]  # fmt: skip
        self.gigabytes = [kv_read_bytes(w.batch, w.keys, kv_heads, head_dim, itemsize=dtype.itemsize) / 1e9
                          for w in steps]  # fmt: skip

    def readings(self, config, *, quick: bool = False) -> list[Timing]:
        """Each workload's Timing with `config`: do_bench medians (L2 flushed between runs; quick: the search's
        shorter SEARCH_WARMUP_MS and SEARCH_REP_MS); on the CPU, the wall clock of one run after a first one (which
        builds the kernels), meaningless for speed."""
        timings = []
        for x in self.inputs:
            if self.on_gpu:
                budget = dict(warmup_ms=SEARCH_WARMUP_MS, rep_ms=SEARCH_REP_MS) if quick else {}
                timings.append(time_cuda(lambda x=x: run_step(config, x), device=self.device, **budget))
                continue
            run_step(config, x)
            start = time.perf_counter()
            run_step(config, x)
            ms = (time.perf_counter() - start) * 1e3
            timings.append(Timing(median_ms=ms, p20_ms=ms, p80_ms=ms))
        return timings


def build_kernels(config, launches: tuple[tuple[int, int, int], ...], *, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: str) -> None:  # fmt: skip
    """Builds the kernels the timed steps launch with `config` into Triton's disk cache, on small stand-ins: a
    compile process's job (CompilePool.start_calls), so the timing process only loads binaries.

    launches: (page_size, seqlen_q, splits) of each distinct step. A stand-in has one entry of 16 pages (4096 keys
    contiguous): every int argument the kernels take then has the class Triton specializes the real steps' on
    (equal to 1, a multiple of 16 or neither) and the same constexprs — PARTIAL, the merge's split count —, hence the
    same binary. A stand-in that differs costs the timing process a compile of its own, nothing else."""
    for page_size, seqlen_q, splits in launches:
        w = Workload(1, 16 * page_size if page_size else 4096, seqlen_q, page_size)
        x = make_inputs(w, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
        run_step(config, x, splits)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()  # a launch error surfaces here, as this config's failure
