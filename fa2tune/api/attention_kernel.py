"""get_kernel(): the attention kernel tuned for one GPU, head dim, dtype and mask, ready to call."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import defaults, lengths, planner
from ..config.inputs import check_dtype, check_flag, check_int, check_prefix_len, check_qkv, check_varlen, check_window
from ..config.types import MAX_HEAD_DIM, DeviceInfo, KernelConfig, integer
from ..launch.launcher import Packing
from . import selection
from .attention import checked_apply


@dataclass(frozen=True)
class AttentionKernel:
    """A resolved kernel: call it as ``kernel(q, k, v)``.

    Attributes:
        head_dim, dtype, causal: what it was resolved for; calls with anything else are refused.
        head_dim_v: V's head dim where it is not Q's and K's (None: head_dim's); calls must have it.
        window, prefix_len: the band mask every call applies ((-1, -1) and 0: none).
        varlen: calls take packed sequences: ``kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)``.
        device: the GPU it was resolved for.
        gqa: the configs below are those of grouped-query calls (fewer K/V heads than query heads: their tuned
            entries first), else those of MHA calls. Every call runs its own grouping's, as attention() does: a
            call of the other grouping runs the configs get_kernel(..., gqa=not gqa) shows (other_forward: its
            forward configs, for all lengths, short and medium ones).
        config: the forward config; bwd_dkdv_config / bwd_dq_config: the backward's.
        source: where the forward config came from — a YAML file path, or "planner-default".
        bwd_source: the same for the backward configs.
        short_config, short_source: the forward config for calls whose longer side is at most
            lengths.SHORT_SEQLEN, and where it came from: the store's "short" entry if there is one, else its "all"
            entry (config), else the planner's default for short calls (defaults.default_config's seqlen_bucket).
            (The backward looks its configs up the same way at each call.)
        medium_config, medium_source: the same for calls whose longer side is past lengths.SHORT_SEQLEN and at most
            lengths.MEDIUM_SEQLEN (the store's "medium" entry).
    """

    head_dim: int
    dtype: torch.dtype
    causal: bool
    device: DeviceInfo
    torch_device: str
    config: KernelConfig
    source: str
    bwd_dkdv_config: KernelConfig
    bwd_dq_config: KernelConfig
    bwd_source: str
    window: tuple[int, int] = (-1, -1)
    prefix_len: int = 0
    varlen: bool = False
    short_config: KernelConfig | None = None
    short_source: str | None = None
    medium_config: KernelConfig | None = None
    medium_source: str | None = None
    head_dim_v: int | None = None
    gqa: bool = False
    other_forward: tuple[KernelConfig | None, ...] = (None, None, None)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *packing,
        scale: float | None = None,
        return_lse: bool = False,
    ):
        """attention(q, k, v) — or attention_varlen(q, k, v, *packing) for a varlen kernel — with this kernel's
        mask and configs (the backward's come from the same store). An inference call of a few query tokens runs
        the decode kernels, as attention()'s does (docs/API.md, "A few query tokens are a decode step"), and a call
        a config cannot run (a misaligned tensor for a warp-specialized one) falls back as attention()'s does: the
        configs were resolved for the caller, not chosen by it — under torch.compile too."""
        if len(packing) != (4 if self.varlen else 0):
            expected = (
                "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k after q, k, v"
                if self.varlen
                else ("only q, k, v (get_kernel(..., varlen=True) gives a kernel for packed sequences)")
            )
            raise TypeError(f"this kernel takes {expected}; got {len(packing)} more positional arguments")
        # q, k, v and the packing checked first: what the lines below read of them is then there
        if self.varlen:
            packing = check_varlen(q, k, v, *packing)
            longest = max(packing[2:])
        else:
            shape = check_qkv(q, k, v)
            longest = max(shape.seqlen_q, shape.seqlen_k)
        head_dim_v = self.head_dim if self.head_dim_v is None else self.head_dim_v
        if q.shape[-1] != self.head_dim or v.shape[-1] != head_dim_v or q.dtype != self.dtype:
            raise ValueError(
                f"this kernel was resolved for head_dim={self.head_dim}, head_dim_v={head_dim_v}, dtype={self.dtype}; "
                f"got q with head_dim={q.shape[-1]}, v with {v.shape[-1]}, dtype={q.dtype}: call fa2tune.get_kernel "
                "for that"
            )
        # The call's grouping (the backward resolves its own configs by it) and its longer side pick the forward
        # config, by the store's rules (what attention() does without one).
        own = (self.config, self.short_config, self.medium_config)
        every, short, medium = own if selection.grouped(q, k) == self.gqa else self.other_forward
        bucket = lengths.bucket_of(longest)
        config = short if bucket == "short" else medium if bucket == "medium" else None
        return checked_apply(q, k, v, self.causal, scale, self.window, self.prefix_len, return_lse,
                              config or every, Packing(*packing) if self.varlen else None,
                              chosen=False)  # fmt: skip


@functools.cache
def _resolved(
    head_dim: int,
    device: str,
    dtype: torch.dtype,
    causal: bool,
    config_dir: str | None,
    window: tuple[int, int],
    prefix_len: int,
    varlen: bool,
    head_dim_v: int | None,
    gqa: bool,
) -> AttentionKernel:
    banded = window != (-1, -1) or prefix_len > 0
    at = planner.config_head_dim(head_dim, head_dim_v or head_dim)  # as attention() resolves such a call
    resolve = lambda kernel, seqlen=None, gqa=gqa: selection.resolve(kernel, at, dtype, causal, device,
                                                                     window=banded, varlen=varlen, seqlen=seqlen,
                                                                     gqa=gqa)  # fmt: skip
    (dkdv, bwd_source), (dq, _) = (resolve(kernel) for kernel in ("bwd_dkdv", "bwd_dq"))

    def forward_configs(gqa: bool) -> list[tuple[KernelConfig, str]]:
        """(config, source) of the forward for all lengths, short and medium ones, of calls of that grouping."""
        found = [resolve("fwd", seqlen, gqa) for seqlen in (None, *map(lengths.longest, ("short", "medium")))]
        if head_dim_v is None:
            return found
        # resolved at the larger head dim, they must take both
        info = selection.device_info(device)
        return [_for_both_head_dims(one, info, head_dim, head_dim_v, dtype, causal) for one in found]

    (fwd, source), short, medium = forward_configs(gqa)
    # resolved now, not at a call of the other grouping: a call traced by torch.compile reads no file
    other = tuple(config for config, _ in forward_configs(not gqa))
    return AttentionKernel(head_dim, dtype, causal, selection.device_info(device), device, fwd, source, dkdv, dq,
                           bwd_source, window, prefix_len, varlen, *short, *medium, head_dim_v, gqa,
                           other)  # fmt: skip


def _for_both_head_dims(found: tuple[KernelConfig, str], info: DeviceInfo, head_dim: int, head_dim_v: int,
                        dtype: torch.dtype, causal: bool) -> tuple[KernelConfig, str]:  # fmt: skip
    """A forward (config, source) resolved at the larger head dim, or where it cannot take both (a warpspec config and
    a head dim warpspec does not take) the Triton template's default there: what attention() runs without a config."""
    if planner.check(found[0], info, head_dim, dtype, "fwd", head_dim_v) is None:
        return found
    at = planner.config_head_dim(head_dim, head_dim_v)
    return defaults.default_config(at, dtype, causal=causal, device=info, warp_specialized=False), "planner-default"


def get_kernel(
    head_dim: int,
    *,
    device: str | torch.device = "cuda:0",
    dtype: torch.dtype = torch.bfloat16,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    prefix_len: int = 0,
    varlen: bool = False,
    head_dim_v: int | None = None,
    gqa: bool = False,
) -> AttentionKernel:
    """The attention kernel for a GPU, head dim, dtype and mask, with its configs and where they came from.

    head_dim_v: V's head dim where it is not Q's and K's head_dim (MLA-style models: get_kernel(192,
    head_dim_v=128)); its configs are those of the larger head dim, as attention() resolves such a call.

    window / prefix_len: a band mask (as fa2tune.attention) applied by every call; varlen: the kernel takes packed
    sequences (as fa2tune.attention_varlen). Each is a template variant with its own tuned entries.

    gqa: the kernel's configs are those of grouped-query calls (K and V with fewer heads than Q), which read the
    entries tuned on such calls (`fa2tune tune --heads H --kv-heads G`) first; False: those of MHA calls. Either
    kernel takes both kinds of call, each running its own grouping's configs, as attention() does.

    Lookup order for each config, a length bucket at a time (the call's own, then "all"; selection.lookup_keys):
    $FA2TUNE_CONFIG_DIR, the user cache dir (~/.cache/fa2tune/configs), the shipped tuned_configs/ (the GPU's own
    file in each; then the other 16-bit dtype's entry; then the files of GPUs of the same chip:
    store.find_for_device); after "all", the planner's default. A missing, corrupt or stale file warns once
    and falls back.
    Resolved kernels are cached per process.
    """
    import os

    head_dim, dtype = check_int("head_dim", head_dim, 1, MAX_HEAD_DIM), check_dtype(dtype)
    if head_dim_v is not None:
        head_dim_v = check_int("head_dim_v", head_dim_v, 1, MAX_HEAD_DIM)
    causal, varlen, gqa = check_flag("causal", causal), check_flag("varlen", varlen), check_flag("gqa", gqa)
    window, prefix_len = check_window(window), check_prefix_len(prefix_len)
    return _resolved(head_dim, _device_name(device), dtype, causal, os.environ.get("FA2TUNE_CONFIG_DIR"), window,
                     prefix_len, varlen, None if head_dim_v == head_dim else head_dim_v, gqa)  # fmt: skip


_MAX_DEVICE_INDEX = 127  # torch.DeviceIndex is an int8


def _device_name(device: object) -> str:
    """get_kernel's device as torch.device names it: a str, a torch.device or a CUDA index, as torch.device takes."""
    index = integer(device)
    if index is None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str, a torch.device or an int, got {type(device).__name__} {device!r}")
    if index is not None and not 0 <= index <= _MAX_DEVICE_INDEX:  # torch keeps an index in 8 bits: 256 reads as 0
        raise ValueError(f"device {device!r} is not a device: a CUDA index is 0..{_MAX_DEVICE_INDEX}")
    try:
        # an int is a CUDA index (torch.device(0) would ask for the current accelerator, absent on a CPU machine)
        return str(torch.device(device) if index is None else torch.device("cuda", index))
    except RuntimeError as exc:  # torch's own words say what a device string looks like
        raise ValueError(f"device {device!r} is not a device: {exc}") from None


def clear_cache() -> None:
    """Forget resolved kernels and configs (after tuning wrote new entries)."""
    _resolved.cache_clear()
    selection.clear_cache()
