"""attention()'s forward over a few query tokens (a generation step without a KV-cache API) on the decode kernels
(fa2tune.launch.short_query): against float64, in SDPA's and flash_attn's layouts; and the calls it leaves to the
forward kernels."""

from __future__ import annotations

import pytest
import torch

import fa2tune
from fa2tune.config.decode_plan import SHORT_QUERY_TOKENS
from fa2tune.config.types import KernelConfig
from fa2tune.launch import short_query
from fa2tune.tune.reference import naive_attention, naive_attention_varlen

from .conftest import assert_close


@pytest.fixture
def decode_calls(monkeypatch) -> list:
    """The short-query route's decode launches, recorded (each still runs)."""
    calls = []
    launch = short_query.decode
    monkeypatch.setattr(short_query, "decode", lambda *a, **kw: (calls.append(a[0].shape), launch(*a, **kw))[1])
    return calls


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window, dtype): one token over GQA 4, three
# tokens at a head dim of two chunks, 16 tokens (the most the route takes) in a causal window, five tokens over three
# keys (causal: the first two see none), fp32 and bf16
_CASES = [
    (2, 8, 2, 1, 300, 64, False, (-1, -1), torch.float16),
    (2, 4, 4, 3, 77, 96, True, (-1, -1), torch.float16),
    (1, 8, 2, SHORT_QUERY_TOKENS, 130, 64, True, (32, 0), torch.bfloat16),
    (2, 4, 2, 5, 3, 64, True, (-1, -1), torch.float32),
    (1, 2, 1, 2, 50, 32, False, (4, 4), torch.float16),
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: "-".join(map(str, c[:6])) + f"-causal{c[6]}")
def test_a_few_query_tokens_run_the_decode_kernels(case, decode_calls, device):
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, window, dtype = case
    torch.manual_seed(seqlen_q + seqlen_k)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, head_dim, device=device, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        o, lse = fa2tune.attention(q, k, v, causal=causal, window=window, return_lse=True)
    assert decode_calls == [(batch, seqlen_q, heads, head_dim)]
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal, window=window)
    assert o.shape == q.shape and o.dtype == dtype and o.stride() == torch.empty(q.shape).stride()  # as the forward's
    assert_close(o, ref.nan_to_num(0.0), dtype)
    seen = torch.isfinite(ref_lse)
    assert_close(lse[seen], ref_lse[seen], torch.float32, what="lse")
    assert (lse[~seen] == float("-inf")).all() and (o[~seen] == 0).all()  # a query that sees no key


def test_keys_split_over_programs_merge_to_the_same_answer(decode_calls, monkeypatch, device):
    # the split-KV path (several programs an entry's keys, merged exactly), which an interpreter "GPU" of one SM never
    # chooses by itself: forced to 1, 3 and 7 splits over 1 and 4 query tokens, causal and not
    from fa2tune.launch import decode as decode_launch

    torch.manual_seed(5)
    k, v = (torch.randn(2, 2, 150, 64, device=device, dtype=torch.float16) for _ in range(2))
    for splits in (1, 3, 7):
        monkeypatch.setattr(decode_launch, "_auto_splits", lambda q, cache, config, splits=splits: splits)
        for seqlen_q, causal in ((1, False), (4, True)):
            q = torch.randn(2, 8, seqlen_q, 64, device=device, dtype=torch.float16)
            with torch.no_grad():
                o, lse = fa2tune.attention(q, k, v, causal=causal, return_lse=True)
            ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
            assert_close(o, ref, torch.float16, what=f"{splits} splits")
            assert_close(lse, ref_lse, torch.float32, what=f"lse, {splits} splits")
    assert len(decode_calls) == 6


def test_flash_attn_s_layout_takes_the_route_too(decode_calls, device):
    # flash_attn_func's (batch, seqlen, heads, head_dim) tensors reach attention() as transposed views
    torch.manual_seed(3)
    q = torch.randn(2, 1, 8, 64, device=device, dtype=torch.float16)
    k, v = (torch.randn(2, 200, 2, 64, device=device, dtype=torch.float16) for _ in range(2))
    out = fa2tune.flash_attn_func(q, k, v, causal=True)
    assert len(decode_calls) == 1
    ref, _ = naive_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True)
    assert_close(out, ref.transpose(1, 2), torch.float16)


@pytest.mark.parametrize("tokens, causal, window", [(1, False, (-1, -1)), (3, True, (-1, -1)), (2, True, (5, 0))])
def test_packed_sequences_of_as_many_query_tokens_each_run_the_decode_kernels(tokens, causal, window, decode_calls,
                                                                              device):  # fmt: skip
    # attention_varlen as the Hugging Face integration calls it in a generation step of a padded batch: each sequence
    # `tokens` query tokens over keys of its own length (0 included: O = 0, lse = -inf), GQA; K and V packed
    torch.manual_seed(tokens + 11)
    key_lengths = [37, 0, 90, 5]
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_q = torch.arange(0, tokens * len(key_lengths) + 1, tokens, dtype=torch.int32, device=device)
    q = torch.randn(int(cu_q[-1]), 8, 64, device=device, dtype=torch.float16)
    k, v = (torch.randn(int(cu_k[-1]), 2, 64, device=device, dtype=torch.float16) for _ in range(2))
    with torch.no_grad():
        o, lse = fa2tune.attention_varlen(q, k, v, cu_q, cu_k, tokens, max(key_lengths), causal=causal, window=window,
                                          return_lse=True)  # fmt: skip
    assert decode_calls == [(len(key_lengths), tokens, 8, 64)]
    ref, ref_lse = naive_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal, window=window)
    assert o.shape == q.shape and o.is_contiguous() and lse.shape == (8, q.shape[0])
    assert_close(o, ref.nan_to_num(0.0), torch.float16)
    seen = torch.isfinite(ref_lse)
    assert_close(lse[seen], ref_lse[seen], torch.float32, what="lse")
    assert (lse[~seen] == float("-inf")).all()
    # the same call through the varlen forward kernels, an explicit config
    forced = fa2tune.attention_varlen(q, k, v, cu_q, cu_k, tokens, max(key_lengths), causal=causal, window=window,
                                      config=KernelConfig(16, 16, 4, 1))  # fmt: skip
    assert_close(o, forced.double(), torch.float16, what="against the varlen forward")


def test_packed_sequences_of_unequal_query_lengths_run_the_forward_kernels(decode_calls, device):
    # 1 and 3 query tokens: max_seqlen_q = 3 but total_q = 4, not 2 · 3 — not a decode step of uniform rows
    cu_q, cu_k = (torch.tensor(offsets, dtype=torch.int32, device=device) for offsets in ([0, 1, 4], [0, 20, 50]))
    q = torch.randn(4, 4, 32, device=device, dtype=torch.float16)
    k, v = (torch.randn(50, 4, 32, device=device, dtype=torch.float16) for _ in range(2))
    with torch.no_grad():
        o = fa2tune.attention_varlen(q, k, v, cu_q, cu_k, 3, 30, causal=True)
    assert decode_calls == []
    ref, _ = naive_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)
    assert_close(o, ref, torch.float16)


def test_other_calls_run_the_forward_kernels(decode_calls, device):
    # more tokens than the route takes, a gradient to come, a prefix, V's own head dim and a config the caller gave
    torch.manual_seed(4)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.float16)
    q, k, v = make(1, 2, 4, 32), make(1, 2, 40, 32), make(1, 2, 40, 32)
    with torch.no_grad():
        fa2tune.attention(make(1, 2, SHORT_QUERY_TOKENS + 1, 32), k, v)
        fa2tune.attention(q, k, v, prefix_len=2)
        fa2tune.attention(q, k, make(1, 2, 40, 16))
        fa2tune.attention(q, k, v, config=KernelConfig(16, 16, 4, 1))
    fa2tune.attention(q.requires_grad_(), k, v)
    assert decode_calls == []


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_a_get_kernel_kernel_s_inference_step_runs_the_decode_kernels(varlen, decode_calls, device):
    # get_kernel()'s configs are resolved for the caller, not chosen by it: its one-token inference call is a decode
    # step as attention()'s is; with a gradient to come the same kernel runs its forward config
    kernel = fa2tune.get_kernel(64, device=str(device), dtype=torch.float16, causal=True, varlen=varlen)
    torch.manual_seed(9)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.float16)
    if varlen:
        cu_q = torch.arange(0, 4, dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 30, 31, 101], dtype=torch.int32, device=device)
        q, k, v = make(3, 4, 64), make(101, 2, 64), make(101, 2, 64)
        packing = (cu_q, cu_k, 1, 70)
        reference = lambda q: naive_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)[0]
    else:
        q, k, v = make(2, 4, 1, 64), make(2, 2, 70, 64), make(2, 2, 70, 64)
        packing = ()
        reference = lambda q: naive_attention(q.double(), k.double(), v.double(), causal=True)[0]
    with torch.no_grad():
        out = kernel(q, k, v, *packing)
    assert len(decode_calls) == 1
    assert_close(out, reference(q), torch.float16)
    trained = kernel(q.clone().requires_grad_(), k, v, *packing)
    assert len(decode_calls) == 1
    assert_close(trained, reference(q), torch.float16, what="the forward kernels")


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_a_compiled_decode_step_runs_the_decode_kernels_and_its_gradient_is_exact(varlen, tokens, decode_calls,
                                                                                  device):  # fmt: skip
    # torch.compile sees the custom op, which routes a few query tokens as the eager path does; the op cannot tell
    # whether a backward follows, so the decode kernels' (O, logsumexp) must serve one: gradients against float64.
    # The op's outputs have its fake's strides (one token a packed sequence once gave a transposed logsumexp).
    torch._dynamo.reset()
    torch.manual_seed(13)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.float32)
    if varlen:
        cu_q = torch.arange(0, 3 * tokens + 1, tokens, dtype=torch.int32, device=device)  # three sequences
        cu_k = torch.tensor([0, 40, 41, 100], dtype=torch.int32, device=device)
        q, k, v = make(3 * tokens, 4, 32), make(100, 2, 32), make(100, 2, 32)
        step = lambda q, k, v: fa2tune.attention_varlen(q, k, v, cu_q, cu_k, tokens, 59, causal=True)
        reference = lambda q, k, v: naive_attention_varlen(q, k, v, cu_q, cu_k, causal=True)[0]
        arguments = (q, k, v, [1, -1, -1, 0], 0.2, [], True, cu_q, cu_k, [tokens, 59])
        torch.library.opcheck(torch.ops.fa2tune.fwd.default, arguments, test_utils=("test_faketensor",))
    else:
        q, k, v = make(2, 4, tokens, 32), make(2, 2, 70, 32), make(2, 2, 70, 32)
        step = lambda q, k, v: fa2tune.attention(q, k, v, causal=True)
        reference = lambda q, k, v: naive_attention(q, k, v, causal=True)[0]
        torch.library.opcheck(torch.ops.fa2tune.fwd.default, (q, k, v, [1, -1, -1, 0], 0.2, [], True, None, None, []),
                              test_utils=("test_faketensor",))  # fmt: skip
    decode_calls.clear()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(q, k, v)
    assert len(decode_calls) == 1
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, reference(q.double(), k.double(), v.double()), torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    do = torch.randn_like(q)
    grads = torch.autograd.grad(compiled(*leaves), leaves, do)
    assert len(decode_calls) == 2
    wants = [t.double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(reference(*wants), wants, do.double())
    for got, want, name in zip(grads, expected, "qkv", strict=True):
        assert_close(got, want, torch.float32, what=f"d{name}")


def test_a_compiled_get_kernel_kernel_s_decode_step_runs_the_decode_kernels(decode_calls, device):
    # traced, the op is told the kernel's configs were resolved for the caller, not chosen: a decode step is one
    torch._dynamo.reset()
    kernel = fa2tune.get_kernel(64, device=str(device), dtype=torch.float16, causal=True)
    torch.manual_seed(10)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.float16)
    q, k, v = make(2, 4, 1, 64), make(2, 2, 70, 64), make(2, 2, 70, 64)
    with torch.no_grad():
        out = torch.compile(lambda q, k, v: kernel(q, k, v), backend="aot_eager", fullgraph=True)(q, k, v)
    assert len(decode_calls) == 1
    assert_close(out, naive_attention(q.double(), k.double(), v.double(), causal=True)[0], torch.float16)
