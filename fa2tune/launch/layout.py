"""What a launcher reads off a call: its tensors' layout (SDPA's or packed sequences), the mask's bounds, the
device to launch on, and the kernel of the template variant the call runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import planner
from ..config.inputs import interpreting
from ..config.types import KernelConfig, Mask, Variant
from ..kernels import codegen
from .grid import cdiv


@dataclass(frozen=True)
class Packing:
    """Packed sequences (FlashAttention-2's varlen layout): tensors are (total_tokens, heads, head_dim) and
    sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q (cu_seqlens_k of k/v)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1


def as_mask(causal: bool | Mask) -> Mask:
    return causal if isinstance(causal, Mask) else Mask(causal=causal)


def layout(q: torch.Tensor, k: torch.Tensor, packing: Packing | None):
    """(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim), and the (batch, head, row) strides of a tensor,
    for SDPA's layout or the packed one (whose batch stride is 0: sequences are found through cu_seqlens)."""
    if packing is None:
        batch, heads_q, seqlen_q, head_dim = q.shape
        return (batch, heads_q, k.shape[1], seqlen_q, k.shape[2], head_dim), lambda t: t.stride()[:3]
    sizes = (packing.batch, q.shape[1], k.shape[1], packing.max_seqlen_q, packing.max_seqlen_k, q.shape[2])
    return sizes, lambda t: (0, t.stride(1), t.stride(0))


def output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """O of attention(q, k, v), uninitialised and contiguous: q's shape and dtype, V's head dim."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def head_dim_options(head_dim: int, head_dim_v: int) -> dict[str, int]:
    """The Triton templates' head-dim constexprs: Q's and K's head dim and its padding (planner.head_dim_padded),
    and where V's differs (the variant's distinct_v: kernel()'s head_dims) V's and its padding."""
    options = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=planner.head_dim_padded(head_dim))
    if head_dim_v != head_dim:
        options.update(HEAD_DIM_V=head_dim_v, HEAD_DIM_V_PAD=planner.head_dim_padded(head_dim_v))
    return options


# A Triton load or store moves at most 16 bytes a thread: 8 elements of a 16-bit tensor.
VECTOR_ELEMENTS = 8


def stride_unit(strides) -> int:
    """The largest power of two up to VECTOR_ELEMENTS that divides every one of `strides` (0 is divisible by any).
    A kernel that takes its strides divided by it and multiplies them back sees each row start aligned to it, which
    Triton's JIT proves of an int argument only when it is divisible by 16 (templates/_macros.jinja's
    strides_in_units)."""
    unit = VECTOR_ELEMENTS
    for stride in strides:
        while stride % unit:
            unit //= 2
    return unit


# Triton passes an int argument under 2^31 as an int32: the kernels multiply a divided stride back in that type.
INT32_LIMIT = 2**31


def in_units(**tensors: tuple[int, ...]) -> tuple[dict[str, int], tuple[int, ...]]:
    """(units, strides) of a Triton kernel's launch, given each tensor's strides by the name of its unit parameter
    (Q=..., DO=...): units {"UNIT_Q": unit, ...}, the constexprs it multiplies each tensor's strides back by
    (stride_unit), and every tensor's strides divided by its unit, in order, as one tuple. A unit a tensor: one of
    weaker alignment narrows no other's vectors. Where a tensor's stride reaches 2^31 its unit is 1 — its strides go
    as they are, int64 —, so a stride divided into an int32 never wraps when the kernel multiplies it back."""
    units = {name: 1 if any(abs(s) >= INT32_LIMIT for s in strides) else stride_unit(strides)
             for name, strides in tensors.items()}  # fmt: skip
    divided = tuple(s // units[name] for name, strides in tensors.items() for s in strides)
    return {f"UNIT_{name}": unit for name, unit in units.items()}, divided


def settled_strides(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a view of it whose size-1 dims have strides that are multiples of VECTOR_ELEMENTS. Such a dim is only
    indexed at 0, so its stride addresses nothing, yet it counts toward the tensor's stride unit (stride_unit) and
    TMA's 16-byte stride rule: a (batch, 1, seqlen, d) slice with a head stride of 3 would read one element at a
    time and leave the warp-specialized kernels. An odd one becomes the extent of the dims inside it (the next
    dim's stride times that dim's size), rounded up to a multiple of VECTOR_ELEMENTS, so it narrows neither."""
    shape = t.shape
    if 1 not in shape:  # the common call: one test
        return t
    strides = t.stride()
    if all(size != 1 or stride % VECTOR_ELEMENTS == 0 for size, stride in zip(shape[:-1], strides, strict=False)):
        return t
    settled = list(strides)
    for dim in range(len(shape) - 2, -1, -1):
        if shape[dim] == 1 and settled[dim] % VECTOR_ELEMENTS:
            extent = settled[dim + 1] * shape[dim + 1]
            settled[dim] = cdiv(extent, VECTOR_ELEMENTS) * VECTOR_ELEMENTS
    return t.as_strided(shape, settled)


def settle(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(tensors through settled_strides, the positions of those it changed). A launch plan's first call asks; a
    signature (plans.plan_key: shapes and strides) with changed positions keeps a plan that settles each call's
    tensors there (settling_launch), so the calls of other signatures that find a plan pay nothing."""
    settled = tuple(settled_strides(t) for t in tensors)
    return settled, tuple(i for i, (a, b) in enumerate(zip(settled, tensors, strict=True)) if a is not b)


def settling_launch(launch: Callable[..., None], positions: tuple[int, ...]) -> Callable[..., None]:
    """`launch`, whose arguments at `positions` go through settled_strides first (settle's positions)."""

    def launch_settled(*args):
        args = list(args)
        for i in positions:
            args[i] = settled_strides(args[i])
        launch(*args)

    return launch_settled


def lse_strides(lse: torch.Tensor, packing: Packing | None) -> tuple[int, int]:
    # dense (batch, H, N): per batch and head; packed (H, total_q): per head only, the row offset is cu_seqlens_q
    return lse.stride()[:2] if packing is None else (0, lse.stride(0))


def totals(q: torch.Tensor, k: torch.Tensor, packing: Packing | None) -> tuple[int, ...]:
    # packed: the rows of q and of k/v, the kernels' TOTAL_Q, TOTAL_K, which bound what cu_seqlens may address
    return (q.shape[0], k.shape[0]) if packing is not None else ()


def mask_args(mask: Mask, seqlen_q: int, seqlen_k: int, packing: Packing | None):
    """The offsets (None for SDPA's layout) and the (left, right, prefix) bounds the kernels take."""
    cu_q, cu_k = (packing.cu_seqlens_q, packing.cu_seqlens_k) if packing is not None else (None, None)
    return cu_q, cu_k, mask.bounds(seqlen_q, seqlen_k)


_NO_SWITCH = contextlib.nullcontext()  # stateless: one instance serves every call


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' own (cuda:1 inputs, current device 0).
    Where it already is (nearly always), no context: entering and leaving torch.cuda.device costs host time every
    call of a short attention waits for."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_SWITCH


def kernel(template: str, name: str, mask: Mask, seqlen_q: int, seqlen_k: int, config: KernelConfig, varlen: bool,
           head_dims: tuple[int, int] | None = None):  # fmt: skip
    """The Triton kernel `name` of the template variant this call runs. Kept per (template, kernel, causal, banded,
    tails, pipeline_qk, varlen, distinct V head dim, interpreter) — what the variant depends on: the variant and
    module lookups cost 8 µs of host time per launch, and a fwd+bwd call makes four.
    head_dims: (Q's and K's, V's); None: one head dim (the variant's distinct_v off)."""
    even_m, even_n = seqlen_q % config.block_m == 0, seqlen_k % config.block_n == 0
    head_dim, head_dim_v = head_dims or (None, None)
    key = (template, name, mask.causal, mask.banded, even_m, even_n, config.pipeline_qk, varlen, head_dim != head_dim_v,
           interpreting())  # fmt: skip
    found = _kernels.get(key)
    if found is None:
        variant = Variant.for_template(
            template, causal=mask.causal, banded=mask.banded, varlen=varlen, even_m=even_m, even_n=even_n,
            pipeline_qk=config.pipeline_qk, dot_fp32=key[-1], head_dim=head_dim, head_dim_v=head_dim_v,
        )  # fmt: skip
        found = _kernels[key] = getattr(codegen.load(template, variant), name)
    return found


# kernel()'s: a few dozen entries at most (templates × kernels × masks × tails), as many as codegen keeps modules
_kernels: dict[tuple, object] = {}
