"""Launch plans: what forward() and backward() work out for a call signature, kept for the calls that repeat it.

A training or inference loop calls attention with the same shapes, strides, dtype, mask, scale and configs over
and over. Everything the launchers work out from those — kernels, grids, scalar arguments, fallback configs — is
kept per such signature as one function of the call's tensors (a plan); a call whose signature was seen allocates
its outputs and runs the plan. At N <= 512 a training call waits for its host, and autograd runs the backward on a
thread of its own (another core), where every object the backward touches is a cache miss: the fewer, the better.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..config.group_split import DKDV_HEADS_ENV
from ..config.inputs import interpreting
from ..config.schedule import SPLIT_TAIL_ENV
from ..config.types import Mask
from .warpspec import TMA_ALIGN


class Plan(NamedTuple):
    launch: Callable[..., None]
    tma: bool  # it reads tensors through TMA: every call's addresses must be 16-byte aligned (warpspec.unsupported)


_plans: dict[tuple, Plan] = {}
MAX_PLANS = 256  # signatures a process keeps; cleared when full
lookup = _plans.get  # the kept plan of a signature, or None (bound once: the hot path pays no extra call)


def plan_key(kind: str, tensors: tuple, mask: Mask, scale: float, configs: tuple) -> tuple:
    """A call's signature: everything its plan is worked out from. configs: the configs the call was handed and
    whatever else decides which kernels run (whether each was the caller's or resolved, deterministic mode, the
    debugging overrides of the schedules and of the backward's group split)."""
    return (kind, tuple([(t.shape, t.stride()) for t in tensors]), tensors[0].dtype, tensors[0].device, mask, scale,
            configs, interpreting(), _overrides())  # fmt: skip


# The debugging overrides that change what a launch runs (the split tail's, the group split's). Read from
# os.environ's own mapping, keyed by encoded names on POSIX (what os.environ.get reads through, encoding the name and
# decoding the value): 0.04 µs a read against 0.7 µs, and every attention call's launch plan key reads them.
_ENVIRON = os.environ._data if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict) else None
_SPLIT_TAIL_KEY, _DKDV_HEADS_KEY = os.fsencode(SPLIT_TAIL_ENV), os.fsencode(DKDV_HEADS_ENV)


def _overrides() -> tuple:
    """The override variables as set (raw; None unset), for a launch plan's key."""
    if _ENVIRON is not None:
        return _ENVIRON.get(_SPLIT_TAIL_KEY), _ENVIRON.get(_DKDV_HEADS_KEY)
    return os.environ.get(SPLIT_TAIL_ENV), os.environ.get(DKDV_HEADS_ENV)


def misaligned(*tensors: torch.Tensor) -> int:
    """Nonzero when a tensor's address is off TMA's alignment."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return bits % TMA_ALIGN


def keep(key: tuple | None, plan: Plan, downgraded: bool, tma_tensors: tuple) -> None:
    """Keeps a plan for its signature. Not one whose warpspec config was swapped for the Triton template's where the
    swap may have been for this call's addresses (warpspec.unsupported), which another call of the signature may not
    share."""
    if key is None or (downgraded and misaligned(*tma_tensors)):
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = plan


def clear_plans() -> None:
    """Forgets every kept plan (tests, benchmarks)."""
    _plans.clear()
