"""fa2tune.flash_attn_with_kvcache (the decode kernels: split-KV, GQA packing, paged caches, append) against a
float64 reference that gathers each entry's keys through its block table, and what it refuses."""

from __future__ import annotations

import csv
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import fa2tune
from fa2tune.api import selection
from fa2tune.config import decode_plan
from fa2tune.config.decode_plan import DecodeConfig
from fa2tune.config.device import known_gpu
from fa2tune.kernels import codegen
from fa2tune.launch import decode as decode_launch

from ._scripts import load_script
from .conftest import assert_close


def _reference(q, k_cache, v_cache, lengths, table, scale, causal=False, window=(-1, -1), k_new=None, v_new=None):
    """(out, lse) in float64 from first principles: entry b's keys are its first lengths[b] cached keys — row b of
    the cache, or key j in page table[b, j // page_size] at slot j % page_size — then the appended ones; query i sits
    at position i + n_keys − seqlen_q and sees the keys its causal and window bounds allow."""
    batch, seqlen_q, heads, _ = q.shape
    group = heads // k_cache.shape[2]
    outs, lses = [], []
    for b in range(batch):
        j = torch.arange(lengths[b])
        rows = (b, j) if table is None else (table[b, j // k_cache.shape[1]].long(), j % k_cache.shape[1])
        keys, values = k_cache[rows].double(), v_cache[rows].double()
        if k_new is not None:
            keys, values = torch.cat([keys, k_new[b].double()]), torch.cat([values, v_new[b].double()])
        n_keys = keys.shape[0]
        scores = torch.einsum("ihd,jhd->hij", q[b].double(), keys.repeat_interleave(group, 1)) * scale
        pos, key = torch.arange(seqlen_q)[:, None] + n_keys - seqlen_q, torch.arange(n_keys)[None, :]
        visible = torch.ones(seqlen_q, n_keys, dtype=torch.bool)
        if causal:
            visible &= key <= pos
        if window[0] >= 0:
            visible &= key >= pos - window[0]
        if window[1] >= 0:
            visible &= key <= pos + window[1]
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        probs = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(scores - lse[..., None]))
        outs.append(torch.einsum("hij,jhd->ihd", probs, values.repeat_interleave(group, 1)))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _make_case(lengths, *, heads=8, kv_heads=2, head_dim=64, seqlen_q=1, seqlen_new=0, page=None, dtype=torch.float16,
               seed=0, device="cpu"):  # fmt: skip
    """Fresh random q, caches (paged through a shuffled table when `page` is set, with spare pages) and new keys.
    Every cache row an entry does not hold — past its length, spare pages — is NaN: a kernel that reads one shows it.
    Returns (q, k_cache, v_cache, table, k_new, v_new, seqlens)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    capacity = max(lengths) + seqlen_new + 3
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    q = rand(batch, seqlen_q, heads, head_dim)
    k_new, v_new = (rand(batch, seqlen_new, kv_heads, head_dim) for _ in "kv") if seqlen_new else (None, None)
    k_cache, v_cache = (rand(batch, capacity, kv_heads, head_dim) for _ in "kv")
    for cache in (k_cache, v_cache):
        for b, length in enumerate(lengths):
            cache[b, length:] = float("nan")
    table = None
    if page is not None:  # the same keys, cut into pages placed in a random order among spare NaN pages
        per_entry = -(-capacity // page)
        pages = batch * per_entry + 3
        order = torch.randperm(pages, generator=gen)[: batch * per_entry]
        table = order.view(batch, per_entry).to(torch.int32)
        paged = []
        for cache in (k_cache, v_cache):
            padded = torch.full((batch, per_entry * page, kv_heads, head_dim), float("nan"), dtype=dtype)
            padded[:, :capacity] = cache
            store = torch.full((pages, page, kv_heads, head_dim), float("nan"), dtype=dtype)
            store[order] = padded.view(batch * per_entry, page, kv_heads, head_dim)
            paged.append(store)
        k_cache, v_cache = paged
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    moved = [t if t is None else t.to(device) for t in (q, k_cache, v_cache, table, k_new, v_new, seqlens)]
    return tuple(moved)


def _check_case(lengths, *, splits=1, causal=False, window=(-1, -1), device="cpu", **case):
    """One call against the reference: output, logsumexp and, with an append, the caches after it."""
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _make_case(lengths, device=device, **case)
    before = (k_cache.clone(), v_cache.clone())
    scale = q.shape[-1] ** -0.5
    out, lse = fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                               block_table=table, causal=causal, window_size=window,
                                               num_splits=splits, return_softmax_lse=True)  # fmt: skip
    cpu = [t if t is None else t.cpu() for t in (q, *before, table, k_new, v_new)]
    ref_out, ref_lse = _reference(*cpu[:3], lengths, cpu[3], scale, causal, window, *cpu[4:])
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, q.dtype)
    assert_close(lse, ref_lse, torch.float16, "softmax_lse")
    if k_new is not None:
        _check_appended(before, (k_cache, v_cache), (k_new, v_new), lengths, table)
    return out, lse


def _check_appended(before, after, new, lengths, table):
    """The caches after an append: entry b's new keys at positions lengths[b] … (through its table), every other row
    untouched (NaN where it was)."""
    for old, now, added in zip(before, after, new, strict=True):
        expected = old.cpu().clone()  # the expected caches are built on the host, whatever the device
        for b, length in enumerate(lengths):
            j = torch.arange(length, length + added.shape[1])
            rows = (b, j) if table is None else (table[b, j // old.shape[1]].long(), j % old.shape[1])
            expected[rows] = added[b].cpu()
        assert torch.equal(now.cpu().nan_to_num(7.0), expected.nan_to_num(7.0))


# ---- results --------------------------------------------------------------------------------------------------

RAGGED = [1, 2, 15, 17, 90]  # one key, two, a page of 16 less one and plus one, several steps


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_every_split_count_matches_the_reference_over_ragged_lengths(page, splits, device):
    # GQA 8 query heads over 2 K/V heads; 16 splits is more than any entry's chunks of 32 keys (the interpreter's
    # steps), so most splits see no key and must weigh nothing in the merge
    _check_case(RAGGED, page=page, splits=splits, device=device)


def test_many_splits_merge_in_blocks_at_a_wide_head_dim(device):
    # d=256 with 40 splits: the merge loads a row's partials 16 splits at a time (decode_plan.merge_blocks), so
    # its last block is part outside the splits and one wholly outside; chunks of 32 keys put keys in most splits
    _check_case([200, 700], head_dim=256, heads=4, kv_heads=2, splits=40, device=device)


@pytest.mark.parametrize("page, lengths, dtype", [(64, [63, 65, 130], torch.bfloat16),
                                                 (48, [47, 49, 100], torch.float16)], ids=["page64", "page48"])
def test_shuffled_pages_of_other_sizes(page, lengths, dtype, device):
    # 64: a step of 32 keys inside one page (one table read a step); 48: steps across pages (a table read a key)
    _check_case(lengths, page=page, splits=2, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "case",
    [
        dict(lengths=[5, 40], seqlen_q=4, seqlen_new=4, heads=4, kv_heads=1, page=16, splits=2),  # MQA, append
        dict(lengths=[3, 70], seqlen_q=16, heads=8, kv_heads=1, splits=3, dtype=torch.bfloat16),  # 128 rows: 2 tiles
        dict(lengths=[0, 33], seqlen_q=16, seqlen_new=16, heads=2, kv_heads=2, page=16, splits=2),  # MHA, append
    ],
    ids=["q4-mqa-append-paged", "q16-two-row-tiles-bf16", "q16-append-mha-paged"],
)
def test_causal_query_tokens_are_aligned_bottom_right(case, device):
    _check_case(causal=True, device=device, **case)


def test_non_causal_query_tokens_see_every_key(device):
    _check_case([9, 50], seqlen_q=4, seqlen_new=4, heads=4, kv_heads=2, page=16, splits=3, device=device)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_append_one_token_then_attend(page, device):
    # lengths 0 (an empty entry that sees only its new key), page-1 (the new key opens a page) and page
    _check_case([0, 15, 16], seqlen_new=1, page=page, splits=2, device=device)


def test_empty_entries_give_zero_and_minus_infinity(device):
    out, lse = _check_case([0, 5, 0], page=16, splits=3, device=device)
    assert torch.equal(out[[0, 2]].cpu(), torch.zeros_like(out[[0, 2]].cpu()))
    assert torch.isneginf(lse[[0, 2]]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("head_dim, page, dtype", [(80, 16, torch.bfloat16), (96, None, torch.float32)])
def test_head_dims_that_are_not_powers_of_two(head_dim, page, dtype, device):
    _check_case([20, 41], head_dim=head_dim, page=page, splits=2, dtype=dtype, device=device)


@pytest.mark.parametrize("causal, window", [(True, (8, -1)), (False, (5, 2))])
def test_window_size_is_flash_attns(causal, window, device):
    _check_case([30, 70], seqlen_q=4, seqlen_new=2, heads=4, kv_heads=2, page=16, splits=3, causal=causal,
                window=window, device=device)  # fmt: skip


def test_cache_seqlens_as_one_int_or_none(device):
    q, k_cache, v_cache, table, *_ = _make_case([40, 40, 40], page=16, device=device)
    scale = q.shape[-1] ** -0.5
    ref = _reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), [40] * 3, table.cpu(), scale)[0]
    assert_close(fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=40, block_table=table), ref,
                 q.dtype)  # fmt: skip
    # None: every entry holds the whole cache (cut here to the 43 rows that hold keys; NaN rows follow them)
    q, k_cache, v_cache, *_ = _make_case([43, 43], device=device)
    full = 43
    k_cache, v_cache = k_cache[:, :full], v_cache[:, :full]
    ref = _reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), [full] * 2, None, scale)[0]
    assert_close(fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache), ref, q.dtype)


def test_the_split_rule_fills_the_gpu_and_runs_when_num_splits_is_0(monkeypatch, device):
    split = functools.partial(decode_plan.num_splits, config=DecodeConfig())  # 2 programs an SM, 512 keys a split
    assert split(batch=32, kv_heads=8, tiles=1, max_keys=8192, sm_count=132) == 1  # 256 programs fill 132 SMs
    assert split(batch=8, kv_heads=8, tiles=1, max_keys=32768, sm_count=132) == 5  # 64 programs → 320
    assert split(batch=1, kv_heads=8, tiles=1, max_keys=131072, sm_count=132) == 33
    assert split(batch=1, kv_heads=8, tiles=1, max_keys=1024, sm_count=132) == 2  # chunks of 512 keys at least
    assert split(batch=1, kv_heads=1, tiles=1, max_keys=10**7, sm_count=132) == decode_plan.MAX_SPLITS
    # num_splits=0 runs the rule for the device: an H200's 132 SMs split this call's 2 programs
    chosen = []
    real = decode_plan.num_splits
    monkeypatch.setattr(decode_launch, "device_info", lambda _: known_gpu("h200"))
    monkeypatch.setattr(decode_plan, "num_splits", lambda **kw: chosen.append(real(**kw)) or chosen[-1])
    _check_case([600, 1100], heads=4, kv_heads=1, page=64, splits=0, device=device)
    assert chosen == [2]  # capacity 1103 keys: two chunks of at least 512


def test_the_split_rule_takes_its_two_parameters_from_the_config():
    shape = dict(batch=8, kv_heads=8, tiles=1, max_keys=32768, sm_count=132)  # 64 programs on 132 SMs
    split = lambda **fields: decode_plan.num_splits(**shape, config=DecodeConfig(**fields))
    assert [split(programs_per_sm=n) for n in (1, 2, 4, 8)] == [3, 5, 9, 17]  # ⌈n · 132 / 64⌉
    # a floor of keys a split reads caps the count: 32768 keys / 4096 = 8 splits at most
    assert split(programs_per_sm=8, min_split_keys=4096) == 8 and split(programs_per_sm=2, min_split_keys=4096) == 5
    # what the launcher works out for a call: (block_m, tiles, splits), from the same rule
    config = DecodeConfig(programs_per_sm=4, min_split_keys=1024)
    assert decode_plan.launch_shape(config, batch=1, seqlen_q=4, heads_q=32, kv_heads=8, capacity=131072,
                                    sm_count=132) == (16, 1, 66)  # fmt: skip
    assert decode_plan.launch_shape(config, batch=1, seqlen_q=4, heads_q=32, kv_heads=8, capacity=8192,
                                    sm_count=132) == (16, 1, 8)  # fmt: skip


def test_a_call_reads_no_tensor_back_to_the_host(monkeypatch, device):
    # No .item() or .tolist() (a sync each): the lengths and pages stay on the device, so a call can be captured in
    # a CUDA graph
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _make_case([7, 30], seqlen_new=1, page=16, device=device)

    def refuse(*_):
        raise AssertionError("a host read")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                    num_splits=2)  # fmt: skip


def test_a_one_token_dims_odd_stride_narrows_no_unit(monkeypatch, device):
    # A one-token q and new keys sliced out of wider buffers with odd strides on their token dim: that dim is
    # indexed at 0 only, so the launchers settle its stride and every tensor keeps 16-byte vectors (UNIT 8).
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _make_case([7, 30], seqlen_new=1, heads=4, page=16,
                                                                   device=device)  # fmt: skip
    q, k_new, v_new = (t.as_strided(t.shape, (t.stride(0), odd, *t.stride()[2:]))
                       for t, odd in ((q, 3), (k_new, 5), (v_new, 7)))  # fmt: skip
    before = (k_cache.clone(), v_cache.clone())
    units = {}
    launcher = decode_launch.fastlaunch.Launcher

    def recording(kernel, grid, scalars, kwargs):
        units.update({name: value for name, value in kwargs.items() if name.startswith("UNIT_")})
        return launcher(kernel, grid, scalars, kwargs)

    monkeypatch.setattr(decode_launch.fastlaunch, "Launcher", recording)
    out, lse = fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                               block_table=table, return_softmax_lse=True)  # fmt: skip
    assert {units[name] for name in ("UNIT_Q", "UNIT_KN", "UNIT_VN", "UNIT_K", "UNIT_V")} == {8}
    cpu = [t.cpu() for t in (q, *before, table, k_new, v_new)]
    ref_out, ref_lse = _reference(*cpu[:3], [7, 30], cpu[3], q.shape[-1] ** -0.5, False, (-1, -1), *cpu[4:])
    assert_close(out, ref_out, q.dtype)
    assert_close(lse, ref_lse, torch.float16, "softmax_lse")
    _check_appended(before, (k_cache, v_cache), (k_new, v_new), [7, 30], table)


def test_torch_compile_runs_the_op_and_appends(device):
    # aot_eager: the custom op traced into a graph that declares its writes to the caches (no C compiler needed)
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _make_case([7, 30], seqlen_new=1, page=16, device=device)
    eager = (k_cache.clone(), v_cache.clone())
    expected = fa2tune.flash_attn_with_kvcache(q, *eager, k_new, v_new, cache_seqlens=seqlens, block_table=table)
    step = torch.compile(fa2tune.flash_attn_with_kvcache, backend="aot_eager", fullgraph=True)
    out = step(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(out, expected)
    assert torch.equal(k_cache.nan_to_num(7.0), eager[0].nan_to_num(7.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_decode_steps_replay_in_a_cuda_graph():
    # Captured once, replayed with new lengths, queries and keys written into the captured tensors: each replay
    # appends at the new lengths and attends over them, as an eager call would
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _make_case([7, 30], seqlen_new=1, page=16, device="cuda")
    call = dict(cache_seqlens=seqlens, block_table=table, num_splits=2, return_softmax_lse=True)
    fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **call)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **call)
    for step in range(2):
        seqlens += 1
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        before = (k_cache.clone(), v_cache.clone())
        graph.replay()
        lengths = seqlens.tolist()
        cpu = [t.cpu() for t in (q, *before, table, k_new, v_new)]
        ref_out, ref_lse = _reference(*cpu[:3], lengths, cpu[3], q.shape[-1] ** -0.5, False, (-1, -1), *cpu[4:])
        assert_close(out, ref_out, q.dtype, f"replay {step}")
        assert_close(lse, ref_lse, torch.float16, f"replay {step} softmax_lse")
        _check_appended(before, (k_cache, v_cache), (k_new, v_new), lengths, cpu[3])


# ---- what it refuses, and lengths or pages outside the cache -------------------------------------------------------


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(rotary_cos=torch.ones(1)), NotImplementedError, "rotary_cos"),
        (dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), NotImplementedError, "cache_batch_idx"),
        (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
        (dict(softcap=30.0), NotImplementedError, "softcap"),
        (dict(k_cache="half"), TypeError, "k_cache must be a torch.Tensor"),
        (dict(v_cache=torch.float32), TypeError, "v_cache must have q's dtype"),
        (dict(q=torch.float64), TypeError, "q must be float16, bfloat16 or float32"),
        (dict(k_cache=(2, 19, 3, 64), v_cache=(2, 19, 3, 64)), ValueError, "multiple of k_cache's heads"),
        (dict(k_cache=(2, 19, 0, 64), v_cache=(2, 19, 0, 64), k=(2, 3, 0, 64), v=(2, 3, 0, 64)), ValueError,
         "k_cache and v_cache must have at least one head (dim 2)"),
        (dict(k_cache=(2, 19, 2, 32)), ValueError, "k_cache and v_cache must have one shape"),
        (dict(q=(2, 1, 4, 300)), ValueError, "head_dim must be in 1..256"),
        (dict(k_cache=(1, 19, 2, 64), v_cache=(1, 19, 2, 64)), ValueError, "a row (dim 0) for each of q's 2"),
        (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_seqlens must be an int or a torch"),
        (dict(cache_seqlens=17), ValueError, "cache_seqlens must be an int in 0..16"),  # + 3 new keys > 19
        (dict(cache_seqlens=None), ValueError, "cache_seqlens must be given with k and v"),
        (dict(k=None), ValueError, "k and v (new keys and values to append) must be passed together"),
        (dict(k=(2, 3, 2, 48)), ValueError, "k must be (batch, seqlen_new, kv_heads, head_dim)"),
        (dict(block_table=torch.zeros(2, 2)), TypeError, "block_table must be a 2-D torch.int32"),
        (dict(num_splits=-1), ValueError, "num_splits must be an int in 0..128"),
        (dict(num_splits=1.5), TypeError, "num_splits must be an int"),
        (dict(window_size=[-2, 0]), ValueError, "window_size sides must be >= -1"),
    ],
)
def test_bad_arguments_are_named(change, error, words, device):
    gen = torch.Generator().manual_seed(0)
    shapes = dict(q=(2, 1, 4, 64), k_cache=(2, 19, 2, 64), v_cache=(2, 19, 2, 64), k=(2, 3, 2, 64), v=(2, 3, 2, 64))
    args = {name: torch.randn(shape, generator=gen).half().to(device) for name, shape in shapes.items()}
    args["cache_seqlens"] = torch.tensor([4, 9], dtype=torch.int32, device=device)
    for name, value in change.items():
        if isinstance(value, torch.dtype):
            value = args[name].to(value)
        elif isinstance(value, tuple):
            value = torch.randn(value, generator=gen).half().to(device)
        elif isinstance(value, torch.Tensor):
            value = value.to(device)
        args[name] = value
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        fa2tune.flash_attn_with_kvcache(**args)


def test_a_call_without_heads_is_empty(device):
    # no query heads and no cache heads: an empty output and logsumexp, as attention()'s and SDPA's
    k_cache, v_cache = (torch.randn(2, 19, 0, 16, device=device) for _ in range(2))
    q, k, v = (torch.randn(2, 1, 0, 16, device=device) for _ in range(3))
    out, lse = fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, return_softmax_lse=True)
    assert out.shape == (2, 1, 0, 16) and lse.shape == (2, 0, 1)


def _append_args(device, batch=2, kv_heads=2):
    gen = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device)
    return dict(q=rand(batch, 1, 4, 16), k=rand(batch, 1, kv_heads, 16), v=rand(batch, 1, kv_heads, 16),
                cache_seqlens=torch.tensor([3, 5][:batch], dtype=torch.int32, device=device)), rand  # fmt: skip


@pytest.mark.parametrize("alias", ["batch expanded", "heads expanded", "k_cache is v_cache", "overlapping slices",
                                   "overlapping permuted", "heads overlapping, neither dense", "folded onto itself"])
def test_an_append_into_caches_that_share_memory_is_refused(alias, device):
    # entries or heads of an expanded cache would overwrite each other's new keys; one tensor as both caches would
    # get the new values over the new keys
    args, rand = _append_args(device)
    one = rand(1, 12, 2, 16)
    caches = {
        "batch expanded": lambda: (one.expand(2, 12, 2, 16), rand(2, 12, 2, 16)),
        "heads expanded": lambda: (rand(2, 12, 1, 16).expand(2, 12, 2, 16), rand(2, 12, 2, 16)),
        "k_cache is v_cache": lambda: (one.expand(2, 12, 2, 16).contiguous(),) * 2,
        "overlapping slices": lambda: (lambda buf: (buf[:2], buf[1:]))(rand(3, 12, 2, 16)),
        "overlapping permuted": lambda: (lambda buf: (buf[:2], buf[1:]))(rand(3, 2, 12, 16).transpose(1, 2)),
        # heads 0-1 and 1-2 of one (…, 3, head_dim) buffer: strided views whose byte ranges interleave
        "heads overlapping, neither dense": lambda: (lambda buf: (buf[:, :, 0:2], buf[:, :, 1:3]))(rand(2, 12, 3, 16)),
        # heads one head_dim apart and rows one head apart: row r's head 1 is row r + 1's head 0
        "folded onto itself": lambda: (rand(416).as_strided((2, 12, 2, 16), (208, 16, 16, 1)), rand(2, 12, 2, 16)),
    }[alias]()
    before = [c.clone() for c in caches]
    words = {"batch expanded": "elements share memory .stride 0 in dim", "heads expanded": "elements share memory "
             ".stride 0 in dim", "folded onto itself": "reaches one element by two indices"}.get(alias, "share memory")
    with pytest.raises(ValueError, match=words):
        fa2tune.flash_attn_with_kvcache(k_cache=caches[0], v_cache=caches[1], **args)
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))  # refused before any write


@pytest.mark.parametrize("past", ["query rows", "new keys"])
def test_a_call_past_a_grid_axis_is_refused_by_name(past, device):
    # the row tiles (group · seqlen_q / 64) and the append's row blocks (seqlen_new / 16) are CUDA grid axes, which
    # stop at 65535: such a call would fail to launch
    from fa2tune.api import selection
    from fa2tune.launch.decode import APPEND_ROWS
    from fa2tune.launch.grid import GRID_AXIS_MAX

    group, width = 8, 8
    rows_a_tile = selection.decode_config(torch.device(device), width, torch.float16).max_block_m  # the call's config
    new = GRID_AXIS_MAX * APPEND_ROWS + 1 if past == "new keys" else 1
    tokens = GRID_AXIS_MAX * rows_a_tile // group + 1 if past == "query rows" else 1
    q = torch.randn(1, tokens, group, width, dtype=torch.float16, device=device)
    k_cache, v_cache = (torch.zeros(1, new + 4, 1, width, dtype=torch.float16, device=device) for _ in range(2))
    k, v = (torch.randn(1, new, 1, width, dtype=torch.float16, device=device) for _ in range(2))
    lengths = torch.tensor([3], dtype=torch.int32, device=device)
    words = "packed rows, more than the decode kernel" if past == "query rows" else "more than one append takes"
    with pytest.raises(ValueError, match=words):
        fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    assert not k_cache.any()  # refused before any write


def test_the_caches_overlap_check_is_exact_on_random_views_of_one_storage():
    # the search against the elements each view reaches, counted one by one: two views share one, or one view reaches
    # an element by two indices, exactly where the check says so
    from fa2tune.config.kvcache_inputs import _folds_onto_itself, _overlap

    gen = torch.Generator().manual_seed(11)
    pick = lambda top: int(torch.randint(top, (), generator=gen))
    base, index = torch.zeros(1200), torch.arange(1200, dtype=torch.float64)
    reached = lambda t: index.as_strided(t.shape, t.stride(), t.storage_offset()).flatten().tolist()

    def view():
        dims = 1 + pick(4)
        strides = (0, 1, 2, 3, 5, 8, 16, 24, 64)
        return base.as_strided([1 + pick(6) for _ in range(dims)], [strides[pick(len(strides))] for _ in range(dims)],
                               pick(80))  # fmt: skip

    for _ in range(600):
        a, b = view(), view()
        assert _overlap(a, b) == bool(set(reached(a)) & set(reached(b))), (a.shape, a.stride(), b.shape, b.stride())
        if 0 not in [stride for stride, n in zip(a.stride(), a.shape, strict=True) if n > 1]:
            assert _folds_onto_itself(a) == (len(set(reached(a))) < a.numel()), (a.shape, a.stride())
    wide = torch.zeros(4, 8192, 16, 128)  # a model's cache: halves of the heads and of head_dim share nothing
    assert not _overlap(wide[:, :, :8], wide[:, :, 8:]) and not _overlap(wide[..., :64], wide[..., 64:])
    assert _overlap(wide[:, :, :9], wide[:, :, 8:]) and _overlap(wide[..., :65], wide[..., 64:])


def test_caches_whose_sharing_the_search_cannot_rule_out_are_refused_saying_so(device, monkeypatch):
    # past the search's budget the check does not know: the append refuses rather than write into memory that may be
    # shared, and says that it could not tell
    from fa2tune.config import kvcache_inputs

    monkeypatch.setattr(kvcache_inputs, "_SEARCH_NODES", 50)
    # 6x + 10y = 7919 with 0 <= x, y <= 2000 has no solution (the left side is even), and coefficients that do not
    # nest leave hundreds of values of y to try before the search can say so
    assert kvcache_inputs._reachable([(6, 0, 2000), (10, 0, 2000)], 7919, nonzero=False) is None
    monkeypatch.setattr(kvcache_inputs, "_SEARCH_NODES", 100_000)
    assert kvcache_inputs._reachable([(6, 0, 2000), (10, 0, 2000)], 7919, nonzero=False) is False
    args, rand = _append_args(device)
    monkeypatch.setattr(kvcache_inputs, "_overlap", lambda a, b: None)
    with pytest.raises(ValueError, match=r"may share memory \(too many index combinations to rule it out\)"):
        fa2tune.flash_attn_with_kvcache(k_cache=rand(2, 12, 2, 16), v_cache=rand(2, 12, 2, 16), **args)


def test_caches_of_two_storage_objects_over_one_buffer_are_checked_by_address(device):
    # a DLPack (CuPy, JAX) view of a tensor is another storage object over the same memory
    from fa2tune.config.kvcache_inputs import _overlap

    buffer = torch.randn(3, 12, 2, 16, device=device)
    other = torch.utils.dlpack.from_dlpack(buffer[1:])
    assert other.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert _overlap(buffer[:2], other) and not _overlap(buffer[:1], other)


def test_an_append_under_a_dispatch_mode_checks_the_caches_memory_too(device):
    # outside plain eager calls the append runs through the custom op, which checks the caches' memory itself
    from torch.utils.flop_counter import FlopCounterMode

    args, rand = _append_args(device)
    shared = rand(1, 12, 2, 16).expand(2, 12, 2, 16)
    with FlopCounterMode(display=False), pytest.raises(ValueError, match="k_cache is written in place"):
        fa2tune.flash_attn_with_kvcache(k_cache=shared, v_cache=rand(2, 12, 2, 16), **args)


def test_k_and_v_interleaved_in_one_buffer_share_no_element_and_append(device):
    # one (batch, capacity, 2, kv_heads, head_dim) buffer, K and V its two halves of dim 2: strided views of one
    # storage whose elements are distinct, as PyTorch's overlap rule sees them
    args, rand = _append_args(device)
    buffer = rand(2, 12, 2, 2, 16)
    want = fa2tune.flash_attn_with_kvcache(k_cache=buffer[:, :, 0].clone(), v_cache=buffer[:, :, 1].clone(), **args)
    got = fa2tune.flash_attn_with_kvcache(k_cache=buffer[:, :, 0], v_cache=buffer[:, :, 1], **args)
    assert torch.equal(got, want)
    assert torch.equal(buffer[0, 3, 0], args["k"][0, 0]) and torch.equal(buffer[1, 5, 1], args["v"][1, 0])


def test_an_append_bumps_the_caches_versions_so_a_backward_that_saved_them_fails(device):
    # the append writes in place: a backward that saved the cache's old values must not give a gradient of the new
    args, rand = _append_args(device)
    x = rand(2, 12, 2, 16).requires_grad_()
    k_cache = x * 2
    loss = (k_cache**2).sum()  # saves k_cache
    v_cache = rand(2, 12, 2, 16)
    versions = (k_cache._version, v_cache._version)
    fa2tune.flash_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, **args)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_an_append_is_refused_where_pytorch_refuses_an_in_place_write(device):
    args, rand = _append_args(device)
    leaf, v_cache = rand(2, 12, 2, 16).requires_grad_(), rand(2, 12, 2, 16)
    with pytest.raises(RuntimeError, match="k_cache is a leaf tensor that requires grad"):
        fa2tune.flash_attn_with_kvcache(k_cache=leaf, v_cache=v_cache, **args)
    with pytest.raises(RuntimeError, match=r"k_cache is a leaf tensor that requires grad \(or a view of one\)"):
        fa2tune.flash_attn_with_kvcache(k_cache=leaf[:, :11], v_cache=v_cache[:, :11], **args)
    with torch.no_grad():  # as an optimizer's update is allowed
        fa2tune.flash_attn_with_kvcache(k_cache=leaf, v_cache=v_cache, **args)
    assert torch.equal(leaf[0, 3].detach(), args["k"][0, 0])
    with torch.inference_mode():
        k_inf, v_inf = rand(2, 12, 2, 16), rand(2, 12, 2, 16)
        fa2tune.flash_attn_with_kvcache(k_cache=k_inf, v_cache=v_inf, **args)  # inside inference mode: allowed
    with pytest.raises(RuntimeError, match="v_cache is an inference tensor"):
        fa2tune.flash_attn_with_kvcache(k_cache=rand(2, 12, 2, 16), v_cache=v_inf, **args)
    # without new keys nothing is written, and nothing is refused
    fa2tune.flash_attn_with_kvcache(args["q"], leaf, v_inf, cache_seqlens=args["cache_seqlens"])


def _bad_values_case(device):
    """A paged cache whose table points past its pages (−1, pages + 5) and whose lengths pass its capacity (−3,
    capacity + 10), inside a larger NaN buffer: a read outside the cache shows up as NaN."""
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _make_case([10, 20, 30], seqlen_new=1, page=16, device=device)
    pages, capacity = k_cache.shape[0], table.shape[1] * 16
    caches = []
    for cache in (k_cache, v_cache):
        buffer = torch.full((pages + 4, *cache.shape[1:]), float("nan"), dtype=cache.dtype, device=device)
        buffer[2 : 2 + pages] = cache
        caches.append(buffer[2 : 2 + pages])
    table = table.clone()
    table[0, 0], table[1, 1] = -1, pages + 5
    seqlens = torch.tensor([-3, capacity + 10, 30], dtype=torch.int32, device=device)
    return q, *caches, table, k_new, v_new, seqlens


def test_lengths_and_pages_outside_the_cache_are_clamped_never_read_past_it(device):
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _bad_values_case(device)
    before = (k_cache.clone(), v_cache.clone())
    out, lse = fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                               block_table=table, num_splits=2, return_softmax_lse=True)  # fmt: skip
    # the kernels' clamped meaning: lengths in 0 … capacity − 1 (one key is appended), pages in 0 … pages − 1
    capacity, pages = table.shape[1] * 16, k_cache.shape[0]
    lengths = seqlens.clamp(0, capacity - 1).tolist()
    clamped = table.clamp(0, pages - 1).cpu()
    _check_appended(before, (k_cache, v_cache), (k_new, v_new), lengths, clamped)
    ref_out, ref_lse = _reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), [n + 1 for n in lengths], clamped,
                                  q.shape[-1] ** -0.5)  # fmt: skip
    # entry 1 holds its whole table, NaN pages included: only entry 0 (clamped to no cached key) and 2 are finite
    assert_close(out[[0, 2]], ref_out[[0, 2]], q.dtype)
    assert_close(lse[[0, 2]], ref_lse[[0, 2]], torch.float16, "softmax_lse")


def test_check_kvcache_names_lengths_and_pages_outside_the_cache(monkeypatch, device):
    q, k_cache, v_cache, table, k_new, v_new, seqlens = _bad_values_case(device)
    call = dict(k=k_new, v=v_new, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -3 is outside 0\.\.47"):
        fa2tune.check_kvcache(q, k_cache, v_cache, **call)
    call["cache_seqlens"] = torch.tensor([3, 20, 30], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = -1 points outside the cache's"):
        fa2tune.check_kvcache(q, k_cache, v_cache, **call)
    table[0, 0] = 0
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = \d+ points outside"):
        fa2tune.check_kvcache(q, k_cache, v_cache, **call)
    table[1, 1] = 1
    table[2, 2] = -7  # entry 2's 31 keys use its first two pages: the third is never read, so not checked
    fa2tune.check_kvcache(q, k_cache, v_cache, **call)
    # FA2TUNE_CHECK_KVCACHE=1: every call checks
    monkeypatch.setenv("FA2TUNE_CHECK_KVCACHE", "1")
    call["cache_seqlens"] = torch.tensor([3, 20, 60], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 60"):
        fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, **call)


def test_decode_kernels_compile_for_sm90_within_the_shared_memory_model():
    # Triton compiles for a GPU that is not here (it ships ptxas): the three kernels, paged with a page a step (64)
    # and a table read a key (16) and not, at d=128 bf16 and d=80 fp16, as a GPU launch would build them. The paged
    # attention holds as many K/V stages in shared memory as the contiguous one: its table reads run a step ahead,
    # so the pipeliner keeps num_stages - 1 steps of K/V in flight for both. No compile takes more shared memory
    # than decode_plan.sram_bytes says (what default_config fits to a device), at 16 packed rows and at 64.
    script = (
        "import json, sys, torch; from fa2tune.tune import probe; from fa2tune.config.decode_plan import DecodeConfig\n"
        "dtypes = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}\n"
        "reports = [probe.compile_decode(k, DecodeConfig(**c), d, dtypes[t], paged=p, page_size=s, block_m=m)\n"
        "           for k, d, t, p, s, c, m in json.loads(sys.argv[1])]\n"
        "print(json.dumps([[r.error, r.shared_bytes] for r in reports]))"
    )
    default = dict(block_n=64, num_stages=3)
    rows = [(kernel, 128, "bf16", paged, size, default, 16) for kernel in ("_decode_fwd", "_decode_merge", "_append_kv")
            for paged, size in ((False, 0), (True, 16), (True, 64))]  # fmt: skip
    rows += [("_decode_fwd", 80, "fp16", True, 16, default, 16), ("_decode_fwd", 256, "bf16", True, 64, default, 64),
             ("_decode_fwd", 256, "fp32", False, 0, dict(block_n=32, num_stages=2), 64)]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script, json.dumps(rows)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=str(codegen.templates_dir().parent))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout.splitlines()[-1])
    assert [error for error, _ in reports] == [None] * len(rows)
    attention = [(row, shared) for row, (_, shared) in zip(rows, reports, strict=True) if row[0] == "_decode_fwd"]
    assert attention[0][1] >= 2 * 2 * 64 * 128 * 2  # two steps of K and V tiles in flight, bf16, d=128
    assert [shared for _, shared in attention[:3]] == [attention[0][1]] * 3  # contiguous, paged 16, paged 64
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for (_, head_dim, dtype, _, _, fields, block_m), shared in attention:
        config = DecodeConfig(**fields, max_block_m=block_m)
        assert shared <= decode_plan.sram_bytes(config, head_dim, dtypes[dtype]), (fields, head_dim, dtype, block_m)


def test_default_configs_fit_the_device():
    h200, a10g = known_gpu("h200"), known_gpu("a10g")
    assert decode_plan.default_config(h200, 128, torch.bfloat16) == decode_plan.DEFAULT_CONFIG
    for device, head_dim, dtype in ((h200, 256, torch.bfloat16), (a10g, 256, torch.float32),
                                    (a10g, 128, torch.float16)):  # fmt: skip
        config = decode_plan.default_config(device, head_dim, dtype)
        assert decode_plan.sram_bytes(config, head_dim, dtype) <= device.smem_per_block, (device.name, head_dim)
    assert decode_plan.default_config(a10g, 256, torch.float32) != decode_plan.DEFAULT_CONFIG
    assert decode_plan.check(decode_plan.DEFAULT_CONFIG, a10g, 256, torch.float32) is not None  # says why not


@pytest.mark.parametrize(
    "fields, error, words",
    [
        (dict(block_n=48), ValueError, "DecodeConfig.block_n must be one of (16, 32, 64, 128, 256), got 48"),
        (dict(max_block_m=8), ValueError, "DecodeConfig.max_block_m must be one of"),
        (dict(num_stages=0), ValueError, "DecodeConfig.num_stages must be in 1..8, got 0"),
        (dict(programs_per_sm=0), ValueError, "DecodeConfig.programs_per_sm must be in 1..32, got 0"),
        (dict(programs_per_sm=33), ValueError, "DecodeConfig.programs_per_sm must be in 1..32, got 33"),
        (dict(min_split_keys=0), ValueError, "DecodeConfig.min_split_keys must be in 1..1073741824, got 0"),
        (dict(min_split_keys=512.0), TypeError, "DecodeConfig.min_split_keys must be an int, got float 512.0"),
        (dict(num_warps=True), TypeError, "DecodeConfig.num_warps must be an int, got bool True"),
    ],
)
def test_decode_config_fields_are_checked(fields, error, words):
    with pytest.raises(error) as exc:
        DecodeConfig(**fields)
    assert words in str(exc.value)


def test_decode_config_round_trips_through_its_mapping():
    config = DecodeConfig(block_n=128, num_warps=8, num_stages=4, max_block_m=16, programs_per_sm=4,
                          min_split_keys=np.int64(1024))  # fmt: skip
    assert type(config.min_split_keys) is int  # a NumPy integer is taken as a Python int
    assert DecodeConfig.from_dict(config.to_dict()) == config and config.label() == "n128 w8 s4 m16 4/SM 1024/split"
    assert DecodeConfig.from_dict({"block_n": 32}) == DecodeConfig(block_n=32)  # the rest at their defaults
    with pytest.raises(ValueError, match="unknown DecodeConfig keys \\['splits'\\]"):
        DecodeConfig.from_dict({"splits": 4})


# ---- the tuned config a call runs ------------------------------------------------------------------------------

_TUNED = DecodeConfig(block_n=16, num_warps=4, num_stages=1, max_block_m=16, programs_per_sm=1, min_split_keys=64)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """An empty FA2TUNE_CONFIG_DIR and user cache, no shipped file (on a GPU the shipped one holds entries for the
    device); a warning the store gave before is given again."""
    from fa2tune.config import store

    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "env"))
    (tmp_path / "env").mkdir(exist_ok=True)  # a missing $FA2TUNE_CONFIG_DIR is warned of
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(store, "shipped_config_dir", lambda: tmp_path / "shipped")
    monkeypatch.setattr(store, "_warned", set())
    return tmp_path / "env"


def _store_decode_entry(directory, device, config=_TUNED, template_hash=None, head_dim=64):
    from fa2tune.config import store

    device_info = selection.device_info  # what the lookup reads (a test may patch it)
    entry = store.Entry(
        key=store.EntryKey(head_dim=head_dim, dtype="fp16", causal=False, kernel="decode"), config=config, ms=0.1,
        tflops=None, baseline=None, trials=1, spread=None, triton_version="3.6.0", torch_version="2.13.0",
        template_hash=template_hash or codegen.decode_code_hash(), date="2026-11-29",
    )  # fmt: skip
    path = directory / f"{device_info(device).slug}.yaml"
    store.write_entries(path, {"slug": device_info(device).slug}, [entry])
    return path


def _configs_run(monkeypatch) -> list:
    """The configs the decode calls made from now on work their plans out with."""
    seen, real = [], decode_launch._plan
    monkeypatch.setattr(decode_launch, "_plan", lambda *args: seen.append(args[-1]) or real(*args))
    return seen


def test_a_call_runs_the_stored_decode_entry_and_an_explicit_config_before_it(config_dir, monkeypatch, device):
    path = _store_decode_entry(config_dir, device)
    assert selection.decode_config(device, 64, torch.float16) == _TUNED
    assert selection.resolve_decode(torch.device(device), 64, torch.float16) == (_TUNED, str(path))
    # other head dims and dtypes have no entry: the default
    default = decode_plan.default_config(decode_launch.device_info(device), 80, torch.float16)
    assert selection.resolve_decode(torch.device(device), 80, torch.float16) == (default, "planner-default")
    # bf16 has no entry of its own: it reads fp16's (the same bytes and rate), and says so in the source; fp32 not
    assert selection.resolve_decode(torch.device(device), 64, torch.bfloat16) == (_TUNED, f"{path} (fp16 entry)")
    assert selection.resolve_decode(torch.device(device), 64, torch.float32)[1] == "planner-default"
    seen = _configs_run(monkeypatch)
    _check_case([20, 41], device=device)  # head_dim 64, fp16: the entry's key
    q, k_cache, v_cache, *_ = _make_case([5], device=device)
    decode_launch.decode(q, decode_launch.KVCache(k_cache, v_cache, None, None, 5), scale=0.1, window=(99, 99),
                         config=decode_plan.INTERPRETER_CONFIG)  # fmt: skip
    assert seen == [_TUNED, decode_plan.INTERPRETER_CONFIG]


@pytest.mark.parametrize("unusable", ["stale", "too-large-for-the-device", "unknown-field"])
def test_an_unusable_decode_entry_falls_back_to_the_default_with_one_warning(config_dir, monkeypatch, unusable,
                                                                               device):  # fmt: skip
    if unusable == "too-large-for-the-device":  # the interpreter's pseudo-device fits any config; an H200 does not
        for module in (decode_launch, selection):  # the launcher's split rule and the config's lookup
            monkeypatch.setattr(module, "device_info", lambda _: known_gpu("h200"))
        _store_decode_entry(config_dir, device, config=DecodeConfig(max_block_m=128, block_n=256, num_stages=8))
        warning = "tuned decode config n256 w4 s8 m128 2/SM 512/split in .* does not fit NVIDIA H200: needs"
    elif unusable == "stale":  # tuned on other kernel code
        _store_decode_entry(config_dir, device, template_hash="0" * 16)
        warning = "tuned for kernel templates 0000000000000000, these are"
    else:  # a field this fa2tune does not know, written into the file by hand
        path = _store_decode_entry(config_dir, device)
        path.write_text(path.read_text().replace("programs_per_sm: 1", "programs_per_sm: 1\n    prefetch: 2", 1))
        warning = "skipped what is malformed .*config has unknown keys \\['prefetch'\\]"
    default = decode_plan.default_config(decode_launch.device_info(device), 64, torch.float16)
    seen = _configs_run(monkeypatch)
    with pytest.warns(RuntimeWarning, match=warning) as caught:
        for lengths in ([20, 41], [9], [3, 4, 5]):  # three call signatures: each resolves its config
            _check_case(lengths, device=device)
    assert len([w for w in caught if "fa2tune" in str(w.message)]) == 1
    assert seen == [default] * 3
    assert selection.resolve_decode(torch.device(device), 64, torch.float16) == (default, "planner-default")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on a GPU the script measures for real")
def test_bench_decode_runs_every_provider_on_both_caches(tmp_path, capsys):
    # scripts/bench_decode.py --device cpu: fa2tune (contiguous and paged), attention() on the same keys, the Hugging
    # Face integration's padded step (in place and unpadded) and SDPA's math backend, each checked against fa2tune's
    # output before it is timed
    script = load_script("bench_decode")
    assert script.main(["--device", "cpu", "--shapes", "2x40x1,1x30x4", "--num-splits", "3",
                        "--csv", str(tmp_path / "d.csv")]) == 0  # fmt: skip
    with open(tmp_path / "d.csv") as handle:
        rows = list(csv.DictReader(handle))
    providers = ("fa2tune", "fa2tune/s3", "fa2tune_attention", "sdpa_math")
    assert {(r["provider"], r["cache"]) for r in rows} == {(p, c) for p in providers
                                                          for c in ("contiguous", "paged16")} | {
        ("fa2tune_hf", "contiguous"), ("fa2tune_unpad", "contiguous")}  # fmt: skip
    assert all(r["note"].startswith("rel err") and float(r["gbps"]) > 0 for r in rows)
    assert "sdpa_math" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.parse_args(["--device", "cpu", "--shapes", "32x8192x1"])
    with pytest.raises(SystemExit):
        script.parse_args(["--device", "cpu", "--num-splits", "0"])
