"""fa2tune: exact FlashAttention-2 in Triton, with block sizes tuned per GPU and head dimension.

The public names are imported on first use (PEP 562), not with the package: `import fa2tune` costs nothing, so the
`fa2tune tune` command can start its helper processes before this process spends seconds importing torch
(fa2tune.tune.processes). `from fa2tune import attention` and `fa2tune.attention` work as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ below imports on first use
    from .api.attention import FlashAttnFunction, attention, attention_varlen
    from .api.attention_kernel import AttentionKernel, get_kernel
    from .api.flash_attn_compat import flash_attn_func, flash_attn_varlen_func
    from .api.kvcache import check_kvcache, flash_attn_with_kvcache
    from .api.sdpa import SdpaPatch, patch_sdpa, scaled_dot_product_attention
    from .config.schedule import Schedule
    from .config.types import KernelConfig, Mask, Variant

_HOMES = {
    "FlashAttnFunction": "api.attention",
    "attention": "api.attention",
    "attention_varlen": "api.attention",
    "AttentionKernel": "api.attention_kernel",
    "get_kernel": "api.attention_kernel",
    "flash_attn_func": "api.flash_attn_compat",
    "flash_attn_varlen_func": "api.flash_attn_compat",
    "check_kvcache": "api.kvcache",
    "flash_attn_with_kvcache": "api.kvcache",
    "SdpaPatch": "api.sdpa",
    "patch_sdpa": "api.sdpa",
    "scaled_dot_product_attention": "api.sdpa",
    "KernelConfig": "config.types",
    "Mask": "config.types",
    "Schedule": "config.schedule",
    "Variant": "config.types",
}
__all__ = [
    "AttentionKernel",
    "FlashAttnFunction",
    "KernelConfig",
    "Mask",
    "Schedule",
    "SdpaPatch",
    "Variant",
    "attention",
    "attention_varlen",
    "check_kvcache",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_kernel",
    "patch_sdpa",
    "scaled_dot_product_attention",
]
assert sorted(_HOMES) == __all__
__version__ = "0.1.0"


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fa2tune' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
