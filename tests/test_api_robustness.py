"""The public API with what a demanding user passes: second-order gradients, and every integer, bool, float and tensor
argument of get_kernel, attention, attention_varlen, an AttentionKernel, FlashAttnFunction and KernelConfig with
wrong types and edge values. Each gives a clear error (naming the argument, what was expected, what came) or the
right result — never a crash deep inside, never a wrong number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fa2tune
from fa2tune.api import ops
from fa2tune.config.inputs import check_window
from fa2tune.config.schedule import Schedule
from fa2tune.config.types import KernelConfig, Mask
from fa2tune.launch import launcher
from fa2tune.tune.reference import naive_attention, naive_attention_varlen

from .conftest import assert_close

SECOND_ORDER = r"fa2tune's attention is differentiable once.*create_graph=True.*SDPBackend.MATH"
F32 = torch.float32


def _qkv(device, shape=(1, 2, 20, 16), seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device).requires_grad_(requires_grad) for _ in range(3)]


def _packed(device, lengths=(5, 15), heads=2, head_dim=16, seed=0, requires_grad=False):
    total = sum(lengths)
    q, k, v = _qkv(device, (total, heads, head_dim), seed, requires_grad)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    return q, k, v, cu


def _reference(q, k, v, **mask):
    return naive_attention(q.double(), k.double(), v.double(), **mask)[0]


# ---- second-order gradients: refused when asked for, never a gradient without attention's terms -------------


def _dense_calls(device):
    def eager(q, k, v):
        return fa2tune.attention(q, k, v, causal=True)

    def op(q, k, v):  # the custom op's autograd formula: what torch.compile and tracing run
        return ops.apply_op(q, k, v, Mask(causal=True), 0.25, None)[0]

    def kernel(q, k, v):
        return fa2tune.get_kernel(16, device=device, dtype=F32, causal=True)(q, k, v)

    def lse(q, k, v):  # the gradient through the logsumexp alone (dO is None in the backward)
        return fa2tune.attention(q, k, v, return_lse=True)[1]

    def lse_op(q, k, v):
        return ops.apply_op(q, k, v, Mask(), 0.25, None)[1]

    return dict(eager=eager, op=op, kernel=kernel, lse=lse, lse_op=lse_op)


@pytest.mark.parametrize("path", ["eager", "op", "kernel", "lse", "lse_op"])
def test_a_gradient_penalty_through_attention_is_refused(path, device):
    # Unrefused, the eager path's create_graph gradient carries no graph, so loss.backward() gives q.grad without the
    # penalty's term and no error; the op path fails only at the second backward, naming fa2tune.bwd's missing
    # autograd formula.
    q, k, v = _qkv(device, requires_grad=True)
    out = _dense_calls(device)[path](q, k, v)
    with pytest.raises(RuntimeError, match=SECOND_ORDER):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("path", ["eager", "op", "kernel"])
def test_a_gradient_penalty_through_packed_attention_is_refused(path, device):
    q, k, v, cu = _packed(device, requires_grad=True)
    packing = launcher.Packing(cu, cu, 15, 15)
    run = {
        "eager": lambda: fa2tune.attention_varlen(q, k, v, cu, cu, 15, 15),
        "op": lambda: ops.apply_op(q, k, v, Mask(), 0.25, None, packing)[0],
        "kernel": lambda: fa2tune.get_kernel(16, device=device, dtype=F32, varlen=True)(q, k, v, cu, cu, 15, 15),
    }[path]
    out = run()
    with pytest.raises(RuntimeError, match=SECOND_ORDER):
        torch.autograd.grad((out * out).sum(), (q, k, v), create_graph=True)


def test_a_second_order_gradient_that_does_not_pass_through_attention_still_works(device):
    # The refusal is in attention's backward, which autograd runs only where a gradient passes through it.
    q, k, v = _qkv(device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    loss = (fa2tune.attention(q, k, v) * w).sum()
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    (g.square().sum() + loss).backward()
    assert q.grad is not None and w.grad is not None and torch.isfinite(w.grad).all()


# ---- get_kernel's arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "head_dim", [True, False, 64.0, float("nan"), "64", None, torch.tensor(True), torch.tensor(64.0)], ids=repr
)
def test_get_kernel_takes_only_integers_as_head_dim(head_dim, device):
    # bool is an int subclass: unchecked, True would pass as head_dim 1; the others are type errors, not ValueErrors.
    with pytest.raises(TypeError, match=r"head_dim must be an int, got"):
        fa2tune.get_kernel(head_dim, device=device, dtype=F32)


@pytest.mark.parametrize("head_dim", [0, -1, 257, 2**40, np.int64(2**40)], ids=repr)
def test_get_kernel_refuses_head_dims_out_of_range(head_dim, device):
    with pytest.raises(ValueError, match=r"head_dim must be an int in 1..256, got"):
        fa2tune.get_kernel(head_dim, device=device, dtype=F32)


def test_get_kernel_takes_numpy_and_0_dim_tensor_integers_as_python_ints(device):
    # A check for int alone refuses each of these; PyTorch takes them as ints, and so does fa2tune.
    kernel = fa2tune.get_kernel(
        np.int64(16), device=device, dtype=F32, window=(np.int32(4), torch.tensor(-1)), prefix_len=np.uint8(3)
    )
    assert (kernel.head_dim, kernel.window, kernel.prefix_len) == (16, (4, -1), 3)
    assert all(type(x) is int for x in (kernel.head_dim, *kernel.window, kernel.prefix_len))
    assert kernel is fa2tune.get_kernel(16, device=device, dtype=F32, window=(4, -1), prefix_len=3)  # one cache entry
    # a CUDA index, as the string names it: the same kernel (and no accelerator asked for where there is none)
    assert fa2tune.get_kernel(16, device=np.int64(0), dtype=F32) is fa2tune.get_kernel(16, device="cuda:0", dtype=F32)
    q, k, v = _qkv(device)
    assert_close(kernel(q, k, v), _reference(q, k, v, window=(4, -1), prefix_len=3), F32)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dtype=[]), TypeError, r"dtype must be torch.bfloat16, torch.float16 or torch.float32, got \[\]"),
        (dict(dtype="bf16"), TypeError, r"dtype must be .* got 'bf16'"),
        (dict(device=None), TypeError, r"device must be a str, a torch.device or an int, got NoneType"),
        (dict(device=True), TypeError, r"device must be a str, a torch.device or an int, got bool"),
        (dict(device="foo"), ValueError, r"device 'foo' is not a device"),
        (dict(device=-1), ValueError, r"device -1 is not a device: a CUDA index is 0..127"),
        (dict(device=256), ValueError, r"device 256 is not a device: a CUDA index is 0..127"),
        (dict(causal=1), TypeError, r"causal must be True or False, got 1"),
        (dict(varlen=np.True_), TypeError, r"varlen must be True or False"),
        (dict(window=(True, 0)), TypeError, r"window must be None or a \(left, right\) pair of ints"),
        (dict(window=(3.0, 0)), TypeError, r"window must be None or a \(left, right\) pair of ints"),
        (dict(window=(torch.tensor(3.0), 0)), TypeError, r"window must be None or a \(left, right\) pair of ints"),
        (dict(window=(1, 2, 3)), TypeError, r"window must be None or a \(left, right\) pair of ints"),
        (dict(window=(np.int64(-2), 0)), ValueError, r"window sides must be >= -1"),
        (dict(prefix_len=True), TypeError, r"prefix_len must be an int, got bool"),
        (dict(prefix_len=2.0), TypeError, r"prefix_len must be an int, got float"),
        (dict(prefix_len=np.int64(-1)), ValueError, r"prefix_len must be >= 0, got -1"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else "",
)
def test_get_kernel_argument_errors_name_the_argument(kwargs, error, match, device):
    # Unchecked, dtype=[] raises "unhashable type: 'list'", and a device that is none torch's own long TypeError or
    # RuntimeError; every error here names the argument.
    with pytest.raises(error, match=match):
        fa2tune.get_kernel(16, **{"device": device, "dtype": F32, **kwargs})


# ---- mask extents past any sequence ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window, prefix_len, reference",
    [
        ((3, 2**31 - 1), 0, dict(window=(3, -1))),  # the kernels add the right side to int32 positions
        ((2**31 - 1, 2**31 - 1), 0, dict()),
        ((2**70, 0), 0, dict(causal=True)),  # past int64: Triton and the op's schema cannot take it
        ((-1, -1), 2**70, dict(prefix_len=20)),
    ],
    ids=["right-2^31", "both-2^31", "left-2^70", "prefix-2^70"],
)
@pytest.mark.parametrize("path", ["eager", "op"])
def test_window_and_prefix_past_any_sequence_reach_every_key(window, prefix_len, reference, path, device):
    # Passed on as they are, a right side near 2^31 wraps around in the kernels and gives a wrong output with no
    # error; a side of 2^70 raises OverflowError inside Triton (eager) or a schema error (op); a prefix of 2^70 a
    # schema error (op).
    q, k, v = _qkv(device, seed=1)
    if path == "eager":
        out = fa2tune.attention(q, k, v, window=window, prefix_len=prefix_len)
    else:
        mask = Mask(window=check_window(window), prefix_len=fa2tune.config.inputs.check_prefix_len(prefix_len))
        out = ops.apply_op(q, k, v, mask, 16**-0.5, None)[0]
    assert_close(out, _reference(q, k, v, **reference), F32)


# ---- scale -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), np.int64(1)], ids=repr)
def test_numpy_scales_are_taken_as_floats(scale, device):
    # np.float64 subclasses float; np.float32 and np.int64 do not, and a check for float alone refuses them.
    q, k, v = _qkv(device, seed=2)
    assert_close(fa2tune.attention(q, k, v, scale=scale), _reference(q, k, v, scale=float(scale)), F32)


def test_a_tensor_scale_is_refused_as_it_would_get_no_gradient(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"scale must be a float or None, got a torch.Tensor.*learnable"):
        fa2tune.attention(q, k, v, scale=torch.tensor(0.3, requires_grad=True))


@pytest.mark.parametrize("scale", [1e39, 1e300], ids=repr)
def test_a_scale_past_fp32s_range_is_refused(scale, device):
    # Unchecked, the kernels' fp32 scale·log2(e) is inf and the output all NaN, with no error.
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number up to 2.36e\+38"):
        fa2tune.attention(q, k, v, scale=scale)


# ---- packed sequences: cu_seqlens and max_seqlen -----------------------------------------------------------


def test_non_contiguous_offsets_are_refused(device):
    # Checked through their strides the offsets read [0, 5, 20] (valid), while the kernels read the memory under
    # them as if contiguous ([0, 99, 5]): an output of ~1e34 with no error.
    q, k, v, _ = _packed(device)
    holder = torch.tensor([0, 99, 5, 99, 20], dtype=torch.int32, device=device)
    cu = holder[::2]
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be contiguous, got stride 2; call .contiguous\(\)"):
        fa2tune.attention_varlen(q, k, v, cu, cu.contiguous(), 15, 15)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be contiguous, got stride 0"):
        fa2tune.attention_varlen(
            q, k, v, cu.contiguous(), torch.zeros(1, dtype=torch.int32, device=device).expand(3), 15, 15
        )


@pytest.mark.parametrize(
    "max_seqlen", [np.int64(15), np.int32(15), torch.tensor(15), torch.tensor(15, dtype=torch.int32)], ids=repr
)
def test_numpy_and_0_dim_tensor_max_seqlens_are_taken_as_ints(max_seqlen, device):
    # A check for int alone refuses these, and flash_attn callers often pass seqlens.max().
    q, k, v, cu = _packed(device, seed=3)
    out = fa2tune.attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen)
    assert torch.equal(out, fa2tune.attention_varlen(q, k, v, cu, cu, 15, 15))


@pytest.mark.parametrize("max_seqlen", [2**40, 2**70], ids=["2^40", "2^70"])
@pytest.mark.parametrize("path", ["eager", "op"])
def test_a_max_seqlen_past_the_tokens_is_the_same_launch_as_the_tokens(max_seqlen, path, device):
    # Passed on as it is, 2^70 raises OverflowError inside Triton and 2^40 sizes a grid of 2^36 programs (a hang in
    # the interpreter; past CUDA's grid limit on a GPU).
    q, k, v, cu = _packed(device, seed=4, requires_grad=True)
    if path == "eager":
        out = fa2tune.attention_varlen(q, k, v, cu, cu, max_seqlen, 15, scale=0.25)
    else:  # attention_varlen's checks, then the op
        packing = launcher.Packing(*fa2tune.config.inputs.check_varlen(q, k, v, cu, cu, max_seqlen, 15))
        assert (packing.max_seqlen_q, packing.max_seqlen_k) == (20, 15)
        out = ops.apply_op(q, k, v, Mask(), 0.25, None, packing)[0]
    ref = naive_attention_varlen(*(t.detach().double() for t in (q, k, v)), cu, cu, scale=0.25)[0]
    assert_close(out, ref, F32)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((True, 15), TypeError, r"max_seqlen_q must be an int, got bool True"),
        ((15.0, 15), TypeError, r"max_seqlen_q must be an int, got float 15.0"),
        ((torch.tensor(15.0), 15), TypeError, r"max_seqlen_q must be an int, got Tensor"),
        ((15, "15"), TypeError, r"max_seqlen_k must be an int, got str '15'"),
        ((-1, 15), ValueError, r"max_seqlen_q must be >= 0, got -1"),
    ],
    ids=lambda x: repr(x) if isinstance(x, tuple) else "",
)
def test_max_seqlen_errors_name_the_argument(args, error, match, device):
    q, k, v, cu = _packed(device)
    with pytest.raises(error, match=match):
        fa2tune.attention_varlen(q, k, v, cu, cu, *args)


@pytest.mark.parametrize(
    "cu, error, match",
    [
        (lambda cu: cu.long(), TypeError, r"cu_seqlens_q must be a 1-D torch.int32 tensor .* got torch.int64"),
        (lambda cu: cu[None], TypeError, r"cu_seqlens_q must be a 1-D torch.int32 tensor .* shape \(1, 3\)"),
        (lambda cu: cu.tolist(), TypeError, r"cu_seqlens_q must be a 1-D torch.int32 tensor .* got list"),
        (lambda cu: cu.to("meta"), ValueError, r"cu_seqlens_q must be on q's device \S+, got meta"),
    ],
    ids=["int64", "2-D", "list", "meta"],
)
def test_offsets_of_a_wrong_type_dtype_rank_or_device_are_refused(cu, error, match, device):
    q, k, v, offsets = _packed(device)
    with pytest.raises(error, match=match):
        fa2tune.attention_varlen(q, k, v, cu(offsets), offsets, 15, 15)


# ---- an AttentionKernel's call ---------------------------------------------------------------------------


def test_a_kernel_call_checks_its_tensors_before_reading_them(device):
    # Unchecked, these raise AttributeError ('str' object has no attribute 'shape') and IndexError (a 0-dim q).
    q, k, v = _qkv(device)
    kernel = fa2tune.get_kernel(16, device=device, dtype=F32)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got str"):
        kernel("q", k, v)
    with pytest.raises(ValueError, match=r"q must be 4-D .* got shape \(\)"):
        kernel(q[0, 0, 0, 0], k, v)
    with pytest.raises(ValueError, match=r"resolved for head_dim=16.*got q with head_dim=8"):
        kernel(q[..., :8], k[..., :8], v[..., :8])


def test_a_varlen_kernel_call_checks_its_packing_before_reading_it(device):
    # Unchecked, max_seqlen_q="a" raises "'>' not supported between instances of 'int' and 'str'", and a fifth
    # packing argument Python's "takes 7 positional arguments but 8 were given".
    q, k, v, cu = _packed(device, seed=5)
    kernel = fa2tune.get_kernel(16, device=device, dtype=F32, varlen=True)
    with pytest.raises(TypeError, match=r"max_seqlen_q must be an int, got str 'a'"):
        kernel(q, k, v, cu, cu, "a", 15)
    with pytest.raises(TypeError, match=r"this kernel takes cu_seqlens_q, .* got 5 more positional arguments"):
        kernel(q, k, v, cu, cu, 15, 15, 1)
    out = kernel(q, k, v, cu, cu, torch.tensor(15), np.int64(2**40))
    assert torch.equal(out, fa2tune.attention_varlen(q, k, v, cu, cu, 15, 15))


# ---- FlashAttnFunction.apply ------------------------------------------------------------------------------


def test_flash_attn_function_checks_its_arguments(device):
    # Unchecked, a k of head_dim 8 under a q of 16 runs (reading past k's rows), a mask of 1 is taken as causal, and
    # a Mask with a side of 2^70 raises OverflowError inside Triton.
    q, k, v = _qkv(device, seed=6)
    with pytest.raises(ValueError, match=r"k's head_dim must equal q's .*, got q=16, k=8"):
        fa2tune.FlashAttnFunction.apply(q, k[..., :8].contiguous(), v, False, 0.3, None)
    with pytest.raises(TypeError, match=r"mask must be True or False \(causal\) or a fa2tune.Mask, got 1"):
        fa2tune.FlashAttnFunction.apply(q, k, v, 1, 0.3, None)
    with pytest.raises(TypeError, match=r"scale must be a float or None, got str"):
        fa2tune.FlashAttnFunction.apply(q, k, v, False, "0.3", None)
    with pytest.raises(TypeError, match=r"packing must be a fa2tune.launch.launcher.Packing or None, got tuple"):
        fa2tune.FlashAttnFunction.apply(q, k, v, False, 0.3, None, (None, None, 1, 1))
    o, _ = fa2tune.FlashAttnFunction.apply(q, k, v, Mask(window=(2**70, 0)), 0.3, None)
    assert_close(o, _reference(q, k, v, causal=True, scale=0.3), F32)


# ---- KernelConfig ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        dict(block_m=64.0),
        dict(block_m=torch.tensor(16)),
        dict(num_warps=4.0),
        dict(num_stages=True),
        dict(num_stages=2.5),
        dict(num_stages=float("nan")),
        dict(pipeline_qk=True),
    ],
    ids=repr,
)
def test_kernel_config_fields_are_integers(fields):
    # Unchecked, 64.0, a tensor or 4.0 crash inside the Triton launch (InterpreterError), and True, False and 2.5
    # run as 1, 0 and 2.5 stages.
    name = next(iter(fields))
    with pytest.raises(TypeError, match=rf"KernelConfig.{name} must be an int, got"):
        KernelConfig(**{"block_m": 16, "block_n": 16, **fields})


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: KernelConfig(16, 16, warp_specialized=0), "KernelConfig.warp_specialized must be a bool, got int 0"),
        (lambda: KernelConfig(16, 16, pingpong="0"), "KernelConfig.pingpong must be a bool, got str"),
        (lambda: KernelConfig(16, 16, fused_dq=1.0), "KernelConfig.fused_dq must be a bool, got float"),
        (lambda: KernelConfig(16, 16, schedule="0"), "KernelConfig.schedule must be a Schedule, got str"),
        (lambda: Schedule(persistent=1), "Schedule.persistent must be a bool, got int 1"),
        (lambda: Schedule(programs_per_sm=2.0), "Schedule.programs_per_sm must be an int, got float"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)  # fmt: skip
def test_kernel_config_switches_are_bools_and_the_schedule_a_schedule(make, message):
    # The switches that were integer codes (warpspec, persistent) are named flags: an int there is an error, not a
    # code read one way or another.
    with pytest.raises(TypeError, match=message):
        make()


def test_kernel_config_takes_numpy_integers_as_python_ints(device):
    # np.int64 block sizes kept as they are crash inside the Triton launch: they are taken as Python ints.
    config = KernelConfig(np.int64(16), np.int32(32), num_warps=np.int64(4), num_stages=np.uint8(1))
    assert config == KernelConfig(16, 32, 4, 1) and all(type(x) is int for x in ops._to_ints(config))
    q, k, v = _qkv(device, seed=7)
    assert_close(fa2tune.attention(q, k, v, config=config), _reference(q, k, v), F32)


# ---- tensors ---------------------------------------------------------------------------------------------


def test_expanded_inputs_with_stride_0_give_the_right_output_and_gradients(device):
    # k and v shared by every head through a stride-0 head dimension, q repeated over the batch: read in place.
    gen = torch.Generator().manual_seed(8)
    q_base = torch.randn(1, 2, 20, 16, generator=gen).to(device).requires_grad_()
    kv_base = [torch.randn(1, 1, 20, 16, generator=gen).to(device).requires_grad_() for _ in range(2)]
    q, k, v = q_base.expand(3, 2, 20, 16), *(t.expand(3, 2, 20, 16) for t in kv_base)
    assert k.stride(1) == 0 and q.stride(0) == 0
    out = fa2tune.attention(q, k, v, causal=True)
    do = torch.randn(out.shape, generator=gen).to(device)
    grads = torch.autograd.grad(out, (q_base, *kv_base), do)
    leaves = [t.detach().double().requires_grad_() for t in (q_base, *kv_base)]
    ref = naive_attention(*(t.expand(3, 2, 20, 16) for t in leaves), causal=True)[0]
    for got, want in zip((out, *grads), (ref, *torch.autograd.grad(ref, leaves, do.double())), strict=True):
        assert_close(got, want, F32)


def test_rows_more_than_2_31_elements_apart_are_addressed_in_64_bits(device):
    # A row stride under 2^31 reaches Triton as an int32; row 2 of these tensors lies past 2^31 elements, where an
    # offset of row·stride (or a tile's step, BLOCK·stride) computed in 32 bits wraps negative and reads before the
    # tensor. Q, K and V are views into one 4 GiB fp16 storage (only their rows are touched), so the forward reads
    # K and V that far and the backward Q and K.
    stride, rows, head_dim = 2**30 + 8, 3, 8
    try:
        storage = torch.empty(stride * (rows - 1) + 3 * head_dim, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError):
        pytest.skip("no 4 GiB of address space for the storage")
    gen = torch.Generator().manual_seed(9)
    views = []
    for which in range(3):  # q, k, v: each row's head_dim values at row·stride + which·head_dim
        view = storage.as_strided((1, 1, rows, head_dim), (0, 0, stride, 1), which * head_dim)
        view.copy_(torch.randn(view.shape, generator=gen).to(device, torch.float16))
        views.append(view.detach().requires_grad_())
    out = fa2tune.attention(*views, causal=True)
    do = torch.randn(out.shape, generator=gen).to(device, torch.float16)
    grads = torch.autograd.grad(out, views, do)
    leaves = [t.detach().double().requires_grad_() for t in views]
    ref = naive_attention(*leaves, causal=True)[0]
    for got, want in zip((out, *grads), (ref, *torch.autograd.grad(ref, leaves, do.double())), strict=True):
        assert_close(got, want, torch.float16)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_config_resolved_for_the_caller_falls_back_where_a_chosen_one_is_refused(grad, device):
    # A get_kernel() kernel's configs are resolved for it (attention.checked_apply's chosen=False): a call a
    # warp-specialized one cannot run (here fp32, which the Hopper kernels do not take) runs the Triton template, as
    # a call without a config does; the same config passed to attention() is the caller's choice, refused by name
    from fa2tune.api.attention import checked_apply

    q, k, v = _qkv(device, (1, 2, 40, 16), requires_grad=grad)
    hopper = KernelConfig(64, 64, 4, 2, warp_specialized=True)
    out = checked_apply(q, k, v, True, None, None, 0, False, hopper, None, chosen=False)
    assert_close(out, _reference(q.detach(), k.detach(), v.detach(), causal=True), F32)
    with pytest.raises(ValueError, match=r"config KernelConfig\(.*\) cannot run this call"):
        fa2tune.attention(q, k, v, causal=True, config=hopper)


def test_every_entry_point_runs_under_inference_mode(device):
    # torch.inference_mode makes inference tensors, which have no version counter: the offsets' check, which keeps
    # a checked offsets tensor by its version, reads them at every call instead; results are no_grad's
    q, k, v = _qkv(device, (1, 2, 20, 16))
    pq, pk, pv, cu = _packed(device)
    calls = {
        "attention": lambda: fa2tune.attention(q, k, v, causal=True),
        "one token": lambda: fa2tune.attention(q[:, :, :1], k, v),
        "varlen": lambda: fa2tune.attention_varlen(pq, pk, pv, cu, cu, 15, 15, causal=True),
        "varlen, a token a sequence": lambda: fa2tune.attention_varlen(
            pq[:2], pk, pv, torch.arange(3, dtype=torch.int32, device=device), cu, 1, 15),
        "flash_attn_varlen_func": lambda: fa2tune.flash_attn_varlen_func(pq, pk, pv, cu, cu, 15, 15, causal=True),
        "kvcache": lambda: fa2tune.flash_attn_with_kvcache(q.transpose(1, 2)[:, :1], k.transpose(1, 2),
                                                          v.transpose(1, 2), causal=True),
    }  # fmt: skip
    for name, call in calls.items():
        with torch.no_grad():
            want = call()
        with torch.inference_mode():
            cu = cu.clone()  # an inference tensor, as offsets made inside inference_mode are
            got = call()
        assert_close(got, want.double(), F32, what=name)


def test_function_transforms_and_forward_mode_ad_are_refused_not_dropped(device):
    # The kernels have no batching rule and no forward derivative. Under torch.func's transforms the eager path took
    # the wrapped tensors for plain ones (a crash reading their data), and a forward-mode AD tangent on a plain
    # tensor was dropped: a JVP of 0 with no error. Each is now a NotImplementedError that says what to do.
    import torch.autograd.forward_ad as fwAD

    q, k, v = _qkv(device)
    transforms = {
        "vmap": lambda: torch.vmap(fa2tune.attention)(q[None], k[None], v[None]),
        "grad": lambda: torch.func.grad(lambda a: fa2tune.attention(a, k, v).sum())(q),
        "jvp": lambda: torch.func.jvp(lambda a: fa2tune.attention(a, k, v), (q,), (q,)),
        "vmap of flash_attn_func": lambda: torch.vmap(fa2tune.flash_attn_func)(q[None], k[None], v[None]),
        "vmap of kvcache": lambda: torch.vmap(fa2tune.flash_attn_with_kvcache)(q[None, :, :1], k[None], v[None]),
    }
    for name, call in transforms.items():
        with pytest.raises(NotImplementedError, match=r"does not run under a torch.func transform \(vmap"):
            call()
            pytest.fail(f"{name}: no error")
    with fwAD.dual_level():
        for index, name in enumerate("qkv"):
            args = [q, k, v]
            args[index] = fwAD.make_dual(args[index], torch.randn_like(args[index]))
            with pytest.raises(NotImplementedError, match=rf"under a forward-mode AD tangent on {name} "):
                fa2tune.attention(*args, causal=True)
        cache_k, cache_v = (t.transpose(1, 2).contiguous() for t in (k, v))
        new_k = fwAD.make_dual(cache_k[:, :1].clone(), torch.randn_like(cache_k[:, :1]))
        with pytest.raises(NotImplementedError, match="under a forward-mode AD tangent on k "):
            fa2tune.flash_attn_with_kvcache(q.transpose(1, 2)[:, :1], cache_k, cache_v, k=new_k,
                                            v=cache_v[:, :1].clone(), cache_seqlens=5)  # fmt: skip
        plain = fa2tune.attention(q, k, v, causal=True)  # no tangent: an ordinary call inside a dual level
    assert_close(plain, _reference(q, k, v, causal=True), F32)
    # traced by torch.compile, a tangent is not visible (dynamo traces stand-in tensors): a call compiled inside a
    # dual level is refused rather than run with its tangent dropped
    compiled = torch.compile(lambda a, b, c: fa2tune.attention(a, b, c), backend="aot_eager", fullgraph=True)
    with fwAD.dual_level(), pytest.raises(Exception, match=r"torch\.compile inside a torch\.autograd\.forward_ad"):
        compiled(fwAD.make_dual(q, torch.randn_like(q)), k, v)
    assert_close(compiled(q, k, v), _reference(q, k, v), F32)  # outside one, compiled calls run


@pytest.mark.parametrize(
    "call",
    [lambda q, k, v, **kw: fa2tune.flash_attn_func(q, k, v, **kw),
     lambda q, k, v, **kw: fa2tune.flash_attn_with_kvcache(q, k, v, **kw)],
    ids=["flash_attn_func", "flash_attn_with_kvcache"],
)  # fmt: skip
def test_flash_attn_entry_points_name_their_own_arguments(call, device):
    # flash_attn's arguments are window_size and softmax_scale; an error names them so, not attention()'s names
    q, k, v = (t.transpose(1, 2) for t in _qkv(device))
    with pytest.raises(TypeError, match=r"^window_size must be None or a \(left, right\) pair of ints, got 5"):
        call(q, k, v, window_size=5)
    with pytest.raises(ValueError, match=r"^window_size sides must be >= -1"):
        call(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"^softmax_scale must be a positive finite number"):
        call(q, k, v, softmax_scale=-1.0)
    with pytest.raises(TypeError, match=r"^softmax_scale must be a float or None, got a torch.Tensor"):
        call(q, k, v, softmax_scale=torch.tensor(0.5))
