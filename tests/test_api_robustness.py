"""The public API with what a demanding user passes: second-order gradients, and every integer, bool, float and tensor
argument of get_kernel, attention, attention_varlen, an AttentionKernel, FlashAttnFunction and KernelConfig with
wrong types and edge values. Each gives a clear error (naming the argument, what was expected, what came) or the
right result — never a crash deep inside, never a wrong number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fa2tune
from fa2tune import launcher
from fa2tune.reference import naive_attention
from fa2tune.types import Mask

SECOND_ORDER = r"fa2tune's attention is differentiable once.*create_graph=True.*SDPBackend.MATH"
F32 = torch.float32


def _qkv(device, shape=(1, 2, 20, 16), seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device).requires_grad_(requires_grad) for _ in range(3)]


def _packed(device, lengths=(5, 15), heads=2, head_dim=16, seed=0, requires_grad=False):
    total = sum(lengths)
    q, k, v = _qkv(device, (total, heads, head_dim), seed, requires_grad)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    return q, k, v, cu


def _reference(q, k, v, **mask):
    return naive_attention(q.double(), k.double(), v.double(), **mask)[0]


# ---- second-order gradients: refused when asked for, never a gradient without attention's terms -------------


def _dense_calls(device):
    def eager(q, k, v):
        return fa2tune.attention(q, k, v, causal=True)

    def op(q, k, v):  # the custom op's autograd formula: what torch.compile and tracing run
        return launcher._apply_op(q, k, v, Mask(causal=True), 0.25, None)[0]

    def kernel(q, k, v):
        return fa2tune.get_kernel(16, device=device, dtype=F32, causal=True)(q, k, v)

    def lse(q, k, v):  # the gradient through the logsumexp alone (dO is None in the backward)
        return fa2tune.attention(q, k, v, return_lse=True)[1]

    def lse_op(q, k, v):
        return launcher._apply_op(q, k, v, Mask(), 0.25, None)[1]

    return dict(eager=eager, op=op, kernel=kernel, lse=lse, lse_op=lse_op)


@pytest.mark.parametrize("path", ["eager", "op", "kernel", "lse", "lse_op"])
def test_a_gradient_penalty_through_attention_is_refused(path, device):
    # Before: the eager path's create_graph gradient carried no graph, so loss.backward() gave q.grad without the
    # penalty's term and no error; the op path failed only at the second backward, naming fa2tune.bwd's missing
    # autograd formula.
    q, k, v = _qkv(device, requires_grad=True)
    out = _dense_calls(device)[path](q, k, v)
    with pytest.raises(RuntimeError, match=SECOND_ORDER):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("path", ["eager", "op", "kernel"])
def test_a_gradient_penalty_through_packed_attention_is_refused(path, device):
    q, k, v, cu = _packed(device, requires_grad=True)
    packing = launcher.Packing(cu, cu, 15, 15)
    run = {
        "eager": lambda: fa2tune.attention_varlen(q, k, v, cu, cu, 15, 15),
        "op": lambda: launcher._apply_op(q, k, v, Mask(), 0.25, None, packing)[0],
        "kernel": lambda: fa2tune.get_kernel(16, device=device, dtype=F32, varlen=True)(q, k, v, cu, cu, 15, 15),
    }[path]
    out = run()
    with pytest.raises(RuntimeError, match=SECOND_ORDER):
        torch.autograd.grad((out * out).sum(), (q, k, v), create_graph=True)


def test_a_second_order_gradient_that_does_not_pass_through_attention_still_works(device):
    # The refusal is in attention's backward, which autograd runs only where a gradient passes through it.
    q, k, v = _qkv(device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    loss = (fa2tune.attention(q, k, v) * w).sum()
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    (g.square().sum() + loss).backward()
    assert q.grad is not None and w.grad is not None and torch.isfinite(w.grad).all()
