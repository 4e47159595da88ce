"""Which config one attention call launches with: the tuned entry from the store, else the planner's default.

Resolved once per (kernel, head_dim, dtype, mask kind, length bucket, device, config dir) and cached, so
attention()'s hot path pays a dict lookup. A call looks up its length's bucket first ("short" for
max(seqlen_q, seqlen_k) <= store.SHORT_SEQLEN), then "all". A tuned entry that does not fit the device it is used on
is ignored with one warning.
"""

from __future__ import annotations

import os

import torch

from ..config import planner, store
from ..config.device import device_info  # also read here by the CLI and the tuner
from ..config.inputs import DTYPE_NAMES
from ..config.types import KernelConfig
from ..kernels import codegen

_cache: dict[tuple, tuple[KernelConfig, str]] = {}


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
    buckets = store.buckets_for(seqlen)
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
