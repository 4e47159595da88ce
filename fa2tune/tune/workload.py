"""What the tuner times: fresh inputs for one kernel, one run of it, and the tuner's objective `make_measure`.

random_qkv and PackedBatch serve the checks (verification.py) and the benchmarks in scripts/ too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config.types import Mask
from .timing import time_cuda

if TYPE_CHECKING:
    from ..launch.launcher import Packing


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
    varlen: bool = False, heads_kv: int | None = None,
):  # fmt: skip
    """Fresh random inputs for `kernel` ("fwd", "bwd_dkdv", "bwd_dq"); backward ones carry a real forward.
    varlen: the batch packed as equal-length sequences, for the packed-sequence variant. heads_kv: K's and V's heads
    (None: `heads`)."""
    from ..api import ops

    q, k, v = random_qkv(batch, heads, seqlen, head_dim, dtype=dtype, device=device, heads_kv=heads_kv)
    packing = None
    if varlen:
        packed = PackedBatch(batch, seqlen, seqlen, device)
        q, k, v = map(packed.pack, (q, k, v))
        packing = packed.packing
    if kernel == "fwd":
        return KernelInputs(q, k, v, packing=packing)
    o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5, packing=packing)
    return KernelInputs(q, k, v, o, lse, torch.randn_like(o), packing)


_RESOLVE = object()  # run_kernel's partner, not worked out by the caller


def run_kernel(kernel: str, cfg, x: KernelInputs, causal: bool | Mask, partner=_RESOLVE):
    """Runs `kernel` with `cfg` (a backward kernel: the whole backward, the other kernel at its resolved config).

    A dQ config runs beside the resolved dK/dV config's twin without dQ fused in (dq_partner): where the resolved
    one fuses dQ, no dQ kernel would run, and every dQ config would time the same. partner: that config as
    dq_partner gave it for x, where the caller runs x many times (make_measure: not resolved in every timed run)."""
    from ..api import ops

    scale = x.q.shape[-1] ** -0.5
    if kernel == "fwd":
        return ops.forward(x.q, x.k, x.v, causal=causal, scale=scale, config=cfg, packing=x.packing)
    if kernel == "bwd_dkdv":
        configs = {"dkdv_config": cfg}
    else:
        configs = {"dq_config": cfg, "dkdv_config": dq_partner(x, causal) if partner is _RESOLVE else partner}
    return ops.backward(x.do, x.q, x.k, x.v, x.o, x.lse, causal=causal, scale=scale, packing=x.packing, **configs)


def dq_partner(x: KernelInputs, causal: bool | Mask):
    """The dK/dV config a dQ study times its configs beside: the one resolved for the inputs, its dQ unfused (a dQ
    entry serves the calls whose dK/dV kernel leaves dQ to it: deterministic mode, V's own head dim, a dK/dV
    entry without fused dQ); None (resolved by the call) where it does not fuse dQ."""
    from ..api import selection
    from ..launch.layout import as_mask

    resolved = selection.config_for(None, "bwd_dkdv", x.q, x.k, x.v, as_mask(causal), x.packing)
    return resolved.without_fused_dq() if resolved.fused_dq else None


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
    heads: tuple[int, int] | None = None,
) -> Callable:
    """The tuner's objective: config -> sum over `seqlens` of the median time (ms) of `kernel` with it.

    Each length runs at batch = tokens // N and heads = width // head_dim (the benchmark grid's batch·N and
    heads·d), or at `heads`, (query heads, K/V heads): a grouped-query call where there are fewer K/V heads. On the
    CPU (the Triton interpreter) the wall clock of one run is used: right for testing the pipeline, meaningless for
    speed.

    with_forward: a backward kernel is timed inside the whole training call — the forward (at its resolved config)
    launched, then the backward — as one timed run. Where the host takes longer to launch the call's kernels than
    the GPU to run them (N <= 1k), that is what shows: a backward with faster kernels but costlier launches (the
    warp-specialized ones) times slower, as the call does, where the backward alone, its launches hidden behind the
    timer's cache flush, times faster.
    """
    heads_q, heads_kv = heads if heads is not None else (max(1, width // head_dim), None)
    inputs = [
        kernel_inputs(kernel, causal, max(1, tokens // n), heads_q, n, head_dim, dtype=dtype, device=device,
                      varlen=varlen, heads_kv=heads_kv)
        for n in seqlens
    ]  # fmt: skip
    on_gpu = str(device).startswith("cuda")
    if with_forward and kernel == "fwd":
        raise ValueError("with_forward times a backward kernel inside the training call; kernel is 'fwd'")

    # a dQ study's dK/dV partner, resolved once for each input rather than in every timed run
    partners = {id(x): dq_partner(x, causal) if kernel == "bwd_dq" else None for x in inputs}

    def run(cfg, x):
        if with_forward:
            run_kernel("fwd", None, x, causal)  # None: the forward's resolved config, as a call would run it
        return run_kernel(kernel, cfg, x, causal, partners[id(x)])

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
