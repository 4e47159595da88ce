"""Which config a launch runs when the one it was handed cannot serve the call.

A config the caller gave (explicit) is run as given or refused with an error that says why. One the API resolved
for the call (a tuned entry or the planner's default) gives way instead: a tuned warpspec entry serves the calls it
can and the others run as they would have before tuning.
"""

from __future__ import annotations

import functools

import torch

from ..config import defaults, planner
from ..config.device import device_info
from ..config.types import KernelConfig, Mask
from . import warpspec

ARGUMENT_NAMES = {"fwd": "config", "bwd_dkdv": "dkdv_config", "bwd_dq": "dq_config"}  # what errors call each


def runnable(config: KernelConfig, kernel: str, explicit: bool, mask: Mask, packing, **tensors) -> KernelConfig:
    """`config`, or — for a warp-specialized config this call cannot take (unaligned strides, band masks, packed
    sequences, fp32) — the Triton template's default. A warp-specialized config the caller gave explicitly is an error
    that says why.
    tensors: every tensor the kernel reads or writes through TMA, by the name an error should give; q and v among
    them."""
    if not config.warp_specialized:
        return config
    reason = warpspec.unsupported(kernel, mask, packing is not None, **tensors)
    if reason is None:
        return config
    if explicit:
        raise ValueError(f"{ARGUMENT_NAMES[kernel]} {config} cannot run this call: {reason}")
    q, v = tensors["q"], tensors["v"]
    head_dim = planner.config_head_dim(q.shape[-1], v.shape[-1])  # as the API resolved `config` (selection)
    return _triton_default(head_dim, q.dtype, mask.causal, kernel, device_info(q.device))


@functools.lru_cache(maxsize=256)
def _triton_default(head_dim: int, dtype: torch.dtype, causal: bool, kernel: str, device) -> KernelConfig:
    return defaults.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=device, warp_specialized=False)


def deterministic(config: KernelConfig, explicit: bool) -> KernelConfig:
    """The dK/dV config a backward runs. With dQ fused in (KernelConfig.fused_dq) the dK/dV programs add their dQ
    shares by TMA reductions in the order they arrive: fp32 sums whose last bits vary from run to run. Under
    torch.use_deterministic_algorithms(True) a resolved fused config gives way to its twin with a dQ kernel
    (fused_dq off: same tiles, less shared memory), whose every sum has one order; an explicit one is an error."""
    if not config.fused_dq or not torch.are_deterministic_algorithms_enabled():
        return config
    if explicit:
        raise RuntimeError(
            f"dkdv_config {config} fuses dQ in (fused_dq=True), which adds dQ in a run-to-run order, and "
            "torch.use_deterministic_algorithms(True) is set: pass its twin with a dQ kernel for a deterministic "
            "backward (config.without_fused_dq(): fused_dq and drain_before_dq off)"
        )
    return config.without_fused_dq()


def unfused_for_v(config: KernelConfig, explicit: bool, head_dim: int, head_dim_v: int) -> KernelConfig:
    """The dK/dV config a backward whose V has a head dim of its own runs. A resolved config that fuses dQ in
    (fused_dq) gives way to its twin with a dQ kernel (same tiles, less shared memory): the store keys entries by one
    head dim, so a resolved one was tuned and checked on calls whose V's head dim is Q's, and the fused kernel with V's
    own is checked only where a caller asks for it (an explicit config runs as given)."""
    if explicit or not config.fused_dq or head_dim_v == head_dim:
        return config
    return config.without_fused_dq()


def check_combination(config: KernelConfig, kernel: str) -> None:
    """Refuses an explicit config whose fields do not combine for `kernel` (KernelConfig.combination_error)."""
    error = config.combination_error(kernel)
    if error is not None:
        raise ValueError(f"{ARGUMENT_NAMES[kernel]} {config}: {error}")
