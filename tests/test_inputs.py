"""Bad input to attention() fails early, naming the argument, what was expected and what came."""

from __future__ import annotations

import pytest
import torch

import fa2tune
from fa2tune import KernelConfig


def _qkv(device, b=1, hq=2, hkv=2, nq=8, nk=8, d=16, dtype=torch.float32):
    return (
        torch.randn(b, hq, nq, d, device=device, dtype=dtype),
        torch.randn(b, hkv, nk, d, device=device, dtype=dtype),
        torch.randn(b, hkv, nk, d, device=device, dtype=dtype),
    )


def test_non_tensor(device):
    q, _k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got list"):
        fa2tune.attention(q, [[1.0]], v)


def test_wrong_rank(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, heads, seqlen, head_dim\).*got shape \(2, 8, 16\)"):
        fa2tune.attention(q[0], k, v)


def test_integer_dtype(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"v must be float16, bfloat16 or float32, got torch.int64"):
        fa2tune.attention(q, k, v.long())


def test_float64_is_not_a_kernel_dtype(device):
    q, k, v = _qkv(device, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"q must be float16, bfloat16 or float32, got torch.float64"):
        fa2tune.attention(q, k, v)


def test_mixed_dtypes(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"share one dtype, got q=torch.float32, k=torch.float16"):
        fa2tune.attention(q, k.half(), v)


def test_batch_mismatch(device):
    q, _, _ = _qkv(device, b=2)
    _, k, v = _qkv(device, b=3)
    with pytest.raises(ValueError, match=r"same batch size, got 2, 3, 3"):
        fa2tune.attention(q, k, v)


def test_kv_heads_mismatch(device):
    q, k, _ = _qkv(device, hq=4, hkv=2)
    _, _, v = _qkv(device, hq=4, hkv=1)
    with pytest.raises(ValueError, match=r"k and v must have the same number of heads, got k=2, v=1"):
        fa2tune.attention(q, k, v)


def test_gqa_heads_must_divide(device):
    q, k, v = _qkv(device, hq=6, hkv=4)
    with pytest.raises(ValueError, match=r"multiple of k/v's heads \(GQA/MQA\), got q heads=6, k/v heads=4"):
        fa2tune.attention(q, k, v)


def test_kv_without_heads_is_named(device):
    q, k, v = _qkv(device, hq=2, hkv=0)
    with pytest.raises(ValueError, match=r"k and v must have at least one head, got none \(q heads=2\)"):
        fa2tune.attention(q, k, v)


@pytest.mark.parametrize("hkv", [0, 2], ids=["no-kv-heads", "kv-heads"])
def test_no_query_heads_give_an_empty_output_and_zero_gradients(device, hkv):
    # as scaled_dot_product_attention: no query heads (and no K/V heads, or some) is an empty call, not an error
    q, k, v = (t.requires_grad_() for t in _qkv(device, hq=0, hkv=hkv))
    o = fa2tune.attention(q, k, v, causal=True)
    assert o.shape == torch.nn.functional.scaled_dot_product_attention(q, k[:, :0], v[:, :0]).shape
    o.sum().backward()
    assert q.grad.shape == q.shape
    assert k.grad.shape == k.shape and not k.grad.any() and not v.grad.any()


@pytest.mark.parametrize("enable_gqa", [False, True])
def test_sdpa_and_packed_calls_without_heads_are_empty(device, enable_gqa):
    q, k, v = (t.requires_grad_() for t in _qkv(device, hq=0, hkv=0))
    o = fa2tune.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    assert o.shape == q.shape
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    packed = [torch.randn(8, 0, 16, device=device, requires_grad=True) for _ in range(3)]
    o = fa2tune.attention_varlen(*packed, cu, cu, 5, 5, causal=True)
    assert o.shape == (8, 0, 16)
    o.sum().backward()
    assert all(t.grad.shape == t.shape for t in packed)


def test_kv_length_mismatch(device):
    q, k, _ = _qkv(device, nk=8)
    _, _, v = _qkv(device, nk=9)
    with pytest.raises(ValueError, match=r"k and v must have the same sequence length, got k=8, v=9"):
        fa2tune.attention(q, k, v)


def test_head_dim_mismatch(device):
    # K's head dim is Q's (the scores are q·kᵀ), V's may be its own (tests/test_head_dim_v.py runs those)
    q, _, v = _qkv(device, d=16)
    _, k, _ = _qkv(device, d=32)
    with pytest.raises(ValueError, match=r"k's head_dim must equal q's \(the scores are q·kᵀ\), got q=16, k=32"):
        fa2tune.attention(q, k, v)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"k's head_dim must equal q's .*, got q=16, k=32"):
        fa2tune.attention_varlen(*packed, cu, cu, 8, 8)


def test_head_dim_too_large(device):
    q, k, v = _qkv(device, d=320, nq=1, nk=1)
    with pytest.raises(ValueError, match=r"q's head_dim must be in 1..256, got 320"):
        fa2tune.attention(q, k, v)
    q, k, _ = _qkv(device, nq=1, nk=1)
    v = torch.randn(1, 2, 1, 264, device=device)
    with pytest.raises(ValueError, match=r"v's head_dim must be in 1..256, got 264"):
        fa2tune.attention(q, k, v)


def test_non_unit_last_stride(device):
    q, _k, v = _qkv(device)
    with pytest.raises(ValueError, match=r"k must have unit stride in its last dimension.*\.contiguous\(\)"):
        fa2tune.attention(q, torch.randn(1, 2, 8, 32, device=device)[..., ::2], v)


def test_devices_differ():
    q, k, v = _qkv("cpu")
    meta = torch.empty_like(k, device="meta")
    with pytest.raises(ValueError, match=r"q, k and v must be on one device, got q=cpu, k=meta, v=cpu"):
        fa2tune.attention(q, meta, v)


def test_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv("cpu")
    with pytest.raises(ValueError, match=r"q is on the CPU.*TRITON_INTERPRET=1"):
        fa2tune.attention(q, k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale_value(scale, device):
    with pytest.raises(ValueError, match=r"scale must be a positive finite number"):
        fa2tune.attention(*_qkv(device), scale=scale)


def test_bad_scale_type(device):
    with pytest.raises(TypeError, match=r"scale must be a float or None, got str"):
        fa2tune.attention(*_qkv(device), scale="0.1")


def test_causal_must_be_bool(device):
    with pytest.raises(TypeError, match=r"causal must be True or False, got 1"):
        fa2tune.attention(*_qkv(device), causal=1)


def test_config_type(device):
    with pytest.raises(TypeError, match=r"config must be a fa2tune.KernelConfig or None, got dict"):
        fa2tune.attention(*_qkv(device), config={"block_m": 64})


def test_kernel_config_fields():
    with pytest.raises(ValueError, match=r"block_m must be one of \(16, 32, 64, 128, 256, 192\), got 48"):
        KernelConfig(48, 64)
    with pytest.raises(ValueError, match=r"num_stages must be in 1..8, got 0"):
        KernelConfig(64, 64, 4, 0)
    with pytest.raises(ValueError, match=r"unknown KernelConfig keys \['block_k'\]"):
        KernelConfig.from_dict({"block_m": 64, "block_n": 64, "block_k": 32})
    cfg = KernelConfig(128, 64, 8, 3)
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg


def test_empty_query_returns_empty(device):
    q, k, v = _qkv(device, nq=0)
    o, lse = fa2tune.attention(q, k, v, return_lse=True)
    assert o.shape == q.shape and lse.shape == (1, 2, 0)
