"""The backward launcher: dQ, dK, dV of attention from the saved logsumexp — δ's preprocess kernel, then the dK/dV
and dQ kernels (Triton templates or warp-specialized), or one dK/dV kernel that adds dQ in (bwd_dkdv warpspec 2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..config.device import device_info
from ..config.group_split import DkdvGrid, dkdv_group_split
from ..config.inputs import check_offsets
from ..config.types import KernelConfig, Mask
from . import fastlaunch, plans, warpspec
from . import layout as _layout
from .fallback import check_combination, deterministic, runnable, unfused_for_v
from .grid import LOG2E, cdiv, input_precision, stats_rows
from .layout import (
    Packing,
    as_mask,
    head_dim_options,
    in_units,
    layout,
    mask_args,
    on_device,
    settle,
    settling_launch,
    totals,
)

# Where q, k, v, o and dO (settle's order) sit among a backward launch's arguments (q, k, v, o, lse, dO, …)
_SETTLED_ARGUMENTS = (0, 1, 2, 3, 5)


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
    dkdv_config: KernelConfig,
    dq_config: KernelConfig,
    dkdv_explicit: bool = True,
    dq_explicit: bool = True,
    packing: Packing | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of O = attention(q, k, v) given dO, recomputing S and P from the saved logsumexp.

    dkdv_config, dq_config: the two kernels' configs (fa2tune.api.ops.backward resolves those a caller has not);
    dkdv_explicit / dq_explicit: each was the caller's choice, as forward()'s explicit.
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
    mask = as_mask(causal)
    key = None
    if packing is None:  # packed offsets are per call
        # deterministic mode picks the dK/dV kernel (fallback.deterministic)
        configs = (dkdv_config, dq_config, dkdv_explicit, dq_explicit, torch.are_deterministic_algorithms_enabled())
        key = plans.plan_key("bwd", (q, k, v, o, lse, do), mask, scale, configs)
        plan = plans.lookup(key)
        if plan is not None:
            dq, dk, dv = _gradient_buffers(q, k, v)
            if not (plan.tma and plans.misaligned(q, k, v, do, dq, dk, dv)):
                with on_device(q):
                    plan.launch(q, k, v, o, lse, do, dq, dk, dv, dlse)
                return dq, dk, dv
    (q, k, v, o, do), unsettled = settle((q, k, v, o, do))  # not lse: ours, and read through _Stats' checks
    for kernel_name, config, explicit in (("bwd_dkdv", dkdv_config, dkdv_explicit), ("bwd_dq", dq_config, dq_explicit)):
        if explicit:
            check_combination(config, kernel_name)
    dkdv_config = deterministic(unfused_for_v(dkdv_config, dkdv_explicit, q.shape[-1], v.shape[-1]), dkdv_explicit)
    dq, dk, dv = _gradient_buffers(q, k, v)
    dkdv_run = runnable(dkdv_config, "bwd_dkdv", dkdv_explicit, mask, packing, q=q, k=k, v=v, grad_out=do, dk=dk,
                        dv=dv)  # fmt: skip
    dq_run = runnable(dq_config, "bwd_dq", dq_explicit, mask, packing, q=q, k=k, v=v, grad_out=do, dq=dq)
    launch = _launcher(q, k, v, o, lse, do, dq, dk, dv, mask, scale, dkdv_run, dq_run, packing)
    with on_device(q):
        launch(q, k, v, o, lse, do, dq, dk, dv, dlse)
    downgraded = dkdv_run != dkdv_config or dq_run != dq_config
    if unsettled:
        launch = settling_launch(launch, tuple(_SETTLED_ARGUMENTS[i] for i in unsettled))
    plans.keep(key, plans.Plan(launch, dkdv_run.warp_specialized or dq_run.warp_specialized), downgraded,
               (q, k, v, do, dq, dk, dv))  # fmt: skip
    return dq, dk, dv


def _gradient_buffers(q, k, v):
    """dq, dk, dv (contiguous, as backward() returns them), uninitialised."""
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))  # fmt: skip


class _Stats(NamedTuple):
    """Where the dK/dV and dQ kernels read the logsumexp and δ: one layout for both, (stride_lb, stride_lh).

    Dense calls: buffers of (batch, heads_q, rows) with rows = seqlen_q rounded up to STATS_ROWS, lse = +inf and
    δ = 0 in the rows past seqlen_q (their P and dS are 0). Triton's JIT specializes an int argument divisible by
    16, and the warp-specialized dK/dV kernel bounds its per-step loads of both by rows (bwd_ws.py.jinja's
    _row_stats): with the strides and that bound multiples of 16 a ragged length compiles the step an aligned one
    does. The forward's logsumexp is read where it is when it already has that layout (seqlen_q a multiple of 16,
    contiguous), else the preprocess copies it into a padded buffer. Packed calls: (heads_q, total_q), contiguous
    (the preprocess writes δ so, and the kernels read both at one head stride); a logsumexp laid out otherwise (a
    slice of a wider buffer) is copied likewise."""

    shape: tuple[int, ...]  # dense: (batch, heads_q, rows); packed: (heads_q, total_q)
    strides: tuple[int, int]  # the kernels' stride_lb, stride_lh
    copy_lse: bool  # the preprocess copies the logsumexp into a buffer of δ's layout

    @property
    def rows(self) -> int:
        """δ's rows a (batch, head) as the preprocess writes them (packed: every packed row, of one head)."""
        return self.shape[-1]

    @classmethod
    def of(cls, q: torch.Tensor, lse: torch.Tensor, packing: Packing | None) -> _Stats:
        if packing is not None:  # per head only: the row offset is cu_seqlens_q
            total_q, heads_q = q.shape[:2]
            return cls((heads_q, total_q), (0, total_q), lse.stride() != (total_q, 1))
        batch, heads_q, seqlen_q = q.shape[:3]
        rows = stats_rows(seqlen_q)
        strides = (heads_q * rows, rows)
        return cls((batch, heads_q, rows), strides, lse.stride() != (*strides, 1) or rows != seqlen_q)

    def buffers(self, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logsumexp the kernels read, δ's buffer) of a call, uninitialised but for lse as it is."""
        delta = lse.new_empty(self.shape)  # fp32, as the logsumexp
        return (lse.new_empty(self.shape) if self.copy_lse else lse), delta


def _launcher(q, k, v, o, lse, do, dq, dk, dv, mask, scale, dkdv_config, dq_config, packing):
    """launch(q, k, v, o, lse, do, dq, dk, dv, dlse) for calls with these tensors' shapes and strides and this
    packing: δ's preprocess kernel, then the dK/dV and dQ kernels — or, dQ fused in (bwd_dkdv warpspec 2), the
    dK/dV kernel adding into a zeroed fp32 dQ and its cast —, everything but the tensors worked out."""
    fused_dq = dkdv_config.fused_dq  # the dK/dV kernel also adds scale·dS·K into an fp32 dQ
    stats = _Stats.of(q, lse, packing)
    pre_launch = _preprocess_launcher(q, k, o, do, lse, stats, mask, dq_config, fused_dq, packing)
    shared = _Shared.of(q, k, v, stats, do, mask, scale, packing)
    split = _GroupSplit.of(q, k, v, mask, dkdv_config, shared.sizes)
    splits = split.split > 1
    # a split launch's strides are its partials': worked out from meta tensors of their layout
    layouts = split.partials(dk, dv, device="meta") if splits else (dk, dv)
    dkdv = _dkdv_launcher(q, k, v, *layouts, mask, scale, dkdv_config, shared, split.split)
    dq_launch = None if fused_dq else _dq_launcher(q, k, v, dq, mask, scale, dq_config, shared)
    seqlen_q = lse.shape[-1]

    def launch(q, k, v, o, lse, do, dq, dk, dv, dlse):
        stats_lse, delta = stats.buffers(lse)
        if fused_dq:
            dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # zeroed by the preprocess
            pre_launch(o, do, lse, stats_lse, delta, dq_acc)
        else:
            pre_launch(o, do, lse, stats_lse, delta, delta)  # DQ_ACC unused (ZERO_DQ off): any pointer
        if dlse is not None:
            delta[..., :seqlen_q].sub_(dlse)  # dlse has lse's shape: δ's rows but the padding
        dk_out, dv_out = split.partials(dk, dv) if splits else (dk, dv)
        if fused_dq:
            dkdv(q, k, v, do, dk_out, dv_out, dq_acc, stats_lse, delta)
            dq.copy_(dq_acc)
        else:
            dkdv(q, k, v, do, dk_out, dv_out, stats_lse, delta)
            dq_launch(q, k, v, do, dq, stats_lse, delta)
        if splits:
            split.sum_into(dk_out, dv_out, dk, dv)

    return launch


class _GroupSplit(NamedTuple):
    """A GQA group's query heads split over `split` dK/dV programs a K/V tile (config.group_split): the dK/dV
    kernel writes partials of heads_kv · split heads — K's and V's shapes, contiguous, the heads dimension (1, dense
    or packed) times split —, summed into dK and dV after it."""

    split: int
    dk_shape: tuple[int, ...]
    dv_shape: tuple[int, ...]

    @classmethod
    def of(cls, q, k, v, mask: Mask, config: KernelConfig, sizes: tuple) -> _GroupSplit:
        # sizes: layout()'s (packed: the longest sequence's lengths, an upper bound on the grid's work). A band's
        # programs are about equally long: it splits as no mask does. A warp-specialized program takes most of an
        # SM (warpspec._grid), or half with two an SM; Triton's may share one, which the slots leave out (one an
        # SM: the rule splits no more for them). MHA (a group of one) never splits and reads no device for it
        batch, _, heads_kv, seqlen_q, seqlen_k, _ = sizes
        group = q.shape[1] // k.shape[1]
        slots = device_info(q.device).sm_count * config.schedule.programs_an_sm if group > 1 else 1
        grid = DkdvGrid(batch * heads_kv, seqlen_q, seqlen_k, config.block_m, config.block_n,
                        mask.causal and not mask.banded, slots)  # fmt: skip
        split = dkdv_group_split(group, grid, fused_dq=config.fused_dq)
        # heads are dimension 1, dense (batch, heads, N, d) or packed (total, heads, d)
        partial = [(*t.shape[:1], t.shape[1] * split, *t.shape[2:]) for t in (k, v)]
        return cls(split, *partial)

    def partials(self, dk: torch.Tensor, dv: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """New partial buffers of dk's and dv's dtype (on `device`, default theirs), uninitialised."""
        return dk.new_empty(self.dk_shape, device=device), dv.new_empty(self.dv_shape, device=device)

    def sum_into(self, dk_part, dv_part, dk, dv) -> None:
        """dk and dv: the partials summed over each K/V head's shares."""
        for part, out in ((dk_part, dk), (dv_part, dv)):
            torch.sum(part.view(*out.shape[:2], self.split, *out.shape[2:]), dim=2, out=out)


def _preprocess_launcher(q, k, o, do, lse, stats: _Stats, mask: Mask, dq_config: KernelConfig, fused_dq: bool,
                         packing: Packing | None):  # fmt: skip
    """launch(o, do, lse, stats_lse, delta, dq_acc): δ = rowsum(dO ∘ O) into δ's buffer (stats.rows rows a batch and
    head); with stats.copy_lse the logsumexp copied into stats_lse, δ's layout; with dQ fused in, the fp32 dQ
    zeroed."""
    (batch, heads_q, _, seqlen_q, seqlen_k, head_dim), strides = layout(q, k, packing)
    # δ per row needs no sequence boundaries: packed rows are preprocessed as one batch of one long sequence.
    pre_rows, pre_batch = (q.shape[0], 1) if packing is not None else (seqlen_q, batch)
    head_dims = (head_dim, o.shape[-1])  # δ sums over O's columns: V's head dim
    pre = _layout.kernel("bwd", "_attn_bwd_preprocess", mask, seqlen_q, seqlen_k, dq_config, packing is not None,
                         head_dims)  # fmt: skip
    pre_grid = (cdiv(pre_rows, dq_config.block_m) * pre_batch * heads_q,)
    # with dQ fused in, the preprocess also zeroes the fp32 dQ: q's shape, contiguous (a meta tensor's strides)
    dq_acc_strides = strides(torch.empty(q.shape, device="meta")) if fused_dq else (0, 0, 0)
    # only a copy reads the logsumexp; a packed one (heads_q, total_q) is read as one batch
    lse_in_strides = (*(0,) * (3 - lse.dim()), *lse.stride()) if stats.copy_lse else (0, 0, 0)
    # O's, dO's and the fp32 dQ's strides go in units the kernel multiplies back (layout.in_units)
    units, tensor_strides = in_units(O=strides(o), DO=strides(do), ACC=dq_acc_strides)
    pre_scalars = (*tensor_strides[:6], *lse_in_strides, *tensor_strides[6:], heads_q, pre_rows, stats.rows)
    pre_options = dict(**head_dim_options(*head_dims), BLOCK_M=dq_config.block_m, ZERO_DQ=fused_dq,
                       COPY_LSE=stats.copy_lse, **units)  # fmt: skip
    return fastlaunch.Launcher(pre, pre_grid, pre_scalars, pre_options)


class _Shared(NamedTuple):
    """What the Triton dK/dV and dQ launches share: sizes, the inputs' strides, the mask's bounds and offsets.
    No tensor but the offsets (packed calls keep no plan): a plan outlives its call."""

    sizes: tuple  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
    head_dims: tuple[int, int]  # (Q's and K's, V's)
    strides: Callable
    inputs: dict[str, tuple]  # strides of q, k, v and dO by their unit names (Q, K, V, DO: layout.in_units)
    stats_strides: tuple[int, int]  # the logsumexp's and δ's (batch, head) strides (_Stats)
    scalars: tuple  # heads, GQA group, lengths, scales, mask bounds, packed totals
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    varlen: bool
    precision: str

    @classmethod
    def of(cls, q, k, v, stats: _Stats, do, mask: Mask, scale: float, packing: Packing | None) -> _Shared:
        sizes, strides = layout(q, k, packing)
        _, heads_q, heads_kv, seqlen_q, seqlen_k, _ = sizes
        cu_q, cu_k, bounds = mask_args(mask, seqlen_q, seqlen_k, packing)
        inputs = {"Q": strides(q), "K": strides(k), "V": strides(v), "DO": strides(do)}
        scalars = (heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, scale, scale * LOG2E, *bounds,
                   *totals(q, k, packing))  # fmt: skip
        return cls(sizes, (sizes[-1], v.shape[-1]), strides, inputs, stats.strides, scalars, cu_q, cu_k,
                   packing is not None, input_precision(q.dtype))  # fmt: skip

    def arguments(self, config: KernelConfig, group_split: int | None = None,
                  **outputs: torch.Tensor) -> tuple[tuple, dict]:  # fmt: skip
        """(scalars, options) of a launch that writes `outputs` (DK=dk, DV=dv, or DQ=dq): every tensor's strides in
        the units the kernel multiplies back (layout.in_units), the statistics' as they are. group_split (the dK/dV
        kernel's, _GroupSplit): the group's share a program streams and KV_SPLIT in place of the group."""
        units, tensor_strides = in_units(**self.inputs, **{name: self.strides(t) for name, t in outputs.items()})
        heads_q, group, *rest = self.scalars
        grouping = (group,) if group_split is None else (group // group_split, group_split)
        scalars = (*tensor_strides[:12], *self.stats_strides, *tensor_strides[12:], heads_q, *grouping, *rest)
        options = dict(**head_dim_options(*self.head_dims), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                       INPUT_PRECISION=self.precision, num_warps=config.num_warps, num_stages=config.num_stages,
                       **units)  # fmt: skip
        return scalars, options


def _dkdv_launcher(q, k, v, dk, dv, mask: Mask, scale: float, config: KernelConfig, shared: _Shared, split: int):
    """launch(q, k, v, do, dk, dv, [dq_acc,] lse, delta): the dK/dV kernel, one program per K/V tile and head — and
    with a group split (split > 1: _GroupSplit), per share of its group, dk and dv its partials."""
    if config.warp_specialized:  # backward() checked that this call can take it
        # the warpspec launchers take the TMA-read tensors first: the Triton ones take the same order
        return warpspec.backward_dkdv_launcher(q, k, shared.stats_strides, causal=mask.causal, scale=scale,
                                               config=config, head_dim_v=v.shape[-1], group_split=split)  # fmt: skip
    batch, _, heads_kv, seqlen_q, seqlen_k, _ = shared.sizes
    dkdv = _layout.kernel("bwd", "_attn_bwd_dkdv", mask, seqlen_q, seqlen_k, config, shared.varlen, shared.head_dims)
    grid = (cdiv(seqlen_k, config.block_n) * batch * heads_kv * split,)
    launch = fastlaunch.Launcher(dkdv, grid, *shared.arguments(config, split, DK=dk, DV=dv))
    cu_q, cu_k = shared.cu_q, shared.cu_k
    return lambda q, k, v, do, dk, dv, lse, delta: launch(q, k, v, do, lse, delta, dk, dv, cu_q, cu_k)


def _dq_launcher(q, k, v, dq, mask: Mask, scale: float, config: KernelConfig, shared: _Shared):
    """launch(q, k, v, do, dq, lse, delta): the dQ kernel, one program per Q tile and head."""
    if config.warp_specialized:  # backward() checked that this call can take it
        return warpspec.backward_dq_launcher(q, k, shared.stats_strides, causal=mask.causal, scale=scale,
                                             config=config, head_dim_v=v.shape[-1])  # fmt: skip
    batch, heads_q, _, seqlen_q, seqlen_k, _ = shared.sizes
    dq_kernel = _layout.kernel("bwd", "_attn_bwd_dq", mask, seqlen_q, seqlen_k, config, shared.varlen,
                               shared.head_dims)  # fmt: skip
    grid = (cdiv(seqlen_q, config.block_m) * batch * heads_q,)
    launch = fastlaunch.Launcher(dq_kernel, grid, *shared.arguments(config, DQ=dq))
    cu_q, cu_k = shared.cu_q, shared.cu_k
    return lambda q, k, v, do, dq, lse, delta: launch(q, k, v, do, lse, delta, dq, cu_q, cu_k)
