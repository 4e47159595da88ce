"""Gradients: dq, dk, dv against float64 autograd through the reference; determinism; torch.compile."""

from __future__ import annotations

import pytest
import torch

import fa2tune
from fa2tune.api import attention, ops
from fa2tune.config.types import KernelConfig
from fa2tune.launch import grid, launcher, layout, warpspec
from fa2tune.tune.reference import naive_attention

from .conftest import assert_close
from .test_launcher import DTYPES, SHAPES

# ‖grad − ref‖ / max(‖ref‖, ‖dO‖) per dtype (METHOD.md: bf16 operands land between 1e-3 and 1e-2; fp32 far
# under 1e-3). ‖dO‖ is the floor of the scale because a gradient can be exactly 0 (N = 1: dq = dk = 0), where
# any rounding of O in a 16-bit dtype is an infinite relative error.
GRAD_REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _random(shape, dtype, device, seed):
    batch, hq, hkv, nq, nk, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, nq, d, generator=gen).to(device, dtype)
    k = torch.randn(batch, hkv, nk, d, generator=gen).to(device, dtype)
    v = torch.randn(batch, hkv, nk, d, generator=gen).to(device, dtype)
    do = torch.randn(batch, hq, nq, d, generator=gen).to(device, dtype)
    return q, k, v, do


def _reference_grads(q, k, v, do, causal, scale=None):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o, _ = naive_attention(*leaves, causal=causal, scale=scale)
    return torch.autograd.grad(o, leaves, do.double())


def _assert_grads_close(grads, refs, dtype, do):
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        assert g.shape == ref.shape, f"{name}: shape {tuple(g.shape)} != {tuple(ref.shape)}"
        assert not torch.isnan(g).any(), f"{name}: {int(torch.isnan(g).sum())} NaN elements"
        scale = max(ref.norm().item(), do.double().norm().item())
        err = ((g.double().cpu() - ref.cpu()).norm() / scale).item()
        assert err <= GRAD_REL_TOL[dtype], f"{name}: relative error {err:.2e} > {GRAD_REL_TOL[dtype]:.0e} ({dtype})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gradients_match_reference(shape, causal, dtype, device):
    q, k, v, do = _random(shape, dtype, device, seed=hash((shape, causal)) % 2**31)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = fa2tune.attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert [g.dtype for g in grads] == [dtype] * 3
    _assert_grads_close(grads, _reference_grads(q, k, v, do, causal), dtype, do)


@pytest.mark.parametrize(
    "dkdv_config, dq_config",
    [(KernelConfig(16, 64), KernelConfig(64, 16)), (KernelConfig(64, 16), KernelConfig(16, 64))],
    ids=["wide_n_for_dkdv", "wide_m_for_dkdv"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_configs_of_both_backward_kernels(dkdv_config, dq_config, causal, device):
    # Ragged both ways and GQA, with tiles that do not line up between the two kernels.
    q, k, v, do = _random((1, 4, 2, 83, 51, 40), torch.float32, device, seed=7)
    o, lse = ops.forward(q, k, v, causal=causal, scale=0.2)
    grads = ops.backward(
        do, q, k, v, o, lse, causal=causal, scale=0.2, dkdv_config=dkdv_config, dq_config=dq_config
    )
    _assert_grads_close(grads, _reference_grads(q, k, v, do, causal, scale=0.2), torch.float32, do)


@pytest.mark.parametrize("batch, kv_heads", [(2, 3), (1, 5), (3, 1)], ids=["6heads", "5heads", "3heads"])
def test_a_causal_dkdv_grid_launched_interleaved_over_heads_covers_every_tile(batch, kv_heads, device):
    # The causal dK/dV grid's slots take the heads' tiles interleaved four heads at a time (_macros.jinja's
    # interleaved_slot): batch · K/V heads of 6, 5 and 3 leave a last set of two, one and three heads; GQA 2, ragged
    # tiles of 16 keys. Every tile's dK and dV must come out once.
    q, k, v, do = _random((batch, 2 * kv_heads, kv_heads, 50, 50, 16), torch.float32, device, seed=batch + kv_heads)
    o, lse = ops.forward(q, k, v, causal=True, scale=0.25)
    grads = ops.backward(do, q, k, v, o, lse, causal=True, scale=0.25, dkdv_config=KernelConfig(16, 16),
                         dq_config=KernelConfig(16, 16))  # fmt: skip
    _assert_grads_close(grads, _reference_grads(q, k, v, do, True, scale=0.25), torch.float32, do)


@pytest.mark.parametrize("which", ["q", "k", "v", "kv"])
def test_any_subset_of_inputs_may_require_grad(which, device):
    q, k, v, do = _random((1, 2, 2, 30, 30, 16), torch.float32, device, seed=3)
    tensors = {"q": q, "k": k, "v": v}
    for name in which:
        tensors[name].requires_grad_()
    o = fa2tune.attention(q, k, v, causal=True)
    o.backward(do)
    refs = dict(zip("qkv", _reference_grads(q, k, v, do, True), strict=True))
    for name, t in tensors.items():
        if name in which:
            rel = ((t.grad.double().cpu() - refs[name].cpu()).norm() / refs[name].norm()).item()
            assert rel < 1e-5, f"d{name} relative error {rel:.2e}"
        else:
            assert t.grad is None


def test_backward_is_deterministic(device):
    q, k, v, do = _random((2, 4, 1, 70, 70, 32), torch.float16, device, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    first = torch.autograd.grad(fa2tune.attention(q, k, v, causal=True), (q, k, v), do)
    second = torch.autograd.grad(fa2tune.attention(q, k, v, causal=True), (q, k, v), do)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("copy_lse", [False, True], ids=["lse-kept", "lse-copied"])
@pytest.mark.parametrize("zero_dq", [False, True], ids=["delta-only", "zeroes-dq"])
def test_the_preprocess_zeroes_exactly_the_fp32_dq_rows_when_asked(zero_dq, copy_lse, device):
    # With dQ fused into the dK/dV kernel the preprocess also zeroes the fp32 dQ it adds into (on the GPU only:
    # that kernel is a Gluon one). Here the preprocess alone: ragged rows (37 of blocks of 16), head_dim 48 padded
    # to 64, and the fp32 dQ a window into a NaN-poisoned buffer, whose other elements must stay as they were.
    # δ fills its buffer's 48 rows a head (0 past row 37), and with COPY_LSE so does the logsumexp (+inf past 37),
    # read through strides of its own.
    from fa2tune.config import planner
    from fa2tune.config.types import Mask

    batch, heads, n, d, block_m, rows = 2, 3, 37, 48, 16, 48
    o, do = (torch.randn(batch, heads, n, d, device=device).to(torch.bfloat16) for _ in range(2))
    delta = torch.full((batch, heads, rows), float("nan"), device=device)
    lse = torch.randn(heads, batch, n, device=device).transpose(0, 1)  # batch and head strides swapped
    lse_out = torch.full((batch, heads, rows), float("nan"), device=device)
    buffer = torch.full((batch, heads, n + 5, d + 8), float("nan"), device=device)
    dq_acc = buffer[:, :, 2 : n + 2, 4 : d + 4]
    kernel = layout.kernel("bwd", "_attn_bwd_preprocess", Mask(), n, n, KernelConfig(block_m, 16, 4, 1), False)
    # the strides in the units the kernel multiplies back: the fp32 dQ's rows are 56 apart, which 16 does not divide
    units, strides = layout.in_units(O=o.stride()[:3], DO=do.stride()[:3],
                                     ACC=dq_acc.stride()[:3] if zero_dq else (0, 0, 0))  # fmt: skip
    assert units == {"UNIT_O": 8, "UNIT_DO": 8, "UNIT_ACC": 8}
    kernel[(grid.cdiv(n, block_m) * batch * heads,)](
        o, do, lse, lse_out, delta, dq_acc, *strides[:6], *lse.stride(), *strides[6:], heads, n, rows, HEAD_DIM=d,
        HEAD_DIM_PAD=planner.head_dim_padded(d), BLOCK_M=block_m, ZERO_DQ=zero_dq, COPY_LSE=copy_lse,
        **units,
    )  # fmt: skip
    expected = (o.float() * do.float()).sum(-1)
    assert torch.allclose(delta[..., :n], expected, rtol=1e-5, atol=1e-5)
    assert (delta[..., n:] == 0).all()
    if copy_lse:
        assert torch.equal(lse_out[..., :n], lse) and (lse_out[..., n:] == float("inf")).all()
    else:
        assert lse_out.isnan().all(), "COPY_LSE off, yet the logsumexp was copied"
    window = torch.zeros_like(buffer, dtype=torch.bool)
    window[:, :, 2 : n + 2, 4 : d + 4] = True
    assert buffer[~window].isnan().all(), "the preprocess wrote outside the fp32 dQ"
    if zero_dq:
        assert (dq_acc == 0).all(), f"{int((dq_acc != 0).sum())} elements of the fp32 dQ not zeroed"
    else:
        assert dq_acc.isnan().all(), "ZERO_DQ off, yet the fp32 dQ was written"


def test_each_tensor_s_stride_unit_is_the_widest_vector_dividing_its_strides_below_2_to_the_31():
    # d = 72: rows 72 elements apart, heads 72·N — 8 divides them where the JIT's own check (16) does not
    assert layout.stride_unit((28 * 197 * 72, 197 * 72, 72)) == 8
    assert layout.stride_unit((0, 0, 0)) == 8  # a packed batch stride, or an unused tensor's
    assert layout.stride_unit((4 * 100, 100)) == 4
    assert layout.stride_unit((48, 37)) == 1
    # a unit a tensor, so that one of weaker alignment narrows no other's; a tensor with a stride of 2^31 or more
    # passes its strides whole: a kernel multiplies a divided one back as an int32, which would wrap
    units, strides = layout.in_units(Q=(144, 72), V=(84, 84), O=(2**31 - 8, 72))
    assert units == {"UNIT_Q": 8, "UNIT_V": 4, "UNIT_O": 8} and strides == (18, 9, 21, 21, (2**31 - 8) // 8, 9)
    assert layout.in_units(K=(2**31 + 2**13, 72), O=(72,)) == ({"UNIT_K": 1, "UNIT_O": 8}, (2**31 + 2**13, 72, 9))


def test_the_warpspec_backward_launchers_refuse_statistics_strides_without_the_padded_rows():
    # The Hopper dK/dV and dQ kernels read a head's logsumexp and δ unmasked up to seqlen_q rounded up to 16: a head
    # stride of seqlen_q (the forward's own layout at a ragged length) would read the next head's rows, or past the
    # buffer's end at the last head. Their launchers check it once, where a plan builds them.
    q = torch.empty(2, 4, 37, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 40, 64, device="meta", dtype=torch.bfloat16)
    config = KernelConfig(64, 128, 4, 2, warp_specialized=True)
    dq_config = KernelConfig(128, 64, 4, 2, warp_specialized=True)
    for launcher_of, cfg in ((warpspec.backward_dkdv_launcher, config), (warpspec.backward_dq_launcher, dq_config)):
        for strides in ((4 * 37, 37), (48, 48)):
            with pytest.raises(ValueError, match=r"48 rows a head \(seqlen_q=37 .*got strides"):
                launcher_of(q, k, strides, causal=False, scale=0.125, config=cfg)
    assert grid.stats_rows(37) == 48 and grid.stats_rows(32) == 32
    assert warpspec._check_stats_strides((4 * 48, 48), 4, 37) is None


@pytest.mark.parametrize("seqlen_q", [37, 32], ids=["ragged", "aligned"])
def test_the_kernels_read_statistics_padded_to_16_rows(seqlen_q, device, monkeypatch):
    # The dK/dV and dQ kernels read the logsumexp and δ at one (batch, head) stride, a multiple of 16 for a dense
    # call, with lse = +inf and δ = 0 in the rows past N_Q: the warp-specialized dK/dV kernel masks its loads of
    # them at N_Q rounded up to 16 (bwd_ws.py.jinja's _row_stats), so a ragged length compiles an aligned one's
    # step. An aligned call's logsumexp is read where the forward left it. δ is shifted by dlse row for row.
    from fa2tune.launch import fastlaunch

    batch, heads = 2, 3
    q, _, _, do = _random((batch, heads, heads, seqlen_q, 45, 16), torch.float32, device, seed=13)
    _, k, v, _ = _random((batch, heads, heads, 45, 45, 16), torch.float32, device, seed=14)
    o, lse = ops.forward(q, k, v, causal=True, scale=0.25)
    dlse = torch.randn_like(lse)
    seen, real = {}, fastlaunch.launch

    def recording(kernel, grid, tensors, scalars, **kwargs):
        real(kernel, grid, tensors, scalars, **kwargs)
        if kernel.fn.__name__ in ("_attn_bwd_dkdv", "_attn_bwd_dq"):
            args = dict(zip(kernel.arg_names, (*tensors, *scalars), strict=False))
            seen[kernel.fn.__name__] = {name: args[name] for name in ("stride_lb", "stride_lh")}
            seen[kernel.fn.__name__].update(LSE=args["LSE"].clone(), DELTA=args["DELTA"].clone(),
                                            same_lse=args["LSE"].data_ptr() == lse.data_ptr())  # fmt: skip

    monkeypatch.setattr(fastlaunch, "launch", recording)
    ops.backward(do, q, k, v, o, lse, causal=True, scale=0.25, dkdv_config=KernelConfig(16, 16),
                 dq_config=KernelConfig(16, 16), dlse=dlse)  # fmt: skip
    rows = -(-seqlen_q // 16) * 16
    delta = (o.double() * do.double()).sum(-1) - dlse.double()
    assert set(seen) == {"_attn_bwd_dkdv", "_attn_bwd_dq"}
    for name, got in seen.items():
        assert (got["stride_lb"], got["stride_lh"]) == (heads * rows, rows), name
        assert got["same_lse"] == (rows == seqlen_q), name  # copied only where the layout differs
        stats = [t.flatten()[: batch * heads * rows].view(batch, heads, rows) for t in (got["LSE"], got["DELTA"])]
        assert torch.equal(stats[0][..., :seqlen_q], lse), name
        assert (stats[0][..., seqlen_q:] == float("inf")).all() and (stats[1][..., seqlen_q:] == 0).all(), name
        assert torch.allclose(stats[1][..., :seqlen_q].double().cpu(), delta.cpu(), rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_a_logsumexp_of_another_layout_gives_the_same_gradients(packed, device):
    # The kernels read the logsumexp and δ at one set of strides, δ as the preprocess writes it (contiguous): a
    # logsumexp that is a slice of a wider buffer (or a dense one in another order) is copied into that layout.
    lengths = [1, 17, 5]
    q, k, v, do = _random((2, 4, 2, 17, 23, 16), torch.float32, device, seed=15)
    packing = None
    if packed:  # (total, heads, d): three sequences of one batch row's tokens
        cu = torch.tensor([0, 1, 18, 23], dtype=torch.int32, device=device)
        q, k, v, do = (t.transpose(1, 2).reshape(-1, *t.shape[1:2], 16)[: sum(lengths)] for t in (q, k, v, do))
        packing = launcher.Packing(cu, cu, max(lengths), max(lengths))
    o, lse = ops.forward(q, k, v, causal=True, scale=0.25, packing=packing)
    dlse = torch.randn_like(lse)
    wide = torch.full((*lse.shape[:-1], lse.shape[-1] + 7), float("nan"), device=device)
    wide[..., 3 : 3 + lse.shape[-1]] = lse
    configs = dict(dkdv_config=KernelConfig(16, 16), dq_config=KernelConfig(16, 16))
    expected = ops.backward(do, q, k, v, o, lse, causal=True, scale=0.25, packing=packing, dlse=dlse, **configs)
    others = [wide[..., 3 : 3 + lse.shape[-1]]]
    if not packed:
        others.append(lse.transpose(0, 1).contiguous().transpose(0, 1))  # batch and head strides swapped
    for other in others:
        grads = ops.backward(do, q, k, v, o, other, causal=True, scale=0.25, packing=packing, dlse=dlse, **configs)
        for got, want in zip(grads, expected, strict=True):
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (other.stride(), (got - want).abs().max())


def test_sum_backward_with_a_stride_zero_gradient(device):
    q, k, v, _ = _random((1, 2, 2, 20, 20, 16), torch.float32, device, seed=5)
    q.requires_grad_()
    fa2tune.attention(q, k, v).sum().backward()  # dO is an expanded scalar: every stride 0
    ref = _reference_grads(q, k, v, torch.ones_like(q), False)[0]
    assert ((q.grad.double().cpu() - ref.cpu()).norm() / ref.norm()).item() < 1e-5


def test_only_linear_memory_is_saved_for_backward(device):
    q, k, v, _ = _random((1, 2, 2, 64, 64, 16), torch.float32, device, seed=6)
    q.requires_grad_()
    o = fa2tune.attention(q, k, v, causal=True)
    saved = [t for t in o.grad_fn.saved_tensors if t is not None]  # None: the cu_seqlens of packed inputs
    assert sum(t.numel() for t in saved) == 4 * q.numel() + q.shape[0] * q.shape[1] * q.shape[2]
    assert all(t.shape[-1] in (16, 64) and t.numel() <= q.numel() for t in saved)  # q, k, v, o, lse: no N×N


def test_wrong_gradient_shape_is_rejected(device):
    q, k, v, _ = _random((1, 2, 2, 20, 20, 16), torch.float32, device, seed=8)
    q.requires_grad_()
    o = fa2tune.attention(q, k, v)
    with pytest.raises(RuntimeError, match="shape"):
        torch.autograd.grad(o, q, torch.ones(1, 2, 20, 15, device=device))


def test_torch_compile_fullgraph_matches_eager(device):
    # Compiled first, before any eager call: tracing must not reach the config store's file reads.
    torch._dynamo.reset()
    from fa2tune.api import attention_kernel

    attention_kernel.clear_cache()

    def layer(q, k, v):
        return fa2tune.attention(q * 2.0, k, v, causal=True).square().sum()

    q, k, v, _ = _random((1, 2, 1, 33, 33, 16), torch.float32, device, seed=9)
    leaves_eager = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_compiled = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(layer, fullgraph=True)
    loss_compiled = compiled(*leaves_compiled)
    loss_compiled.backward()
    loss_eager = layer(*leaves_eager)
    loss_eager.backward()
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(leaves_compiled, leaves_eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_output", [True, False], ids=["o-and-lse", "lse-only"])
def test_the_logsumexp_is_differentiable(use_output, device):
    # ∂lse_i/∂s_ij = P_ij: a loss on the logsumexp (merging attention over key chunks, z-loss) gets its gradient.
    q, k, v, _ = _random((1, 2, 1, 37, 45, 32), torch.float32, device, seed=12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = fa2tune.attention(*leaves, causal=True, return_lse=True)
    weights = torch.randn_like(lse)
    loss = (lse * weights).sum() + (o.square().sum() if use_output else 0)
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = naive_attention(*ref_leaves, causal=True)
    finite = torch.isfinite(ref_lse)  # causal with q_len < k_len: every row sees a key here
    assert finite.all()
    ref_loss = (ref_lse * weights.double()).sum() + (ref_o.square().sum() if use_output else 0)
    wants = torch.autograd.grad(ref_loss, ref_leaves, allow_unused=True)  # the logsumexp alone does not use v
    for got, want, leaf in zip(grads, wants, ref_leaves, strict=True):
        assert_close(got, torch.zeros_like(leaf) if want is None else want, torch.float32, what="gradient")


def test_torch_compile_with_one_tensor_as_q_k_and_v(device):
    # dynamo refuses an autograd.Function given one tensor twice; the autograd formula is on the op instead.
    torch._dynamo.reset()
    x = _random((1, 2, 2, 40, 40, 16), torch.float32, device, seed=13)[0].requires_grad_()
    out = torch.compile(lambda x: fa2tune.attention(x, x, x, causal=True), fullgraph=True)(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    ref_x = x.detach().double().requires_grad_()
    ref = naive_attention(ref_x, ref_x, ref_x, causal=True)[0]
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), ref_x)
    assert_close(out, ref, torch.float32)
    assert_close(grad, ref_grad, torch.float32, what="gradient")


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_eager_calls_and_the_custom_op_give_the_same_outputs_and_gradients(packed, device):
    # Eager calls skip the custom op's dispatch (launcher.EagerAttention); torch.compile sees the op. The two
    # must agree bit for bit: same kernels, same configs, same logsumexp gradient, same varlen checks.
    from fa2tune.config.types import Mask

    torch.manual_seed(14)
    if packed:
        lengths = [5, 0, 33, 17]
        total = sum(lengths)
        q, k, v = (torch.randn(total, 4, 32, device=device) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        packing = launcher.Packing(cu, cu, max(lengths), max(lengths))
    else:
        q, k, v = (torch.randn(2, 4, 41, 32, device=device) for _ in range(3))
        packing = None
    mask = Mask(causal=True, window=(9, -1))
    runs = []
    for eager in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        apply = attention.apply_eager if eager else lambda *args: ops.apply_op(*args)
        o, lse = apply(*leaves, mask, 0.3, None, packing)
        weights = torch.randn_like(o, generator=torch.Generator(device).manual_seed(1))
        loss = (o * weights).sum() + torch.where(torch.isfinite(lse), lse, 0).sum()
        runs.append((o, lse, *torch.autograd.grad(loss, leaves)))
    for eager_t, op_t in zip(*runs, strict=True):
        assert torch.equal(eager_t, op_t)


def test_traced_calls_go_through_the_custom_op(device):
    # Under a dispatch mode (fake tensors, make_fx) the launchers must not run: the op's fake kernel answers.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 1000, 64, dtype=torch.bfloat16, device=device)
        k = torch.empty(2, 2, 1500, 64, dtype=torch.bfloat16, device=device)
        o, lse = fa2tune.attention(q, k, k, causal=True, return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (2, 4, 1000) and lse.dtype == torch.float32


def test_calls_with_nothing_to_differentiate_skip_autograd(device, monkeypatch):
    # Inputs without grad, or any inputs under torch.no_grad / inference_mode: the forward runs without the
    # autograd.Function (its host time buys nothing there) and gives the grad path's outputs bit for bit.
    torch.manual_seed(15)
    q, k, v = (torch.randn(2, 4, 37, 32, device=device) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with_grad = fa2tune.attention(*leaves, causal=True, return_lse=True)
    assert with_grad[0].requires_grad and with_grad[0].grad_fn is not None
    calls = []
    real = launcher.EagerAttention.apply
    monkeypatch.setattr(launcher.EagerAttention, "apply", lambda *args: calls.append(args) or real(*args))
    outputs = [fa2tune.attention(q, k, v, causal=True, return_lse=True)]
    with torch.no_grad():
        outputs.append(fa2tune.attention(*leaves, causal=True, return_lse=True))
    with torch.inference_mode():
        outputs.append(fa2tune.attention(q, k, v, causal=True, return_lse=True))
    assert not calls
    for o, lse in outputs:
        assert not o.requires_grad and o.grad_fn is None
        assert torch.equal(o, with_grad[0].detach()) and torch.equal(lse, with_grad[1].detach())
    fa2tune.attention(leaves[0], k, v, causal=True)  # one input with grad: the autograd.Function again
    assert len(calls) == 1


def _large_scores(nq, nk, dtype, device, seed, *, all_negative):
    """flash-attention's test_flash_attn_bwd_overflow inputs: 2 batches, 5 heads, d = 64, q = randn·5, k and
    v = randn·3; all_negative: every query points away from one key direction (q ≈ −2·k₀, keys ≈ k₀), so every
    score is about −144 and each logsumexp too — past fp32's range as an exponent, not only fp16's."""
    gen = torch.Generator().manual_seed(seed)
    shape = lambda n: (2, 5, n, 64)
    v, do = torch.randn(shape(nk), generator=gen) * 3, torch.randn(shape(nq), generator=gen)
    if all_negative:
        k0 = torch.randn(2, 5, 1, 64, generator=gen) * 3
        k = k0 + 0.05 * torch.randn(shape(nk), generator=gen)
        q = -2 * k0 + 0.05 * torch.randn(shape(nq), generator=gen)
    else:
        q, k = torch.randn(shape(nq), generator=gen) * 5, torch.randn(shape(nk), generator=gen) * 3
    return (t.to(device, dtype) for t in (q, k, v, do))


def _assert_grads_within_flash_attention_bound(grads, q, k, v, do, causal, scale=None):
    """No NaN, and each gradient's largest error against float64 at most 5× that of the same attention computed by
    PyTorch in the inputs' dtype, plus 1e-3: test_flash_attn_bwd_overflow's bound. Scores this large carry the
    16-bit rounding of q·kᵀ into the exponent (bf16: a few % of a gradient, in PyTorch as here)."""
    refs = _reference_grads(q, k, v, do, causal, scale)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    same_dtype = torch.autograd.grad(naive_attention(*leaves, causal=causal, scale=scale)[0], leaves, do)
    for name, g, ref, pt in zip(("dq", "dk", "dv"), grads, refs, same_dtype, strict=True):
        assert not torch.isnan(g).any(), f"{name}: {int(torch.isnan(g).sum())} NaN elements"
        err, pt_err = ((t.double().cpu() - ref.cpu()).abs().max().item() for t in (g, pt))
        assert err <= 5 * pt_err + 1e-3, f"{name}: largest error {err:.2e}, PyTorch's in {q.dtype} {pt_err:.2e}"


# Lengths 1-3, one past a tile (32: the interpreter's tiles; 16, 64, 128 on a GPU: tests/test_gpu.py), and q ≠ k.
@pytest.mark.parametrize("lengths", [(1, 1), (2, 2), (3, 3), (2, 33), (33, 2)], ids=lambda n: "x".join(map(str, n)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_short_sequences_of_large_scores_give_finite_gradients(lengths, causal, dtype, device):
    # A few keys with scores of large magnitude make a query's logsumexp very negative. A key past N_K — a zero row
    # of a ragged tile, whose score is 0 — then has P = e^(−lse), past the 16-bit range (or fp32's): a kernel that
    # lets it reach dS·K adds ±inf·0 = NaN to dQ. FlashAttention had this bug; so had fa2tune's dK/dV kernel with dQ
    # fused in (the shipped d=64 entries on the H200: dq NaN at N = 1 and 2). On the GPU this runs the shipped
    # entries; here the interpreter's Triton kernels.
    for all_negative in (False, True):
        q, k, v, do = _large_scores(*lengths, dtype, device, seed=sum(lengths), all_negative=all_negative)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o, lse = fa2tune.attention(q, k, v, causal=causal, return_lse=True)
        grads = torch.autograd.grad(o, (q, k, v), do)
        ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
        seen = torch.isfinite(ref_lse)
        assert_close(lse[seen], ref_lse[seen], torch.float32, what="lse")
        assert (ref_lse[seen] < -100).all() or not all_negative  # the inputs do what they are for
        assert_close(o, ref_o.nan_to_num(0.0), dtype)
        _assert_grads_within_flash_attention_bound(grads, q, k, v, do, causal)


@pytest.mark.parametrize("width", [80, 76, 73], ids=["unit8", "unit4", "unit1"])
def test_inputs_cut_from_wider_rows_match_reference(width, device):
    # q, k, v and dO of head dim 72 cut from rows `width` elements wide (a slice of a fused buffer), in the flash_attn
    # layout: strides of 0, 4 and 1 mod 8, which the Triton kernels take in units of 8, 4 and 1 (layout.in_units)
    # and multiply back. A sliding window, so that a GPU runs those kernels too; forward and gradients against
    # float64.
    gen = torch.Generator().manual_seed(width)
    rows = [torch.randn(2, 45, 3, width, generator=gen).to(device, torch.float16)[..., 1:73] for _ in range(4)]
    assert rows[0].stride()[-2:] == (width, 1)
    q, k, v, do = (t.transpose(1, 2) for t in rows)  # (batch, heads, seqlen, 72) views, unit last stride
    leaves = [t.requires_grad_() for t in (q, k, v)]
    o = fa2tune.attention(*leaves, causal=True, window=(20, 0))
    grads = torch.autograd.grad(o, leaves, do)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*ref_leaves, causal=True, window=(20, 0))
    assert_close(o, ref, torch.float16)
    _assert_grads_close(grads, torch.autograd.grad(ref, ref_leaves, do.double()), torch.float16, do)
