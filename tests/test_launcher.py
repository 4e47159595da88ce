"""The forward kernel against the float64 reference, on odd shapes, every dtype, causal and not."""

from __future__ import annotations

import math

import pytest
import torch

import fa2tune
from fa2tune.api import ops
from fa2tune.config.schedule import PERSISTENT
from fa2tune.config.types import KernelConfig
from fa2tune.launch import grid, layout
from fa2tune.tune.reference import naive_attention

from .conftest import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
SHAPES = [
    (1, 1, 1, 1, 1, 64),  # N = 1
    (2, 2, 2, 37, 37, 64),  # ragged: 37 is no multiple of any block
    (1, 2, 2, 130, 130, 16),  # smallest head dim, one row past a tile
    (1, 2, 1, 37, 130, 96),  # q_len < k_len, d = 96 padded to 128, GQA 2:1
    (1, 4, 1, 130, 37, 64),  # q_len > k_len (causal: leading rows see no key), MQA
    (1, 2, 2, 64, 64, 128),  # even tiles everywhere
    (1, 1, 1, 45, 77, 80),  # d = 80
]


def _reference(q, k, v, causal, scale=None):
    mask = causal if isinstance(causal, fa2tune.Mask) else fa2tune.Mask(causal=causal)
    return naive_attention(q.double(), k.double(), v.double(), causal=mask.causal, scale=scale, window=mask.window,
                           prefix_len=mask.prefix_len)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(shape, causal, dtype, device):
    batch, hq, hkv, nq, nk, d = shape
    torch.manual_seed(hash((shape, causal, str(dtype))) % 2**31)
    q = torch.randn(batch, hq, nq, d, dtype=dtype, device=device)
    k = torch.randn(batch, hkv, nk, d, dtype=dtype, device=device)
    v = torch.randn(batch, hkv, nk, d, dtype=dtype, device=device)
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    o, lse = ops.forward(q, k, v, causal=causal, scale=d**-0.5, out=out)
    assert o.data_ptr() == out.data_ptr()
    ref_o, ref_lse = _reference(q, k, v, causal)
    assert_close(o, ref_o, dtype)
    assert_close(lse, ref_lse, torch.float32, what="lse")
    assert o.dtype == dtype and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "config",
    [
        KernelConfig(16, 16),
        KernelConfig(16, 64),
        KernelConfig(64, 16),
        KernelConfig(64, 32, num_warps=8),
        KernelConfig(16, 16, pipeline_qk=1),
        KernelConfig(32, 16, pipeline_qk=1),
    ],
    ids=lambda c: f"m{c.block_m}n{c.block_n}" + ("-pipelined" if c.pipeline_qk else ""),
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_block_config_gives_the_same_function(config, causal, device):
    torch.manual_seed(1)
    q = torch.randn(1, 2, 75, 48, device=device)
    k = torch.randn(1, 2, 91, 48, device=device)
    v = torch.randn(1, 2, 91, 48, device=device)
    o, lse = ops.forward(q, k, v, causal=causal, scale=0.3, config=config)
    ref_o, ref_lse = _reference(q, k, v, causal, scale=0.3)
    assert_close(o, ref_o, torch.float32)
    assert_close(lse, ref_lse, torch.float32, what="lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "mask",
    [False, True, fa2tune.Mask(window=(20, 5)), fa2tune.Mask(causal=True, prefix_len=24)],
    ids=["full", "causal", "window", "prefix"],
)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pipelined_forward_matches_reference(shape, mask, dtype, device):
    # pipeline_qk reorders the unmasked loop (prologue QKᵀ, steady state, epilogue softmax): loops of 0, 1 and
    # many full tiles occur across these shapes and masks.
    batch, hq, hkv, nq, nk, d = shape
    torch.manual_seed(hash((shape, str(mask), str(dtype))) % 2**31)
    q = torch.randn(batch, hq, nq, d, dtype=dtype, device=device)
    k = torch.randn(batch, hkv, nk, d, dtype=dtype, device=device)
    v = torch.randn(batch, hkv, nk, d, dtype=dtype, device=device)
    out = torch.full_like(q, float("nan"))
    o, lse = ops.forward(q, k, v, causal=mask, scale=d**-0.5, out=out, config=KernelConfig(16, 16, pipeline_qk=1))
    ref_o, ref_lse = _reference(q, k, v, mask)
    assert_close(o, ref_o, dtype)
    assert_close(lse, ref_lse, torch.float32, what="lse")


def test_rows_that_see_no_key_give_zero_and_minus_inf(device):
    # causal with seqlen_q > seqlen_k: query i sees keys j <= i - 30, so rows 0..29 see nothing.
    torch.manual_seed(2)
    q = torch.randn(1, 1, 40, 32, device=device)
    k = torch.randn(1, 1, 10, 32, device=device)
    v = torch.randn(1, 1, 10, 32, device=device)
    o, lse = fa2tune.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(o[0, 0, :30].cpu(), torch.zeros(30, 32))
    assert torch.isneginf(lse[0, 0, :30]).all()
    assert torch.isfinite(lse[0, 0, 30:]).all()
    assert_close(o, _reference(q, k, v, True)[0], torch.float32)


def test_strided_inputs_are_read_in_place(device):
    # The common (batch, seqlen, heads, d) layout viewed as SDPA's, and k, v sliced from one packed tensor.
    torch.manual_seed(3)
    q = torch.randn(2, 50, 4, 32, device=device).transpose(1, 2)
    kv = torch.randn(2, 50, 2, 2, 32, device=device)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    o = fa2tune.attention(q, k, v, causal=True)
    assert o.is_contiguous()
    assert_close(o, _reference(q, k, v, True)[0], torch.float32)


def test_size_one_dims_strides_count_toward_no_unit(device):
    # A (batch, 1, seqlen, d) slice whose head stride is 3 elements: that stride addresses nothing (the dim is
    # indexed at 0 only), so the launchers settle it and the tensor keeps its widest vectors and TMA's alignment.
    torch.manual_seed(9)
    base = torch.randn(2, 40, 3 * 32 + 8, device=device)
    q, k, v = (base[:, :, i * 32 : (i + 1) * 32].unsqueeze(1) for i in range(3))
    q = q.as_strided(q.shape, (q.stride(0), 3, *q.stride()[2:]))
    settled = layout.settled_strides(q)
    assert layout.stride_unit(q.stride()[:3]) == 1 and layout.stride_unit(settled.stride()[:3]) == 8
    assert settled.stride()[1] == settled.stride(2) * 40 and torch.equal(settled, q)
    assert layout.settled_strides(k) is k  # already settled: no new view
    # a size-1 stride that is already a multiple of 8 stays, though it is not the contiguous one (it narrows nothing)
    wide = torch.randn(2, 2, 1, 64, device=device)[..., :36]
    assert layout.settled_strides(wide) is wide
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))  # clone keeps no odd stride: the control
    q, k, v = (t.requires_grad_() for t in (q.detach(), k.detach(), v.detach()))
    o = fa2tune.attention(q, k, v, causal=True)
    do = torch.randn_like(o)
    o.backward(do)
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    again = fa2tune.attention(q, k, v, causal=True)  # the kept plans, which settle each call's strides
    odd_do = torch.randn(2, 40, 33, device=device)[..., :32].unsqueeze(1).as_strided(do.shape, (1320, 5, 33, 1))
    odd_do.copy_(do)
    again.backward(odd_do)  # dO with an odd size-1 stride of its own
    assert torch.equal(again, o) and all(torch.equal(t.grad, g) for t, g in zip((q, k, v), grads, strict=True))
    want = _reference(qg, kg, vg, True)[0]
    want.backward(do.double())
    assert_close(o, want, torch.float32)
    for got, ref in ((q.grad, qg.grad), (k.grad, kg.grad), (v.grad, vg.grad)):
        assert_close(got, ref, torch.float32)
    out = torch.full_like(q, float("nan"))  # keeps q's odd stride; returned as it is, written in full
    o_out, _ = ops.forward(q.detach(), k.detach(), v.detach(), causal=True, scale=32**-0.5, out=out)
    assert o_out is out and torch.equal(out, o)


def test_default_scale_is_inverse_sqrt_head_dim(device):
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 33, 40, device=device) for _ in range(3))
    assert_close(fa2tune.attention(q, k, v), _reference(q, k, v, False, scale=1 / math.sqrt(40))[0], torch.float32)
    assert_close(fa2tune.attention(q, k, v, scale=2.0), _reference(q, k, v, False, scale=2.0)[0], torch.float32)


def test_large_scores_stay_finite(device):
    # Scores near 1e4: exp without the running max would overflow even in fp32.
    torch.manual_seed(5)
    q = 30 * torch.randn(1, 1, 70, 16, device=device)
    k = 30 * torch.randn(1, 1, 70, 16, device=device)
    v = torch.randn(1, 1, 70, 16, device=device)
    o, lse = fa2tune.attention(q, k, v, scale=1.0, return_lse=True)
    ref_o, ref_lse = _reference(q, k, v, False, scale=1.0)
    assert_close(o, ref_o, torch.float32)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.cpu(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("batch_heads", [1, 7, 65535, 65536, 200_000, 2**31 - 65536])
def test_forward_grid_covers_every_head_within_cuda_limits(batch_heads):
    tiles, b1, b2 = grid.fwd_grid(3, batch_heads)
    assert tiles == 3 and 1 <= b1 <= grid.GRID_AXIS_MAX and 1 <= b2 <= grid.GRID_AXIS_MAX
    assert batch_heads <= b1 * b2 < batch_heads + b2  # every head has a program; fewer than b2 idle ones


def test_forward_grid_refuses_more_heads_than_one_launch_covers():
    with pytest.raises(ValueError, match="batch·heads"):
        grid.fwd_grid(1, grid.GRID_AXIS_MAX**2 + 1)


@pytest.mark.parametrize("batch_heads", [2**31 - 1, 2**31, 65535**2])
def test_forward_grid_refuses_program_ids_past_int32(batch_heads):
    # The kernel numbers (batch, head) programs in int32: a grid whose axis2·B1 + axis1 could reach 2^31 would wrap
    # to negative heads and write out of bounds. Such a call is refused with a way out, not run.
    with pytest.raises(ValueError, match=r"32-bit program ids.*split the batch"):
        grid.fwd_grid(1, batch_heads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_with_batch_heads_split_over_two_grid_axes(causal, device, monkeypatch):
    # CUDA's cap (65535) made small: 3 batches x 5 heads = 15 go to grid axes (4, 4), one program per tile idle.
    monkeypatch.setattr(grid, "GRID_AXIS_MAX", 4)
    assert grid.fwd_grid(2, 15) == (2, 4, 4)
    torch.manual_seed(5)
    q, k, v = (torch.randn(3, 5, 70, 32, device=device) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    o, lse = ops.forward(q, k, v, causal=causal, scale=32**-0.5, out=out, config=KernelConfig(32, 16))
    ref_o, ref_lse = _reference(q, k, v, causal)
    assert_close(o, ref_o, torch.float32)
    assert_close(lse, ref_lse, torch.float32, what="lse")


def test_configs_cross_the_custom_op_boundary_whole():
    # torch.compile's path passes configs to the custom ops as int lists: every field, switches included, comes back
    pingpong = KernelConfig(128, 128, 4, 2, warp_specialized=True, pingpong=True, schedule=PERSISTENT)
    for cfg in (KernelConfig(64, 32, 4, 3, pipeline_qk=1), pingpong):
        assert ops._from_ints(ops._to_ints(cfg)) == cfg
    assert ops._from_ints([]) is None  # "resolve inside the op"
