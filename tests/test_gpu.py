"""Checks that need a real CUDA device: production-sized shapes, 64-bit offsets. Run with scripts/gpu-tests.sh."""

from __future__ import annotations

import pytest
import torch

import fa2tune
from fa2tune.api import ops, selection
from fa2tune.config import defaults, planner
from fa2tune.config.device import device_info
from fa2tune.config.schedule import PERSISTENT
from fa2tune.config.types import KernelConfig
from fa2tune.launch import split_tail, warpspec
from fa2tune.tune.reference import naive_attention

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


@pytest.mark.parametrize("seqlen", [700, 3000, 5000], ids=["short", "medium", "all"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_each_length_bucket_runs_its_shipped_entry_right(head_dim, causal, seqlen):
    # The shipped file holds a bf16 forward entry per length bucket (lengths.BUCKET_RANGES); a call of a bucket's
    # length launches that entry's config: forward and gradients against float64, output poisoned first.
    from fa2tune.api import selection
    from fa2tune.config import lengths

    config, source = selection.resolve("fwd", head_dim, torch.bfloat16, causal, "cuda", seqlen=seqlen)
    if torch.cuda.get_device_capability() == (9, 0) and "H200" in torch.cuda.get_device_name():
        assert source.endswith("nvidia-h200.yaml"), f"no shipped {lengths.bucket_of(seqlen)} entry: {source}"
    torch.manual_seed(seqlen + head_dim)
    q, k, v = (torch.randn(1, 2, seqlen, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))  # fmt: skip
    out = torch.full_like(q, float("nan"), requires_grad=False)
    o, _ = ops.forward(q.detach(), k.detach(), v.detach(), causal=causal, scale=head_dim**-0.5, config=config,
                            out=out)  # fmt: skip
    o_auto = fa2tune.attention(q, k, v, causal=causal)  # the same entry through the public call, with autograd
    grads = torch.autograd.grad(o_auto, (q, k, v), torch.ones_like(o_auto))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(qd, kd, vd, causal=causal)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), torch.ones_like(ref))
    assert_close(o, ref, torch.bfloat16)
    assert torch.equal(o, o_auto.detach())
    for got, want, name in zip(grads, ref_grads, "qkv", strict=True):
        assert_close(got, want, torch.bfloat16, what=f"d{name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_grouped_query_training_call_runs_its_grouped_entries_right(head_dim, causal):
    # A GQA call reads a bucket's grouped entry before its plain one (selection.lookup_keys: the H100 ships d = 64 and
    # 128 bf16 causal ones in every length bucket, which its N=1000 calls reach in their own, "short") and an MHA call
    # never: both through attention() with autograd, against float64, at a ragged length.
    from fa2tune.config import lengths, store

    torch.manual_seed(head_dim)
    info = device_info("cuda")
    for heads_kv in (2, 8):
        grouped = heads_kv < 8
        key = store.EntryKey(head_dim=head_dim, dtype="bf16", causal=causal, kernel="bwd_dkdv",
                             seqlen_bucket=lengths.bucket_of(1000), gqa=grouped)  # fmt: skip
        found = next(store.find_for_device(info, selection.lookup_keys(key), template_hash=None), None)
        assert found is None or found.entry.key.gqa <= grouped  # an MHA call never reads a grouped entry
        if grouped and info.slug == "nvidia-h100-80gb-hbm3" and causal:
            assert found.entry.key == key and found.path.name == "nvidia-h100-80gb-hbm3.yaml"
        q = torch.randn(1, 8, 1000, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        k, v = (torch.randn(1, heads_kv, 1000, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                for _ in range(2))  # fmt: skip
        _assert_trains_right(q, k, v, fa2tune.attention(q, k, v, causal=causal), causal, f" (K/V heads {heads_kv})")


def _assert_trains_right(q, k, v, o, causal: bool, what: str = "") -> None:
    """o = attention(q, k, v) (bf16, with autograd) and its gradients of a sum against float64."""
    grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(qd, kd, vd, causal=causal)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), torch.ones_like(ref))
    assert_close(o, ref, torch.bfloat16, what=f"o{what}")
    for got, want, name in zip(grads, ref_grads, "qkv", strict=True):
        assert_close(got, want, torch.bfloat16, what=f"d{name}{what}")


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
    from fa2tune.config import device, planner

    info = device.inspect("cuda:0")
    props = torch.cuda.get_device_properties(0)
    assert info.name == props.name and info.sm_count == props.multi_processor_count
    assert info.smem_per_block >= 48 * 1024 and info.source == "card" and info.triton_version
    cfg = defaults.default_config(128, torch.bfloat16, device=info)
    assert planner.check(cfg, info, 128, torch.bfloat16) is None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_direct_launches_give_what_triton_s_launch_path_gives(causal, monkeypatch):
    # fa2tune.launch.fastlaunch reuses a compiled kernel for later calls of the same argument class. Calls that
    # alternate classes — 16-byte aligned and not, a stride that is and is not a multiple of 16, another length — must
    # each get the binary compiled for them: results equal to the JIT path's, bit for bit, and right against float64.
    from fa2tune.launch import fastlaunch

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
            # the Triton forward (fastlaunch's kernels), not a warp-specialized one the shipped file may name
            o = fa2tune.attention(q, k, v, causal=causal, config=KernelConfig(64, 64, 4, 2))
            outs.append((o, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))))
        return outs

    fastlaunch.clear()
    monkeypatch.setattr(fastlaunch, "_enabled", True)  # whatever FA2TUNE_DIRECT_LAUNCH says
    # bit for bit needs a deterministic backward: a shipped dK/dV entry with dQ fused in adds dQ in arrival order
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
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


# The warp-specialized forward (templates/fwd_ws.py.jinja) at each consumer count, ping-pong, and stage count, and
# the shipped d=64 short causal config ((64, 128) 3 stages two an SM); the lengths cross tile edges, and (causal,
# N_Q > N_K) leaves rows that see no key. Causal with B_c < B_r, a program's last K/V tiles lie in its first
# warpgroups' future (they release them unread): with ping-pong and persistent too.
_WS_CONFIGS = [KernelConfig.parse(text) for text in (
    "64,128,4,2,ws", "128,128,4,2,ws", "128,128,4,2,ws,pingpong", "192,128,4,2,ws", "128,64,4,3,ws",
    "128,128,4,2,ws,persistent", "128,128,4,2,ws,pingpong,persistent", "192,64,4,3,ws,persistent",
    "64,64,4,2,ws,persistent,x2", "128,64,4,3,ws,pingpong,persistent", "64,128,4,3,ws,persistent,x2")]  # fmt: skip
_config_id = lambda c: c.label().replace(" ", "-")
_WS_LENGTHS = [(1000, 1537), (1, 5), (257, 257), (300, 1000), (1000, 300)]
_HOPPER = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                             reason="needs Hopper")  # fmt: skip
_WS_DIMS = pytest.mark.parametrize(
    "head_dim, dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float16)]
)


def _ws_inputs(head_dim: int, dtype: torch.dtype, kv_heads: int = 2):
    """(q, k, v) at each of _WS_LENGTHS: 2 batches, 4 query heads over kv_heads K/V heads (2: GQA)."""
    for seqlen_q, seqlen_k in _WS_LENGTHS:
        q = torch.randn(2, 4, seqlen_q, head_dim, dtype=dtype, device="cuda")
        yield q, *(torch.randn(2, kv_heads, seqlen_k, head_dim, dtype=dtype, device="cuda") for _ in range(2))


@_HOPPER
@pytest.mark.parametrize(
    "config", _WS_CONFIGS, ids=_config_id
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@_WS_DIMS
def test_warpspec_forward_matches_reference(config, causal, head_dim, dtype, monkeypatch):
    torch.manual_seed(head_dim + config.block_m)
    if config.schedule.persistent:
        # three programs walk every tile (as on a GPU of three SMs; six with two an SM): each meets tiles of several
        # heads and lengths, in the causal order's reversed rounds too, with its K/V ring and Q, O buffers carried
        # from tile to tile
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)
    for q, k, v in _ws_inputs(head_dim, dtype):
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5, config=config, out=out)
        ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
        assert o is out
        assert_close(o, ref_o.nan_to_num(0.0), dtype)
        seen = torch.isfinite(ref_lse)
        assert_close(lse[seen], ref_lse[seen], torch.float32, what="lse")
        assert (lse[~seen] == float("-inf")).all()  # a row that sees no key: O = 0, lse = -inf


# Head dims that are not powers of two run the warp-specialized forward a power-of-two chunk at a time
# (fa2tune.config.head_chunks: 96 = 64 + 32, 240 = 128 + 64 + 32 + 16; 40 is read as 32 + 16 with the last 8 columns
# zero-filled by TMA and never written): each head dim's default config (the planner's), persistent or ping-pong,
# causal and not, GQA, ragged lengths, both 16-bit types.
_CHUNKED_DIMS = [(16, torch.bfloat16), (24, torch.bfloat16), (40, torch.bfloat16), (80, torch.float16),
                 (96, torch.bfloat16), (112, torch.bfloat16), (136, torch.float16), (160, torch.bfloat16),
                 (192, torch.bfloat16), (200, torch.float16), (224, torch.bfloat16), (240, torch.bfloat16),
                 (256, torch.bfloat16)]  # fmt: skip


@_HOPPER
@pytest.mark.parametrize("heads", [None, "4", "1", "8"], ids=["rule", "two_shares", "one_a_program", "unsplit"])
@pytest.mark.parametrize("spelling", ["64,128,4,2,ws,fused-dq,drain-before-dq", "64,128,4,3,ws,fused-dq,persistent",
                                      "64,64,4,2,ws,split-roles", "64,64,4,3,ws", "32,64,4,3"])  # fmt: skip
def test_dkdv_of_a_split_group_matches_reference(spelling, heads, monkeypatch):
    # GQA 8 over 2 K/V heads, causal, ragged: heads=4 splits each group over two programs a K/V tile (partials of 4
    # heads, summed after: fa2tune.config.group_split), heads=1 over eight, heads=8 not at all; the rule splits
    # this grid (6 or 11 K/V tiles a head, 24 or 44 programs) as far as its SMs ask: on 132 (an H100 SXM's, an
    # H200's) into eight, one query head a program. Persistent (at d=64, where it fits with dQ fused in): three
    # programs walk the partials' tiles. The last spelling is the Triton template's.
    from fa2tune.config.group_split import DKDV_HEADS_ENV
    from fa2tune.launch import backward as backward_launch
    from fa2tune.launch import plans

    if heads is None:
        monkeypatch.delenv(DKDV_HEADS_ENV, raising=False)
    else:
        monkeypatch.setenv(DKDV_HEADS_ENV, heads)
    splits = []
    rule = backward_launch.dkdv_group_split
    monkeypatch.setattr(backward_launch, "dkdv_group_split",
                        lambda *a, **kw: splits.append(rule(*a, **kw)) or splits[-1])  # fmt: skip
    plans._plans.clear()
    config = KernelConfig.parse(spelling)
    if config.schedule.persistent:
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)
    head_dim = 192 if config.split_roles else 64 if config.schedule.persistent else 128
    torch.manual_seed(12)
    q = torch.randn(2, 16, 700, head_dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 2, 650, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    do = torch.randn_like(q)
    o, lse = ops.forward(q, k, v, causal=True, scale=head_dim**-0.5)
    grads = ops.backward(do, q, k, v, o, lse, causal=True, scale=head_dim**-0.5, dkdv_config=config)
    if heads is None:
        assert len(splits) == 1 and splits[0] == (8 if device_info(0).sm_count == 132 else splits[0]) > 1, splits
    else:
        assert splits == [8 // int(heads)], splits
    _assert_gradients_match_reference(grads, q, k, v, do, causal=True)


@_HOPPER
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, dtype", _CHUNKED_DIMS, ids=lambda x: str(x).replace("torch.", ""))
def test_warpspec_forward_at_every_head_dim_matches_reference(head_dim, dtype, causal, monkeypatch):
    torch.manual_seed(head_dim)
    config = defaults.default_config(head_dim, dtype, causal=causal, kernel="fwd", device=device_info(0))
    assert config.warp_specialized, config
    if config.schedule.persistent:
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)  # every program walks several tiles and heads
    for q, k, v in _ws_inputs(head_dim, dtype):
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5, config=config, out=out)
        ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
        assert_close(o, ref_o.nan_to_num(0.0), dtype)
        seen = torch.isfinite(ref_lse)
        assert_close(lse[seen], ref_lse[seen], torch.float32, what="lse")
        assert (lse[~seen] == float("-inf")).all()


@_HOPPER
@pytest.mark.parametrize("head_dim", [96, 192])
def test_attention_at_chunked_head_dims_trains(head_dim):
    # the whole call: the chunked forward, then the backward (the Triton templates' at these head dims) from its
    # logsumexp, against float64 autograd
    torch.manual_seed(head_dim + 1)
    q, k, v = (torch.randn(2, 4, 700, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))  # fmt: skip
    o = fa2tune.attention(q, k, v, causal=True)
    grad = torch.randn_like(o)
    o.backward(grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = naive_attention(*ref, causal=True)
    ref_o.backward(grad.double())
    assert_close(o, ref_o, torch.bfloat16)
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in ref), strict=True):
        assert_close(got, want, torch.bfloat16, what="grad")


def _record_splits(monkeypatch) -> list[int]:
    """The split of each split-tail merge a launcher builds from now on (split_tail.Merge), in order."""
    splits, merge = [], split_tail.Merge
    monkeypatch.setattr(split_tail, "Merge", lambda *args, **kw: (splits.append(kw["split"]), merge(*args, **kw))[1])
    return splits


@_HOPPER
@pytest.mark.parametrize("config", [c for c in _WS_CONFIGS if c.schedule == PERSISTENT], ids=_config_id)
@_WS_DIMS
def test_warpspec_forward_with_a_split_tail_matches_reference(config, head_dim, dtype, monkeypatch):
    # a persistent forward whose last round is part empty cuts its tiles into pieces of their K/V tiles, merged
    # after the kernel (fa2tune/launch/split_tail.py): here on as few programs as make the plan cut a small problem
    torch.manual_seed(head_dim + config.block_n)
    monkeypatch.setattr(split_tail, "MIN_KV_STEPS", 2)
    splits = _record_splits(monkeypatch)
    q = torch.randn(2, 4, 1000, head_dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(2, 2, 1537, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    tiles, kv_steps = 2 * 4 * -(-1000 // config.block_m), -(-1537 // config.block_n)
    programs = next(p for p in range(3, 64) if split_tail.plan(tiles, p, kv_steps)[1] > 1)
    monkeypatch.setattr(warpspec, "_sm_count", lambda index: programs)
    out = torch.full_like(q, float("nan"))  # poisoned: the whole tiles and the merged ones must all be written
    o, lse = ops.forward(q, k, v, causal=False, scale=head_dim**-0.5, config=config, out=out)
    assert splits == [split_tail.plan(tiles, programs, kv_steps)[1]]  # the launch cut its tail
    ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double())
    assert_close(o, ref_o, dtype)
    assert_close(lse, ref_lse, torch.float32, what="lse")


@_HOPPER
@pytest.mark.parametrize("head_dim", [32, 256])
def test_warpspec_other_head_dims_and_gradients(head_dim):
    torch.manual_seed(head_dim)
    config = KernelConfig.parse("128,64,4,2,ws,pingpong")
    q, k, v = (torch.randn(1, 3, 700, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))  # fmt: skip
    _assert_trains_right(q, k, v, fa2tune.attention(q, k, v, causal=True, config=config), causal=True)


@_HOPPER
def test_warpspec_takes_what_tma_takes_and_the_rest_runs_triton(monkeypatch):
    from fa2tune.api import selection

    config = KernelConfig.parse("128,128,4,2,ws")
    wide = torch.randn(1, 2, 300, 68, dtype=torch.bfloat16, device="cuda")[..., :64]  # row stride 136 B: not % 16
    q = torch.randn(1, 2, 300, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="warpspec needs q's address and strides in multiples of 16 bytes"):
        fa2tune.attention(wide, q, q, config=config)
    with pytest.raises(ValueError, match="warpspec takes float16/bfloat16"):
        fa2tune.attention(q.float(), q.float(), q.float(), config=config)
    # a tuned (resolved) warpspec config serves what it can and leaves the rest to the Triton template
    monkeypatch.setattr(selection, "resolve", lambda *args, **kwargs: (config, "test"))
    for args in ((wide, q, q), (q.float(), q.float(), q.float())):
        o = fa2tune.attention(*args)
        ref, _ = naive_attention(*(t.double() for t in args))
        assert_close(o, ref, args[0].dtype)
    o = fa2tune.attention(q, q, q, window=(16, 0))  # a band mask: Triton's template
    ref, _ = naive_attention(q.double(), q.double(), q.double(), window=(16, 0))
    assert_close(o, ref, torch.bfloat16)


@_HOPPER
def test_warpspec_direct_launches_give_what_the_jit_gives(monkeypatch):
    # The warp-specialized forward launches through fastlaunch too, its TMA descriptors keyed by dtype, block and
    # layout: lengths and head counts that change the scalars, and a second call of each, equal the JIT's bit for bit.
    from fa2tune.launch import fastlaunch

    torch.manual_seed(5)
    config = KernelConfig.parse("128,128,4,2,ws,pingpong")
    cases = [torch.randn(2, 4, n, 128, dtype=torch.bfloat16, device="cuda") for n in (300, 512, 77)]

    def run_all():
        return [ops.forward(x, x.flip(2), x, causal=True, scale=0.1, config=config) for x in cases * 2]

    fastlaunch.clear()
    monkeypatch.setattr(fastlaunch, "_enabled", True)
    start = fastlaunch.direct_launches
    direct = run_all()
    assert fastlaunch.direct_launches - start == len(cases), "the direct path was not taken"
    monkeypatch.setattr(fastlaunch, "_enabled", False)
    for got, want in zip(direct, run_all(), strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@_HOPPER
@pytest.mark.parametrize(
    "configs",
    [(KernelConfig.parse("64,128,4,2,ws"), None), (KernelConfig.parse("64,64,4,3,ws"), None),
     (KernelConfig.parse("64,128,4,2,ws"), KernelConfig.parse("128,64,4,2,ws")),
     (None, KernelConfig.parse("64,128,4,3,ws")),
     (KernelConfig.parse("64,128,4,2,ws,persistent"), KernelConfig.parse("128,64,4,3,ws")),
     (KernelConfig.parse("64,64,4,3,ws,persistent"), None),
     (KernelConfig.parse("64,128,4,2,ws,persistent"), KernelConfig.parse("128,64,4,3,ws,persistent")),
     (None, KernelConfig.parse("64,128,4,2,ws,persistent")),
     (KernelConfig.parse("64,128,4,2,ws,fused-dq"), None),
     (KernelConfig.parse("64,64,4,3,ws,fused-dq,persistent"), None),
     (KernelConfig.parse("64,64,4,3,ws,persistent,x2"), KernelConfig.parse("128,64,4,3,ws")),
     (KernelConfig.parse("64,64,4,3,ws,fused-dq,persistent,x2"), None),
     (KernelConfig.parse("64,128,4,2,ws,persistent"), KernelConfig.parse("64,64,4,2,ws,persistent,x2")),
     (KernelConfig.parse("64,64,4,2,ws,split-roles"), None),
     (KernelConfig.parse("64,64,4,3,ws,split-roles,persistent"), KernelConfig.parse("128,64,4,3,ws"))],
    ids=["dkdv_2consumers", "dkdv_1consumer3stages", "both_2consumers", "dq_1consumer3stages",
         "dkdv_persistent_2consumers", "dkdv_persistent_1consumer3stages", "both_persistent",
         "dq_persistent_1consumer", "fused_dq_2consumers", "fused_dq_persistent_1consumer3stages",
         "dkdv_two_an_sm", "fused_dq_two_an_sm", "dq_two_an_sm", "dkdv_split_roles", "dkdv_split_roles_persistent"],
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@_WS_DIMS
def test_warpspec_backward_matches_reference(configs, causal, head_dim, dtype, monkeypatch):
    # The warp-specialized dK/dV and dQ kernels (templates/bwd_ws.py.jinja, bwd_dq_ws.py.jinja), each beside the
    # other or the Triton one: all three gradients against float64 autograd, GQA (dK/dV summed over two query heads
    # each), lengths across tiles, N_Q ≠ N_K, rows that see no key (causal, N_Q > N_K). Persistent: three programs
    # walk every tile, as in the forward's test. Fused dQ (fused_dq): no dQ kernel runs, dQ is the sum of
    # the dK/dV programs' TMA reductions — over query heads' GQA groups, ragged tiles and rows past N_Q. Causal dQ of
    # two consumers with B_c = 64: the first releases, unread, the program's K/V tiles past its rows' diagonal. Split
    # roles: the dV side hands Pᵀ to the dK side every step, over program boundaries when persistent.
    dkdv_config, dq_config = configs
    if any(c is not None and c.schedule.persistent for c in configs):
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)
    torch.manual_seed(head_dim + sum(c.block_n for c in configs if c is not None))
    # GQA and not: causal dK/dV programs of two consumers skip the second's Q tiles before its diagonal only when
    # every query head has its own K/V head
    for q, k, v in (*_ws_inputs(head_dim, dtype), *_ws_inputs(head_dim, dtype, kv_heads=4)):
        do = torch.randn_like(q)
        o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5)
        grads = ops.backward(do, q, k, v, o, lse, causal=causal, scale=head_dim**-0.5, dkdv_config=dkdv_config,
                                  dq_config=dq_config)  # fmt: skip
        _assert_gradients_match_reference(grads, q, k, v, do, causal=causal)


@_HOPPER
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, dtype", _CHUNKED_DIMS, ids=lambda x: str(x).replace("torch.", ""))
def test_warpspec_backward_at_every_head_dim_matches_reference(head_dim, dtype, causal, monkeypatch):
    # the dK/dV and dQ kernels a chunk at a time, as the forward (head_chunks): each head dim's default configs (the
    # planner's: dK/dV of two consumers on 64 K/V rows each up to d=128, with split roles past it; dQ warp-specialized
    # everywhere), persistent ones over three programs, GQA and not, ragged lengths
    device = device_info(0)
    configs = [defaults.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=device)
               for kernel in ("bwd_dkdv", "bwd_dq")]  # fmt: skip
    assert any(c.warp_specialized for c in configs), configs
    if any(c.schedule.persistent for c in configs):
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)
    torch.manual_seed(head_dim + 3)
    for q, k, v in (*_ws_inputs(head_dim, dtype), *_ws_inputs(head_dim, dtype, kv_heads=4)):
        do = torch.randn_like(q)
        o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5)
        grads = ops.backward(do, q, k, v, o, lse, causal=causal, scale=head_dim**-0.5, dkdv_config=configs[0],
                             dq_config=configs[1])  # fmt: skip
        _assert_gradients_match_reference(grads, q, k, v, do, causal=causal)


# Head dims padded to fewer chunks (KernelConfig.pad_head_dim, head_chunks.fewer_chunks): 104 and 112 as one chunk of
# 128, 176 as 128 + 64, 208 and 240 as 256; TMA zero-fills Q's, K's and V's columns past the head dim and writes none
# of O's, dQ's, dK's or dV's there. Each kernel's default with the pad preferred (defaults.default_config(pad=True)).
_PADDED_DIMS = [(104, torch.float16, False), (112, torch.bfloat16, True), (176, torch.bfloat16, False),
                (208, torch.float16, True), (240, torch.bfloat16, False)]  # fmt: skip


@_HOPPER
@pytest.mark.parametrize("head_dim, dtype, causal", _PADDED_DIMS, ids=lambda x: str(x).replace("torch.", ""))
def test_a_head_dim_padded_to_fewer_chunks_matches_reference(head_dim, dtype, causal, monkeypatch):
    device = device_info(0)
    fwd, dkdv, dq = (defaults.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=device, pad=True)
                     for kernel in ("fwd", "bwd_dkdv", "bwd_dq"))  # fmt: skip
    assert fwd.pad_head_dim and dkdv.pad_head_dim and dq.pad_head_dim, (fwd, dkdv, dq)
    if any(c.schedule.persistent for c in (fwd, dkdv, dq)):
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)
    torch.manual_seed(head_dim + 5)
    for q, k, v in (*_ws_inputs(head_dim, dtype), *_ws_inputs(head_dim, dtype, kv_heads=4)):
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5, config=fwd, out=out)
        ref_o, _ = naive_attention(q.double(), k.double(), v.double(), causal=causal)
        assert_close(o, ref_o.nan_to_num(0.0), dtype)
        do = torch.randn_like(q)
        grads = ops.backward(do, q, k, v, o, lse, causal=causal, scale=head_dim**-0.5, dkdv_config=dkdv,
                             dq_config=dq)  # fmt: skip
        _assert_gradients_match_reference(grads, q, k, v, do, causal=causal)


# dQ fused into the dK/dV kernel a head-dim chunk at a time (head_chunks.dq_blocks), two 64-row K/V blocks a
# program: at d=80, 96, 112 column blocks of 64, 32 and 16 dealt to the two consumers unevenly; V's own head dim
# (64/32, 96/128): dQ follows K's chunks, dV V's. drain_before_dq: dK from shared memory with or without the mask,
# the Q_i, dO_i buffer freed before dQ, one and two programs an SM.
_FUSED_CHUNKED = [
    (80, 80, torch.float16, False, "64,128,4,2,ws,fused-dq"),
    (96, 96, torch.bfloat16, False, "64,128,4,2,ws,fused-dq,persistent"),
    (96, 96, torch.bfloat16, True, "64,128,4,2,ws,fused-dq"),
    # causal at 64 < d <= 96: the step loop in two phases (bwd_ws.py.jinja's CAUSAL_SPLIT), V in registers under the
    # mask; persistent, one program a tile and drained, as the shipped d=80 and d=96 entries run it
    (96, 96, torch.bfloat16, True, "64,128,4,2,ws,fused-dq,persistent"),
    (80, 80, torch.float16, True, "64,128,4,2,ws,fused-dq"),
    (80, 80, torch.bfloat16, True, "64,128,4,2,ws,fused-dq,persistent"),
    (96, 96, torch.float16, True, "64,128,4,2,ws,fused-dq,persistent,drain-before-dq"),
    (80, 64, torch.bfloat16, True, "64,128,4,2,ws,fused-dq,persistent"),  # V's own head dim under the two phases
    (112, 112, torch.bfloat16, True, "64,128,4,2,ws,fused-dq"),
    (64, 32, torch.bfloat16, True, "64,128,4,2,ws,fused-dq"),
    (96, 128, torch.float16, False, "64,128,4,2,ws,fused-dq"),
    (128, 128, torch.bfloat16, True, "64,128,4,2,ws,fused-dq,drain-before-dq"),
    (96, 96, torch.float16, False, "64,128,4,2,ws,fused-dq,persistent,drain-before-dq"),
    (64, 64, torch.bfloat16, True, "64,64,4,3,ws,fused-dq,persistent,x2,drain-before-dq"),
    (64, 64, torch.bfloat16, False, "64,128,4,3,ws,fused-dq,persistent,drain-before-dq"),
    (128, 128, torch.float16, False, "64,128,4,2,ws,fused-dq,drain-before-dq"),
    # d <= 64 without the mask: the two consumers take turns forming dQ_i (bwd_ws.py.jinja's ALTERNATE),
    # persistent or not, of one chunk (32, 56 read as 64, 64) or two (40 and 48: 32 + 16, where the turns under a
    # runtime branch gave wrong dK and dV one program a tile); one consumer (64 rows) runs the same module with the
    # turns off (a constexpr)
    (64, 64, torch.bfloat16, False, "64,128,4,3,ws,fused-dq,persistent"),
    (32, 32, torch.float16, False, "64,128,4,2,ws,fused-dq"),
    (48, 64, torch.bfloat16, False, "64,128,4,2,ws,fused-dq,persistent"),
    (64, 64, torch.float16, False, "64,64,4,3,ws,fused-dq"),
    (48, 48, torch.bfloat16, False, "64,128,4,2,ws,fused-dq"),
    (40, 40, torch.float16, False, "64,128,4,3,ws,fused-dq"),
    (48, 48, torch.float16, False, "64,128,4,3,ws,fused-dq,persistent"),
    (56, 56, torch.bfloat16, False, "64,128,4,2,ws,fused-dq"),
    # and with the mask, dK reading dSᵀ from shared memory (drained or not), every consumer on every Q tile
    (64, 64, torch.bfloat16, True, "64,128,4,3,ws,fused-dq,persistent"),
    (48, 48, torch.float16, True, "64,128,4,2,ws,fused-dq"),
    (32, 32, torch.bfloat16, True, "64,128,4,3,ws,fused-dq,persistent,drain-before-dq"),
    (64, 64, torch.float16, False, "64,128,4,2,ws,fused-dq,drain-before-dq"),
    (32, 32, torch.float16, True, "64,128,4,2,ws,fused-dq"),
]  # fmt: skip


@_HOPPER
@pytest.mark.parametrize("head_dim, head_dim_v, dtype, causal, config", _FUSED_CHUNKED,
                         ids=lambda x: str(x).replace("torch.", "").replace(",", "-"))  # fmt: skip
def test_fused_dq_at_every_head_dim_matches_reference(head_dim, head_dim_v, dtype, causal, config, monkeypatch):
    # GQA (four query heads over two K/V heads), ragged lengths, N_Q ≠ N_K, rows that see no key; persistent over
    # three programs
    config = KernelConfig.parse(config)
    assert planner.check(config, device_info(0), max(head_dim, head_dim_v), dtype, "bwd_dkdv") is None
    if config.schedule.persistent:
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)
    torch.manual_seed(head_dim + head_dim_v)
    # and without GQA (one query head a K/V head), where a tile's step count is odd at an odd number of Q tiles
    for q, k, v in (*_v_inputs(head_dim, head_dim_v, dtype), *_v_inputs(head_dim, head_dim_v, dtype, kv_heads=4)):
        o, lse = ops.forward(q, k, v, causal=causal, scale=head_dim**-0.5)
        do = torch.randn_like(o)
        grads = ops.backward(do, q, k, v, o, lse, causal=causal, scale=head_dim**-0.5, dkdv_config=config)
        _assert_gradients_match_reference(grads, q, k, v, do, causal=causal)


def _assert_gradients_match_reference(grads, q, k, v, do, *, causal: bool) -> None:
    """dQ, dK, dV (grads) against float64 autograd through naive attention, at q's dtype's tolerance."""
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(qd, kd, vd, causal=causal)
    ref_grads = torch.autograd.grad(ref.nan_to_num(0.0), (qd, kd, vd), do.double())
    for got, want, name in zip(grads, ref_grads, "qkv", strict=True):
        assert_close(got, want, q.dtype, what=f"d{name} at N_Q={q.shape[2]} N_K={k.shape[2]}")


@_HOPPER
def test_fused_dq_backward_is_deterministic_when_torch_asks(monkeypatch):
    # dQ fused into the dK/dV kernel is summed by TMA reductions in arrival order; under
    # torch.use_deterministic_algorithms(True) a resolved fused config runs its fused_dq=False twin (dQ kernel): the
    # same bits on every run, and the same gradients as the fused run to rounding. An explicit fused config is an error.
    torch.manual_seed(11)
    q, k, v, do = (torch.randn(1, 4, 1000, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    o, lse = ops.forward(q, k, v, causal=True, scale=0.125)
    fused = KernelConfig.parse("64,128,4,3,ws,fused-dq,persistent")
    monkeypatch.setattr(selection, "resolve", lambda kernel, *a, **kw: (
        fused if kernel == "bwd_dkdv" else KernelConfig.parse("128,64,4,3,ws"), "test"))  # fmt: skip
    ops.clear_plans()
    loose = ops.backward(do, q, k, v, o, lse, causal=True, scale=0.125)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    runs = [ops.backward(do, q, k, v, o, lse, causal=True, scale=0.125) for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))
    for a, b in zip(runs[0], loose, strict=True):
        assert_close(a, b, torch.bfloat16, what="deterministic twin against the fused run")
    with pytest.raises(RuntimeError, match=r"dkdv_config .* fuses dQ in .*use_deterministic_algorithms"):
        ops.backward(do, q, k, v, o, lse, causal=True, scale=0.125, dkdv_config=fused)
    ops.clear_plans()


# Every backward kernel (Triton; warp-specialized dK/dV and dQ; dK/dV with dQ fused in, one and two programs an SM, at
# d=64 with K and V as register operands and at d=128 from shared memory) on flash-attention's
# test_flash_attn_bwd_overflow inputs (tests/test_backward.py): lengths 1-3, one past each tile (16, 32, 64, 128),
# q ≠ k. A key past N_K of a ragged tile has P = e^(−lse), past the 16-bit range; the fused dQ added it as inf·0 = NaN.
_OVERFLOW_LENGTHS = [(1, 1), (2, 2), (3, 3), (17, 17), (33, 33), (65, 65), (129, 129), (2, 129), (129, 2), (1, 65)]
_OVERFLOW_CASES = [
    (64, torch.float16, False, KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2)),
    (64, torch.bfloat16, True, KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2)),
    (64, torch.float16, False, KernelConfig.parse("64,128,4,2,ws"), KernelConfig.parse("128,64,4,3,ws")),
    (64, torch.bfloat16, True, KernelConfig.parse("64,128,4,2,ws"), KernelConfig.parse("128,64,4,3,ws")),
    *((64, dtype, causal, KernelConfig.parse("64,128,4,3,ws,fused-dq,persistent"), None)
      for dtype in (torch.float16, torch.bfloat16) for causal in (False, True)),
    *((64, dtype, causal, KernelConfig.parse("64,64,4,3,ws,fused-dq,persistent,x2"), None)
      for dtype in (torch.float16, torch.bfloat16) for causal in (False, True)),
    *((128, dtype, False, KernelConfig.parse("64,128,4,2,ws,fused-dq"), None)
      for dtype in (torch.float16, torch.bfloat16)),
]  # fmt: skip


@_HOPPER
@pytest.mark.parametrize(
    "head_dim, dtype, causal, dkdv_config, dq_config", _OVERFLOW_CASES,
    ids=lambda x: x.label() if isinstance(x, KernelConfig) else str(x),
)  # fmt: skip
def test_short_sequences_of_large_scores_give_finite_gradients_in_every_kernel(head_dim, dtype, causal, dkdv_config,
                                                                                dq_config, monkeypatch):  # fmt: skip
    from .test_backward import _assert_grads_within_flash_attention_bound, _large_scores

    if dkdv_config.schedule.persistent:
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)  # three programs walk every head's tiles
    scale = 0.125  # d=64's: d=128 repeats each input's columns (scaled by 2^-0.5), for the same scores
    for seqlen_q, seqlen_k in _OVERFLOW_LENGTHS:
        for all_negative in (False, True):
            q, k, v, do = _large_scores(seqlen_q, seqlen_k, dtype, "cuda", seed=seqlen_q + 7 * seqlen_k,
                                        all_negative=all_negative)  # fmt: skip
            if head_dim != 64:
                q, k, v, do = (torch.cat([t, t], dim=-1) * 2**-0.5 for t in (q, k, v, do))
            o, lse = ops.forward(q, k, v, causal=causal, scale=scale)
            grads = ops.backward(do, q, k, v, o, lse, causal=causal, scale=scale, dkdv_config=dkdv_config,
                                      dq_config=dq_config)  # fmt: skip
            _assert_grads_within_flash_attention_bound(grads, q, k, v, do, causal, scale)


@_HOPPER
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_warpspec_backward_direct_launches_give_what_the_jit_gives(causal, monkeypatch):
    # fastlaunch.launch_tma: from the second call of a key the dK/dV and dQ kernels are launched by their compiled
    # launcher with descriptors encoded once per tensor address. Each case runs three times — the JIT's call, then
    # two direct ones that reuse the inputs' encodings and encode their new gradient buffers (every result is kept,
    # so each call's buffers are at new addresses) — and equals the JIT path bit for bit.
    from fa2tune.launch import fastlaunch

    torch.manual_seed(7)
    configs = dict(dkdv_config=KernelConfig.parse("64,128,4,2,ws,persistent"),
                   dq_config=KernelConfig.parse("128,64,4,3,ws,persistent"))  # fmt: skip
    cases = []
    for n in (300, 512):
        q, k, v, do = (torch.randn(2, 4, n, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4))
        o, lse = ops.forward(q, k, v, causal=causal, scale=0.1)
        cases.append((do, q, k, v, o, lse))

    def run_all():
        return [ops.backward(*case, causal=causal, scale=0.1, **configs) for case in cases for _ in range(3)]

    fastlaunch.clear()
    monkeypatch.setattr(fastlaunch, "_enabled", True)
    start = fastlaunch.direct_launches
    direct = run_all()
    assert fastlaunch.direct_launches - start >= 2 * 2 * len(cases), "the direct path was not taken"
    monkeypatch.setattr(fastlaunch, "_enabled", False)
    for got, want in zip(direct, run_all(), strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_on_the_calling_thread_gives_what_the_device_thread_gives(head_dim):
    # README recommends torch.autograd.set_multithreading_enabled(False) for short training calls (docs/PERF.md, "Host
    # time per call": the backward then runs on the calling thread, not on autograd's thread for the GPU). fa2tune's
    # launches read the current device and stream, and keep per-process caches: the gradients must not depend on the
    # thread.
    torch.manual_seed(12)
    shape = (2, 4, 300, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    results = {}
    for threads in (True, False, True):
        with torch.autograd.set_multithreading_enabled(threads):
            o = fa2tune.attention(q, k, v, causal=True)
            results.setdefault(threads, []).append((o, *torch.autograd.grad(o, (q, k, v), grad_out)))
    # O, dK and dV bit for bit; dQ is summed in arrival order where the shipped config fuses it into the dK/dV
    # kernel (d=64: warpspec 2, TMA reductions), so it may differ in its last bits from call to call, thread or not
    first = results[True][0]
    for got in (*results[True], *results[False]):
        assert torch.equal(got[0], first[0]) and torch.equal(got[2], first[2]) and torch.equal(got[3], first[3])
        torch.testing.assert_close(got[1], first[1], atol=1e-2, rtol=1e-2)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(qd, kd, vd, causal=True)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), grad_out.double())
    for got, want, name in zip(results[False][0][1:], ref_grads, "qkv", strict=True):
        assert_close(got, want, torch.bfloat16, what=f"d{name}")


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_cuda_graph_replays_give_what_eager_calls_give(training):
    # A call that waits for its host (N <= 512, docs/PERF.md, "Host time per call") runs at its kernels' speed when
    # captured in a CUDA graph: fa2tune's launches — direct ones, TMA descriptors encoded once per address — must be
    # capturable. The shipped configs (warpspec on Hopper), captured after a warm-up, replayed on new values copied into
    # the captured inputs, equal eager calls bit for bit (the kernels are deterministic).
    torch.manual_seed(11)
    shape = (2, 4, 300, 128)
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=training) for _ in range(3)]
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v, do):
        o = fa2tune.attention(q, k, v, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), do)) if training else (o,)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles and the first (JIT) launch of each key happen here, not while capturing
            step(*inputs, grad_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*inputs, grad_out)
    for _ in range(2):
        values = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        with torch.no_grad():
            for static, value in zip((*inputs, grad_out), values, strict=True):
                static.copy_(value)
        graph.replay()
        leaves = [value.clone().requires_grad_(training) for value in values[:3]]
        want = step(*leaves, values[3])
        for got, expected in zip(captured, want, strict=True):
            assert torch.equal(got, expected)


@_HOPPER
def test_a_split_tail_is_capturable_in_a_cuda_graph(monkeypatch):
    # the split tail allocates its pieces' workspace and launches the merge on each call (fa2tune/launch/split_tail.py):
    # captured, replays on new values equal eager calls bit for bit, as the test above asks of every launch
    torch.manual_seed(12)
    config = KernelConfig.parse("128,128,4,2,ws,persistent")
    monkeypatch.setattr(split_tail, "MIN_KV_STEPS", 2)
    tiles, kv_steps = 2 * 4 * -(-1000 // 128), -(-1000 // 128)
    programs = next(p for p in range(3, 64) if split_tail.plan(tiles, p, kv_steps)[1] > 1)
    monkeypatch.setattr(warpspec, "_sm_count", lambda index: programs)
    splits = _record_splits(monkeypatch)
    inputs = [torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    step = lambda q, k, v: fa2tune.attention(q, k, v, config=config)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*inputs)
    # the plan (built by the warm-up calls, before the capture) cut its tail; the captured call runs that plan, and the
    # replays below equal eager calls only if its merge ran inside the graph
    assert splits and all(split > 1 for split in splits)
    for _ in range(2):
        values = [torch.randn_like(t) for t in inputs]
        for static, value in zip(inputs, values, strict=True):
            static.copy_(value)
        graph.replay()
        assert torch.equal(captured, step(*values))


# V's head dim apart from Q's and K's (dv != d, as MLA-style models use: 192/128). A call resolves the configs of the
# larger head dim (planner.config_head_dim): warp-specialized where they take both head dims, the shipped d=64 dK/dV
# entry (dQ fused in) giving way to its twin with a dQ kernel at (64, 32).
_V_HEAD_DIMS = [(192, 128, torch.bfloat16), (128, 64, torch.bfloat16), (96, 160, torch.float16),
                (64, 32, torch.bfloat16), (112, 80, torch.bfloat16)]  # fmt: skip (112: the dK/dV default padded)
_v_dims_id = lambda x: str(x).replace("torch.", "")


def _v_inputs(head_dim: int, head_dim_v: int, dtype: torch.dtype, kv_heads: int = 2):
    """(q, k, v) as _ws_inputs gives them, v of head_dim_v."""
    for seqlen_q, seqlen_k in _WS_LENGTHS:
        q = torch.randn(2, 4, seqlen_q, head_dim, dtype=dtype, device="cuda")
        k = torch.randn(2, kv_heads, seqlen_k, head_dim, dtype=dtype, device="cuda")
        yield q, k, torch.randn(2, kv_heads, seqlen_k, head_dim_v, dtype=dtype, device="cuda")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, head_dim_v, dtype", _V_HEAD_DIMS, ids=_v_dims_id)
def test_attention_with_a_v_head_dim_of_its_own_trains(head_dim, head_dim_v, dtype, causal):
    # the whole call, as attention() resolves it, through autograd: GQA and not, ragged lengths, N_Q ≠ N_K, rows
    # that see no key (causal, N_Q > N_K)
    torch.manual_seed(head_dim + head_dim_v)
    for q, k, v in (*_v_inputs(head_dim, head_dim_v, dtype), *_v_inputs(head_dim, head_dim_v, dtype, kv_heads=4)):
        leaves = [t.requires_grad_() for t in (q, k, v)]
        o = fa2tune.attention(*leaves, causal=causal)
        assert o.shape == (*q.shape[:3], head_dim_v)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, leaves, do)
        ref, _ = naive_attention(q.detach().double(), k.detach().double(), v.detach().double(), causal=causal)
        assert_close(o, ref.nan_to_num(0.0), dtype)
        _assert_gradients_match_reference(grads, *(t.detach() for t in (q, k, v)), do, causal=causal)


@_HOPPER
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, head_dim_v, dtype", _V_HEAD_DIMS[:3], ids=_v_dims_id)
def test_warpspec_kernels_with_a_v_head_dim_of_its_own_match_reference(head_dim, head_dim_v, dtype, causal,
                                                                       monkeypatch):  # fmt: skip
    # each warp-specialized kernel, given explicitly: the larger head dim's default (a one-consumer dK/dV config
    # where that default is the Triton template's), V, O, dO and dV read and written in V's own chunks; persistent
    # ones over three programs; output poisoned first
    device = device_info(0)
    configs = [defaults.default_config(max(head_dim, head_dim_v), dtype, causal=causal, kernel=kernel, device=device)
               for kernel in ("fwd", "bwd_dkdv", "bwd_dq")]  # fmt: skip
    configs = [c if c.warp_specialized else KernelConfig.parse("64,64,4,2,ws") for c in configs]
    if any(c.schedule.persistent for c in configs):
        monkeypatch.setattr(warpspec, "_sm_count", lambda index: 3)
    torch.manual_seed(head_dim + head_dim_v + 1)
    scale = head_dim**-0.5
    for q, k, v in (*_v_inputs(head_dim, head_dim_v, dtype), *_v_inputs(head_dim, head_dim_v, dtype, kv_heads=4)):
        out = torch.full((*q.shape[:3], head_dim_v), float("nan"), dtype=dtype, device="cuda")
        o, lse = ops.forward(q, k, v, causal=causal, scale=scale, config=configs[0], out=out)
        ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
        assert_close(o, ref_o.nan_to_num(0.0), dtype)
        seen = torch.isfinite(ref_lse)
        assert_close(lse[seen], ref_lse[seen], torch.float32, what="lse")
        do = torch.randn_like(o)
        grads = ops.backward(do, q, k, v, o, lse, causal=causal, scale=scale, dkdv_config=configs[1],
                             dq_config=configs[2])  # fmt: skip
        _assert_gradients_match_reference(grads, q, k, v, do, causal=causal)


@_HOPPER
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (96, 160)])
def test_warpspec_split_tail_with_a_v_head_dim_of_its_own_matches_reference(head_dim, head_dim_v, monkeypatch):
    # the pieces' partial O has O's columns, V's chunks (split_tail.workspace), merged into O of V's head dim
    torch.manual_seed(head_dim_v)
    config = KernelConfig.parse("128,64,4,2,ws,persistent")
    monkeypatch.setattr(split_tail, "MIN_KV_STEPS", 2)
    splits = _record_splits(monkeypatch)
    q, k, v = next(_v_inputs(head_dim, head_dim_v, torch.bfloat16))  # N_Q = 1000, N_K = 1537
    tiles, kv_steps = 2 * 4 * -(-1000 // config.block_m), -(-1537 // config.block_n)
    programs = next(p for p in range(3, 64) if split_tail.plan(tiles, p, kv_steps)[1] > 1)
    monkeypatch.setattr(warpspec, "_sm_count", lambda index: programs)
    out = torch.full((2, 4, 1000, head_dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = ops.forward(q, k, v, causal=False, scale=head_dim**-0.5, config=config, out=out)
    assert splits == [split_tail.plan(tiles, programs, kv_steps)[1]]
    ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double())
    assert_close(o, ref_o, torch.bfloat16)
    assert_close(lse, ref_lse, torch.float32, what="lse")


def test_hf_generate_with_a_static_cache_runs_its_compiled_step_in_cuda_graphs():
    # transformers' default for a static cache: the decode step compiled by inductor in mode "reduce-overhead",
    # recorded and replayed as a CUDA graph. fa2tune's step (fa2tune::padded_step on the plan's StepKeys) compiles
    # whole (fullgraph=True), reads no value on the host inside the capture, and gives SDPA's tokens and logits.
    pytest.importorskip("transformers")
    import transformers

    from fa2tune.integrations import transformers as fa2tune_hf

    from .test_hf_integration import _batch, _model

    fa2tune_hf.register()
    model = _model("llama", torch.float32).eval().cuda()
    prompt = {name: t[0::2].cuda() for name, t in _batch(11).items() if name != "labels"}  # one row left-padded
    outputs = {}
    for implementation in ("sdpa", "fa2tune"):
        torch._dynamo.reset()
        model.set_attn_implementation(implementation)
        outputs[implementation] = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                                 cache_implementation="static",
                                                 compile_config=transformers.CompileConfig(fullgraph=True),
                                                 return_dict_in_generate=True, output_logits=True)  # fmt: skip
    assert torch.equal(outputs["fa2tune"].sequences, outputs["sdpa"].sequences)
    for got, want in zip(outputs["fa2tune"].logits, outputs["sdpa"].logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
