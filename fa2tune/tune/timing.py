"""Timing and FLOP accounting shared by the tuner and the benchmarks in scripts/: do_bench readings (median and
spread), a kernel-by-kernel profile, the FLOPs of attention under a mask and the bytes a decode step reads."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..config.types import Mask


def attention_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    *,
    causal: bool | Mask,
    mode: str = "fwd",
) -> float:
    """FLOPs of attention: 2 matmuls of 2·N_q·N_k·d each per head (4·B·H·N_q·N_k·d), over the visible pairs.

    A mask counts the pairs a query may see (causal bottom-right aligned: N(N+1)/2 for N_q = N_k, the usual
    "× 0.5"; a window of (left, 0) about N·(left + 1)). mode "fwd+bwd" multiplies by 3.5: the backward does 5
    matmuls of the same size to the forward's 2.
    """
    mask = causal if isinstance(causal, Mask) else Mask(causal=causal)
    if mask == Mask():
        pairs = seqlen_q * seqlen_k
    else:
        left, right, prefix = mask.bounds(seqlen_q, seqlen_k)
        shift = seqlen_k - seqlen_q
        pairs = 0
        for i in range(seqlen_q):  # query i sees keys [i' - left, i' + right] and [0, prefix)
            lo, hi = max(0, i + shift - left), min(seqlen_k - 1, i + shift + right)
            band = max(0, hi - lo + 1)
            prefix_in_band = max(0, min(prefix - 1, hi) - lo + 1)
            pairs += band + prefix - prefix_in_band
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]
    return 4.0 * batch * heads * pairs * head_dim * factor


def kv_read_bytes(batch: int, keys: int, kv_heads: int, head_dim: int, *, itemsize: int) -> int:
    """Bytes of K and V a decode step reads: 2 · batch · keys · kv_heads · head_dim · itemsize. A decode step is bound
    by that read (its queries and outputs are a few rows), so its speed is reported as these bytes / time."""
    return 2 * batch * keys * kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one measured callable: the median and the 20th/80th percentiles of do_bench."""

    median_ms: float
    p20_ms: float
    p80_ms: float

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12


# On the H200 the first timing a process makes reads 3-8 % faster than the same config timed later — whichever config
# comes first, after a 2 s run of it too, so not the clock's post-idle boost; the cause is not known. time_cuda
# therefore discards a process's first timing: every reading it returns is one made after another.
_timed_before = False
# do_bench times as many runs as fit its `rep` window after an estimate (at least one): forward + backward at N=64k
# (batch·N = 16k, 60-250 ms a call) got one or two runs in the 100 ms window, and one reading is no median. A reading
# whose window held fewer than MIN_RUNS runs is taken again in a window one run longer than MIN_RUNS calls (do_bench's
# estimate, which the window is divided by, includes its L2 flush). The tuner's calls (N <= 16k, up to ~15 ms) fit
# that many and are timed once, as before.
MIN_RUNS = 5


def time_cuda(
    fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100, device: str | torch.device | None = None
) -> Timing:
    """Times fn with triton.testing.do_bench (events, L2 flushed between runs) on `device` (default: the current);
    a process's first call times fn twice and returns the second reading (above), and a reading whose window held
    fewer than MIN_RUNS runs of fn is taken again in a window that holds them (the first reading is the estimate).

    do_bench records its events and flushes L2 on the *current* device: timing a kernel that runs on another GPU
    measures nothing, so the device the work runs on is made current here.
    """
    global _timed_before
    from triton.testing import do_bench

    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        p20, median, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
        few_runs = math.isfinite(median) and median * MIN_RUNS > rep_ms
        if not _timed_before or few_runs:  # the last reading is kept
            window = math.ceil(median * (MIN_RUNS + 1)) if few_runs else rep_ms
            p20, median, p80 = do_bench(fn, warmup=warmup_ms, rep=window, quantiles=[0.2, 0.5, 0.8])
        _timed_before = True
    return Timing(median_ms=median, p20_ms=p20, p80_ms=p80)


def kernel_times_ms(fn: Callable[[], object], reps: int = 10) -> dict[str, float]:
    """Mean device milliseconds per call of each CUDA kernel that fn launches, by kernel name (torch.profiler).

    Their sum against time_cuda's reading is the time the GPU waited for the host; each entry is one kernel's share.
    fn runs once first, so compiles and caches stay out of the profile."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / reps / 1e3 for e in prof.key_averages() if e.device_time_total > 0}


# A tune's finish (tune.finish) times its finalists this many rounds (`fa2tune bench --rounds` its providers as many
# as asked), each in the other direction (first to last, then last to first), and ranks them by the mean of their
# readings. A GPU's readings drift within a finish: on an H100 a d=64 dK/dV config read
# 9.40 ms in the search and 10.43 ms re-timed last of three (+11 %) while the one before it moved −0.5 %, and the
# configs re-timed last in a fixed order are the default and the incumbent, the tune's "before". Over a forward and a
# reverse round each finalist's mean takes the same share of a drift that grows steadily through the finish (so the
# count is even: an odd one times the first finalists once more late, the last once more early).
FINAL_ROUNDS = 2

Finalist = TypeVar("Finalist", bound=Hashable)
Reading = TypeVar("Reading")


def final_readings(finalists: list[Finalist], read: Callable[[Finalist], Reading],
                   rounds: int = FINAL_ROUNDS) -> dict[Finalist, list[Reading]]:  # fmt: skip
    """Each finalist's readings, one a round, the rounds in alternating order (FINAL_ROUNDS); a finalist listed
    twice is timed once a round. A finalist whose reading raises in any round is left out, and not read again: a
    config that runs only sometimes is never named the winner (`read` records why, where its caller needs it)."""
    finalists = list(dict.fromkeys(finalists))
    readings: dict[Finalist, list[Reading]] = {finalist: [] for finalist in finalists}
    failed = set()
    for round_ in range(rounds):
        for finalist in finalists if round_ % 2 == 0 else finalists[::-1]:
            if finalist in failed:
                continue
            try:
                readings[finalist].append(read(finalist))
            except Exception:
                failed.add(finalist)
    return {finalist: values for finalist, values in readings.items() if finalist not in failed}
