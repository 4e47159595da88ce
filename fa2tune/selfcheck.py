"""Runs the kernels against the float64 reference on fresh random inputs: `fa2tune check`, and tuned winners."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .launcher import forward
from .reference import naive_attention
from .types import KernelConfig

# Relative error ‖out − ref‖ / ‖ref‖ allowed per dtype (METHOD.md: bf16 operands land between 1e-3 and 1e-2).
REL_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class CheckResult:
    """One comparison: the shape, the relative errors of O and of the logsumexp, and whether both passed."""

    shape: tuple[int, int, int, int, int, int]  # batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim
    dtype: torch.dtype
    causal: bool
    rel_err: float
    lse_rel_err: float
    passed: bool


def default_shapes(on_gpu: bool) -> list[tuple[int, int, int, int, int, int]]:
    """Odd shapes: N=1, ragged tails, q_len != k_len both ways, GQA, d=96; larger on a GPU."""
    if on_gpu:
        return [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 777, 2049, 64), (3, 4, 1, 1, 513, 96), (1, 2, 2, 4096, 4096, 128)]
    return [(1, 2, 1, 37, 37, 64), (1, 2, 2, 1, 40, 96), (1, 2, 2, 70, 30, 32)]


def _random_inputs(shape, dtype, device, seed):
    """q, k, v and dO drawn on the CPU from a seeded generator (the same values on every device), then moved."""
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sizes = [(heads_q, seqlen_q), (heads_kv, seqlen_k), (heads_kv, seqlen_k), (heads_q, seqlen_q)]
    return [torch.randn(batch, h, n, head_dim, generator=gen).to(device, dtype) for h, n in sizes]


def check_forward(
    shape: tuple[int, int, int, int, int, int],
    *,
    dtype: torch.dtype,
    causal: bool,
    device: str | torch.device,
    config: KernelConfig | None = None,
    seed: int = 0,
) -> CheckResult:
    """Compares the forward kernel with float64 standard attention on random inputs; the output is poisoned first."""
    head_dim = shape[-1]
    q, k, v, _ = _random_inputs(shape, dtype, device, seed)
    out = torch.full_like(q, float("nan"))
    o, lse = forward(q, k, v, causal=causal, scale=head_dim**-0.5, config=config, out=out)
    ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    rel = ((o.double() - ref_o).norm() / ref_o.norm().clamp_min(1e-30)).item()
    finite = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isfinite(lse), finite)
    lse_rel = ((lse.double() - ref_lse)[finite].norm() / ref_lse[finite].norm().clamp_min(1e-30)).item()
    passed = rel <= REL_TOLERANCE[dtype] and lse_rel <= 1e-5 and lse_ok  # NaN compares False: fails
    return CheckResult(shape, dtype, causal, rel, lse_rel if lse_ok else float("inf"), passed)


def check_backward(
    shape: tuple[int, int, int, int, int, int],
    *,
    dtype: torch.dtype,
    causal: bool,
    device: str | torch.device,
    dkdv_config: KernelConfig | None = None,
    dq_config: KernelConfig | None = None,
    seed: int = 0,
) -> float:
    """Worst relative error (‖g − ref‖ / max(‖ref‖, ‖dO‖)) of dq, dk, dv against float64 autograd."""
    from .launcher import backward

    head_dim = shape[-1]
    q, k, v, do = _random_inputs(shape, dtype, device, seed)
    scale = head_dim**-0.5
    o, lse = forward(q, k, v, causal=causal, scale=scale)
    grads = backward(do, q, k, v, o, lse, causal=causal, scale=scale, dkdv_config=dkdv_config, dq_config=dq_config)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = naive_attention(*leaves, causal=causal, scale=scale)
    refs = torch.autograd.grad(ref_o, leaves, do.double())
    worst = 0.0
    for g, ref in zip(grads, refs, strict=True):
        err = ((g.double() - ref).norm() / max(ref.norm().item(), do.double().norm().item())).item()
        worst = max(worst, err if err == err else float("inf"))
    return worst
