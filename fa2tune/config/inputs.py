"""Checks of what users pass to attention(): every error names the argument, what was expected and what came."""

from __future__ import annotations

import itertools
import math
import numbers
import os
import weakref
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

from .types import DTYPE_CHOICES, MAX_HEAD_DIM, integer

# The dtypes the kernels take, by their short names (types.DTYPE_CHOICES) as YAML, the CLI and Triton signatures
# spell them.
DTYPES_BY_NAME = dict(zip(DTYPE_CHOICES, (torch.bfloat16, torch.float16, torch.float32), strict=True))
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}
SUPPORTED_DTYPES = tuple(DTYPE_NAMES)

# A window side or prefix past any sequence reaches every key, as an unbounded one does (Mask.bounds): larger ones
# are kept at this, within the int64 that the custom op's schema and Triton's scalar arguments take.
MASK_EXTENT_MAX = 2**62
# The kernels multiply the scores by scale·log2(e) in fp32: a larger scale would be inf there.
SCALE_MAX = torch.finfo(torch.float32).max / math.log2(math.e)


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """An integer argument as a Python int: an int, a NumPy integer or an integer 0-dim tensor, as PyTorch takes
    them (types.integer); not a bool nor a float. TypeError for another type, ValueError outside minimum..maximum."""
    number = integer(value)
    if number is None and _integer_scalar_tensor(value):
        number = int(value.item())  # type: ignore[union-attr]
    if number is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if number < minimum or (maximum is not None and number > maximum):
        expected = f"an int in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {number}")
    return number


def _integer_scalar_tensor(value: object) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    )


def check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    return dtype


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention call, in SDPA's layout (batch, heads, seqlen, head_dim): head_dim is Q's and K's,
    head_dim_v V's (and O's), which may differ (MLA-style models: 192 and 128)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph, where reading a tensor back to the host is an error."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# The names errors give the three tensors: the arguments' own (flash_attn's and attention()'s q, k, v; SDPA's query,
# key, value: sdpa.SDPA_NAMES).
QKV_NAMES = ("q", "k", "v")


def _check_tensors(q: object, k: object, v: object, layout: str, names: tuple[str, str, str] = QKV_NAMES) -> None:
    """What q, k, v must share in any layout: tensor type, rank, dtype, unit last stride, one device."""
    rank = layout.count(",") + 1
    qn, kn, vn = names
    for name, t in zip(names, (q, k, v), strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(
                f"{name} must have unit stride in its last dimension (head_dim), got strides {tuple(t.stride())}; "
                "call .contiguous() on it"
            )
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    check_no_function_transform(q, k, v, names=names)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{qn}, {kn} and {vn} must share one dtype, got {qn}={q.dtype}, {kn}={k.dtype}, {vn}={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{qn}, {kn} and {vn} must be on one device, got {qn}={q.device}, {kn}={k.device}, {vn}={v.device}"
        )
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{qn} is on the CPU, but fa2tune's kernels run on CUDA devices; move the tensors to a GPU, or set "
            "TRITON_INTERPRET=1 before importing triton to run them through Triton's interpreter (slow, for tests)"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{qn} must be on a CUDA device, got {q.device}")


def function_transform(*tensors: torch.Tensor, names: tuple[str, ...] = QKV_NAMES) -> str | None:
    """Why fa2tune cannot run a call on these tensors because of a torch.func transform (vmap, grad, jvp, jacrev,
    ...) or forward-mode AD (torch.autograd.forward_ad), or None. The kernels have no batching rule and no forward
    derivative: the eager path would take a transform's wrapped tensors for plain ones (a crash) and drop a tangent
    (a JVP of 0, silently). While torch.compile traces, neither a transform nor a tangent is visible (dynamo traces
    the call on stand-in tensors), so a call traced inside a forward_ad.dual_level gets a reason too."""
    level = getattr(forward_ad, "_current_level", None)  # the private dual level: a cheap test before unpack_dual
    if torch.compiler.is_compiling():
        if level is not None and level >= 0:
            return "torch.compile inside a torch.autograd.forward_ad.dual_level (a forward-mode tangent)"
        return None
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "a torch.func transform (vmap, grad, jvp, jacrev, ...)"
    if level is None or level >= 0:
        for name, t in zip(names, tensors, strict=True):
            if t is not None and forward_ad.unpack_dual(t).tangent is not None:
                return f"a forward-mode AD tangent on {name} (torch.autograd.forward_ad)"
    return None


def check_no_function_transform(*tensors: torch.Tensor, names: tuple[str, ...] = QKV_NAMES) -> None:
    """NotImplementedError naming the transform or the tangent where function_transform finds one: fa2tune
    differentiates in reverse mode only (backward(), torch.autograd.grad)."""
    reason = function_transform(*tensors, names=names)
    if reason is not None:
        raise NotImplementedError(
            f"fa2tune's attention does not run under {reason}: it has no batching rule and no forward derivative. "
            "Call it outside the transform (its batch dimension takes what vmap would map over) and differentiate "
            "it in reverse mode (backward() or torch.autograd.grad)"
        )


def _check_heads(heads_q: int, heads_k: int, heads_v: int, names: tuple[str, str, str] = QKV_NAMES) -> None:
    qn, kn, vn = names
    if heads_k != heads_v:
        raise ValueError(f"{kn} and {vn} must have the same number of heads, got {kn}={heads_k}, {vn}={heads_v}")
    if heads_k == 0:
        if heads_q == 0:
            return  # no heads at all: an empty output, as scaled_dot_product_attention gives
        raise ValueError(f"{kn} and {vn} must have at least one head, got none ({qn} heads={heads_q})")
    if heads_q % heads_k != 0:
        raise ValueError(
            f"{qn}'s heads must be a multiple of {kn}/{vn}'s heads (GQA/MQA), got {qn} heads={heads_q}, "
            f"{kn}/{vn} heads={heads_k}"
        )


def _check_head_dim(head_dim: int, k_dim: int, v_dim: int, names: tuple[str, str, str] = QKV_NAMES) -> None:
    """Q and K share a head dim (the scores are q·kᵀ); V's may be its own (O takes it), each in 1..MAX_HEAD_DIM."""
    qn, kn, vn = names
    if k_dim != head_dim:
        raise ValueError(f"{kn}'s head_dim must equal {qn}'s (the scores are q·kᵀ), got {qn}={head_dim}, {kn}={k_dim}")
    for name, dim in ((qn, head_dim), (vn, v_dim)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}'s head_dim must be in 1..{MAX_HEAD_DIM}, got {dim}")


def check_qkv(q: object, k: object, v: object, names: tuple[str, str, str] = QKV_NAMES) -> AttentionShape:
    """Validates q, k, v (batch, heads, seqlen, head_dim) and returns their sizes; errors call them `names` (the
    caller's arguments': SDPA's are query, key, value).

    Raises:
        TypeError: a non-tensor, a non-float dtype, or mixed dtypes.
        ValueError: wrong rank, mismatched sizes (k's head_dim other than q's; v's may differ), GQA heads that
            do not divide, a head_dim > 256,
            a non-unit last stride, tensors on different devices, or CPU tensors without the interpreter.
    """
    _check_tensors(q, k, v, "(batch, heads, seqlen, head_dim) as in scaled_dot_product_attention", names)
    batch, heads_q, seqlen_q, head_dim = q.shape
    qn, kn, vn = names
    try:
        if k.shape[0] != batch or v.shape[0] != batch:
            raise ValueError(
                f"{qn}, {kn} and {vn} must have the same batch size, got {batch}, {k.shape[0]}, {v.shape[0]}"
            )
        _check_heads(heads_q, k.shape[1], v.shape[1], names)
        if k.shape[2] != v.shape[2]:
            raise ValueError(
                f"{kn} and {vn} must have the same sequence length, got {kn}={k.shape[2]}, {vn}={v.shape[2]}"
            )
    except ValueError as error:
        raise ValueError(f"{error}{_LAYOUT_HINT}") from None
    _check_head_dim(head_dim, k.shape[3], v.shape[3], names)
    return AttentionShape(batch, heads_q, k.shape[1], seqlen_q, k.shape[2], head_dim, v.shape[3])


# What a shape mismatch in SDPA's layout often means: sizes cannot tell the two layouts apart, so this is a hint.
_LAYOUT_HINT = (
    " (the layout is (batch, heads, seqlen, head_dim), as scaled_dot_product_attention's; for flash_attn's "
    "(batch, seqlen, heads, head_dim) pass .transpose(1, 2) of each tensor, or call fa2tune.flash_attn_func)"
)


def unit_last_stride(t: object) -> object:
    """`t` with the unit stride in head_dim that the kernels read, copied only when it has none: for the calls that
    take any strides, as PyTorch's SDPA and flash_attn do (attention() asks for it instead)."""
    return t.contiguous() if isinstance(t, torch.Tensor) and t.dim() > 0 and t.stride(-1) != 1 else t


def check_varlen(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Validates packed sequences' shapes and types (FlashAttention-2's varlen layout); returns
    (cu_q, cu_k, max_q, max_k). The offsets' values are checked by check_offsets, inside the kernel op."""
    _check_tensors(q, k, v, "(total_tokens, heads, head_dim) as in flash_attn_varlen_func")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got k={k.shape[0]}, v={v.shape[0]}")
    _check_heads(q.shape[1], k.shape[1], v.shape[1])
    _check_head_dim(q.shape[2], k.shape[2], v.shape[2])
    maxima = []
    for name, cu, max_name, max_len, total in (
        ("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, q.shape[0]),
        ("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, k.shape[0]),
    ):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise TypeError(f"{name} must be a 1-D torch.int32 tensor of batch + 1 >= 2 offsets, got {got}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
        if cu.stride(0) != 1:  # the kernels read offset b at cu + b
            raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}; call .contiguous() on it")
        # No sequence is longer than its tensor's rows: a larger maximum (a model's context length) is the same
        # launch as that, and sizes the grid by rows that exist.
        maxima.append(min(check_int(max_name, max_len, 0), total))
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    return cu_seqlens_q, cu_seqlens_k, *maxima


def check_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, total_q: int, total_k: int):
    """The values of packed sequences' offsets: start at 0, never decrease, end at the token count, no sequence
    longer than its max_seqlen. The kernels only keep offsets in bounds: without this a wrong cu_seqlens would give
    wrong results with no error.

    Reads the offsets back to the host (a small copy and a sync) — once per offsets tensor: one checked before with
    the same totals and maxima, on the same memory and not modified since (its version counter unchanged), is not
    read again, so a model whose layers share one cu_seqlens pays one host sync per step, not one per layer. A write
    the version counter does not see (`cu.data[i] = ...`, a NumPy or DLPack view) escapes this check, not the
    kernels' bounds: they clamp every offset to the tensor's rows (templates/_common.py.jinja, _sequence_rows), so
    such offsets give a defined result, never a read or write outside a tensor. Called inside the fa2tune::fwd op,
    which runs eagerly even in a torch.compile graph, where a host read would break the graph. While a CUDA graph is
    captured (torch.compile's "reduce-overhead", as transformers compiles a static cache's decode step) nothing can
    be read back: the values go unchecked there, the shapes and dtypes still are, and the kernels' clamping holds.
    """
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or (cu.dim() == 1 and cu.stride(0) != 1):  # `cu.data = ...` may change either
            raise ValueError(f"{name} must be a contiguous torch.int32 tensor, got {cu.dtype}, strides {cu.stride()}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:  # the kernels read both at batch + 1
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must be 1-D and of one length (batch + 1), got shapes "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    if capturing_cuda_graph():
        return
    for name, cu, total, max_name, max_len in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k),
    ):
        # data_ptr: `cu.data = other` keeps the version. An inference tensor (made under torch.inference_mode) has
        # no version counter, so nothing tells a write to it: it is read at every call.
        stamp = None if cu.is_inference() else (cu._version, cu.data_ptr(), total, max_len)
        seen = _checked_offsets.get(id(cu))
        if stamp is not None and seen is not None and seen[0]() is cu and seen[1] == stamp:
            continue
        offsets = cu.tolist()
        seq_lens = [b - a for a, b in itertools.pairwise(offsets)]
        if offsets[0] != 0 or min(seq_lens) < 0:
            shown = f"{offsets[:8]}{'...' if len(offsets) > 8 else ''}"
            raise ValueError(f"{name} must start at 0 and never decrease, got {shown}")
        if offsets[-1] != total:
            raise ValueError(f"{name} must end at the number of tokens ({total}), got {offsets[-1]}")
        longest = max(seq_lens)
        if longest > max_len:
            raise ValueError(f"{max_name}={max_len} is below the longest sequence in {name} ({longest})")
        if stamp is None:
            continue
        if len(_checked_offsets) >= 64:  # a bound, not an LRU: offsets tensors normally live for one step
            _checked_offsets.clear()
        _checked_offsets[id(cu)] = (weakref.ref(cu), stamp)


# id(offsets tensor) -> (weak reference to it, (version, data_ptr, total, max_len) it was checked with)
_checked_offsets: dict[int, tuple[weakref.ref, tuple[int, int, int, int]]] = {}


def check_window(window: object, name: str = "window") -> tuple[int, int]:
    """FlashAttention-2's window_size: (left, right) ints >= -1, -1 = unbounded; None = no window. name: the
    argument as the caller's API spells it (flash_attn's window_size)."""
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{name} must be None or a (left, right) pair of ints, got {window!r}")
    try:
        sides = [min(check_int(f"{name} side", side, -1), MASK_EXTENT_MAX) for side in window]
    except TypeError:
        raise TypeError(f"{name} must be None or a (left, right) pair of ints, got {window!r}") from None
    except ValueError:
        raise ValueError(f"{name} sides must be >= -1 (-1 = unbounded), got {tuple(window)}") from None
    return (sides[0], sides[1])


def check_prefix_len(prefix_len: object) -> int:
    return min(check_int("prefix_len", prefix_len, 0), MASK_EXTENT_MAX)


def check_scale(scale: object, head_dim: int, name: str = "scale") -> float:
    """Returns the softmax scale: 1/sqrt(head_dim) when None, else a positive finite float up to SCALE_MAX (a
    Python or NumPy number). Not a tensor: a learnable scale would get no gradient through a float. name: the
    argument as the caller's API spells it (flash_attn's softmax_scale)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, torch.Tensor):
        raise TypeError(
            f"{name} must be a float or None, got a torch.Tensor; it is taken as a constant (no gradient reaches it): "
            f"pass float({name}), or for a learnable scale multiply q by it and pass {name}=1.0"
        )
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and 0 < scale <= SCALE_MAX):
        raise ValueError(f"{name} must be a positive finite number up to {SCALE_MAX:.3g} (past it scale·log2(e), the "
                         f"fp32 factor the kernels apply to the scores, is inf), got {scale!r}")  # fmt: skip
    return scale


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value
