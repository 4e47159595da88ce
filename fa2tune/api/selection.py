"""Which config one attention call launches with: the tuned entry from the store, else the planner's default.

Resolved once per (kernel, head_dim, dtype, mask kind, length bucket, device, config dir) and cached, so
attention()'s hot path pays a dict lookup. A call looks up its length's bucket first (lengths.buckets_for: "short"
for max(seqlen_q, seqlen_k) <= lengths.SHORT_SEQLEN, ...), then "all". A tuned entry that does not fit the device it
is used on is ignored with one warning.
"""

from __future__ import annotations

import os

import torch

from ..config import lengths, planner, store
from ..config.device import INTERPRETER, inspect_cached
from ..config.inputs import DTYPE_NAMES, interpreting
from ..config.types import DeviceInfo, KernelConfig
from ..kernels import codegen

_cache: dict[tuple, tuple[KernelConfig, str]] = {}


def device_info(device: torch.device | str) -> DeviceInfo:
    """The DeviceInfo for a tensor's device: the card's reading (cached), or the interpreter pseudo-device."""
    device = torch.device(device)
    if device.type == "cpu" or interpreting():
        return INTERPRETER
    return inspect_cached(device.index if device.index is not None else torch.cuda.current_device())


# Counts clear_cache() calls: what launcher's launch plans (resolved configs among them) are kept under.
generation = 0


def clear_cache() -> None:
    """Forget resolved configs (after a tune wrote new entries, or the config directories changed)."""
    global generation
    _cache.clear()
    generation += 1


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
) -> tuple[KernelConfig, str]:
    """(config, source) for one kernel launch; source is "<file>" for a tuned entry, else "planner-default".

    window: a band mask (sliding window or prefix-LM); varlen: packed sequences — each its own template variant,
    tuned and stored under its own key. seqlen: the call's max(seqlen_q, seqlen_k), which picks the length bucket
    (None: the "all" bucket only).
    """
    info = device_info(device)
    buckets = lengths.buckets_for(seqlen)
    cache_key = (kernel, head_dim, dtype, causal, window, varlen, buckets[0], info.slug,
                 os.environ.get("FA2TUNE_CONFIG_DIR"))  # fmt: skip
    hit = _cache.get(cache_key)
    if hit is not None:
        return hit

    result = None
    for bucket in buckets:
        key = store.EntryKey(head_dim=head_dim, dtype=DTYPE_NAMES[dtype], causal=causal, kernel=kernel,
                             seqlen_bucket=bucket, window=window, varlen=varlen)  # fmt: skip
        found = store.lookup(info.slug, key, template_hash=lambda config, key=key: codegen.entry_code_hash(key, config))
        if found is None:
            continue
        entry, path = found
        reason = planner.check(entry.config, info, head_dim, dtype, kernel)
        if reason is None:
            result = (entry.config, str(path))
            break
        store._warn_once(f"fa2tune: tuned config {entry.config} in {path} does not fit {info.name}: {reason}")
    if result is None:
        result = (planner.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=info), "planner-default")
    _cache[cache_key] = result
    return result
