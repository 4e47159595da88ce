"""forward() and backward() as attention() runs them — the configs a caller leaves out resolved for the call —
and the torch custom ops fa2tune::fwd / fa2tune::bwd around them: what torch.compile sees of attention().

The ops are registered with fake implementations, so torch.compile sees two opaque ops with known output shapes
instead of tracing into Triton launches. They resolve their configs when they run, never while torch.compile
traces the caller (the store reads files). Scripts, the tuner and tests call forward() and backward() directly.
"""

from __future__ import annotations

import torch

from ..config.types import KernelConfig, Mask
from ..launch import launcher, short_query
from ..launch.launcher import Packing
from . import selection


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
    """fa2tune.launch.launcher.forward with config resolved for the call when None (the tuned or planner's)."""
    mask = causal if isinstance(causal, Mask) else Mask(causal=causal)
    resolved = selection.config_for(config, "fwd", q, k, v, mask, packing)
    return launcher.forward(q, k, v, causal=mask, scale=scale, config=resolved, explicit=config is not None,
                            out=out, packing=packing)  # fmt: skip


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
    """fa2tune.launch.launcher.backward with the configs left None resolved for the call."""
    mask = causal if isinstance(causal, Mask) else Mask(causal=causal)
    if dkdv_config is None and dq_config is None:
        dkdv, dq = selection.for_call(selection.BACKWARD, q, k, v, mask, packing)
    else:
        dkdv = selection.config_for(dkdv_config, "bwd_dkdv", q, k, v, mask, packing)
        dq = selection.config_for(dq_config, "bwd_dq", q, k, v, mask, packing)
    return launcher.backward(do, q, k, v, o, lse, causal=mask, scale=scale, dkdv_config=dkdv, dq_config=dq,
                             dkdv_explicit=dkdv_config is not None, dq_explicit=dq_config is not None,
                             packing=packing, dlse=dlse)  # fmt: skip


def clear_plans() -> None:
    """Forgets what each call signature worked out: its launch plans and its resolved configs (tests, benchmarks
    that patch what those are worked out from: selection.resolve, warpspec._sm_count)."""
    launcher.clear_plans()
    selection.clear_cache()


def decode_step(q, k, v, mask: Mask, scale: float, packing: Packing | None = None):
    """(O, logsumexp) of a call short_query.takes admits, on the decode kernels, in the forward kernels' layouts (a
    backward reads them as it reads the forward's); the decode config resolved for the call's signature."""
    if packing is None:
        return short_query.forward(q, k, v, mask, scale, resolve=selection.decode_config)
    return short_query.forward_packed(q, k, v, mask, scale, packing, resolve=selection.decode_config)


def apply_op(q, k, v, mask: Mask, scale: float, config: KernelConfig | None, packing: Packing | None = None,
             chosen: bool = True):  # fmt: skip
    """(O, logsumexp) through the custom op, as torch.compile and tracing run attention() (the eager path:
    fa2tune.api.attention.apply_eager). Tests and benchmarks call it to compare the two. chosen: as attention's
    _apply takes it (False: `config` was resolved for the caller, as a get_kernel() kernel's)."""
    cu_q, cu_k, max_seqlens = (
        (None, None, [])
        if packing is None
        else (packing.cu_seqlens_q, packing.cu_seqlens_k, [packing.max_seqlen_q, packing.max_seqlen_k])
    )
    config_ints = _to_ints(config) if config is not None else []
    return torch.ops.fa2tune.fwd(q, k, v, _mask_to_ints(mask), scale, config_ints, chosen, cu_q, cu_k, max_seqlens)


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
    chosen: bool,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    packing, mask, given = _packing(cu_seqlens_q, cu_seqlens_k, max_seqlens), _mask_from_ints(mask), _from_ints(config)
    if (given is None or not chosen) and short_query.takes(q, k, v, mask, packing):
        # a decode step, traced: the decode kernels, as the eager path runs it. Their (O, logsumexp) are the forward
        # kernels' to rounding, so a backward that follows (the op cannot tell whether one will) reads them alike
        return decode_step(q, k, v, mask, scale, packing)
    resolved = selection.config_for(given, "fwd", q, k, v, mask, packing)
    return launcher.checked_forward(q, k, v, mask, scale, resolved, given is not None and chosen, packing)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, mask, scale, config, chosen, cu_seqlens_q, cu_seqlens_k, max_seqlens):
    o = q.new_empty((*q.shape[:-1], v.shape[-1]))  # q's shape with V's head dim, contiguous
    return o, _lse_like(q, cu_seqlens_q is not None)


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
    q, k, v, mask, scale, _config, _chosen, cu_q, cu_k, max_seqlens = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.mask, ctx.scale, ctx.max_seqlens = mask, scale, max_seqlens
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to make and subtract


def _backward(ctx, do, dlse):
    """O(N) saved state (q, k, v, O, logsumexp); S and P are recomputed. dlse: see launcher.backward()."""
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    launcher.refuse_second_order(q, k, v, do, dlse)
    if do is None:  # only the logsumexp reached the loss
        do = torch.zeros_like(o)
    dq, dk, dv = torch.ops.fa2tune.bwd(do, q, k, v, o, lse, ctx.mask, ctx.scale, [], [], cu_q, cu_k,
                                       ctx.max_seqlens, dlse)  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None


# The autograd formula lives on the op itself (not a Python autograd.Function), so torch.compile traces one op —
# also when q, k and v are one tensor, which dynamo refuses for an autograd.Function.
torch.library.register_autograd("fa2tune::fwd", _backward, setup_context=_setup_context)
