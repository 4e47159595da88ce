"""Timing and FLOP accounting shared by the benchmarks in scripts/ (and, later, the tuner)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, *, causal: bool, mode: str = "fwd"
) -> float:
    """FLOPs of attention: 2 matmuls of 2·N_q·N_k·d each per head (4·B·H·N_q·N_k·d), over the visible pairs.

    Causal counts the pairs a query may see (bottom-right aligned; N(N+1)/2 for N_q = N_k, the usual "× 0.5").
    mode "fwd+bwd" multiplies by 3.5: the backward does 5 matmuls of the same size to the forward's 2.
    """
    if causal:
        shift = seqlen_k - seqlen_q
        # query i sees min(N_k, max(0, i + shift + 1)) keys
        pairs = sum(min(seqlen_k, max(0, i + shift + 1)) for i in range(seqlen_q))
    else:
        pairs = seqlen_q * seqlen_k
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]
    return 4.0 * batch * heads * pairs * head_dim * factor


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one measured callable: the median and the 20th/80th percentiles of do_bench."""

    median_ms: float
    p20_ms: float
    p80_ms: float

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12


def time_cuda(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100) -> Timing:
    """Times fn on the current CUDA device with triton.testing.do_bench (events, L2 flushed between runs)."""
    from triton.testing import do_bench

    p20, median, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
    return Timing(median_ms=median, p20_ms=p20, p80_ms=p80)


def random_qkv(
    batch: int,
    heads: int,
    seqlen: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    heads_kv: int | None = None,
    seqlen_k: int | None = None,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh standard-normal q, k, v in SDPA's layout (never zeros: they hide unwritten outputs)."""
    heads_kv = heads if heads_kv is None else heads_kv
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    q = torch.randn(batch, heads, seqlen, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=dtype, device=device)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def make_measure(
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    *,
    seqlens: tuple[int, ...],
    device: str,
    tokens: int = 16384,
    width: int = 2048,
) -> Callable:
    """The tuner's objective: config -> sum over `seqlens` of the median time (ms) of `kernel` with it.

    Each length runs at batch = tokens // N and heads = width // head_dim (the PERF-NOTES grid). For a backward
    kernel the whole backward is timed, the other backward kernel at its resolved config. On the CPU (the Triton
    interpreter) the wall clock of one run is used: right for testing the pipeline, meaningless for speed.
    """
    from . import launcher

    inputs = {}
    for seqlen in seqlens:
        batch, heads = max(1, tokens // seqlen), max(1, width // head_dim)
        q, k, v = random_qkv(batch, heads, seqlen, head_dim, dtype=dtype, device=device)
        if kernel == "fwd":
            inputs[seqlen] = (q, k, v, None, None, None)
        else:
            o, lse = launcher.forward(q, k, v, causal=causal, scale=head_dim**-0.5)
            inputs[seqlen] = (q, k, v, o, lse, torch.randn_like(o))

    def run(cfg, q, k, v, o, lse, do):
        if kernel == "fwd":
            return launcher.forward(q, k, v, causal=causal, scale=head_dim**-0.5, config=cfg)
        key = "dkdv_config" if kernel == "bwd_dkdv" else "dq_config"
        return launcher.backward(do, q, k, v, o, lse, causal=causal, scale=head_dim**-0.5, **{key: cfg})

    def measure(cfg) -> float:
        total = 0.0
        for args in inputs.values():
            if str(device).startswith("cuda"):
                total += time_cuda(lambda args=args: run(cfg, *args)).median_ms
            else:
                import time

                run(cfg, *args)  # first call renders and imports the variant
                start = time.perf_counter()
                run(cfg, *args)
                total += (time.perf_counter() - start) * 1e3
        return total

    def spread(cfg) -> float | None:
        """The winner's worst (p80 − p20) / median over the tuning lengths; None on the CPU."""
        if not str(device).startswith("cuda"):
            return None
        timings = [time_cuda(lambda args=args: run(cfg, *args)) for args in inputs.values()]
        return round(max((t.p80_ms - t.p20_ms) / t.median_ms for t in timings), 4)

    measure.spread = spread
    return measure


def _compile_one(job) -> str | None:
    kernel, head_dim, dtype, causal, cfg, seqlen, device = job
    try:
        from . import launcher

        q, k, v = random_qkv(1, 1, seqlen, head_dim, dtype=dtype, device=device)
        if kernel == "fwd":
            launcher.forward(q, k, v, causal=causal, scale=1.0, config=cfg)
        else:
            o, lse = launcher.forward(q, k, v, causal=causal, scale=1.0)
            key = "dkdv_config" if kernel == "bwd_dkdv" else "dq_config"
            launcher.backward(torch.randn_like(o), q, k, v, o, lse, causal=causal, scale=1.0, **{key: cfg})
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # failures are data
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc) else ''}"


def precompile(kernel, head_dim, dtype, causal, configs, *, seqlens, device="cuda:0", workers=16) -> dict:
    """Compiles every config in a pool of processes (compiling is CPU work, most of a tune's time), so the study
    then only times: Triton's disk cache hands the binaries to this process. Returns {config: failure reason}."""
    import multiprocessing as mp

    # A length that is a multiple of every block gives the same Jinja variant as the tuning lengths (all 2^k).
    jobs = [(kernel, head_dim, dtype, causal, cfg, 256, device) for cfg in configs]
    with mp.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_compile_one, jobs)
    return {cfg: reason for cfg, reason in zip(configs, results, strict=True) if reason}


def load_sweep(path, *, head_dim: int, causal: bool) -> dict:
    """{config: cost} from a scripts/sweep_configs.py CSV, cost = 1000 / TFLOP/s (lower is better, ∝ time).

    Configs that failed in the sweep are absent. Replaying such a table lets the tuner be tested and compared
    with exhaustive search without a GPU.
    """
    import csv

    from .types import KernelConfig

    table = {}
    with open(path) as handle:
        for row in csv.DictReader(handle):
            if int(row["head_dim"]) == head_dim and row["causal"] == str(causal) and row["tflops"] != "nan":
                fields = ("block_m", "block_n", "num_warps", "num_stages")
                table[KernelConfig(*(int(row[f]) for f in fields))] = 1000.0 / float(row["tflops"])
    return table
