"""The backward's group split (fa2tune.config.group_split): its rule, its override, and gradients of split groups
against float64 through the Triton template (the warp-specialized kernel's: tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from fa2tune.api import ops
from fa2tune.config.group_split import DKDV_HEADS_ENV, MAX_CAUSAL_STREAMED_HEADS, dkdv_group_split
from fa2tune.config.types import KernelConfig
from fa2tune.launch import launcher

from .test_backward import _assert_grads_close, _random, _reference_grads


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(DKDV_HEADS_ENV, raising=False)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_a_causal_group_splits_into_the_fewest_shares_of_at_most_the_streamed_heads(group):
    split = dkdv_group_split(group, causal=True)
    assert group % split == 0 and group // split <= MAX_CAUSAL_STREAMED_HEADS
    assert all(group % fewer or group // fewer > MAX_CAUSAL_STREAMED_HEADS for fewer in range(1, split))
    assert dkdv_group_split(group, causal=False) == 1  # equally long programs: one load of K/V for the group
    assert dkdv_group_split(group, causal=True, warp_specialized=False) == 1  # the Triton template's: not measured


def test_the_override_sets_the_streamed_heads_under_either_mask(monkeypatch):
    monkeypatch.setenv(DKDV_HEADS_ENV, "2")
    assert dkdv_group_split(8, causal=False) == 4 and dkdv_group_split(6, causal=True) == 3
    monkeypatch.setenv(DKDV_HEADS_ENV, "5")
    assert dkdv_group_split(8, causal=True) == 2 and dkdv_group_split(5, causal=True) == 1
    monkeypatch.setenv(DKDV_HEADS_ENV, "1000")
    assert dkdv_group_split(8, causal=True) == 1


@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_a_bad_override_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(DKDV_HEADS_ENV, value)
    with pytest.raises(ValueError, match=DKDV_HEADS_ENV):
        dkdv_group_split(8, causal=True)


@pytest.mark.parametrize("heads", [None, "1", "3"], ids=["unsplit", "one_a_program", "uneven_share"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_groups_give_the_reference_gradients(heads, causal, device, monkeypatch):
    # GQA 8 over two K/V heads, ragged lengths (N_Q != N_K, not multiples of the tiles), the Triton template: heads=1
    # splits each group into eight partials, heads=3 into four shares of two; the rule splits none here.
    if heads is not None:
        monkeypatch.setenv(DKDV_HEADS_ENV, heads)
    q, k, v, do = _random((2, 16, 2, 45, 53, 16), torch.float32, device, seed=21)
    o, lse = ops.forward(q, k, v, causal=causal, scale=0.25)
    grads = ops.backward(do, q, k, v, o, lse, causal=causal, scale=0.25, dkdv_config=KernelConfig(16, 16),
                         dq_config=KernelConfig(16, 16))  # fmt: skip
    _assert_grads_close(grads, _reference_grads(q, k, v, do, causal, scale=0.25), torch.float32, do)


def test_a_split_plan_is_not_reused_once_the_override_changes(device, monkeypatch):
    # The launch plan's key holds the override: the same call under another override works out its own plan (the
    # split rule is asked again), and under the first override again reuses the first plan.
    from fa2tune.launch import backward as backward_launch
    from fa2tune.launch import plans

    asked = []
    rule = backward_launch.dkdv_group_split
    monkeypatch.setattr(backward_launch, "dkdv_group_split", lambda *a: asked.append(rule(*a)) or asked[-1])
    plans._plans.clear()
    q, k, v, do = _random((1, 8, 1, 40, 40, 16), torch.float32, device, seed=22)
    o, lse = ops.forward(q, k, v, causal=True, scale=0.25)
    configs = dict(dkdv_config=KernelConfig(16, 16), dq_config=KernelConfig(16, 16))
    results = []
    for heads in ("8", "1", "8"):
        monkeypatch.setenv(DKDV_HEADS_ENV, heads)
        results.append(ops.backward(do, q, k, v, o, lse, causal=True, scale=0.25, **configs))
    assert asked == [1, 8]
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_packed_sequences_split_their_groups(device, monkeypatch):
    # (total, heads, d) with three sequences, GQA 4 over two K/V heads split in two: the partials' heads are
    # dimension 1 there too.
    monkeypatch.setenv(DKDV_HEADS_ENV, "2")
    lengths = [7, 30, 12]
    q, k, v, do = _random((1, 8, 2, sum(lengths), sum(lengths), 16), torch.float32, device, seed=23)
    q, k, v, do = (t[0].transpose(0, 1).contiguous() for t in (q, k, v, do))
    cu = torch.tensor([0, 7, 37, 49], dtype=torch.int32, device=device)
    packing = launcher.Packing(cu, cu, max(lengths), max(lengths))
    o, lse = ops.forward(q, k, v, causal=True, scale=0.25, packing=packing)
    grads = ops.backward(do, q, k, v, o, lse, causal=True, scale=0.25, packing=packing,
                         dkdv_config=KernelConfig(16, 16), dq_config=KernelConfig(16, 16))  # fmt: skip
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        parts = [t[start:end].transpose(0, 1)[None] for t in (q, k, v, do)]
        want = _reference_grads(*parts, True, scale=0.25)
        got = [g[start:end].transpose(0, 1)[None] for g in grads]
        _assert_grads_close(got, want, torch.float32, parts[3])
