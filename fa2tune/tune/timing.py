"""Timing, FLOP accounting and kernel runs shared by the tuner and the benchmarks in scripts/."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config.types import Mask

if TYPE_CHECKING:
    from ..launch.launcher import Packing


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


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one measured callable: the median and the 20th/80th percentiles of do_bench."""

    median_ms: float
    p20_ms: float
    p80_ms: float

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12


# On the H200 the first timing a process made read 3-8 % faster than the same config timed later — whichever config
# came first, after a 2 s run of it too, so not the clock's post-idle boost (docs/PERF.md v27); the cause is not
# known. time_cuda therefore discards a process's first timing: every reading it returns is one made after another.
_timed_before = False


def time_cuda(
    fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100, device: str | torch.device | None = None
) -> Timing:
    """Times fn with triton.testing.do_bench (events, L2 flushed between runs) on `device` (default: the current);
    a process's first call times fn twice and returns the second reading (above).

    do_bench records its events and flushes L2 on the *current* device: timing a kernel that runs on another GPU
    measures nothing, so the device the work runs on is made current here.
    """
    global _timed_before
    from triton.testing import do_bench

    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        for _ in range(1 if _timed_before else 2):  # the last reading is kept
            p20, median, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
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


@dataclass(frozen=True)
class KernelInputs:
    """What one timed run of a kernel reads: q, k, v, and for a backward kernel the forward's O, LSE and a dO;
    packing for packed sequences (q, k, v then (total_tokens, heads, head_dim))."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    do: torch.Tensor | None = None
    packing: Packing | None = None


class PackedBatch:
    """A batch of SDPA-layout tensors as packed equal-length sequences (the varlen kernels' layout), and back."""

    def __init__(self, batch: int, seqlen_q: int, seqlen_k: int, device):
        from ..launch.launcher import Packing

        cu = [torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device) for n in (seqlen_q, seqlen_k)]
        self.packing = Packing(cu[0], cu[1], seqlen_q, seqlen_k)
        self.batch = batch

    @staticmethod
    def pack(t: torch.Tensor) -> torch.Tensor:
        """(batch, heads, N, d) -> (batch·N, heads, d)."""
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous()

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """(batch·N, heads, d) -> (batch, heads, N, d), a view."""
        return t.reshape(self.batch, -1, t.shape[1], t.shape[2]).transpose(1, 2)

    def unpack_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """(heads, batch·N) -> (batch, heads, N), a view."""
        return lse.reshape(lse.shape[0], self.batch, -1).transpose(0, 1)


def kernel_inputs(
    kernel: str, causal: bool | Mask, batch: int, heads: int, seqlen: int, head_dim: int, *, dtype, device,
    varlen: bool = False,
):  # fmt: skip
    """Fresh random inputs for `kernel` ("fwd", "bwd_dkdv", "bwd_dq"); backward ones carry a real forward.
    varlen: the batch packed as equal-length sequences, for the packed-sequence variant."""
    from ..api import ops

    q, k, v = random_qkv(batch, heads, seqlen, head_dim, dtype=dtype, device=device)
    packing = None
    if varlen:
        packed = PackedBatch(batch, seqlen, seqlen, device)
        q, k, v = map(packed.pack, (q, k, v))
        packing = packed.packing
    if kernel == "fwd":
        return KernelInputs(q, k, v, packing=packing)
    o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5, packing=packing)
    return KernelInputs(q, k, v, o, lse, torch.randn_like(o), packing)


def run_kernel(kernel: str, cfg, x: KernelInputs, causal: bool | Mask):
    """Runs `kernel` with `cfg` (a backward kernel: the whole backward, the other kernel at its resolved config)."""
    from ..api import ops

    scale = x.q.shape[-1] ** -0.5
    if kernel == "fwd":
        return ops.forward(x.q, x.k, x.v, causal=causal, scale=scale, config=cfg, packing=x.packing)
    key = "dkdv_config" if kernel == "bwd_dkdv" else "dq_config"
    return ops.backward(
        x.do, x.q, x.k, x.v, x.o, x.lse, causal=causal, scale=scale, packing=x.packing, **{key: cfg}
    )


def make_measure(
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool | Mask,
    *,
    seqlens: tuple[int, ...],
    device: str,
    tokens: int = 16384,
    width: int = 2048,
    varlen: bool = False,
    with_forward: bool = False,
) -> Callable:
    """The tuner's objective: config -> sum over `seqlens` of the median time (ms) of `kernel` with it.

    Each length runs at batch = tokens // N and heads = width // head_dim (the PERF-NOTES grid). On the CPU (the
    Triton interpreter) the wall clock of one run is used: right for testing the pipeline, meaningless for speed.

    with_forward: a backward kernel is timed inside the whole training call — the forward (at its resolved config)
    launched, then the backward — as one timed run. Where the host takes longer to launch the call's kernels than
    the GPU to run them (N <= 1k), that is what shows: a backward with faster kernels but costlier launches (the
    warp-specialized ones) times slower, as the call does (docs/PERF.md v11, v13), where the backward alone, its
    launches hidden behind the timer's cache flush, times faster.
    """
    inputs = [
        kernel_inputs(kernel, causal, max(1, tokens // n), max(1, width // head_dim), n, head_dim, dtype=dtype,
                      device=device, varlen=varlen)
        for n in seqlens
    ]  # fmt: skip
    on_gpu = str(device).startswith("cuda")
    if with_forward and kernel == "fwd":
        raise ValueError("with_forward times a backward kernel inside the training call; kernel is 'fwd'")

    def run(cfg, x):
        if with_forward:
            run_kernel("fwd", None, x, causal)  # None: the forward's resolved config, as a call would run it
        return run_kernel(kernel, cfg, x, causal)

    def measure(cfg) -> float:
        total = 0.0
        for x in inputs:
            if on_gpu:
                total += time_cuda(lambda x=x: run(cfg, x), device=device).median_ms
            else:
                run(cfg, x)  # first call renders and imports the variant
                start = time.perf_counter()
                run(cfg, x)
                total += (time.perf_counter() - start) * 1e3
        return total

    def spread(cfg) -> float | None:
        """The winner's worst (p80 − p20) / median over the tuning lengths; None on the CPU."""
        if not on_gpu:
            return None
        timings = [time_cuda(lambda x=x: run(cfg, x), device=device) for x in inputs]
        return round(max((t.p80_ms - t.p20_ms) / t.median_ms for t in timings), 4)

    measure.spread = spread
    measure.inputs = inputs
    return measure


def failure_reason(exc: BaseException) -> str:
    """One line saying why a config failed: the exception's type and the first line of its message."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0][:200] if message else ''}"


def _compile_one(job) -> str | None:
    kernel, head_dim, dtype, causal, cfg, seqlen, device, varlen = job
    if _released is not None and _released.is_set():  # the tune times nothing more: skip it (CompilePool.release)
        return None
    try:
        # batch and heads of 2, not 1: Triton compiles an int argument equal to 1 as a constant, so a binary built
        # with H_Q = 1 would not be the one a real launch (H_Q = 16) loads from the cache.
        x = kernel_inputs(kernel, causal, 2, 2, seqlen, head_dim, dtype=dtype, device=device, varlen=varlen)
        run_kernel(kernel, cfg, x, causal)
        if x.q.is_cuda:
            torch.cuda.synchronize()  # a launch error surfaces here, as this config's failure
        return None
    except Exception as exc:  # failures are data
        return failure_reason(exc)


_released = None  # in a compile process: its pool's release event (CompilePool.release)


def _start_compiler(environment: dict[str, str], released=None) -> None:
    """A compile process's start: the caller's environment, its pool's release event, and a lower priority.

    It does not create its CUDA context here: a pool's processes all doing so at once made the tuning process's
    own context wait behind theirs (4.3 s instead of 0.5 s on the H200 host, docs/TUNING.md session 6). Each
    creates it with its first compile, after the tuning process has its own.
    """
    from . import processes

    global _released
    processes.adopt(environment)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the tuning process's: it lets the pool go
    _released = released
    try:
        # Compiles run while the tuning process times kernels: a timing process waiting for a core would launch
        # late and read slow.
        os.nice(10)
    except OSError:  # not allowed here: compile at normal priority
        pass


class CompilePool:
    """Spawned processes that compile kernel configs (CPU work, most of a tune's time) into Triton's disk cache, so
    the timing process then only loads binaries. Start it once and hand it every batch: each process pays its
    start-up once. Use as a context manager, or call close().

    context: where the processes come from (fa2tune.tune.processes): by default forked from the fork server, which
    imported torch and fa2tune once for all of them; a process that has not initialized CUDA may pass
    processes.fork_context() to fork them from itself.
    """

    def __init__(self, workers: int = 16, context=None):
        from . import processes

        self.workers = workers
        context = context or processes.context()
        self._released = context.Event()
        self._pool = context.Pool(workers, initializer=_start_compiler, initargs=(dict(os.environ), self._released))

    def compile(self, kernel, head_dim, dtype, causal, configs, *, seqlens, device="cuda:0", varlen=False) -> dict:
        """Compiles every config; returns {config: failure reason} for those that failed.

        Each length N is compiled at 256 + N mod 256, a short length with the same divisibility by every block
        size, hence the same Jinja variant (even or ragged tails) as N itself.
        """
        wait = self.start(kernel, head_dim, dtype, causal, configs, seqlens=seqlens, device=device, varlen=varlen)
        return {cfg: reason for cfg in configs if (reason := wait(cfg))}

    def start(self, kernel, head_dim, dtype, causal, configs, *, seqlens, device="cuda:0", varlen=False):
        """compile() in the background: returns at once with wait(config) -> its failure reason or None.

        wait blocks for that config's compile only (a config not in `configs` returns None at once), so a tuner
        can time the first config of a batch as soon as it is built, not after the slowest of the batch;
        wait.ready(config) says whether it would block. The processes take configs up in the order given, and
        batches in the order started.
        """
        lengths = sorted({256 + n % 256 for n in seqlens})
        pending = {
            cfg: [self._pool.apply_async(_compile_one, ((kernel, head_dim, dtype, causal, cfg, n, device, varlen),))
                  for n in lengths]
            for cfg in dict.fromkeys(configs)
        }  # fmt: skip

        def wait(cfg) -> str | None:
            return next((reason for result in pending.get(cfg, ()) if (reason := result.get())), None)

        def ready(cfg) -> bool:
            """Whether wait(cfg) would return at once."""
            return all(result.ready() for result in pending.get(cfg, ()))

        wait.ready = ready
        return wait

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def release(self) -> None:
        """For a tune that will time nothing more: the compiles not started yet are skipped (their wait says
        None, as for a config never started), and the processes exit once their current compile is done — while
        the caller goes on (the study's finish), not at close(). Waiting at the end for the queued batches and
        compiles-ahead nobody would load, and for 16 processes to tear down their CUDA contexts, cost 3-4 s at
        the end of a tune on the 2×H200 host. (Not Pool.terminate: it can hang, python/cpython#78178; a micro-test
        of it on the H200 host did not return within 200 s, cause not diagnosed.) Nothing can be started after this."""
        self._released.set()
        self._pool.close()

    def close(self) -> None:
        """Waits for every compile started (none not yet begun, after release()), then for the processes' exit."""
        self._pool.close()
        self._pool.join()

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def precompile(kernel, head_dim, dtype, causal, configs, *, seqlens, device="cuda:0", workers=16, varlen=False) -> dict:
    """CompilePool.compile in a pool of its own. Returns {config: failure reason}."""
    with CompilePool(workers) as pool:
        return pool.compile(kernel, head_dim, dtype, causal, configs, seqlens=seqlens, device=device, varlen=varlen)


def load_sweep(path, *, head_dim: int, causal: bool) -> dict:
    """{config: cost} from a scripts/sweep_configs.py CSV, cost = 1000 / TFLOP/s (lower is better, ∝ time).

    Configs that failed in the sweep are absent. Replaying such a table lets the tuner be tested and compared
    with exhaustive search without a GPU.
    """
    import csv

    from ..config.types import KernelConfig

    table = {}
    with open(path) as handle:
        for row in csv.DictReader(handle):
            if int(row["head_dim"]) == head_dim and row["causal"] == str(causal) and row["tflops"] != "nan":
                fields = ("block_m", "block_n", "num_warps", "num_stages")
                table[KernelConfig(*(int(row[f]) for f in fields))] = 1000.0 / float(row["tflops"])
    return table
