"""Runs the kernels against the float64 reference on fresh random inputs: `fa2tune check`, and tuned winners (the
decode kernel's too: check_decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api.ops import forward
from ..config.types import KernelConfig, Mask
from .reference import naive_attention
from .workload import PackedBatch

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


def _mask_kwargs(causal: bool | Mask) -> dict:
    mask = causal if isinstance(causal, Mask) else Mask(causal=causal)
    return dict(causal=mask.causal, window=mask.window, prefix_len=mask.prefix_len)


def _kernel_layout(q, k, varlen: bool):
    """(to_kernel, to_sdpa, to_sdpa_lse, packing): identity for SDPA's layout; for varlen, the batch packed as
    equal-length sequences (PackedBatch) and its outputs put back, so checks compare in one layout."""
    if not varlen:
        same = lambda t: t
        return same, same, same, None
    packed = PackedBatch(q.shape[0], q.shape[2], k.shape[2], q.device)
    return packed.pack, packed.unpack, packed.unpack_lse, packed.packing


def _run_forward(q, k, v, causal, config, varlen, out=None):
    """forward() on SDPA-layout inputs, through the packed-sequence kernels when varlen; outputs in SDPA layout."""
    to_kernel, to_sdpa, to_sdpa_lse, packing = _kernel_layout(q, k, varlen)
    o, lse = forward(*map(to_kernel, (q, k, v)), causal=causal, scale=q.shape[-1] ** -0.5, config=config,
                     out=out, packing=packing)  # fmt: skip
    return to_sdpa(o), to_sdpa_lse(lse)


def check_forward(
    shape: tuple[int, int, int, int, int, int],
    *,
    dtype: torch.dtype,
    causal: bool | Mask,
    device: str | torch.device,
    config: KernelConfig | None = None,
    seed: int = 0,
    varlen: bool = False,
) -> CheckResult:
    """Compares the forward kernel with float64 standard attention on random inputs; the output is poisoned first.

    causal may be a Mask (window, prefix); varlen runs the packed-sequence kernels on the batch packed."""
    q, k, v, _ = _random_inputs(shape, dtype, device, seed)
    out = None if varlen else torch.full_like(q, float("nan"))
    o, lse = _run_forward(q, k, v, causal, config, varlen, out)
    ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), **_mask_kwargs(causal))
    rel = ((o.double() - ref_o).norm() / ref_o.norm().clamp_min(1e-30)).item()
    finite = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isfinite(lse), finite)
    lse_rel = ((lse.double() - ref_lse)[finite].norm() / ref_lse[finite].norm().clamp_min(1e-30)).item()
    passed = rel <= REL_TOLERANCE[dtype] and lse_rel <= 1e-5 and lse_ok  # NaN compares False: fails
    return CheckResult(shape, dtype, bool(_mask_kwargs(causal)["causal"]), rel, lse_rel if lse_ok else float("inf"),
                       passed)  # fmt: skip


def check_backward(
    shape: tuple[int, int, int, int, int, int],
    *,
    dtype: torch.dtype,
    causal: bool | Mask,
    device: str | torch.device,
    dkdv_config: KernelConfig | None = None,
    dq_config: KernelConfig | None = None,
    seed: int = 0,
    varlen: bool = False,
) -> float:
    """Worst relative error (‖g − ref‖ / max(‖ref‖, ‖dO‖)) of dq, dk, dv against float64 autograd."""
    from ..api.ops import backward

    head_dim = shape[-1]
    q, k, v, do = _random_inputs(shape, dtype, device, seed)
    scale = head_dim**-0.5
    to_kernel, to_sdpa, _, packing = _kernel_layout(q, k, varlen)
    kq, kk, kv, kdo = map(to_kernel, (q, k, v, do))
    o, lse = forward(kq, kk, kv, causal=causal, scale=scale, packing=packing)
    grads = backward(kdo, kq, kk, kv, o, lse, causal=causal, scale=scale, packing=packing,
                     dkdv_config=dkdv_config, dq_config=dq_config)  # fmt: skip
    grads = tuple(map(to_sdpa, grads))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = naive_attention(*leaves, scale=scale, **_mask_kwargs(causal))
    refs = torch.autograd.grad(ref_o, leaves, do.double())
    worst = 0.0
    for g, ref in zip(grads, refs, strict=True):
        err = ((g.double() - ref).norm() / max(ref.norm().item(), do.double().norm().item())).item()
        worst = max(worst, err if err == err else float("inf"))
    return worst


def check_decode(config, *, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str | torch.device,
                 seed: int = 0) -> float:  # fmt: skip
    """Worst relative error ‖O − ref‖ / ‖ref‖ of decode steps with `config` (a DecodeConfig) against float64
    attention over each entry's keys: ragged lengths over a contiguous and a paged cache, one query token and four
    (those causal), the keys split as the config's rule splits them on the device (a merge, on a GPU)."""
    from ..config.kvcache_inputs import check_call
    from ..config.types import Mask
    from .decode_workload import DecodeInputs, run_step

    on_gpu = str(device).startswith("cuda")
    lengths, page = ([1000, 2500, 4097], 256) if on_gpu else ([5, 37], 16)
    per_entry = -(-max(lengths) // page)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    worst = 0.0
    for seqlen_q, paged in ((1, False), (4, True)):
        batch = len(lengths)
        q = rand(batch, seqlen_q, heads, head_dim)
        rows = (batch * per_entry, page) if paged else (batch, per_entry * page)
        k_cache, v_cache = rand(*rows, kv_heads, head_dim), rand(*rows, kv_heads, head_dim)
        table = torch.randperm(batch * per_entry, generator=gen).view(batch, per_entry).to(device, torch.int32)
        table = table if paged else None
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        cache = check_call(q, k_cache, v_cache, None, None, seqlens, table)
        causal = seqlen_q > 1
        left, right, _ = Mask(causal=causal).bounds(seqlen_q, cache.capacity)
        out = run_step(config, DecodeInputs(q, cache, (left, right), head_dim**-0.5))[0].double().cpu()
        for b, length in enumerate(lengths):
            keys = torch.arange(length, device=device)
            at = (table[b, keys // page].long(), keys % page) if paged else (b, keys)
            k, v = (cache_[at].double().transpose(0, 1) for cache_ in (k_cache, v_cache))  # (kv_heads, keys, d)
            ref, _ = naive_attention(q[b].double().transpose(0, 1), k, v, causal=causal)  # (heads, seqlen_q, d)
            ref = ref.transpose(0, 1).cpu()
            err = ((out[b] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            worst = max(worst, err if err == err else float("inf"))  # NaN compares False: the worst
    return worst

