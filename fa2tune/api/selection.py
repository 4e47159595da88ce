"""Which config one attention call launches with: the tuned entry from the store, else the planner's default.

resolve() looks a call up by (kernel, head_dim, dtype, mask kind, length bucket, grouped-query or not, device, config
dir): the call's length's bucket first (lengths.buckets_for: "short" for max(seqlen_q, seqlen_k) <=
lengths.SHORT_SEQLEN, ...), then "all"; a grouped-query call reads a bucket's entry tuned on such calls before its
plain one (lookup_keys). A tuned entry that does not fit the device it is used on is ignored with one warning.
for_call() keeps what resolve() gave per call signature, so attention()'s hot path pays one dict lookup for all its
configs. A call whose V has a head dim of its own resolves at the larger of the two (planner.config_head_dim).
resolve_decode does the same for the decode kernel (flash_attn_with_kvcache), whose launcher asks it when a call
signature is new.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from ..config import decode_plan, defaults, lengths, planner, store
from ..config.decode_config import DECODE_KERNEL, DecodeConfig
from ..config.device import device_info
from ..config.inputs import DTYPE_NAMES, DTYPES_BY_NAME, interpreting
from ..config.types import KernelConfig, Mask
from ..kernels import codegen

__all__ = ["BACKWARD", "FORWARD", "FORWARD_BACKWARD", "clear_cache", "config_for", "decode_config", "device_info",
           "first_fitting", "for_call", "grouped", "lookup", "lookup_keys", "resolve", "resolve_decode",
           "unfit"]  # fmt: skip

_cache: dict[tuple, tuple[KernelConfig, str]] = {}
PLANNER_DEFAULT = "planner-default"  # resolve's source where no entry serves a call

# The kernels a call runs, as for_call takes them.
FORWARD = ("fwd",)
BACKWARD = ("bwd_dkdv", "bwd_dq")
FORWARD_BACKWARD = FORWARD + BACKWARD

_calls: dict[tuple, tuple[KernelConfig, ...]] = {}  # for_call's: configs per call signature
_MAX_CALLS = 256  # signatures kept; cleared when full


def clear_cache() -> None:
    """Forget resolved configs (after a tune wrote new entries, or the config directories changed)."""
    _cache.clear()
    _calls.clear()


def resolve(
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    device: torch.device | str,
    *,
    window: bool = False,
    varlen: bool = False,
    seqlen: int | None = None,
    gqa: bool = False,
) -> tuple[KernelConfig, str]:
    """(config, source) for one kernel launch; source is "<file>" for a tuned entry ("<file> (bf16 entry)" for an
    fp16 call that reads a bf16 entry, and the reverse; "<file> (tuned on <GPU>, the same chip)" for another GPU's
    entry where this one has none: store.find_for_device), else "planner-default".

    window: a band mask (sliding window or prefix-LM); varlen: packed sequences — each its own template variant,
    tuned and stored under its own key. seqlen: the call's max(seqlen_q, seqlen_k), which picks the length bucket
    (None: the "all" bucket only). gqa: the call has fewer K/V heads than query heads; in each length bucket an
    entry tuned on such calls comes before the plain one (lookup_keys).
    """
    info = device_info(device)
    buckets = lengths.buckets_for(seqlen)
    cache_key = (kernel, head_dim, dtype, causal, window, varlen, gqa, buckets[0], info.slug,
                 os.environ.get("FA2TUNE_CONFIG_DIR"))  # fmt: skip
    hit = _cache.get(cache_key)
    if hit is not None:
        return hit

    key = store.EntryKey(head_dim=head_dim, dtype=DTYPE_NAMES[dtype], causal=causal, kernel=kernel,
                         seqlen_bucket=buckets[0], window=window, varlen=varlen, gqa=gqa)  # fmt: skip
    result = _cache[cache_key] = lookup(key, info)
    return result


def lookup(
    key: store.EntryKey, info, *, first: Path | None = None, passed_over: tuple[Path, store.EntryKey] | None = None
) -> tuple[KernelConfig, str]:
    """(config, source) of resolve, uncached, for the calls of `key` (lookup_keys: its bucket's, then "all"; in
    each, a GQA call's grouped entry before its plain one) on the GPU `info` (a DeviceInfo): the first entry
    store.find_for_device finds that fits the GPU (one warning for each that does not), else the planner's default
    for the bucket. first, passed_over: find_for_device's (an audit's: a file read first, one of its entries read as
    absent — tune.audit)."""
    def warn(found: store.Found, reason: str) -> None:
        store._warn_once(f"fa2tune: tuned config {found.entry.config} {_named(found)} does not fit {info.name}: "
                         f"{reason}")  # fmt: skip

    found = first_fitting(info, lookup_keys(key), fresh=True, first=first, passed_over=passed_over, on_unfit=warn)
    if found is not None:
        return found.entry.config, found.source
    config = defaults.default_config(key.head_dim, DTYPES_BY_NAME[key.dtype], causal=key.causal, kernel=key.kernel,
                                     device=info, seqlen_bucket=key.seqlen_bucket)  # fmt: skip
    return config, PLANNER_DEFAULT


def first_fitting(info, keys: list[store.EntryKey], *, fresh: bool, first: Path | None = None,
                  passed_over: tuple[Path, store.EntryKey] | None = None, on_unfit=None,
                  skip=None) -> store.Found | None:  # fmt: skip
    """The first entry for `keys` (in order) that store.find_for_device finds on the GPU `info` and the GPU can run
    (unfit), or None. fresh: stale entries (tuned on other kernel code) are passed over, as calls pass them over; a
    tune's incumbent counts them. on_unfit(found, reason): told of each entry passed over as unfit. skip(found):
    entries read as absent (a bucket study's baseline: the GPU's own entries of the key it writes)."""
    # the keys differ in bucket, grouping and dtype, which the code does not
    code_hash = (lambda config: codegen.entry_code_hash(keys[0], config)) if fresh else None
    for found in store.find_for_device(info, keys, template_hash=code_hash, first=first, passed_over=passed_over):
        if skip is not None and skip(found):
            continue
        reason = unfit(found.entry, info)
        if reason is None:
            return found
        if on_unfit is not None:
            on_unfit(found, reason)
    return None


def lookup_keys(key: store.EntryKey) -> list[store.EntryKey]:
    """The keys a call of `key` reads entries of, in order: its length bucket's, then "all" (lengths.buckets_for);
    for a grouped-query call (key.gqa) each bucket's grouped entry before its plain one. The length bucket comes
    first, as it does between files: an "all" entry is tuned where the bucket entries beside it leave it calls
    (tune.job.unserved_lengths), and a grouped one tuned at 1k-16k picked configs slower at 8k-16k than the plain
    "all" entry's (docs/PERF.md, "Grouped-query attention"). A GQA call with no grouped entry reads what MHA calls
    read."""
    buckets = lengths.buckets_for(lengths.longest(key.seqlen_bucket))
    groupings = (True, False) if key.gqa else (False,)
    return [replace(key, seqlen_bucket=bucket, gqa=gqa) for bucket in buckets for gqa in groupings]


def _named(found: store.Found) -> str:
    """An entry as a warning about it names it: its own dtype and file, the same words whichever call's lookup
    reached it (an fp16 call reads a bf16 entry too), so that one entry gives one warning."""
    return f"in {found.path} ({found.entry.key.dtype} entry)"


def unfit(entry: store.Entry, info) -> str | None:
    """Why the device `info` (a DeviceInfo) cannot run a stored entry's config — the planner's check, or the decode
    plan's for a decode entry — or None: what resolve and resolve_decode pass over an entry for."""
    key = entry.key
    if key.kernel == DECODE_KERNEL:
        return decode_plan.check(entry.config, info, key.head_dim, DTYPES_BY_NAME[key.dtype])
    return planner.check(entry.config, info, key.head_dim, DTYPES_BY_NAME[key.dtype], key.kernel)


def for_call(kernels: tuple[str, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
             packing) -> tuple:  # fmt: skip
    """The configs `kernels` (FORWARD, BACKWARD, ...) launch with for this call, as resolve() picks them.

    Kept per call signature, so a call whose signature was seen pays one dict lookup: what decides them (head dims,
    dtype, device, mask, packed or not, and the longer side, which picks the length bucket — for SDPA's layout the
    shapes, which hold both) and what may change what resolve() finds (the config directory; for a CUDA tensor
    Triton's interpreter, under which its device resolves as the interpreter's). clear_cache() forgets them.
    packing: a fa2tune.launch.launcher.Packing, or None.
    """
    if packing is None:
        key = (kernels, q.shape, k.shape, v.shape[-1], q.dtype, q.device, mask, os.environ.get("FA2TUNE_CONFIG_DIR"),
               q.is_cuda and interpreting())  # fmt: skip
    else:
        key = (kernels, q.shape[-1], v.shape[-1], max(packing.max_seqlen_q, packing.max_seqlen_k), q.dtype, q.device,
               mask, os.environ.get("FA2TUNE_CONFIG_DIR"), q.is_cuda and interpreting(), "packed",
               grouped(q, k))  # fmt: skip
    configs = _calls.get(key)
    if configs is None:
        configs = _resolve_call(kernels, q, k, v, mask, packing)
        if len(_calls) >= _MAX_CALLS:
            _calls.clear()
        _calls[key] = configs
    return configs


def _resolve_call(kernels: tuple[str, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                  packing) -> tuple:  # fmt: skip
    # The longer side picks the length bucket of the tuned configs (lengths.buckets_for).
    longest = max(q.shape[2], k.shape[2]) if packing is None else max(packing.max_seqlen_q, packing.max_seqlen_k)
    head_dim = planner.config_head_dim(q.shape[-1], v.shape[-1])
    return tuple(resolve(kernel, head_dim, q.dtype, mask.causal, q.device, window=mask.banded,
                         varlen=packing is not None, seqlen=longest, gqa=grouped(q, k))[0]
                 for kernel in kernels)  # fmt: skip


def grouped(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call is grouped-query attention: K with fewer heads than Q (dim 1 in SDPA's layout (batch, heads,
    N, d) and in the packed one (tokens, heads, d))."""
    return k.shape[1] < q.shape[1]


def config_for(config: KernelConfig | None, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Mask, packing):  # fmt: skip
    """`config`, or — None — the one resolved for this call's `kernel` (for_call)."""
    return config if config is not None else for_call((kernel,), q, k, v, mask, packing)[0]


def resolve_decode(device: torch.device | str, head_dim: int, dtype: torch.dtype) -> tuple[DecodeConfig, str]:
    """(config, source) a decode call on `device` runs when it passes none: the store's decode entry for the device,
    head dim and dtype (`fa2tune tune --kernel decode` writes it; store.lookup: the first file along the search path
    that has one; else the other 16-bit dtype's — never another GPU's of the same chip, whose memory bandwidth may
    differ: store.find_for_device), source its file's path; else
    decode_plan.default_config, source "planner-default". An entry the store cannot use — malformed (unknown fields,
    bad values), tuned on other kernel code (stale) or too large for this device — falls back with one warning. Not
    cached here: the launcher asks once per call signature."""
    info = device_info(device)
    key = store.EntryKey(head_dim=head_dim, dtype=DTYPE_NAMES[dtype], causal=False, kernel=DECODE_KERNEL)
    for found in store.find_for_device(info, [key], template_hash=codegen.decode_code_hash()):
        reason = unfit(found.entry, info)
        if reason is None:
            return found.entry.config, found.source
        store._warn_once(f"fa2tune: tuned decode config {found.entry.config.label()} {_named(found)} does not fit "
                         f"{info.name}: {reason}; using the default")  # fmt: skip
    return decode_plan.default_config(info, head_dim, dtype), PLANNER_DEFAULT


def decode_config(device: torch.device | str, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """resolve_decode's config alone: the `resolve` the API hands the decode launcher."""
    return resolve_decode(device, head_dim, dtype)[0]
