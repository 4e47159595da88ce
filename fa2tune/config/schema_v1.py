"""Configs as the store's schema 1 wrote them, read as KernelConfig's named flags.

Schema 1 held a config's template and schedule in two integer codes: `warpspec` 0 (the Triton template), 1 (the
warp-specialized one) or 2 (its second mode, which meant the forward's ping-pong and the dK/dV kernel's fused dQ), and
`persistent` 0 (one program a tile), 1 (persistent) or 2 (persistent, two programs an SM). Each pair of codes maps to
one config of today's fields, with the split tail at its default, which is what a schema-1 config ran.
"""

from __future__ import annotations

from .schedule import PER_TILE, PERSISTENT, TWO_AN_SM
from .types import KernelConfig

FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "pipeline_qk", "warpspec", "persistent")
REQUIRED = ("block_m", "block_n")
_SCHEDULES = {0: PER_TILE, 1: PERSISTENT, 2: TWO_AN_SM}


def config(data: dict, kernel: str) -> KernelConfig:
    """The config a schema-1 mapping of FIELDS (block_m and block_n required) stands for in `kernel`'s entry.
    Raises ValueError for an unknown key or a code out of range, TypeError for a value that is not an int."""
    unknown = set(data) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown schema-1 config keys {sorted(unknown)}")
    values = dict(data)
    warpspec, persistent = values.pop("warpspec", 0), values.pop("persistent", 0)
    for name, code in (("warpspec", warpspec), ("persistent", persistent)):
        if type(code) is not int:
            raise TypeError(f"{name} must be an int, got {type(code).__name__} {code!r}")
        if code not in (0, 1, 2):
            raise ValueError(f"{name} must be 0, 1 or 2, got {code!r}")
    second_mode = warpspec == 2
    return KernelConfig(**values, warp_specialized=warpspec > 0, pingpong=second_mode and kernel != "bwd_dkdv",
                        fused_dq=second_mode and kernel == "bwd_dkdv", schedule=_SCHEDULES[persistent])  # fmt: skip
