"""The drop-in calls: fa2tune.scaled_dot_product_attention (and patch_sdpa) against PyTorch's own SDPA in float64,
flash_attn_func / flash_attn_varlen_func against the float64 reference in flash_attn's layout; outputs and every
gradient, then what each refuses."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import fa2tune
from fa2tune.api import flash_attn_compat, sdpa
from fa2tune.config.types import KernelConfig
from fa2tune.tune.reference import naive_attention, naive_attention_varlen

from .conftest import assert_close
from .test_backward import _assert_grads_close

# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim), dtype: attention()'s matrix (tests/test_launcher.py)
# in brief — N = 1, ragged lengths, seqlen_q < and > seqlen_k, GQA and MQA, d = 80 and 96 — each shape in one dtype.
CASES = [
    ((1, 1, 1, 1, 1, 64), torch.float32),
    ((2, 2, 2, 37, 37, 64), torch.float16),
    ((1, 2, 1, 37, 70, 96), torch.bfloat16),
    ((1, 4, 1, 45, 19, 80), torch.float16),
]
CASE_IDS = ["n1-fp32", "ragged-fp16", "q<k-gqa-d96-bf16", "q>k-mqa-d80-fp16"]


def _tensors(shape, dtype, device, seed, layout="sdpa"):
    """Fresh random q, k, v: (batch, heads, seqlen, d), or flash_attn's (batch, seqlen, heads, d)."""
    batch, hq, hkv, nq, nk, d = shape
    gen = torch.Generator().manual_seed(seed)
    sizes = [(batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, d)]
    if layout == "flash":
        sizes = [(b, n, h, d) for b, h, n, d in sizes]
    return [torch.randn(size, generator=gen).to(device, dtype) for size in sizes]


def _check(run, reference, inputs, dtype, seed=0):
    """run(*inputs) against reference(*float64 copies on the CPU): the output and the gradient of each input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in inputs]
    out, ref = run(*leaves), reference(*ref_leaves)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.device, dtype)
    grads = torch.autograd.grad(out, leaves, grad_out)
    _assert_grads_close(grads, torch.autograd.grad(ref, ref_leaves, grad_out.cpu().double()), dtype, grad_out)


def _torch_sdpa(**kwargs):
    return lambda q, k, v: sdpa.TORCH_SDPA(q, k, v, **kwargs)


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts the packed-sequence launches of fa2tune.scaled_dot_product_attention (its key-padding route)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fa2tune.attention_varlen(*args, **kwargs)

    monkeypatch.setattr(sdpa, "attention_varlen", counted)
    return calls


@pytest.fixture
def fresh_notes(monkeypatch):
    """Forget which fallbacks were logged, so a test sees its own first one."""
    monkeypatch.setattr(sdpa, "_noted", set())


# ---- scaled_dot_product_attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape, dtype", CASES, ids=CASE_IDS)
def test_sdpa_matches_pytorchs(shape, dtype, is_causal, device):
    # is_causal is top-left aligned, as PyTorch's, also where seqlen_q != seqlen_k.
    gqa = shape[1] != shape[2]
    _check(
        lambda q, k, v: fa2tune.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa),
        _torch_sdpa(is_causal=is_causal, enable_gqa=gqa),
        _tensors(shape, dtype, device, seed=hash((shape, is_causal)) % 2**31),
        dtype,
    )


def test_sdpa_takes_positional_arguments_in_pytorchs_order_and_any_strides(device):
    q, k, v = _tensors((2, 2, 2, 9, 12, 32), torch.float32, device, seed=3)
    q_strided = torch.randn(2, 2, 9, 64, device=device)[..., ::2].copy_(q)  # head_dim stride 2
    out = fa2tune.scaled_dot_product_attention(q_strided, k, v, None, 0.0, True, 0.3)
    assert_close(out, sdpa.TORCH_SDPA(q.double(), k.double(), v.double(), is_causal=True, scale=0.3), torch.float32)


def _key_padding(batch, seqlen_k, device, seed, empty_row=None):
    """Bool (batch, seqlen_k) of the keys each batch entry sees, at least one each unless `empty_row`."""
    visible = torch.rand(batch, seqlen_k, generator=torch.Generator().manual_seed(seed)) > 0.4
    visible[:, seqlen_k // 2] = True
    if empty_row is not None:
        visible[empty_row] = False
    return visible.to(device)


def _additive(visible, masked_value, dtype=torch.float32):
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, masked_value)


def _per_key(mask):  # (batch, seqlen_k) -> (batch, 1, 1, seqlen_k)
    return mask[:, None, None, :]


FP32_MIN, FP16_MIN = torch.finfo(torch.float32).min, torch.finfo(torch.float16).min
KEY_PADDING_MASKS = {
    "bool-b11k": lambda vis, hq, nq: _per_key(vis),
    "bool-all-hidden-row": lambda vis, hq, nq: _per_key(vis),  # batch entry 1 sees no key: output 0
    "neg-inf": lambda vis, hq, nq: _per_key(_additive(vis, float("-inf"))),
    "finfo-min-expanded": lambda vis, hq, nq: _per_key(_additive(vis, FP32_MIN)).expand(-1, hq, nq, -1),
    "fp16-min-materialized": lambda vis, hq, nq: (
        _per_key(_additive(vis, FP16_MIN, torch.float16)).expand(-1, 1, nq, -1).contiguous()
    ),
    "bool-one-row-for-all": lambda vis, hq, nq: vis[:1],  # (1, seqlen_k): broadcast over batch and queries
}


@pytest.mark.parametrize("kind", list(KEY_PADDING_MASKS))
def test_sdpa_key_padding_masks_run_packed_and_match_pytorchs(kind, packed_calls, caplog, device):
    shape, dtype = (3, 4, 2, 11, 21, 64), torch.float16
    visible = _key_padding(3, 21, device, seed=7, empty_row=1 if kind == "bool-all-hidden-row" else None)
    mask = KEY_PADDING_MASKS[kind](visible, 4, 11)
    with caplog.at_level(logging.WARNING, logger="fa2tune"):
        _check(
            lambda q, k, v: fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            _torch_sdpa(attn_mask=mask.cpu() if mask.dtype == torch.bool else mask.cpu().double(), enable_gqa=True),
            _tensors(shape, dtype, device, seed=8),
            dtype,
        )
    assert len(packed_calls) == 1 and not caplog.records


def test_sdpa_mask_keeping_every_key_runs_dense(packed_calls, device):
    q, k, v = _tensors((2, 2, 2, 5, 7, 16), torch.float32, device, seed=1)
    out = fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(2, 1, 1, 7, dtype=torch.bool))
    assert not packed_calls
    assert_close(out, sdpa.TORCH_SDPA(q.double(), k.double(), v.double()), torch.float32)


def _causal_bool(nq, nk, device):
    return torch.ones(nq, nk, dtype=torch.bool, device=device).tril()


OTHER_MASKS = {
    "bool-per-query": (lambda nq, nk, dev: torch.rand(nq, nk, device=dev) > 0.3, False),
    "additive-bias": (lambda nq, nk, dev: torch.randn(2, 1, nq, nk, device=dev), False),
    "finfo-min-whole-row": (
        lambda nq, nk, dev: torch.zeros(2, 1, 1, nk, device=dev).index_fill_(
            0, torch.tensor([1], device=dev), torch.finfo(torch.float32).min
        ),
        False,
    ),
    "with-is-causal": (lambda nq, nk, dev: torch.ones(2, 1, 1, nk, dtype=torch.bool, device=dev), True),
}


@pytest.mark.parametrize("kind", list(OTHER_MASKS))
def test_sdpa_other_masks_run_on_pytorchs_sdpa_and_say_so_once(kind, packed_calls, fresh_notes, caplog, device):
    make, is_causal = OTHER_MASKS[kind]
    torch.manual_seed(5)
    mask = make(9, 13, device)
    with caplog.at_level(logging.WARNING, logger="fa2tune"):
        for _ in range(2):
            _check(
                lambda q, k, v: fa2tune.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal),
                _torch_sdpa(attn_mask=mask.cpu() if mask.dtype == torch.bool else mask.cpu().double(),
                            is_causal=is_causal),
                _tensors((2, 2, 2, 9, 13, 32), torch.float32, device, seed=6),
                torch.float32,
            )  # fmt: skip
    assert not packed_calls
    assert len(caplog.records) == 1 and "PyTorch's SDPA" in caplog.records[0].getMessage()


def test_sdpa_gives_a_learnable_mask_its_gradient(device):
    q, k, v = _tensors((2, 2, 2, 6, 8, 16), torch.float32, device, seed=2)
    bias = torch.zeros(2, 1, 1, 8, device=device, requires_grad=True)
    fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=bias).square().sum().backward()
    ref_bias = torch.zeros(2, 1, 1, 8, dtype=torch.float64, requires_grad=True)
    sdpa.TORCH_SDPA(q.double(), k.double(), v.double(), attn_mask=ref_bias).square().sum().backward()
    assert_close(bias.grad, ref_bias.grad, torch.float32, what="mask gradient")


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.1"),
        (dict(dropout_p="0"), TypeError, "dropout_p must be a float"),
        (dict(is_causal=1), TypeError, "is_causal must be True or False"),
        (dict(k_heads=1), ValueError, "enable_gqa=True"),
        (dict(q_heads=3, k_heads=2, enable_gqa=True), ValueError, "query's heads must be a multiple of key/value's"),
        (dict(attn_mask=torch.ones(3, 1, 1, 7, dtype=torch.bool)), ValueError, "attn_mask must broadcast"),
        (dict(attn_mask=torch.ones(7, dtype=torch.int32)), TypeError, "attn_mask must be bool"),
        (dict(attn_mask=[True] * 7), TypeError, "attn_mask must be a torch.Tensor"),
        (dict(attn_mask=torch.zeros(2, 1, 1, 7, dtype=torch.bfloat16)), TypeError, "float32 or query's dtype"),
        (dict(attn_mask=torch.zeros(2, 1, 1, 7, dtype=torch.float64)), TypeError, "float32 or query's dtype"),
        (dict(scale=-1.0), ValueError, "scale must be a positive"),
    ],
)
def test_sdpa_refuses_what_it_cannot_run_naming_the_argument(kwargs, error, words, device):
    kwargs = dict(kwargs)
    q_heads, k_heads = kwargs.pop("q_heads", 2), kwargs.pop("k_heads", 2)
    q = torch.randn(2, q_heads, 5, 16, device=device)
    k = v = torch.randn(2, k_heads, 7, 16, device=device)
    with pytest.raises(error, match=words):
        fa2tune.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sdpa_takes_the_mask_dtypes_pytorchs_sdpa_takes(mask_dtype, device):
    q = torch.randn(2, 2, 5, 16, device=device, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 7, 16, device=device, dtype=torch.float16) for _ in range(2))
    keep = torch.arange(7, device=device) < torch.tensor([[4], [7]], device=device)
    mask = torch.zeros(2, 1, 1, 7, device=device, dtype=mask_dtype).masked_fill(~keep[:, None, None], float("-inf"))
    try:  # does PyTorch take this mask dtype with float16 inputs? (asked on the CPU, where every dtype runs)
        probe = torch.zeros(1, 1, 1, 16, dtype=q.dtype)
        sdpa.TORCH_SDPA(probe, probe, probe, attn_mask=torch.zeros(1, 1, 1, 1, dtype=mask_dtype))
    except RuntimeError:
        with pytest.raises(TypeError, match="attn_mask must be bool, float32 or query's dtype"):
            fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return
    want = sdpa.TORCH_SDPA(q.double(), k.double(), v.double(), attn_mask=mask.double())
    assert_close(fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=mask), want, q.dtype)


def test_under_autocast_a_mask_is_taken_in_the_dtype_autocast_gives_it(device):
    # autocast casts SDPA's float inputs but float64 ones, the mask among them: a float16 mask with float32 inputs
    # under bfloat16 autocast reaches SDPA in bfloat16, as the query does (taken); a float64 one stays float64 (refused)
    q = torch.randn(2, 2, 5, 16, device=device)
    k, v = (torch.randn(2, 2, 7, 16, device=device) for _ in range(2))
    keep = torch.arange(7, device=device) < torch.tensor([[4], [7]], device=device)
    hidden = ~keep[:, None, None]
    with torch.autocast(device.type if isinstance(device, torch.device) else device, dtype=torch.bfloat16):
        mask = torch.zeros(2, 1, 1, 7, device=device, dtype=torch.float16).masked_fill(hidden, float("-inf"))
        got = fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with pytest.raises(TypeError, match="attn_mask must be bool, float32 or query's dtype"):
            fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=mask.double())
    rounded = [t.bfloat16().double() for t in (q, k, v)]
    want = sdpa.TORCH_SDPA(*rounded, attn_mask=torch.zeros_like(mask, dtype=torch.float64).masked_fill(hidden, -1e300))
    assert got.dtype == torch.bfloat16
    assert_close(got, want, torch.bfloat16)


def test_sdpa_and_its_patch_follow_autocast_as_pytorchs_sdpa(monkeypatch, device):
    # SDPA is one of autocast's lower-precision ops: under torch.autocast its float32 inputs run in autocast's dtype
    # and so does its output, and inputs of mixed dtypes are cast alike. fa2tune's stand-ins must give the same: the
    # result in bfloat16, computed from the bfloat16-rounded inputs by fa2tune's kernels, not a float32 result, a
    # dtype error, nor a hand-off to PyTorch.
    # Autocast is not asked whether it exists for CUDA or the CPU (it always does): torch.compile before PyTorch 2.12
    # cannot trace that question, and a compiled model's attention broke its graph there (GPU-tested under 2.11).
    served = []
    monkeypatch.setattr(sdpa, "attention", lambda *args, **kwargs: served.append(args[0].dtype) or
                        fa2tune.attention(*args, **kwargs))  # fmt: skip
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: pytest.fail(f"asked {device_type}"))
    q, k, v = _tensors((1, 2, 2, 24, 24, 32), torch.float32, device, seed=7)
    want = sdpa.TORCH_SDPA(*(t.to(torch.bfloat16).double() for t in (q, k, v)), is_causal=True)
    with torch.autocast(device_type=q.device.type, dtype=torch.bfloat16):
        outs = {"fa2tune": fa2tune.scaled_dot_product_attention(q, k, v, is_causal=True),
                "mixed dtypes": fa2tune.scaled_dot_product_attention(q.to(torch.bfloat16), k, v, is_causal=True)}
        with fa2tune.patch_sdpa():
            outs["patch_sdpa"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert served == [torch.bfloat16] * 3
    for name, out in outs.items():
        assert out.dtype == torch.bfloat16, (name, out.dtype)
        assert_close(out, want, torch.bfloat16, what=name)


def test_patch_sdpa_hands_meta_tensors_and_function_transforms_to_pytorch(device):
    # Calls fa2tune cannot run go to the SDPA the patch replaced: meta tensors (shape inference; autocast cannot even
    # be asked about their device type) and torch.func transforms, which fa2tune's own SDPA refuses by name.
    q, k, v = _tensors((2, 2, 2, 9, 9, 32), torch.float32, device, seed=5)
    meta = [t.to("meta") for t in (q, k, v)]
    with fa2tune.patch_sdpa():
        assert F.scaled_dot_product_attention(*meta, is_causal=True).device.type == "meta"
        mapped = torch.vmap(F.scaled_dot_product_attention)(q[None], k[None], v[None])  # 4-D inside the map
    assert_close(mapped[0], sdpa.TORCH_SDPA(q.double(), k.double(), v.double()), torch.float32)
    with pytest.raises(ValueError, match="query must be on a CUDA device, got meta"):  # SDPA's argument names
        fa2tune.scaled_dot_product_attention(*meta)
    with pytest.raises(NotImplementedError, match=r"does not run under a torch\.func transform"):
        torch.vmap(fa2tune.scaled_dot_product_attention)(q[None], k[None], v[None])


# ---- patch_sdpa ------------------------------------------------------------------------------------------------


def test_patch_sdpa_serves_torch_calls_until_undone(packed_calls, device):
    q, k, v = _tensors((2, 4, 2, 9, 9, 32), torch.float16, device, seed=4)
    mask = _key_padding(2, 9, device, seed=4)[:, None, None, :]
    before = F.scaled_dot_product_attention
    with fa2tune.patch_sdpa() as patch:
        assert F.scaled_dot_product_attention is not before
        assert fa2tune.patch_sdpa().undo() is None  # a patch within a patch undoes nothing
        out = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        assert len(packed_calls) == 1  # fa2tune's key-padding route ran
    assert F.scaled_dot_product_attention is before
    patch.undo()  # a second undo does nothing
    assert F.scaled_dot_product_attention is before
    assert_close(out, sdpa.TORCH_SDPA(q.double(), k.double(), v.double(), mask, enable_gqa=True), torch.float16)


def test_patch_sdpa_refuses_to_undo_over_a_later_replacement():
    before = F.scaled_dot_product_attention
    patch = fa2tune.patch_sdpa()
    try:
        F.scaled_dot_product_attention = sdpa.TORCH_SDPA
        with pytest.raises(RuntimeError, match="replaced again"):
            patch.undo()
    finally:
        F.scaled_dot_product_attention = before


@pytest.mark.parametrize(
    "name, args, kwargs",
    [
        ("float64", lambda d: [torch.randn(1, 2, 5, 8, dtype=torch.float64, device=d)] * 3, {}),
        ("3-D", lambda d: [torch.randn(2, 5, 8, device=d)] * 3, {}),
        ("value head dim > 256",
         lambda d: [torch.randn(1, 2, 5, 8, device=d)] * 2 + [torch.randn(1, 2, 5, 264, device=d)], {}),
        ("batch broadcast", lambda d: [torch.randn(2, 2, 5, 8, device=d)] + [torch.randn(1, 2, 5, 8, device=d)] * 2,
         {}),
        ("head dim 0", lambda d: [torch.randn(1, 2, 5, 0, device=d)] * 2 + [torch.randn(1, 2, 5, 8, device=d)], {}),
        ("value head dim 0",
         lambda d: [torch.randn(1, 2, 5, 8, device=d)] * 2 + [torch.randn(1, 2, 5, 0, device=d)], {}),
        ("scale 0", lambda d: [torch.randn(1, 2, 5, 8, device=d)] * 3, dict(scale=0.0)),
        ("dropout", lambda d: [torch.randn(1, 2, 5, 8, device=d)] * 3, dict(dropout_p=0.5)),
    ],
)  # fmt: skip
def test_patch_sdpa_hands_calls_it_cannot_serve_to_pytorch_and_says_so_once(name, args, kwargs, fresh_notes, caplog):
    inputs = args("cpu")
    torch.manual_seed(0)
    expected = sdpa.TORCH_SDPA(*inputs, **kwargs)
    with caplog.at_level(logging.WARNING, logger="fa2tune"), fa2tune.patch_sdpa():
        for _ in range(2):
            torch.manual_seed(0)  # dropout draws the same mask
            assert torch.equal(F.scaled_dot_product_attention(*inputs, **kwargs), expected)
    assert len(caplog.records) == 1 and "run on the SDPA it replaced" in caplog.records[0].getMessage()


def test_patch_sdpa_names_mixed_dtypes_as_its_reason(fresh_notes, caplog):
    # PyTorch refuses query, key and value of different dtypes: the patch must raise what it raises, and its note
    # must name the mix, not query's dtype alone (float32, which it would serve)
    q = torch.randn(1, 2, 5, 8)
    k, v = q.half(), q.half()
    with pytest.raises(RuntimeError) as expected:
        sdpa.TORCH_SDPA(q, k, v)
    with caplog.at_level(logging.WARNING, logger="fa2tune"), fa2tune.patch_sdpa(), pytest.raises(RuntimeError) as got:
        F.scaled_dot_product_attention(q, k, v)
    assert str(got.value) == str(expected.value)
    assert len(caplog.records) == 1 and "different dtypes" in caplog.records[0].getMessage()


@pytest.mark.parametrize("mask", ["bfloat16 mask", "float64 mask", "0-dim bool", "0-dim float", "1-D bool"])
def test_patch_sdpa_leaves_masks_pytorch_refuses_to_pytorch(mask, packed_calls, device):
    # PyTorch's SDPA takes a bool mask or one in query's dtype, of at least one dimension (its CPU backends: two):
    # the patched function must raise what it raises, not give a result code run without the patch would not get
    q, k, v = _tensors((2, 2, 2, 5, 7, 16), torch.float32, device, seed=6)
    hidden = torch.where(_key_padding(2, 7, device, seed=6), 0.0, float("-inf"))[:, None, None, :]
    mask = {"bfloat16 mask": hidden.bfloat16(), "float64 mask": hidden.double(),
            "0-dim bool": torch.tensor(True, device=device), "0-dim float": torch.tensor(0.0, device=device),
            "1-D bool": _key_padding(2, 7, device, seed=6)[0]}[mask]
    try:
        sdpa.TORCH_SDPA(q, k, v, attn_mask=mask)
    except (RuntimeError, IndexError) as error:
        refused = type(error)
    else:
        pytest.skip("this PyTorch takes the mask")
    with fa2tune.patch_sdpa(), pytest.raises(refused):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not packed_calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_patch_sdpa_runs_a_float32_mask_beside_a_16_bit_query(dtype, packed_calls, device):
    # PyTorch takes a bool mask, a float32 one, or one in query's dtype
    q, k, v = _tensors((2, 2, 2, 5, 7, 16), dtype, device, seed=6)
    visible = _key_padding(2, 7, device, seed=6)
    mask = torch.where(visible, 0.0, float("-inf"))[:, None, None, :]
    with fa2tune.patch_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(packed_calls) == 1
    assert_close(out, sdpa.TORCH_SDPA(*(t.double() for t in (q, k, v)), attn_mask=visible[:, None, None, :]), dtype)


def test_patch_sdpa_runs_a_float32_mask_under_autocast_as_pytorchs_would_see_it(packed_calls, device):
    # under autocast a float32 mask reaches PyTorch's SDPA in autocast's dtype, as query does: fa2tune runs it
    q, k, v = _tensors((2, 2, 2, 5, 7, 16), torch.float32, device, seed=6)
    visible = _key_padding(2, 7, device, seed=6)
    mask = torch.where(visible, 0.0, float("-inf"))[:, None, None, :]
    with torch.autocast(device_type=q.device.type, dtype=torch.bfloat16), fa2tune.patch_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(packed_calls) == 1 and out.dtype == torch.bfloat16
    want = sdpa.TORCH_SDPA(*(t.bfloat16().double() for t in (q, k, v)), attn_mask=visible[:, None, None, :])
    assert_close(out, want, torch.bfloat16)


def test_patch_sdpa_runs_multihead_attention_with_a_key_padding_mask(packed_calls, device):
    torch.manual_seed(9)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, device=device).train()  # train: no fused fast path
    x = torch.randn(2, 11, 32, device=device)
    ignored = ~_key_padding(2, 11, device, seed=9)  # MultiheadAttention's convention: True = ignore
    expected = mha(x, x, x, key_padding_mask=ignored, need_weights=False)[0]
    expected_grads = torch.autograd.grad(expected.square().sum(), list(mha.parameters()))
    with fa2tune.patch_sdpa():
        out = mha(x, x, x, key_padding_mask=ignored, need_weights=False)[0]
    grads = torch.autograd.grad(out.square().sum(), list(mha.parameters()))
    assert len(packed_calls) == 1
    assert_close(out, expected, torch.float32)
    for g, ref in zip(grads, expected_grads, strict=True):
        assert_close(g, ref, torch.float32, what="parameter gradient")


# ---- flash_attn_func and flash_attn_varlen_func ----------------------------------------------------------------


def _flash_reference(**mask):
    """naive_attention in flash_attn's layout (bottom-right aligned masks, as flash_attn's)."""

    def reference(q, k, v):
        out, _ = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **mask)
        return out.transpose(1, 2)

    return reference


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape, dtype", CASES, ids=CASE_IDS)
def test_flash_attn_func_matches_reference(shape, dtype, causal, device):
    def run(q, k, v):
        out = fa2tune.flash_attn_func(q, k, v, causal=causal)
        assert out.is_contiguous() and out.shape == q.shape
        return out

    inputs = _tensors(shape, dtype, device, seed=hash((shape, causal, "flash")) % 2**31, layout="flash")
    _check(run, _flash_reference(causal=causal), inputs, dtype)


@pytest.mark.parametrize("window, causal", [((3, 0), True), ((2, 5), False), ((-1, 4), False), ((6, -1), False)])
def test_flash_attn_func_window_size_is_flash_attns(window, causal, device):
    inputs = _tensors((2, 2, 1, 23, 31, 64), torch.bfloat16, device, seed=12, layout="flash")
    _check(
        lambda q, k, v: fa2tune.flash_attn_func(q, k, v, 0.0, 0.2, causal, window),
        _flash_reference(causal=causal, window=window, scale=0.2),
        inputs,
        torch.bfloat16,
    )


def test_flash_attn_func_return_attn_probs_gives_the_logsumexp(device):
    q, k, v = _tensors((2, 4, 2, 13, 17, 32), torch.float16, device, seed=13, layout="flash")
    out, lse, probs = fa2tune.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse = naive_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True)
    assert probs is None and lse.shape == (2, 4, 13) and lse.dtype == torch.float32
    assert_close(out, ref_out.transpose(1, 2), torch.float16)
    assert_close(lse, ref_lse, torch.float32, what="lse")


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (4, 0))])
def test_flash_attn_varlen_func_matches_each_sequence_alone(causal, window, device):
    lens_q, lens_k = [5, 1, 23, 0], [9, 1, 17, 3]  # q < k, q = k = 1, q > k, and a sequence without queries
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(sum(lens_q), 4, 80, generator=gen).to(device, torch.float16)
    k, v = (torch.randn(sum(lens_k), 2, 80, generator=gen).to(device, torch.float16) for _ in range(2))
    _check(
        lambda q, k, v: fa2tune.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 17, causal=causal, window_size=window),
        lambda q, k, v: naive_attention_varlen(q, k, v, cu_q.cpu(), cu_k.cpu(), causal=causal, window=window)[0],
        [q, k, v],
        torch.float16,
    )
    _, lse, probs = fa2tune.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 17, causal=causal, return_attn_probs=True)
    assert probs is None and lse.shape == (4, sum(lens_q))
    ref_lse = naive_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal)[1]
    assert_close(lse, ref_lse, torch.float32, what="lse")


def test_deterministic_runs_a_fused_dq_configs_dq_kernel_twin(monkeypatch, device):
    fused = KernelConfig(128, 128, warp_specialized=True, fused_dq=True)
    monkeypatch.setattr(flash_attn_compat.selection, "for_call", lambda *args: (KernelConfig(64, 64), fused, fused))
    seen = []
    monkeypatch.setattr(flash_attn_compat.launcher.EagerAttention, "apply", lambda *args: seen.append(args[6]))
    q, k, v = (t.requires_grad_() for t in _tensors((1, 2, 2, 8, 8, 16), torch.float16, device, 0, "flash"))
    with pytest.raises(TypeError):  # the stand-in apply returns None, which the caller cannot unpack
        fa2tune.flash_attn_func(q, k, v, deterministic=True)
    (_, dkdv, dq), = seen  # fmt: skip
    assert not dkdv.fused_dq and dkdv.block_m == 128 and dkdv.warp_specialized and dq is fused


def test_deterministic_backward_is_bitwise_reproducible(device):
    inputs = _tensors((1, 2, 1, 19, 19, 64), torch.bfloat16, device, seed=15, layout="flash")
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fa2tune.flash_attn_func(*leaves, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out.float().square().sum(), leaves))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    _check(lambda q, k, v: fa2tune.flash_attn_func(q, k, v, causal=True, deterministic=True),
           _flash_reference(causal=True), inputs, torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.1"),
        (dict(softcap=30.0), NotImplementedError, "softcap=30.0"),
        (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
        (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), NotImplementedError, "block_table"),
        (dict(deterministic=1), TypeError, "deterministic must be True or False"),
        (dict(return_attn_probs=None), TypeError, "return_attn_probs must be True or False"),
    ],
)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_flash_attn_refuses_what_it_cannot_run_naming_the_argument(kwargs, error, words, varlen, device):
    if "block_table" in kwargs and not varlen:
        pytest.skip("flash_attn_func has no block_table")
    q, k, v = _tensors((2, 4, 2, 6, 6, 16), torch.float16, device, seed=0, layout="flash")
    with pytest.raises(error, match=words):
        if varlen:
            cu = _cu([6, 6], device)
            fa2tune.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, 6, 6, **kwargs)
        else:
            fa2tune.flash_attn_func(q, k, v, **kwargs)


def test_layout_mixups_get_errors_that_name_the_layouts(device):
    # GQA tensors in the other call's layout: the head counts do not divide, and the error says which layout.
    q, k, v = _tensors((2, 6, 2, 8, 3, 16), torch.float16, device, seed=0)  # SDPA's layout
    with pytest.raises(ValueError, match=r"flash_attn_func takes \(batch, seqlen, heads, head_dim\)"):
        fa2tune.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"flash_attn's \(batch, seqlen, heads, head_dim\) pass .transpose"):
        fa2tune.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def test_flash_attn_func_with_no_kv_heads_says_so_without_a_layout_hint(device):
    q, k, v = (torch.randn(1, 6, heads, 16, device=device) for heads in (4, 0, 0))
    with pytest.raises(ValueError, match=r"k and v must have at least one head \(dim 2\), got k \(1, 6, 0, 16\)$"):
        fa2tune.flash_attn_func(q, k, v)
    # no heads at all is an empty call
    assert fa2tune.flash_attn_func(q[:, :, :0], k, v).shape == (1, 6, 0, 16)
