"""The backward's group split (fa2tune.config.group_split): its rule, its override, and gradients of split groups
against float64 through the Triton template (the warp-specialized kernel's: tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from fa2tune.api import ops
from fa2tune.config.group_split import (
    DKDV_HEADS_ENV,
    MAX_CAUSAL_FUSED_HEADS,
    DkdvGrid,
    _steps_a_head,
    dkdv_group_split,
    many_waves_heads,
)
from fa2tune.config.types import KernelConfig
from fa2tune.launch import launcher

from .test_backward import _assert_grads_close, _random, _reference_grads


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(DKDV_HEADS_ENV, raising=False)


# A grid of whole waves on an H100's 132 SMs: GQA over 4 K/V heads, batch 2, N=8k, 64 × 128 tiles (512 programs)
_FULL = DkdvGrid(batch_heads_kv=8, seqlen_q=8192, seqlen_k=8192, block_m=64, block_n=128, causal=True, slots=132)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_a_full_causal_grid_splits_only_with_fused_dq_into_the_fewest_shares_of_at_most_the_streamed_heads(group):
    split = dkdv_group_split(group, _FULL, fused_dq=True)
    assert group % split == 0 and group // split <= MAX_CAUSAL_FUSED_HEADS
    assert all(group % fewer or group // fewer > MAX_CAUSAL_FUSED_HEADS for fewer in range(1, split))
    assert dkdv_group_split(group, _FULL, fused_dq=False) == 1  # the tail is short against a slot's work
    assert dkdv_group_split(group, _FULL._replace(causal=False), fused_dq=True) == 1  # equally long programs


@pytest.mark.parametrize("fused_dq", [False, True])
def test_a_grid_short_of_the_sms_splits_until_it_fills_them(fused_dq):
    # One K/V head of 8 query heads, batch 1, N=4k: 32 equal programs (no mask) for 132 SMs. Split in four, 128
    # programs run in one wave, each a quarter as long; split in eight they need two waves and end no sooner. With
    # 64 SMs two splits fill them, with 32 the grid does. The causal grid's programs are unequal: it splits at least
    # as far.
    grid = DkdvGrid(1, 4096, 4096, 64, 128, False, slots=132)
    assert dkdv_group_split(8, grid, fused_dq=fused_dq) == 4
    assert dkdv_group_split(8, grid._replace(slots=64), fused_dq=fused_dq) == 2
    assert dkdv_group_split(8, grid._replace(slots=32), fused_dq=fused_dq) == 1
    assert dkdv_group_split(8, grid._replace(causal=True), fused_dq=fused_dq) >= 4


def test_a_causal_grid_of_one_wave_splits_where_no_mask_does_not():
    # 8 query heads over 1 K/V head, batch 1, N=16k (128 programs for 132 SMs): causal, the first K/V tile's program
    # is twice the average, and the grid waits for it; split in two, two waves of half-length programs end sooner.
    # Without the mask 128 equal programs are one wave already.
    grid = DkdvGrid(1, 16384, 16384, 64, 128, True, slots=132)
    assert dkdv_group_split(8, grid, fused_dq=False) == 2
    assert dkdv_group_split(8, grid._replace(causal=False), fused_dq=False) == 1


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (100, 100), (130, 70), (70, 130), (256, 200), (5, 300)])
@pytest.mark.parametrize("block_m, block_n", [(64, 128), (32, 64), (16, 16)])
def test_the_steps_a_head_count_the_q_tiles_that_see_each_k_tile(seqlen_q, seqlen_k, block_m, block_n):
    # against the mask itself (bottom-right aligned, as types.Mask): a Q tile steps over a K/V tile when any of its
    # queries sees any of the tile's keys
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
    steps = [sum(bool(rows.any()) for rows in visible[:, first:first + block_n].split(block_m))
             for first in range(0, seqlen_k, block_n)]  # fmt: skip
    assert _steps_a_head(seqlen_q, seqlen_k, block_m, block_n, True) == (max(steps), sum(steps))
    q_tiles, k_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    assert _steps_a_head(seqlen_q, seqlen_k, block_m, block_n, False) == (q_tiles, q_tiles * k_tiles)


def test_a_grid_without_keys_is_not_split():
    # a packed call's offsets go unchecked under CUDA-graph capture: a longest length of 0 must not break the rule
    assert dkdv_group_split(8, DkdvGrid(2, 100, 0, 64, 128, True, slots=132), fused_dq=True) == 2
    assert dkdv_group_split(8, DkdvGrid(2, 0, 100, 64, 128, True, slots=132), fused_dq=False) == 1


def test_the_override_sets_the_streamed_heads_under_either_mask(monkeypatch):
    monkeypatch.setenv(DKDV_HEADS_ENV, "2")
    no_mask = _FULL._replace(causal=False)
    assert dkdv_group_split(8, no_mask, fused_dq=False) == 4 and dkdv_group_split(6, _FULL, fused_dq=True) == 3
    monkeypatch.setenv(DKDV_HEADS_ENV, "5")
    assert dkdv_group_split(8, _FULL, fused_dq=True) == 2 and dkdv_group_split(5, _FULL, fused_dq=False) == 1
    monkeypatch.setenv(DKDV_HEADS_ENV, "1000")
    assert dkdv_group_split(8, _FULL, fused_dq=True) == 1
    assert dkdv_group_split(8, DkdvGrid(1, 4096, 4096, 64, 128, True, 132), fused_dq=False) == 1


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_a_bad_override_names_the_variable(monkeypatch, value, group):
    monkeypatch.setenv(DKDV_HEADS_ENV, value)
    with pytest.raises(ValueError, match=DKDV_HEADS_ENV):
        dkdv_group_split(group, _FULL, fused_dq=True)


@pytest.mark.parametrize("heads", [None, "1", "3"], ids=["rule", "one_a_program", "uneven_share"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_groups_give_the_reference_gradients(heads, causal, device, monkeypatch):
    # GQA 8 over two K/V heads, ragged lengths (N_Q != N_K, not multiples of the tiles), the Triton template: heads=1
    # splits each group into eight partials, heads=3 into four shares of two; the rule splits none under the
    # interpreter (one SM: no grid is short of it) and, on a GPU, the grid short of its SMs.
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
    monkeypatch.setattr(backward_launch, "dkdv_group_split", lambda *a, **kw: asked.append(rule(*a, **kw)) or asked[-1])
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


def test_a_grid_of_many_waves_splits_by_the_fused_rule_alone(monkeypatch):
    # what a tune's compile example forces, its small grid standing for the timed calls' full ones
    assert dkdv_group_split(8, _FULL, fused_dq=True) == 8 // many_waves_heads(8, causal=True, fused_dq=True)
    assert many_waves_heads(8, causal=True, fused_dq=True) == MAX_CAUSAL_FUSED_HEADS
    assert many_waves_heads(6, causal=True, fused_dq=True) == 3  # the largest divisor within the rule
    assert many_waves_heads(8, causal=False, fused_dq=True) == many_waves_heads(8, causal=True, fused_dq=False) == 8
    monkeypatch.setenv(DKDV_HEADS_ENV, "2")  # the override rules here too
    assert many_waves_heads(8, causal=False, fused_dq=False) == 2
