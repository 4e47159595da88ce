"""The forward launcher: O and the logsumexp of attention, by the Triton template or the warp-specialized kernel."""

from __future__ import annotations

import torch

from ..config.inputs import check_offsets
from ..config.types import KernelConfig, Mask
from . import fastlaunch, plans, warpspec
from . import layout as _layout
from .fallback import check_combination, runnable
from .grid import LOG2E, cdiv, fwd_grid, input_precision
from .layout import (
    Packing,
    as_mask,
    head_dim_options,
    in_units,
    layout,
    lse_strides,
    mask_args,
    on_device,
    output_like,
    settle,
    settled_strides,
    settling_launch,
    totals,
)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool | Mask,
    scale: float,
    config: KernelConfig,
    explicit: bool = True,
    out: torch.Tensor | None = None,
    packing: Packing | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the forward kernel on validated inputs (see inputs.check_qkv / inputs.check_varlen).

    Args:
        causal: a bool (plain or causal) or a Mask (window, prefix).
        config: the config to launch with (fa2tune.api.ops.forward resolves one for callers without one).
        explicit: the caller chose config: a config this call cannot run is an error. False for a config resolved
            for the call (tuned or the planner's), which then gives way to the Triton template's default.
        out: optional preallocated output: q's shape with V's head dim (any strides with a unit last stride); written
            in place.
        packing: packed sequences; q, k, v are then (total_tokens, heads, head_dim).

    Returns:
        O with q's shape (V's head dim) and dtype, and the fp32 logsumexp in natural log: (batch, heads_q, seqlen_q), or
        (heads_q, total_q) for packed sequences.
    """
    mask = as_mask(causal)
    key = None
    if out is None and packing is None:  # a plan's outputs are allocated as below; packed offsets are per call
        key = plans.plan_key("fwd", (q, k, v), mask, scale, (config, explicit))
        plan = plans.lookup(key)
        if plan is not None:
            o = output_like(q, v)
            lse = q.new_empty(q.shape[:3], dtype=torch.float32)  # torch.empty's keyword parsing: 0.5 µs more
            if not (plan.tma and plans.misaligned(q, k, v, o)):
                with on_device(q):
                    plan.launch(q, k, v, o, lse)
                return o, lse
    (q, k, v), unsettled = settle((q, k, v))
    (batch, heads_q, _, seqlen_q, _, _), _ = layout(q, k, packing)
    if explicit:
        check_combination(config, "fwd")
    result = output_like(q, v) if out is None else out
    o = settled_strides(result)  # the caller's out is returned as it is, and written through this view
    lse_shape = (batch, heads_q, seqlen_q) if packing is None else (heads_q, q.shape[0])
    lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
    if o.numel() == 0 or batch == 0 or seqlen_q == 0:
        return result, lse.fill_(float("-inf"))
    run = runnable(config, "fwd", explicit, mask, packing, q=q, k=k, v=v, out=o)
    launch = _launcher(q, k, v, o, lse, mask, scale, run, packing)
    with on_device(q):
        launch(q, k, v, o, lse)
    if unsettled:
        launch = settling_launch(launch, unsettled)
    plans.keep(key, plans.Plan(launch, run.warp_specialized), run != config, (q, k, v, o))
    return result, lse


def checked_forward(q, k, v, mask: Mask, scale: float, config: KernelConfig, explicit: bool, packing: Packing | None):
    """forward(), after checking packed offsets' values: not in attention_varlen, as the custom op runs eagerly
    even inside a compiled graph (where reading them back would break it). Both call paths come through here."""
    if packing is not None:
        check_offsets(packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q, packing.max_seqlen_k,
                      q.shape[0], k.shape[0])  # fmt: skip
    return forward(q, k, v, causal=mask, scale=scale, config=config, explicit=explicit, packing=packing)


def _launcher(q, k, v, o, lse, mask: Mask, scale: float, config: KernelConfig, packing: Packing | None):
    """launch(q, k, v, o, lse) for calls with these tensors' shapes and strides and this packing: the forward's one
    kernel launch with everything but the tensors worked out."""
    if config.warp_specialized:  # runnable() checked that this call can take it
        return warpspec.forward_launcher(q, k, lse, causal=mask.causal, scale=scale, config=config,
                                         head_dim_v=v.shape[-1])  # fmt: skip
    (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim), strides = layout(q, k, packing)
    head_dims = (head_dim, v.shape[-1])
    fwd = _layout.kernel("fwd", "_attn_fwd", mask, seqlen_q, seqlen_k, config, packing is not None, head_dims)
    cu_q, cu_k, (left, right, prefix) = mask_args(mask, seqlen_q, seqlen_k, packing)
    grid = fwd_grid(cdiv(seqlen_q, config.block_m), batch * heads_q)
    units, tensor_strides = in_units(Q=strides(q), K=strides(k), V=strides(v), O=strides(o))  # multiplied back
    scalars = (*tensor_strides, *lse_strides(lse, packing), batch, heads_q, heads_q // heads_kv, seqlen_q, seqlen_k,
               scale * LOG2E, left, right, prefix, *totals(q, k, packing))  # fmt: skip
    options = dict(**head_dim_options(*head_dims), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                   INPUT_PRECISION=input_precision(q.dtype), num_warps=config.num_warps,
                   num_stages=config.num_stages, **units)  # fmt: skip

    launch = fastlaunch.Launcher(fwd, grid, scalars, options)
    return lambda q, k, v, o, lse: launch(q, k, v, o, lse, cu_q, cu_k)
