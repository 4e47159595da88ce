"""General masks (sliding window, prefix-LM) and packed sequences, forward and backward, against float64."""

from __future__ import annotations

import pytest
import torch

import fa2tune
from fa2tune.config.types import KernelConfig, Mask
from fa2tune.tune.reference import band_visible, naive_attention, naive_attention_varlen

from .conftest import assert_close

# (seqlen_q, seqlen_k, window, prefix_len, causal)
MASKS = [
    (37, 37, (5, 3), 0, False),  # two-sided window, ragged
    (70, 70, (20, -1), 0, True),  # causal sliding window (the long-context case)
    (70, 50, (0, 0), 0, False),  # each query sees one key; the first 20 queries see none
    (50, 70, (-1, 7), 0, False),  # right window only, q_len < k_len
    (50, 70, (-1, -1), 20, False),  # prefix-LM
    (64, 64, (10, -1), 33, True),  # prefix-LM with a left window
    (33, 33, (0, -1), 0, False),  # left 0: keys at and after the query
    (1, 1, (3, 3), 0, False),  # N = 1
    (64, 64, (-1, -1), 64, False),  # the prefix is everything: full attention
]
CONFIGS = [KernelConfig(16, 16), KernelConfig(32, 16), KernelConfig(16, 64)]


def _grads(fn, inputs, do):
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, do))


def _check_against_reference(q, k, v, run, reference, dtype):
    """run(q, k, v) -> O through fa2tune; reference(q, k, v) -> O in float64; compares O, dQ, dK and dV."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = run(q, k, v)
    do = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), do))
    ref_inputs = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    want = _grads(reference, ref_inputs, do.double())
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want, strict=True):
        assert_close(a, b, dtype, what=name)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}")
@pytest.mark.parametrize("case", MASKS, ids=lambda c: f"q{c[0]}k{c[1]}w{c[2][0]},{c[2][1]}p{c[3]}{'c' * c[4]}")
def test_band_masks_match_reference(case, config, device):
    nq, nk, window, prefix, causal = case
    torch.manual_seed(hash((case, config)) % 2**31)
    q = torch.randn(1, 4, nq, 32, device=device)
    k, v = (torch.randn(1, 2, nk, 32, device=device) for _ in range(2))  # GQA 2:1
    mask = dict(causal=causal, window=window, prefix_len=prefix)
    _check_against_reference(
        q, k, v,
        lambda q, k, v: fa2tune.attention(q, k, v, **mask, config=config),
        lambda q, k, v: naive_attention(q, k, v, **mask)[0],
        torch.float32,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_band_mask_in_half_precision(dtype, device):
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 2, 90, 64, device=device, dtype=dtype) for _ in range(3))
    _check_against_reference(
        q, k, v,
        lambda q, k, v: fa2tune.attention(q, k, v, causal=True, window=(24, -1), prefix_len=5),
        lambda q, k, v: naive_attention(q, k, v, causal=True, window=(24, -1), prefix_len=5)[0],
        dtype,
    )  # fmt: skip


def test_lse_and_empty_rows(device):
    # window (0, 0) with q_len 50 > k_len 20: query i sits at key i - 30, so the first 30 queries see no key.
    torch.manual_seed(8)
    q = torch.randn(1, 1, 50, 16, device=device)
    k, v = (torch.randn(1, 1, 20, 16, device=device) for _ in range(2))
    o, lse = fa2tune.attention(q, k, v, window=(0, 0), return_lse=True)
    ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), window=(0, 0))
    assert torch.equal(o[0, 0, :30].cpu(), torch.zeros(30, 16))
    assert torch.isneginf(lse[0, 0, :30]).all() and torch.isfinite(lse[0, 0, 30:]).all()
    assert_close(o, ref_o, torch.float32)
    assert_close(lse, ref_lse, torch.float32, what="lse")


def test_tiles_outside_the_window_are_never_read(device):
    # 16 queries at the end of 512 keys with window (16, 0) see keys 480..511 only. With K/V tiles of up to 128
    # rows (any config the forward and backward may pick), keys 0..383 lie in tiles no query tile reaches: NaN
    # there would poison any tile that is visited (0·NaN = NaN), even a masked one.
    torch.manual_seed(9)
    q = torch.randn(1, 1, 16, 32, device=device)
    k, v = (torch.randn(1, 1, 512, 32, device=device) for _ in range(2))
    clean = naive_attention(q.double(), k.double(), v.double(), window=(16, 0))[0]
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, :, :384] = float("nan")
    v_poisoned[:, :, :384] = float("nan")
    q_, k_, v_ = (t.requires_grad_() for t in (q, k_poisoned, v_poisoned))
    out = fa2tune.attention(q_, k_, v_, window=(16, 0))
    assert_close(out, clean, torch.float32)
    dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), torch.randn_like(out))
    assert not dq.isnan().any()
    # dK/dV of unseen keys are exactly 0 (their loop is empty), not NaN
    assert torch.equal(dk[:, :, :384].cpu(), torch.zeros(1, 1, 384, 32))
    assert torch.equal(dv[:, :, :384].cpu(), torch.zeros(1, 1, 384, 32))


def test_reference_mask_definition():
    # band_visible against the definition written out element by element.
    for nq, nk, window, prefix, causal in MASKS:
        visible = band_visible(nq, nk, causal=causal, window=window, prefix_len=prefix)
        left, right = window
        for i in range(nq):
            for j in range(nk):
                pos = i + nk - nq
                in_band = (left < 0 or j >= pos - left) and j <= pos + (
                    0 if causal or prefix else right if right >= 0 else nk
                )
                assert bool(visible[i, j]) == (j < prefix or in_band), (nq, nk, window, prefix, causal, i, j)


def test_causal_window_is_the_same_as_right_zero(device):
    torch.manual_seed(10)
    q, k, v = (torch.randn(1, 2, 45, 32, device=device) for _ in range(3))
    a = fa2tune.attention(q, k, v, causal=True, window=(8, 5))
    b = fa2tune.attention(q, k, v, window=(8, 0))
    assert torch.equal(a, b)
    assert Mask(causal=True, window=(8, 5)).bounds(45, 45) == (8, 0, 0)


# ---- packed sequences ----------------------------------------------------------------------------------------


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


VARLEN = [
    ([5, 1, 40, 0, 17], [5, 1, 40, 0, 17], {}),  # lengths 1 and 0 among others
    ([5, 1, 40, 2, 17], [9, 2, 33, 3, 17], dict(causal=True)),  # q_len != k_len per sequence, bottom-right
    ([30, 1, 17], [30, 1, 20], dict(window=(4, 2))),
    ([30, 1, 17], [30, 1, 20], dict(causal=True, prefix_len=6)),
    ([64, 64], [64, 64], dict(causal=True)),  # even lengths: still the ragged (per-sequence) variant
]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"{len(c[0])}seqs-{'-'.join(c[2]) or 'full'}")
def test_varlen_matches_each_sequence_alone(case, device):
    lens_q, lens_k, mask = case
    torch.manual_seed(hash(str(case)) % 2**31)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    q = torch.randn(sum(lens_q), 4, 32, device=device)
    k, v = (torch.randn(sum(lens_k), 2, 32, device=device) for _ in range(2))
    _check_against_reference(
        q, k, v,
        lambda q, k, v: fa2tune.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **mask,
                                                 config=KernelConfig(16, 16)),
        lambda q, k, v: naive_attention_varlen(q, k, v, cu_q, cu_k, **mask)[0],
        torch.float32,
    )  # fmt: skip


def test_varlen_lse_layout_and_no_cross_talk(device):
    # Changing one sequence's keys changes nothing in the others: nothing attends across a boundary.
    torch.manual_seed(11)
    lens = [20, 1, 33]
    cu = _cu(lens, device)
    q, k, v = (torch.randn(sum(lens), 2, 16, device=device) for _ in range(3))
    o, lse = fa2tune.attention_varlen(q, k, v, cu, cu, 33, 33, return_lse=True)
    assert lse.shape == (2, sum(lens))
    assert_close(lse, naive_attention_varlen(q.double(), k.double(), v.double(), cu, cu)[1], torch.float32, "lse")
    k2, v2 = k.clone(), v.clone()
    k2[21:], v2[21:] = torch.randn(33, 2, 16, device=device), torch.randn(33, 2, 16, device=device)
    o2 = fa2tune.attention_varlen(q, k2, v2, cu, cu, 33, 33)
    assert torch.equal(o2[:21], o[:21]) and not torch.equal(o2[21:], o[21:])


# ---- bad input -------------------------------------------------------------------------------------------------


def _packed(device, lens=(4, 6)):
    cu = _cu(list(lens), device)
    q, k, v = (torch.randn(sum(lens), 2, 16, device=device) for _ in range(3))
    return q, k, v, cu


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(cu_seqlens_q=[0, 6, 4, 10], cu_seqlens_k=[0, 4, 4, 10]), ValueError, "never decrease"),
        (dict(cu_seqlens_q=[1, 4, 10]), ValueError, "start at 0"),
        (dict(cu_seqlens_q=[0, 4, 9]), ValueError, "end at the number of tokens"),
        (dict(max_seqlen_q=5), ValueError, "max_seqlen_q=5 is below the longest"),
        (dict(cu_seqlens_k="int64"), TypeError, "cu_seqlens_k must be a 1-D torch.int32"),
        (dict(cu_seqlens_k=[0, 10], max_seqlen_k=10), ValueError, "same number of sequences"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0, got -1"),
        (dict(q="4d"), ValueError, "q must be 3-D (total_tokens, heads, head_dim)"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_varlen_bad_input(change, error, words, device):
    q, k, v, cu = _packed(device)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    for name, value in change.items():
        if value == "int64":
            value = cu.long()
        elif value == "4d":
            value = q[None]
        elif isinstance(value, list):
            value = torch.tensor(value, dtype=torch.int32, device=device)
        args[name] = value
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        fa2tune.attention_varlen(**args)


def test_varlen_offsets_are_read_back_once_per_tensor_until_modified(device):
    # Every layer of a packed batch shares one cu_seqlens: one host read per step, not one per layer — but a
    # tensor changed in place is checked again, and a new tensor with other values is always checked.
    q, k, v, cu = _packed(device)
    reads = []
    original = cu.tolist
    cu.tolist = lambda: reads.append(1) or original()  # instance attribute: counts this tensor's host reads
    for _layer in range(3):
        fa2tune.attention_varlen(q, k, v, cu, cu, 6, 6)
    assert len(reads) == 1
    fa2tune.attention_varlen(q, k, v, cu, cu, 7, 7)  # other maxima: checked again
    assert len(reads) == 2
    cu[1] = 7  # in place: lengths 7 and 3, above max_seqlen 6
    with pytest.raises(ValueError, match="max_seqlen_q=6 is below the longest"):
        fa2tune.attention_varlen(q, k, v, cu, cu, 6, 6)
    bad = _cu([7, 3], device)
    with pytest.raises(ValueError, match="below the longest"):
        fa2tune.attention_varlen(q, k, v, bad, bad, 6, 6)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(window=(-2, 0)), ValueError, "window sides must be >= -1"),
        (dict(window=(3,)), TypeError, "window must be None or a \\(left, right\\) pair"),
        (dict(window=(1.5, 0)), TypeError, "pair of ints"),
        (dict(prefix_len=-1), ValueError, "prefix_len must be >= 0"),
        (dict(prefix_len=True), TypeError, "prefix_len must be an int"),
    ],
)
def test_mask_bad_input(kwargs, error, words, device):
    q = torch.randn(1, 1, 8, 16, device=device)
    with pytest.raises(error, match=words):
        fa2tune.attention(q, q, q, **kwargs)


def test_varlen_and_window_under_torch_compile_fullgraph(device):
    # The offsets' values are checked inside the custom op (a host read would break the graph), so a compiled
    # caller still gets the clear error.
    torch._dynamo.reset()
    cu = _cu([7, 33], device)
    q, k, v = (torch.randn(40, 2, 16, device=device, requires_grad=True) for _ in range(3))

    def layer(q, k, v):
        packed = fa2tune.attention_varlen(q, k, v, cu, cu, 33, 33, causal=True, window=(5, -1))
        return packed.square().sum()

    compiled = torch.compile(layer, fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention_varlen(*leaves, cu, cu, causal=True, window=(5, -1))[0].square().sum()
    for got, want in zip(grads, torch.autograd.grad(ref, leaves), strict=True):
        assert_close(got, want, torch.float32, what="gradient")
    bad = torch.tensor([0, 34, 40], dtype=torch.int32, device=device)
    with pytest.raises(Exception, match=r"max_seqlen_q=33 is below the longest sequence in cu_seqlens_q \(34\)"):
        torch.compile(lambda q: fa2tune.attention_varlen(q, k, v, bad, bad, 33, 33), fullgraph=True)(q.detach())


def test_varlen_half_precision_with_a_generous_max_seqlen(device):
    # max_seqlen above the longest sequence (as a fixed-size buffer gives): the extra programs exit early.
    torch.manual_seed(14)
    lens = [19, 1, 45]
    cu = _cu(lens, device)
    q, k, v = (torch.randn(sum(lens), 4, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    _check_against_reference(
        q, k, v,
        lambda q, k, v: fa2tune.attention_varlen(q, k, v, cu, cu, 128, 128, causal=True),
        lambda q, k, v: naive_attention_varlen(q, k, v, cu, cu, causal=True)[0],
        torch.bfloat16,
    )  # fmt: skip


def test_varlen_with_no_tokens(device):
    cu = torch.zeros(3, dtype=torch.int32, device=device)  # two empty sequences
    q = torch.randn(0, 2, 16, device=device, requires_grad=True)
    o, lse = fa2tune.attention_varlen(q, q, q, cu, cu, 0, 0, return_lse=True)
    assert o.shape == (0, 2, 16) and lse.shape == (2, 0)
    (grad,) = torch.autograd.grad(o.sum(), q)
    assert grad.shape == q.shape
