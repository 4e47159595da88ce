"""Launchers for the generated kernels, their autograd formula, and the public attention() entry points.

Importing fa2tune does not import triton: the kernels' modules are rendered and imported on first use, so a
program (or `fa2tune --device cpu`) can still choose Triton's interpreter (TRITON_INTERPRET=1) after importing us.

The launchers are registered as torch custom ops (fa2tune::fwd, fa2tune::bwd) with fake implementations, so
torch.compile sees two opaque ops with known output shapes instead of tracing into Triton launches.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..api import selection
from ..config import planner, schedule
from ..config.inputs import (
    check_flag,
    check_offsets,
    check_prefix_len,
    check_qkv,
    check_scale,
    check_varlen,
    check_window,
    interpreting,
)
from ..config.types import KernelConfig, Mask, Variant
from ..kernels import codegen
from . import fastlaunch, warpspec

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels run the softmax on exp2


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products ("ieee"), as a user asking for fp32 expects; Triton would use tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


GRID_AXIS_MAX = 65535  # CUDA's cap on grid axes 1 and 2
# The forward computes pid_bh = axis2·B1 + axis1 and batch·heads in int32 (Triton's type for program ids): every
# program id of the grid must stay below 2^31. Only inputs of ~2^31 heads of a few elements come near it.
MAX_BATCH_HEADS = 2**31 - 1


def fwd_grid(q_tiles: int, batch_heads: int) -> tuple[int, int, int]:
    """The forward's grid: (Q tiles, B1, B2) with B1·B2 >= batch_heads and B1, B2 <= GRID_AXIS_MAX.

    Programs with pid_bh = axis2·B1 + axis1 >= batch_heads return at once; there are fewer than B2 of them.
    """
    axis_max = GRID_AXIS_MAX
    b2 = _cdiv(batch_heads, axis_max)
    if b2 > axis_max:
        raise ValueError(f"batch·heads = {batch_heads} exceeds what one launch can cover ({axis_max}²)")
    b1 = _cdiv(batch_heads, b2)  # the smallest B1 for that B2: fewer than b2 idle programs per Q tile
    if b1 * b2 > MAX_BATCH_HEADS:
        raise ValueError(
            f"batch·heads = {batch_heads} is more than the forward kernel can number with 32-bit program ids "
            f"(at most {MAX_BATCH_HEADS}); split the batch into several calls"
        )
    return (q_tiles, b1, b2)


def _kernel(template: str, name: str, mask: Mask, seqlen_q: int, seqlen_k: int, config: KernelConfig, varlen: bool):
    """The Triton kernel `name` of the template variant this call runs. Kept per (template, kernel, causal, banded,
    tails, pipeline_qk, varlen, interpreter) — what the variant depends on: the variant and module lookups took 8 µs
    of the host time of each of a fwd+bwd call's four launches (docs/PERF.md v11)."""
    even_m, even_n = seqlen_q % config.block_m == 0, seqlen_k % config.block_n == 0
    key = (template, name, mask.causal, mask.banded, even_m, even_n, config.pipeline_qk, varlen, interpreting())
    kernel = _kernels.get(key)
    if kernel is None:
        variant = Variant.for_template(
            template, causal=mask.causal, banded=mask.banded, varlen=varlen, even_m=even_m, even_n=even_n,
            pipeline_qk=config.pipeline_qk, dot_fp32=key[-1],
        )  # fmt: skip
        kernel = _kernels[key] = getattr(codegen.load(template, variant), name)
    return kernel


# _kernel's: a few dozen entries at most (templates × kernels × masks × tails), as many as codegen keeps modules
_kernels: dict[tuple, object] = {}


@dataclass(frozen=True)
class Packing:
    """Packed sequences (FlashAttention-2's varlen layout): tensors are (total_tokens, heads, head_dim) and
    sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q (cu_seqlens_k of k/v)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1


def _layout(q: torch.Tensor, k: torch.Tensor, packing: Packing | None):
    """(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim), and the (batch, head, row) strides of a tensor,
    for SDPA's layout or the packed one (whose batch stride is 0: sequences are found through cu_seqlens)."""
    if packing is None:
        batch, heads_q, seqlen_q, head_dim = q.shape
        return (batch, heads_q, k.shape[1], seqlen_q, k.shape[2], head_dim), lambda t: t.stride()[:3]
    sizes = (packing.batch, q.shape[1], k.shape[1], packing.max_seqlen_q, packing.max_seqlen_k, q.shape[2])
    return sizes, lambda t: (0, t.stride(1), t.stride(0))


def _lse_strides(lse: torch.Tensor, packing: Packing | None) -> tuple[int, int]:
    # dense (batch, H, N): per batch and head; packed (H, total_q): per head only, the row offset is cu_seqlens_q
    return lse.stride()[:2] if packing is None else (0, lse.stride(0))


def _totals(q: torch.Tensor, k: torch.Tensor, packing: Packing | None) -> tuple[int, ...]:
    # packed: the rows of q and of k/v, the kernels' TOTAL_Q, TOTAL_K, which bound what cu_seqlens may address
    return (q.shape[0], k.shape[0]) if packing is not None else ()


def _mask_args(mask: Mask, seqlen_q: int, seqlen_k: int, packing: Packing | None):
    cu_q, cu_k = (packing.cu_seqlens_q, packing.cu_seqlens_k) if packing is not None else (None, None)
    return cu_q, cu_k, mask.bounds(seqlen_q, seqlen_k)


_NO_SWITCH = contextlib.nullcontext()  # stateless: one instance serves every call


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' own (cuda:1 inputs, current device 0).
    Where it already is (nearly always), no context: entering and leaving torch.cuda.device costs host time every
    call of a short attention waits for."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_SWITCH


def _config(
    config: KernelConfig | None, kernel: str, q: torch.Tensor, k: torch.Tensor, mask: Mask, packing: Packing | None
) -> KernelConfig:
    if config is not None:
        return config
    # The longer side picks the length bucket of the tuned configs (lengths.buckets_for).
    longest = max(packing.max_seqlen_q, packing.max_seqlen_k) if packing is not None else max(q.shape[2], k.shape[2])
    return selection.resolve(kernel, q.shape[-1], q.dtype, mask.causal, q.device, window=mask.banded,
                             varlen=packing is not None, seqlen=longest)[0]  # fmt: skip


def _runnable(config: KernelConfig, kernel: str, explicit: bool, mask: Mask, packing, **tensors) -> KernelConfig:
    """`config`, or — for a warpspec config this call cannot take (unaligned strides, band masks, packed sequences,
    fp32) — the Triton template's default: a tuned warpspec entry serves the calls it can and the others run as
    they would have before tuning. A warpspec config the caller gave explicitly is an error that says why."""
    if not config.warp_specialized:
        return config
    reason = warpspec.unsupported(mask, packing is not None, **tensors)
    if reason is None:
        return config
    if explicit:
        name = {"fwd": "config", "bwd_dkdv": "dkdv_config", "bwd_dq": "dq_config"}[kernel]
        raise ValueError(f"{name} {config} cannot run this call: {reason}")
    q = tensors["q"]
    return _triton_default(q.shape[-1], q.dtype, mask.causal, kernel, selection.device_info(q.device))


@functools.lru_cache(maxsize=256)
def _triton_default(head_dim: int, dtype: torch.dtype, causal: bool, kernel: str, device) -> KernelConfig:
    return planner.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=device, warp_specialized=False)


# ---- launch plans ----------------------------------------------------------------------------------------------
# A training or inference loop calls attention with the same shapes, strides, dtype, mask and scale over and over.
# Everything forward() and backward() work out from those — configs, kernels, grids, scalar arguments — is kept per
# such signature as one function of the call's tensors (a plan); a call whose signature was seen allocates its
# outputs and runs the plan. At N <= 512 a training call waits for its host, and autograd runs the backward on a
# thread of its own (another core), where every object the backward touches is a cache miss: the fewer, the better
# (docs/PERF.md v15).


class _Plan(NamedTuple):
    launch: Callable[..., None]
    tma: bool  # it reads tensors through TMA: every call's addresses must be 16-byte aligned (warpspec.unsupported)


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 256  # signatures a process keeps; cleared when full


def _plan_key(kind: str, tensors: tuple, mask: Mask, scale: float, configs: tuple) -> tuple:
    """A call's signature: what its plan was worked out from. The resolved configs come from the tuned files and the
    planner through selection.resolve, whose cache generation and config directory are part of it; the schedules'
    debugging overrides (schedule.env_overrides) change what a config's launch runs."""
    return (kind, tuple([(t.shape, t.stride()) for t in tensors]), tensors[0].dtype, tensors[0].device, mask, scale,
            configs, selection.generation, os.environ.get("FA2TUNE_CONFIG_DIR"), interpreting(),
            schedule.env_overrides())  # fmt: skip


def _misaligned(*tensors: torch.Tensor) -> int:
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return bits % warpspec.TMA_ALIGN


def _keep(key: tuple | None, plan: _Plan, downgraded: bool, tma_tensors: tuple) -> None:
    """Keeps a plan for its signature. Not one whose warpspec config was swapped for the Triton template's where the
    swap may have been for this call's addresses (warpspec.unsupported), which another call of the signature may not
    share."""
    if key is None or (downgraded and _misaligned(*tma_tensors)):
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan


def clear_plans() -> None:
    """Forgets every kept plan (tests)."""
    _plans.clear()


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool | Mask,
    scale: float,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    packing: Packing | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the forward kernel on validated inputs (see inputs.check_qkv / inputs.check_varlen).

    Args:
        causal: a bool (plain or causal) or a Mask (window, prefix).
        out: optional preallocated output like q (any strides with a unit last stride); written in place.
        packing: packed sequences; q, k, v are then (total_tokens, heads, head_dim).

    Returns:
        O with q's shape and dtype, and the fp32 logsumexp in natural log: (batch, heads_q, seqlen_q), or
        (heads_q, total_q) for packed sequences.
    """
    mask = _as_mask(causal)
    key = None
    if out is None and packing is None:  # a plan's outputs are allocated as below; packed offsets are per call
        key = _plan_key("fwd", (q, k, v), mask, scale, config)
        plan = _plans.get(key)
        if plan is not None:
            o = torch.empty_like(q, memory_format=torch.contiguous_format)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            if not (plan.tma and _misaligned(q, k, v, o)):
                with _on_device(q):
                    plan.launch(q, k, v, o, lse)
                return o, lse
    (batch, heads_q, _, seqlen_q, _, _), _ = _layout(q, k, packing)
    explicit = config is not None
    if explicit and config.combination_error("fwd") is not None:
        raise ValueError(f"config {config}: {config.combination_error('fwd')}")
    config = _config(config, "fwd", q, k, mask, packing)
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse_shape = (batch, heads_q, seqlen_q) if packing is None else (heads_q, q.shape[0])
    lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
    if o.numel() == 0 or batch == 0 or seqlen_q == 0:
        return o, lse.fill_(float("-inf"))
    runnable = _runnable(config, "fwd", explicit, mask, packing, q=q, k=k, v=v, out=o)
    launch = _forward_launcher(q, k, v, o, lse, mask, scale, runnable, packing)
    with _on_device(q):
        launch(q, k, v, o, lse)
    _keep(key, _Plan(launch, runnable.warp_specialized), runnable != config, (q, k, v, o))
    return o, lse


def _forward_launcher(q, k, v, o, lse, mask: Mask, scale: float, config: KernelConfig, packing: Packing | None):
    """launch(q, k, v, o, lse) for calls with these tensors' shapes and strides and this packing: the forward's one
    kernel launch with everything but the tensors worked out."""
    if config.warp_specialized:  # _runnable checked that this call can take it
        return warpspec.forward_launcher(q, k, lse, causal=mask.causal, scale=scale, config=config)
    (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim), strides = _layout(q, k, packing)
    kernel = _kernel("fwd", "_attn_fwd", mask, seqlen_q, seqlen_k, config, packing is not None)
    cu_q, cu_k, (left, right, prefix) = _mask_args(mask, seqlen_q, seqlen_k, packing)
    grid = fwd_grid(_cdiv(seqlen_q, config.block_m), batch * heads_q)
    scalars = (*strides(q), *strides(k), *strides(v), *strides(o), *_lse_strides(lse, packing), batch, heads_q,
               heads_q // heads_kv, seqlen_q, seqlen_k, scale * LOG2E, left, right, prefix,
               *_totals(q, k, packing))  # fmt: skip
    options = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=planner.head_dim_padded(head_dim), BLOCK_M=config.block_m,
                   BLOCK_N=config.block_n, INPUT_PRECISION=_input_precision(q.dtype), num_warps=config.num_warps,
                   num_stages=config.num_stages)  # fmt: skip

    launch = fastlaunch.Launcher(kernel, grid, scalars, options)
    return lambda q, k, v, o, lse: launch(q, k, v, o, lse, cu_q, cu_k)


def _as_mask(causal: bool | Mask) -> Mask:
    return causal if isinstance(causal, Mask) else Mask(causal=causal)


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool | Mask,
    scale: float,
    dkdv_config: KernelConfig | None = None,
    dq_config: KernelConfig | None = None,
    packing: Packing | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of O = attention(q, k, v) given dO, recomputing S and P from the saved logsumexp.

    dlse: the gradient of the logsumexp output, if a loss used it. ∂lse_i/∂s_ij = P_ij, so it enters as
    dS = P ∘ (dP − (δ − dlse)): it only shifts δ, and the kernels need no change.

    Returns:
        (dq, dk, dv), contiguous, with the shapes and dtypes of q, k, v; dk/dv summed over the query heads that
        share each K/V head (GQA).
    """
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if packing is not None:  # offsets given new memory since the forward (`cu.data = ...`) are checked again
        check_offsets(packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q, packing.max_seqlen_k,
                      q.shape[0], k.shape[0])  # fmt: skip
    if do.stride(-1) != 1:
        do = do.contiguous()  # e.g. the stride-0 gradient of out.sum()
    mask = _as_mask(causal)
    key = None
    if packing is None:  # packed offsets are per call
        deterministic = torch.are_deterministic_algorithms_enabled()  # picks the dK/dV kernel: _deterministic
        key = _plan_key("bwd", (q, k, v, o, lse, do), mask, scale, (dkdv_config, dq_config, deterministic))
        plan = _plans.get(key)
        if plan is not None:
            dq, dk, dv, delta = _gradient_buffers(q, k, v, lse)
            if not (plan.tma and _misaligned(q, k, v, do, dq, dk, dv)):
                with _on_device(q):
                    plan.launch(q, k, v, o, lse, do, dq, dk, dv, delta, dlse)
                return dq, dk, dv
    for name, kernel, given in (("dkdv_config", "bwd_dkdv", dkdv_config), ("dq_config", "bwd_dq", dq_config)):
        if given is not None and given.combination_error(kernel) is not None:
            raise ValueError(f"{name} {given}: {given.combination_error(kernel)}")
    explicit_dkdv, explicit_dq = dkdv_config is not None, dq_config is not None
    dkdv_config = _deterministic(_config(dkdv_config, "bwd_dkdv", q, k, mask, packing), explicit_dkdv)
    dq_config = _config(dq_config, "bwd_dq", q, k, mask, packing)
    dq, dk, dv, delta = _gradient_buffers(q, k, v, lse)
    dkdv_run = _runnable(dkdv_config, "bwd_dkdv", explicit_dkdv, mask, packing, q=q, k=k, v=v, grad_out=do, dk=dk,
                         dv=dv)  # fmt: skip
    dq_run = _runnable(dq_config, "bwd_dq", explicit_dq, mask, packing, q=q, k=k, v=v, grad_out=do, dq=dq)
    launch = _backward_launcher(q, k, v, o, lse, do, dq, dk, dv, mask, scale, dkdv_run, dq_run, packing)
    with _on_device(q):
        launch(q, k, v, o, lse, do, dq, dk, dv, delta, dlse)
    downgraded = dkdv_run != dkdv_config or dq_run != dq_config
    _keep(key, _Plan(launch, dkdv_run.warp_specialized or dq_run.warp_specialized), downgraded,
          (q, k, v, do, dq, dk, dv))  # fmt: skip
    return dq, dk, dv


def _deterministic(config: KernelConfig, explicit: bool) -> KernelConfig:
    """The dK/dV config a backward runs. With dQ fused in (KernelConfig.fused_dq) the dK/dV programs add their dQ
    shares by TMA reductions in the order they arrive: fp32 sums whose last bits vary from run to run. Under
    torch.use_deterministic_algorithms(True) a tuned fused config gives way to its twin with a dQ kernel (fused_dq
    off: same tiles, less shared memory), whose every sum has one order; an explicit one is an error."""
    if not config.fused_dq or not torch.are_deterministic_algorithms_enabled():
        return config
    if explicit:
        raise RuntimeError(
            f"dkdv_config {config} fuses dQ in (fused_dq=True), which adds dQ in a run-to-run order, and "
            "torch.use_deterministic_algorithms(True) is set: pass fused_dq=False for a deterministic backward"
        )
    return replace(config, fused_dq=False)


def _gradient_buffers(q, k, v, lse):
    """dq, dk, dv (contiguous, as backward() returns them) and δ, uninitialised."""
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), torch.empty_like(lse))  # fmt: skip


def _backward_launcher(q, k, v, o, lse, do, dq, dk, dv, mask, scale, dkdv_config, dq_config, packing):
    """launch(q, k, v, o, lse, do, dq, dk, dv, delta, dlse) for calls with these tensors' shapes and strides and
    this packing: δ's preprocess kernel, then the dK/dV and dQ kernels — or, dQ fused in (KernelConfig.fused_dq), the
    dK/dV kernel adding into a zeroed fp32 dQ and its cast —, everything but the tensors worked out."""
    (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim), strides = _layout(q, k, packing)
    varlen = packing is not None
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=planner.head_dim_padded(head_dim))
    precision = _input_precision(q.dtype)
    # δ per row needs no sequence boundaries: packed rows are preprocessed as one batch of one long sequence.
    pre_rows, pre_batch = (q.shape[0], 1) if varlen else (seqlen_q, batch)
    pre = _kernel("bwd", "_attn_bwd_preprocess", mask, seqlen_q, seqlen_k, dq_config, varlen)
    pre_grid = (_cdiv(pre_rows, dq_config.block_m) * pre_batch * heads_q,)
    fused_dq = dkdv_config.fused_dq  # the dK/dV kernel also adds scale·dS·K into an fp32 dQ
    # with dQ fused in, the preprocess also zeroes the fp32 dQ: q's shape, contiguous (a meta tensor's strides)
    dq_acc_strides = strides(torch.empty(q.shape, device="meta")) if fused_dq else (0, 0, 0)
    pre_scalars = (*strides(o), *strides(do), *dq_acc_strides, heads_q, pre_rows)
    pre_options = dict(**common, BLOCK_M=dq_config.block_m, ZERO_DQ=fused_dq)
    cu_q, cu_k, bounds = _mask_args(mask, seqlen_q, seqlen_k, packing)
    inputs = (*strides(q), *strides(k), *strides(v), *strides(do), *_lse_strides(lse, packing))
    sizes = (heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, scale, scale * LOG2E, *bounds, *_totals(q, k, packing))

    if dkdv_config.warp_specialized:  # backward() checked that this call can take it
        # the warpspec launchers take the TMA-read tensors first: the Triton ones below take the same order
        dkdv = warpspec.backward_dkdv_launcher(q, k, lse, causal=mask.causal, scale=scale, config=dkdv_config)
    else:
        dkdv_kernel = _kernel("bwd", "_attn_bwd_dkdv", mask, seqlen_q, seqlen_k, dkdv_config, varlen)
        dkdv_grid = (_cdiv(seqlen_k, dkdv_config.block_n) * batch * heads_kv,)
        dkdv_scalars = (*inputs, *strides(dk), *strides(dv), *sizes)
        dkdv_options = dict(**common, BLOCK_M=dkdv_config.block_m, BLOCK_N=dkdv_config.block_n,
                            INPUT_PRECISION=precision, num_warps=dkdv_config.num_warps,
                            num_stages=dkdv_config.num_stages)  # fmt: skip
        dkdv_launch = fastlaunch.Launcher(dkdv_kernel, dkdv_grid, dkdv_scalars, dkdv_options)
        dkdv = lambda q, k, v, do, dk, dv, lse, delta: dkdv_launch(q, k, v, do, lse, delta, dk, dv, cu_q, cu_k)
    if fused_dq:
        dq_launch = None
    elif dq_config.warp_specialized:  # backward() checked that this call can take it
        dq_launch = warpspec.backward_dq_launcher(q, k, lse, causal=mask.causal, scale=scale, config=dq_config)
    else:
        dq_kernel = _kernel("bwd", "_attn_bwd_dq", mask, seqlen_q, seqlen_k, dq_config, varlen)
        dq_grid = (_cdiv(seqlen_q, dq_config.block_m) * batch * heads_q,)
        dq_scalars = (*inputs, *strides(dq), *sizes)
        dq_options = dict(**common, BLOCK_M=dq_config.block_m, BLOCK_N=dq_config.block_n, INPUT_PRECISION=precision,
                          num_warps=dq_config.num_warps, num_stages=dq_config.num_stages)  # fmt: skip
        dq_kernel_launch = fastlaunch.Launcher(dq_kernel, dq_grid, dq_scalars, dq_options)
        dq_launch = lambda q, k, v, do, dq, lse, delta: dq_kernel_launch(q, k, v, do, lse, delta, dq, cu_q, cu_k)

    pre_launch = fastlaunch.Launcher(pre, pre_grid, pre_scalars, pre_options)

    def launch(q, k, v, o, lse, do, dq, dk, dv, delta, dlse):
        if fused_dq:
            dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # zeroed by the preprocess
            pre_launch(o, do, delta, dq_acc)
        else:
            pre_launch(o, do, delta, delta)  # DQ_ACC unused (ZERO_DQ off): any pointer
        if dlse is not None:
            delta.sub_(dlse)  # same layout as lse, hence as δ
        if fused_dq:
            dkdv(q, k, v, do, dk, dv, dq_acc, lse, delta)
            dq.copy_(dq_acc)
        else:
            dkdv(q, k, v, do, dk, dv, lse, delta)
            dq_launch(q, k, v, do, dq, lse, delta)

    return launch


# ---- torch custom ops: what torch.compile sees -------------------------------------------------------------
# Configs cross the op boundary as plain int lists (custom-op schemas take no dataclasses).


def _to_ints(config: KernelConfig) -> list[int]:
    return config.to_ints()  # every field, the schedule's too: _from_ints reads them back


def _from_ints(config: list[int]) -> KernelConfig | None:
    # [] means "resolve inside the op": the store lookup (file I/O) then runs at call time, never while
    # torch.compile traces the caller.
    return KernelConfig.from_ints(config) if config else None


def _mask_to_ints(mask: Mask) -> list[int]:
    return [int(mask.causal), *mask.window, mask.prefix_len]


def _mask_from_ints(ints: list[int]) -> Mask:
    return Mask(causal=bool(ints[0]), window=(ints[1], ints[2]), prefix_len=ints[3])


def _packing(cu_q: torch.Tensor | None, cu_k: torch.Tensor | None, max_seqlens: list[int]) -> Packing | None:
    return None if cu_q is None else Packing(cu_q, cu_k, *max_seqlens)


def _lse_like(q: torch.Tensor, varlen: bool) -> torch.Tensor:
    shape = (q.shape[1], q.shape[0]) if varlen else q.shape[:-1]
    return q.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("fa2tune::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: list[int],
    scale: float,
    config: list[int],
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    packing = _packing(cu_seqlens_q, cu_seqlens_k, max_seqlens)
    return _checked_forward(q, k, v, _mask_from_ints(mask), scale, _from_ints(config), packing)


def _checked_forward(q, k, v, mask: Mask, scale: float, config: KernelConfig | None, packing: Packing | None):
    """forward(), after checking packed offsets' values: here, not in attention_varlen, as the op runs eagerly
    even inside a compiled graph (where reading them back would break it). Both call paths come through here."""
    if packing is not None:
        check_offsets(packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q, packing.max_seqlen_k,
                      q.shape[0], k.shape[0])  # fmt: skip
    return forward(q, k, v, causal=mask, scale=scale, config=config, packing=packing)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, mask, scale, config, cu_seqlens_q, cu_seqlens_k, max_seqlens):
    return torch.empty_like(q, memory_format=torch.contiguous_format), _lse_like(q, cu_seqlens_q is not None)


@torch.library.custom_op("fa2tune::bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    mask: list[int],
    scale: float,
    dkdv_config: list[int],
    dq_config: list[int],
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlens: list[int],
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(
        do, q, k, v, o, lse, causal=_mask_from_ints(mask), scale=scale,
        dkdv_config=_from_ints(dkdv_config), dq_config=_from_ints(dq_config),
        packing=_packing(cu_seqlens_q, cu_seqlens_k, max_seqlens), dlse=dlse,
    )  # fmt: skip


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, o, lse, mask, scale, dkdv_config, dq_config, cu_seqlens_q, cu_seqlens_k, max_seqlens, dlse):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, scale, _config, cu_q, cu_k, max_seqlens = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.mask, ctx.scale, ctx.max_seqlens = mask, scale, max_seqlens
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to make and subtract


# What a backward that autograd asks to differentiate says (_refuse_second_order).
SECOND_ORDER_ERROR = (
    "fa2tune's attention is differentiable once: a gradient through it taken with create_graph=True (a gradient "
    "penalty, a Hessian-vector product, double backward) is not supported, as its backward kernels have no "
    "gradient of their own and the second-order terms would be missing. For second-order gradients, run those "
    "layers with torch.nn.functional.scaled_dot_product_attention under "
    "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)"
)


def _refuse_second_order(*tensors: torch.Tensor | None) -> None:
    """Raises when this backward is asked for a graph of its own. Autograd runs a backward with grad mode on exactly
    when the gradient is taken with create_graph=True (torch.compile's tracing of the backward runs it with grad
    mode off); the saved inputs then require grad. Its kernels' outputs would carry no graph, so the second
    derivative would silently lack attention's terms: an error now, before any of it is computed."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(SECOND_ORDER_ERROR)


def _backward(ctx, do, dlse):
    """O(N) saved state (q, k, v, O, logsumexp); S and P are recomputed. dlse: see backward()."""
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    _refuse_second_order(q, k, v, do, dlse)
    if do is None:  # only the logsumexp reached the loss
        do = torch.zeros_like(o)
    dq, dk, dv = torch.ops.fa2tune.bwd(do, q, k, v, o, lse, ctx.mask, ctx.scale, [], [], cu_q, cu_k,
                                       ctx.max_seqlens, dlse)  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None


# The autograd formula lives on the op itself (not a Python autograd.Function), so torch.compile traces one op —
# also when q, k and v are one tensor, which dynamo refuses for an autograd.Function.
torch.library.register_autograd("fa2tune::fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's forward and autograd formula without the op: what an eager call runs.

    Dispatching a torch custom op with a registered autograd formula costs ~70 µs of host time per call (the
    dispatcher, the autograd wrapper, dynamo's disable guard, configs and masks packed into int lists) — more
    than a short attention forward takes on the GPU. Eager calls (no torch.compile, no tracing mode, plain tensors)
    come here instead; the op stays what torch.compile sees. Both run forward() and backward() with the same
    arguments, and the tests run both paths.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, config, packing):
        o, lse = _checked_forward(q, k, v, mask, scale, config, packing)
        # The offsets are saved like the tensors: an in-place write to them before the backward is then autograd's
        # error ("modified by an inplace operation"), as on the op path, not gradients of other sequences.
        cu = (packing.cu_seqlens_q, packing.cu_seqlens_k) if packing is not None else ()
        ctx.save_for_backward(q, k, v, o, lse, *cu)
        ctx.mask, ctx.scale, ctx.packing = mask, scale, packing
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, *_ = ctx.saved_tensors
        _refuse_second_order(q, k, v, do, dlse)
        if do is None:  # only the logsumexp reached the loss
            do = torch.zeros_like(o)
        dq, dk, dv = backward(do, q, k, v, o, lse, causal=ctx.mask, scale=ctx.scale, packing=ctx.packing, dlse=dlse)
        return dq, dk, dv, None, None, None, None


def _eager(*tensors: torch.Tensor) -> bool:
    """True when nothing traces this call: no torch.compile, no dispatch mode (make_fx, fake tensors), and plain
    tensors, so the launchers may run directly."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(type(t) is torch.Tensor for t in tensors)


def _apply(q, k, v, mask: Mask, scale: float, config: KernelConfig | None, packing: Packing | None = None):
    if _eager(q, k, v):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _EagerAttention.apply(q, k, v, mask, scale, config, packing)
        # Nothing to differentiate (inference, torch.no_grad, inputs without grad): the forward alone. The
        # autograd.Function's own host time (14 µs of a trivial one on the development machine) would buy nothing,
        # and a short inference call waits for its host.
        return _checked_forward(q, k, v, mask, scale, config, packing)
    return _apply_op(q, k, v, mask, scale, config, packing)


def _apply_op(q, k, v, mask: Mask, scale: float, config: KernelConfig | None, packing: Packing | None = None):
    cu_q, cu_k, max_seqlens = (
        (None, None, [])
        if packing is None
        else (packing.cu_seqlens_q, packing.cu_seqlens_k, [packing.max_seqlen_q, packing.max_seqlen_k])
    )
    config_ints = _to_ints(config) if config is not None else []
    return torch.ops.fa2tune.fwd(q, k, v, _mask_to_ints(mask), scale, config_ints, cu_q, cu_k, max_seqlens)


class FlashAttnFunction:
    """`FlashAttnFunction.apply(q, k, v, causal_or_mask, scale, config[, packing])` -> (O, logsumexp), both
    differentiable: the differentiable op behind attention(), for code written against an autograd.Function."""

    @staticmethod
    def apply(q, k, v, mask, scale, config, packing=None):
        if packing is None:
            check_qkv(q, k, v)
        elif isinstance(packing, Packing):
            packing = Packing(*check_varlen(q, k, v, packing.cu_seqlens_q, packing.cu_seqlens_k,
                                            packing.max_seqlen_q, packing.max_seqlen_k))  # fmt: skip
        else:
            raise TypeError(f"packing must be a fa2tune.launch.launcher.Packing or None, got {type(packing).__name__}")
        if isinstance(mask, Mask):  # checked as attention() checks its parts
            mask = Mask(causal=check_flag("causal", mask.causal), window=check_window(mask.window),
                        prefix_len=check_prefix_len(mask.prefix_len))  # fmt: skip
        elif isinstance(mask, bool):
            mask = Mask(causal=mask)
        else:
            raise TypeError(f"mask must be True or False (causal) or a fa2tune.Mask, got {mask!r}")
        return _apply(q, k, v, mask, check_scale(scale, q.shape[-1]), _check_config(config), packing)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    prefix_len: int = 0,
    return_lse: bool = False,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q·kᵀ·scale)·v by FlashAttention-2: a drop-in for scaled_dot_product_attention.

    Args:
        q: (batch, heads_q, seqlen_q, head_dim), float16/bfloat16/float32, unit stride in head_dim.
        k, v: (batch, heads_kv, seqlen_k, head_dim), same dtype and device; heads_q % heads_kv == 0 (GQA/MQA).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned, as FlashAttention-2);
            a query that sees no key gets an output of 0 and a logsumexp of -inf.
        scale: softmax scale, default 1/sqrt(head_dim).
        window: (left, right), FlashAttention-2's window_size: query i sees keys i' - left <= j <= i' + right,
            i' = i + seqlen_k - seqlen_q; -1 leaves a side unbounded; with causal, right is 0.
        prefix_len: prefix-LM: keys [0, prefix_len) are visible to every query, causal after them (implies
            causal; combines with a left window).
        return_lse: also return the fp32 logsumexp (batch, heads_q, seqlen_q) of the scaled scores; it is
            differentiable too (a loss may use it, e.g. to merge attention over chunks of keys).
        config: forward block sizes, warps and stages; default: the tuned or the planner's pick.

    Returns:
        O with q's shape and dtype; with return_lse, (O, lse). Differentiable in q, k and v.
    """
    check_qkv(q, k, v)
    return _checked_apply(q, k, v, causal, scale, window, prefix_len, return_lse, config, None)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    prefix_len: int = 0,
    return_lse: bool = False,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences, as FlashAttention-2's flash_attn_varlen_func: nothing attends across a
    sequence boundary, and no padding is computed.

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative lengths starting at 0, on q's device: sequence b
            is rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k/v.
        max_seqlen_q, max_seqlen_k: the longest sequence of each (they size the launch grid).
        causal, scale, window, prefix_len: as attention(), per sequence (bottom-right aligned within it).
        return_lse: also return the fp32 logsumexp, (heads_q, total_q) as FlashAttention-2 returns it.

    Returns:
        O (total_q, heads_q, head_dim) in q's dtype; with return_lse, (O, lse). Differentiable in q, k and v.
    """
    packing = Packing(*check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _checked_apply(q, k, v, causal, scale, window, prefix_len, return_lse, config, packing)


def _checked_apply(q, k, v, causal, scale, window, prefix_len, return_lse, config, packing):
    """The keyword arguments attention() and attention_varlen() share, checked; then the differentiable op."""
    mask = Mask(causal=check_flag("causal", causal), window=check_window(window),
                prefix_len=check_prefix_len(prefix_len))  # fmt: skip
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    o, lse = _apply(q, k, v, mask, scale, _check_config(config), packing)
    return (o, lse) if return_lse else o


def _check_config(config: object) -> KernelConfig | None:
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a fa2tune.KernelConfig or None, got {type(config).__name__}")
    return config
