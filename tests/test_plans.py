"""Launch plans (fa2tune.launch.plans): what a call's signature decides is kept, and a call only reuses it when nothing
that decided it changed — shapes, strides, dtype, mask, scale, configs, the resolved-config cache."""

from __future__ import annotations

import pytest
import torch

import fa2tune
from fa2tune.api import ops, selection
from fa2tune.config.types import KernelConfig
from fa2tune.launch import plans
from fa2tune.tune.reference import naive_attention

from .conftest import assert_close


@pytest.fixture
def resolves(monkeypatch):
    """Counts selection.resolve calls: a call that works its plan out resolves its configs, one that reuses it not."""
    calls = []
    real = selection.resolve

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(selection, "resolve", counted)
    return calls


def _qkv(shape=(1, 2, 45, 32), dtype=torch.float16, device="cpu", grad=False):
    return [torch.randn(shape, dtype=dtype, device=device, requires_grad=grad) for _ in range(3)]


def _grads(q, k, v, do, causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*leaves, causal=causal)
    return torch.autograd.grad(ref, leaves, do.double())


def test_a_second_call_reuses_the_plan_and_gives_the_same_result(device, resolves):
    torch.manual_seed(1)
    q, k, v = _qkv(device=device)
    first, _ = ops.forward(q, k, v, causal=True, scale=0.2)
    assert resolves == ["fwd"]
    q2, k2, v2 = _qkv(device=device)  # new values, same signature
    second, lse = ops.forward(q2, k2, v2, causal=True, scale=0.2)
    assert resolves == ["fwd"]  # nothing resolved again
    ref_o, ref_lse = naive_attention(q2.double(), k2.double(), v2.double(), causal=True, scale=0.2)
    assert_close(second, ref_o, torch.float16)
    assert_close(lse, ref_lse, torch.float32, what="lse")
    again, _ = ops.forward(q, k, v, causal=True, scale=0.2)
    assert torch.equal(again, first)


@pytest.mark.parametrize("change", ["v strides", "seqlen", "dtype", "mask", "scale", "config"])
def test_a_call_that_differs_in_anything_the_plan_was_worked_out_from_works_its_own_out(change, device, resolves):
    torch.manual_seed(2)
    q, k, v = _qkv(device=device)
    ops.forward(q, k, v, causal=False, scale=0.2)
    assert len(plans._plans) == 1
    causal, scale, config, dtype = False, 0.2, None, torch.float16
    if change == "v strides":  # same shape, v read through other strides: the kernel's stride arguments differ
        v = torch.randn(1, 2, 45, 64, dtype=dtype, device=device)[..., :32]  # rows 64 elements apart, k's 32
    elif change == "seqlen":
        q, k, v = _qkv((1, 2, 46, 32), device=device)
    elif change == "dtype":
        dtype = torch.float32
        q, k, v = (t.float() for t in (q, k, v))
    elif change == "mask":
        causal = True
    elif change == "scale":
        scale = 0.3
    else:
        config = KernelConfig(16, 16)
    assert v.stride(-1) == 1
    o, _ = ops.forward(q, k, v, causal=causal, scale=scale, config=config)
    assert len(plans._plans) == 2
    ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    assert_close(o, ref, dtype)


def test_clearing_the_resolved_configs_retires_the_plans(device, resolves):
    q, k, v = _qkv(device=device)
    ops.forward(q, k, v, causal=False, scale=0.2)
    ops.forward(q, k, v, causal=False, scale=0.2)
    assert resolves == ["fwd"]
    selection.clear_cache()  # what a tune, a new config file or a test does
    ops.forward(q, k, v, causal=False, scale=0.2)
    assert resolves == ["fwd", "fwd"]


def test_the_backward_plan_serves_calls_with_and_without_a_logsumexp_gradient(device, resolves):
    torch.manual_seed(3)
    q, k, v = _qkv(device=device, grad=True)
    do = torch.randn_like(q)
    for _ in range(2):  # the second call runs the first one's plans
        o = fa2tune.attention(q, k, v, causal=True)
        got = torch.autograd.grad(o, (q, k, v), do)
    assert resolves.count("bwd_dkdv") == 1 and resolves.count("bwd_dq") == 1
    want = _grads(q, k, v, do, causal=True)
    for g, w, name in zip(got, want, "qkv", strict=True):
        assert_close(g, w, torch.float16, what=f"d{name}")
    # Now the logsumexp reaches the loss too: the plan shifts δ by dlse between its preprocess and main kernels.
    o, lse = fa2tune.attention(q, k, v, causal=True, return_lse=True)
    dlse = torch.randn_like(lse)
    got = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
    assert resolves.count("bwd_dkdv") == 1  # the same plan
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = naive_attention(*leaves, causal=True)
    want = torch.autograd.grad((ref_o, ref_lse), leaves, (do.double(), dlse.double()))
    for g, w, name in zip(got, want, "qkv", strict=True):
        assert_close(g, w, torch.float16, what=f"d{name}")


def test_a_backward_with_other_grad_out_strides_works_its_own_plan_out(device):
    # out.sum()'s gradient is a stride-0 expand; backward() makes it contiguous, so its plan is the contiguous one's
    torch.manual_seed(4)
    q, k, v = _qkv(device=device, grad=True)
    o = fa2tune.attention(q, k, v)
    got = torch.autograd.grad(o.sum(), (q, k, v))
    o = fa2tune.attention(q, k, v)
    strided = torch.randn(1, 2, 32, 45, dtype=q.dtype, device=device).transpose(-1, -2)  # row stride 1: copied
    again = torch.autograd.grad(o, (q, k, v), strided)
    want = _grads(q, k, v, torch.ones_like(q), causal=False)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, torch.float16)
    want = _grads(q, k, v, strided, causal=False)
    for g, w in zip(again, want, strict=True):
        assert_close(g, w, torch.float16)


def test_a_plan_is_not_kept_where_the_addresses_may_have_decided_the_config():
    # A warpspec config swapped for the Triton one: for the signature (kept), or maybe for these addresses (not).
    plan = plans.Plan(lambda *tensors: None, tma=False)
    aligned = torch.zeros(64, dtype=torch.float16)
    shifted = aligned[1:]  # 2 bytes past a 16-byte boundary
    plans.keep(("aligned",), plan, True, (aligned, aligned))
    plans.keep(("shifted",), plan, True, (aligned, shifted))
    plans.keep(("not downgraded",), plan, False, (aligned, shifted))
    plans.keep(None, plan, False, (aligned,))  # a call with no signature (packed sequences, out=)
    assert set(plans._plans) == {("aligned",), ("not downgraded",)}


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    plan = plans.Plan(lambda *tensors: None, tma=False)
    for i in range(7):
        plans.keep((i,), plan, False, ())
        assert len(plans._plans) <= 3
    assert (6,) in plans._plans


def test_packed_sequences_and_given_outputs_keep_no_plan(device):
    q, k, v = _qkv(device=device)
    ops.forward(q, k, v, causal=False, scale=0.2, out=torch.empty_like(q))
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # (45, 2, 32): one sequence of 45 tokens
    cu = torch.tensor([0, 45], dtype=torch.int32, device=device)
    fa2tune.attention_varlen(*packed, cu, cu, 45, 45)
    assert not plans._plans


def test_plans_hold_no_tensors(device):
    # A plan outlives its call: a tensor in its closures (an input, an output, a gradient buffer) would keep a
    # training step's activations alive for as long as the process keeps the plan.
    q, k, v = _qkv(device=device, grad=True)
    torch.autograd.grad(fa2tune.attention(q, k, v, causal=True), (q, k, v), torch.randn_like(q))
    assert len(plans._plans) == 2  # the forward's and the backward's

    def contents(fn, seen):
        if id(fn) in seen:
            return
        seen.add(id(fn))
        for cell in fn.__closure__ or ():
            value = cell.cell_contents
            yield value
            if callable(value) and hasattr(value, "__closure__"):
                yield from contents(value, seen)

    for plan in plans._plans.values():
        held = list(contents(plan.launch, set()))
        assert held and not any(isinstance(x, torch.Tensor) for x in held)
        flat = [y for x in held if isinstance(x, tuple | list) for y in x]
        assert not any(isinstance(y, torch.Tensor) for y in flat)
