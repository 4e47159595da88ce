"""Checks that need a real CUDA device: production-sized shapes, 64-bit offsets. Run with scripts/gpu-tests.sh."""

from __future__ import annotations

import pytest
import torch

import fa2tune
from fa2tune.reference import naive_attention

from .conftest import assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_production_shapes_match_reference(head_dim, causal, dtype):
    torch.manual_seed(head_dim)
    q = torch.randn(2, 4, 1000, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(2, 2, 1537, head_dim, dtype=dtype, device="cuda")
    v = torch.randn(2, 2, 1537, head_dim, dtype=dtype, device="cuda")
    o, lse = fa2tune.attention(q, k, v, causal=causal, return_lse=True)
    ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    assert_close(o, ref_o, dtype)
    assert_close(lse, ref_lse, torch.float32, what="lse")


def test_offsets_past_two_to_the_31_elements():
    # 2^31 + 2^21 elements per tensor: the last (batch, head) starts past what int32 offsets can address.
    batch, heads, seqlen, head_dim = 16384 + 16, 16, 128, 64
    q = torch.randn(batch, heads, seqlen, head_dim, dtype=torch.bfloat16, device="cuda")
    assert q.numel() > 2**31
    k, v = q[:, :, torch.randperm(seqlen, device="cuda")], q.flip(2)
    o = fa2tune.attention(q, k, v, causal=True)
    tail = slice(batch - 2, batch)
    ref, _ = naive_attention(q[tail].double(), k[tail].double(), v[tail].double(), causal=True)
    assert_close(o[tail], ref, torch.bfloat16)


def test_inspect_reads_the_card():
    from fa2tune import device, planner

    info = device.inspect("cuda:0")
    props = torch.cuda.get_device_properties(0)
    assert info.name == props.name and info.sm_count == props.multi_processor_count
    assert info.smem_per_block >= 48 * 1024 and info.source == "card" and info.triton_version
    cfg = planner.default_config(128, torch.bfloat16, device=info)
    assert planner.check(cfg, info, 128, torch.bfloat16) is None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_direct_launches_give_what_triton_s_launch_path_gives(causal, monkeypatch):
    # fa2tune.fastlaunch reuses a compiled kernel for later calls of the same argument class. Calls that alternate
    # classes — 16-byte aligned and not, a stride that is and is not a multiple of 16, another length — must each
    # get the binary compiled for them: results equal to the JIT path's, bit for bit, and right against float64.
    from fa2tune import fastlaunch

    torch.manual_seed(3)
    base = torch.randn(2 * 4 * 300 * 64 + 8, dtype=torch.bfloat16, device="cuda")
    aligned = base[: 2 * 4 * 300 * 64].view(2, 4, 300, 64)
    shifted = base[1 : 1 + 2 * 4 * 300 * 64].view(2, 4, 300, 64)  # 2 bytes off a 16-byte boundary
    wide = torch.randn(2, 4, 300, 72, dtype=torch.bfloat16, device="cuda")[..., :64]  # row stride 72: not % 16
    cases = [(aligned, aligned, aligned), (shifted, aligned, shifted), (wide, wide, aligned), (aligned[:, :, :77],) * 3]

    def run_all():
        outs = []
        for q, k, v in cases * 2:  # every class twice: the second call of each is a direct launch
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            o = fa2tune.attention(q, k, v, causal=causal)
            outs.append((o, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))))
        return outs

    fastlaunch.clear()
    monkeypatch.setattr(fastlaunch, "_enabled", True)  # whatever FA2TUNE_DIRECT_LAUNCH says
    start = fastlaunch.direct_launches
    direct = run_all()
    assert fastlaunch.direct_launches - start >= 4 * len(cases), "the direct path was not taken"
    monkeypatch.setattr(fastlaunch, "_enabled", False)
    jit = run_all()
    for got, want in zip(direct, jit, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    for (q, k, v), (o, *_) in zip(cases, direct, strict=False):
        ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=causal)
        assert_close(o, ref, torch.bfloat16)
