"""Attention's autograd formula for eager calls (EagerAttention), and the refusal of a second derivative that the
eager path and the custom op (fa2tune.api.ops) share."""

from __future__ import annotations

import torch

from ..config.types import Mask
from .backward import backward
from .forward import checked_forward
from .layout import Packing

# What a backward that autograd asks to differentiate says (refuse_second_order).
SECOND_ORDER_ERROR = (
    "fa2tune's attention is differentiable once: a gradient through it taken with create_graph=True (a gradient "
    "penalty, a Hessian-vector product, double backward) is not supported, as its backward kernels have no "
    "gradient of their own and the second-order terms would be missing. For second-order gradients, run those "
    "layers with torch.nn.functional.scaled_dot_product_attention under "
    "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)"
)


def refuse_second_order(*tensors: torch.Tensor | None) -> None:
    """Raises when this backward is asked for a graph of its own. Autograd runs a backward with grad mode on exactly
    when the gradient is taken with create_graph=True (torch.compile's tracing of the backward runs it with grad
    mode off); the saved inputs then require grad. Its kernels' outputs would carry no graph, so the second
    derivative would silently lack attention's terms: an error now, before any of it is computed."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(SECOND_ORDER_ERROR)


def needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call has a gradient to come: grad mode on and an input that requires one. Without, the forward
    alone runs (nothing is saved for a backward)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def is_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when nothing traces this call: no torch.compile, no dispatch mode (make_fx, fake tensors), and plain
    tensors, so the launchers may run directly."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor


class EagerAttention(torch.autograd.Function):
    """The eager autograd path: attention's forward and autograd formula without the custom op, for calls nothing
    traces. Benchmarks compare it with the custom-op path (fa2tune.api.ops.apply_op).

    Dispatching a torch custom op with a registered autograd formula costs ~70 µs of host time per call (the
    dispatcher, the autograd wrapper, dynamo's disable guard, configs and masks packed into int lists) — more
    than a short attention forward takes on the GPU. Eager calls (no torch.compile, no tracing mode, plain tensors)
    come here instead; the op stays what torch.compile sees. Both run forward() and backward() with the same
    arguments, and the tests run both paths.

    apply(q, k, v, mask, scale, packing, configs, explicit) -> (O, logsumexp). configs: (forward, dK/dV, dQ), as
    the API resolved them; explicit: the caller gave the forward's (the backward's two are always resolved ones).
    """

    @staticmethod
    def forward(ctx, q, k, v, mask: Mask, scale: float, packing: Packing | None, configs: tuple, explicit: bool):
        o, lse = checked_forward(q, k, v, mask, scale, configs[0], explicit, packing)
        # The offsets are saved like the tensors: an in-place write to them before the backward is then autograd's
        # error ("modified by an inplace operation"), as on the op path, not gradients of other sequences.
        cu = (packing.cu_seqlens_q, packing.cu_seqlens_k) if packing is not None else ()
        ctx.save_for_backward(q, k, v, o, lse, *cu)
        ctx.mask, ctx.scale, ctx.packing, ctx.configs = mask, scale, packing, configs
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, *_ = ctx.saved_tensors
        refuse_second_order(q, k, v, do, dlse)
        if do is None:  # only the logsumexp reached the loss
            do = torch.zeros_like(o)
        _, dkdv_config, dq_config = ctx.configs
        dq, dk, dv = backward(do, q, k, v, o, lse, causal=ctx.mask, scale=ctx.scale, dkdv_config=dkdv_config,
                              dq_config=dq_config, dkdv_explicit=False, dq_explicit=False, packing=ctx.packing,
                              dlse=dlse)  # fmt: skip
        return dq, dk, dv, None, None, None, None, None
