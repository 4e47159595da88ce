"""V's head dim apart from Q's and K's (dv != d, as MLA-style models use): outputs and every gradient against the
float64 reference, through attention(), attention_varlen(), the custom op under torch.compile, get_kernel and the
drop-in calls; the configs such a call resolves and runs (the larger head dim's)."""

from __future__ import annotations

import ast
from dataclasses import replace

import pytest
import torch

import fa2tune
from fa2tune.api import sdpa
from fa2tune.config import head_chunks
from fa2tune.config.types import KernelConfig, Variant
from fa2tune.kernels import codegen
from fa2tune.launch import fallback
from fa2tune.tune.reference import naive_attention, naive_attention_varlen

from .conftest import assert_close
from .test_backward import _assert_grads_close
from .test_compat import _check, _key_padding, _torch_sdpa


def _qkv(shape, dtype, device, seed, layout="sdpa"):
    """Fresh random q, k (head dim d) and v (head dim dv) of shape (batch, heads_q, heads_kv, N_q, N_k, d, dv), in
    SDPA's layout or flash_attn's (batch, seqlen, heads, d)."""
    batch, hq, hkv, nq, nk, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    sizes = [(batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)]
    if layout == "flash":
        sizes = [(b, n, h, dim) for b, h, n, dim in sizes]
    return [torch.randn(size, generator=gen).to(device, dtype) for size in sizes]


def _reference(q, k, v, **mask):
    """(O, lse) and a function of dO giving the three float64 gradients."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    o, lse = naive_attention(*leaves, **mask)
    return o, lse, lambda do: torch.autograd.grad(o, leaves, do.cpu().double())


# (d, dv) narrower and wider V, head dims that are not powers of two; GQA (4 query heads on 2 K/V heads), lengths
# that are no multiple of a tile (the interpreter's 32) and N_Q != N_K; one dtype each.
CASES = [((32, 16), torch.float32), ((16, 48), torch.float16), ((40, 24), torch.bfloat16)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims, dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_attention_with_a_v_head_dim_of_its_own_matches_reference(dims, dtype, causal, device):
    q, k, v = _qkv((1, 4, 2, 37, 45, *dims), dtype, device, seed=sum(dims) + causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = fa2tune.attention(*leaves, causal=causal, return_lse=True)
    ref_o, ref_lse, ref_grads = _reference(q, k, v, causal=causal)
    assert o.shape == (1, 4, 37, dims[1]) and o.dtype == dtype and o.is_contiguous()
    assert_close(o, ref_o, dtype)
    assert_close(lse, ref_lse, torch.float32, what="lse")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    grads = torch.autograd.grad(o, leaves, do)
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]
    _assert_grads_close(grads, ref_grads(do), dtype, do)


def test_a_window_with_a_v_head_dim_of_its_own_matches_reference(device):
    q, k, v = _qkv((2, 2, 1, 41, 41, 32, 16), torch.float32, device, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fa2tune.attention(*leaves, window=(7, 3), scale=0.3)
    ref_o, _, ref_grads = _reference(q, k, v, window=(7, 3), scale=0.3)
    assert_close(o, ref_o, torch.float32)
    do = torch.randn_like(o)
    _assert_grads_close(torch.autograd.grad(o, leaves, do), ref_grads(do), torch.float32, do)


def test_packed_sequences_with_a_v_head_dim_of_its_own_match_reference(device):
    lengths = [5, 0, 33, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lengths), heads, d, generator=gen).to(device)
               for heads, d in ((4, 16), (2, 16), (2, 48)))  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = fa2tune.attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), causal=True, return_lse=True)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = naive_attention_varlen(*ref_leaves, cu.cpu(), cu.cpu(), causal=True)
    assert o.shape == (sum(lengths), 4, 48)
    assert_close(o, ref_o, torch.float32)
    assert_close(lse, ref_lse, torch.float32, what="lse")
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, do)
    _assert_grads_close(grads, torch.autograd.grad(ref_o, ref_leaves, do.cpu().double()), torch.float32, do)


def test_torch_compile_runs_the_custom_op_with_a_v_head_dim_of_its_own(device):
    # the op's fake output has V's head dim (a graph traced with q's would not compile), and the op gives what the
    # eager path gives, bit for bit. The output and its gradient are compared, not a loss reduced from it: on a GPU
    # inductor fuses a reduction after the op and sums in another order (305.8831 against 305.8830 eager).
    torch._dynamo.reset()
    q, k, v = _qkv((1, 2, 1, 33, 33, 32, 16), torch.float32, device, seed=5)

    def layer(q, k, v):
        return fa2tune.attention(q * 2.0, k, v, causal=True)

    leaves_eager = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_compiled = [t.clone().requires_grad_() for t in (q, k, v)]
    out_compiled = torch.compile(layer, fullgraph=True)(*leaves_compiled)
    out_eager = layer(*leaves_eager)
    assert out_compiled.shape == (1, 2, 33, 16) and torch.equal(out_compiled, out_eager)
    grad_out = torch.randn_like(out_eager)
    out_compiled.backward(grad_out)
    out_eager.backward(grad_out)
    for a, b in zip(leaves_compiled, leaves_eager, strict=True):
        assert a.grad.shape == a.shape and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding"])
def test_sdpa_takes_a_value_head_dim_of_its_own_as_pytorchs_does(masked, device):
    # PyTorch's SDPA takes Ev != E; so does fa2tune's, on the dense kernels and the key-padding route (packed)
    mask = _key_padding(2, 21, device, seed=6)[:, None, None, :] if masked else None
    _check(lambda q, k, v: fa2tune.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
           _torch_sdpa(attn_mask=None if mask is None else mask.cpu(), enable_gqa=True),
           _qkv((2, 4, 2, 11, 21, 24, 40), torch.float32, device, seed=7), torch.float32)  # fmt: skip


def test_flash_attn_func_takes_a_value_head_dim_of_its_own(device):
    # as flash_attn 3's hdim_v: out (batch, seqlen, heads, dv)
    def reference(q, k, v):
        return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)[0].transpose(1, 2)

    inputs = _qkv((2, 4, 2, 19, 23, 32, 16), torch.float16, device, seed=8, layout="flash")
    _check(lambda q, k, v: fa2tune.flash_attn_func(q, k, v, causal=True), reference, inputs, torch.float16)


def test_get_kernel_resolves_both_head_dims_and_refuses_other_calls(device):
    q, k, v = _qkv((1, 2, 2, 20, 20, 32, 16), torch.float32, device, seed=9)
    kernel = fa2tune.get_kernel(32, head_dim_v=16, device=device, dtype=torch.float32, causal=True)
    assert kernel.head_dim_v == 16
    assert torch.equal(kernel(q, k, v), fa2tune.attention(q, k, v, causal=True, config=kernel.config))
    with pytest.raises(ValueError, match=r"resolved for head_dim=32, head_dim_v=16, .* v with 32"):
        kernel(q, k, k)
    with pytest.raises(ValueError, match=r"head_dim_v must be an int in 1..256, got 300"):
        fa2tune.get_kernel(32, head_dim_v=300, device=device)
    assert fa2tune.get_kernel(32, head_dim_v=32, device=device) is fa2tune.get_kernel(32, device=device)


def test_fused_dq_renders_dq_in_k_s_chunks_and_dv_in_v_s():
    # The dK/dV kernel with dQ fused in takes V's head dim apart from Q's and K's: its dQ blocks (and their fp32 TMA
    # descriptors) follow K's chunks, its dV wgmmas V's. A resolved
    # fused config (an entry, tuned and checked with one head dim) gives way to its twin with a dQ kernel; an
    # explicit one runs as given.
    fused = KernelConfig(64, 128, 4, 2, warp_specialized=True, fused_dq=True)
    assert fallback.unfused_for_v(fused, False, 64, 32) == replace(fused, fused_dq=False)
    drained = replace(fused, drain_before_dq=True)
    assert fallback.unfused_for_v(drained, False, 64, 32) == replace(fused, fused_dq=False)
    assert fallback.unfused_for_v(fused, True, 64, 32) is fused
    assert fallback.unfused_for_v(fused, False, 64, 64) is fused
    for head_dim, head_dim_v in ((64, 32), (112, 80), (96, 128)):
        variant = Variant.for_template("bwd_ws", causal=False, banded=False, varlen=False, even_m=False, even_n=False,
                                       fused_dq=True, head_dim=head_dim, head_dim_v=head_dim_v)  # fmt: skip
        source = codegen.render("bwd_ws", variant)
        ast.parse(source)
        qk, vc = head_chunks.chunks(head_dim), head_chunks.chunks(head_dim_v)
        assert variant.fused_dq and variant.qk_chunks == qk and variant.v_chunks == vc
        assert f"dqacc_desc{len(qk) - 1}" in source and f"dqacc_desc{len(qk)}" not in source
        assert f"dv_desc{len(vc) - 1}" in source and f"dv_desc{len(vc)}" not in source
        for index, _, width in head_chunks.dq_blocks(head_dim):
            assert f"tma_reduce_add(dqacc_desc[{index}]" in source and f"dq_buf{width}" in source


def test_the_triton_templates_render_v_head_dim_only_where_it_differs():
    # one head dim: the code every stored entry's hash names (tests/test_store.py checks the shipped ones); two: V,
    # O, dO and dV on constexprs of their own
    at = lambda template, **dims: Variant.for_template(template, causal=True, banded=False, varlen=False, even_m=True,
                                                       even_n=False, **dims)  # fmt: skip
    for template in ("fwd", "bwd"):
        assert at(template, head_dim=64, head_dim_v=64) == at(template)
        assert "HEAD_DIM_V" not in codegen.render(template, at(template))
        distinct = at(template, head_dim=64, head_dim_v=32)
        assert distinct.distinct_v and "HEAD_DIM_V_PAD: tl.constexpr" in codegen.render(template, distinct)


def test_sdpa_patch_still_hands_pytorch_what_it_cannot_take(device):
    # on the device the tests run on: CPU tensors are handed over for that alone where a GPU runs the kernels
    q, k = torch.randn(1, 2, 5, 8, device=device), torch.randn(1, 2, 5, 4, device=device)
    reason = sdpa._unsupported(q, k, k, None, None, 0.0, False, None, False)
    assert reason.startswith("query and key head dims that differ")
    v = torch.randn(1, 2, 5, 4, device=device)
    assert sdpa._unsupported(q, q, v, None, None, 0.0, False, None, False) is None
