"""The decode tune's search space: every DecodeConfig of the SEARCH table that fits the device, grouped into the
classes of configs that launch the same kernels on every timed step.

Two configs that compile the same kernels and split every timed step's keys alike run the same code on the same
grid: timing both would time one launch twice. On issue 45's steps (GQA 32/8: 4 and 16 packed rows a K/V head)
max_block_m never cuts a tile (the rows fit 16), and min_split_keys never caps the split count (the keys of the split
steps reach 32k and 128k): the tune tells configs apart by block_n, num_warps, num_stages and programs_per_sm alone.
Each class is timed once, through its representative: the default where it is a member, else the incumbent (the
config the file holds), else the member nearest the default — so the fields the steps leave undecided keep the
default's values, and a stored config changes only where a timing chose it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import torch

from ..config import decode_plan
from ..config.decode_config import DecodeConfig
from ..config.types import DeviceInfo
from .decode_workload import Workload

# The values each field takes (issue 45), the interpreter's few small ones apart: its time grows with the tiles
SEARCH = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4), "max_block_m": (16, 32, 64),
          "programs_per_sm": (1, 2, 4, 8), "min_split_keys": (256, 512, 1024)}  # fmt: skip
CPU_SEARCH = {"block_n": (16, 32), "num_warps": (4,), "num_stages": (1,), "max_block_m": (16,),
              "programs_per_sm": (1, 2), "min_split_keys": (512,)}  # fmt: skip
FIELDS = tuple(f.name for f in fields(DecodeConfig))
assert set(SEARCH) == set(CPU_SEARCH) == set(FIELDS), "a DecodeConfig field the search leaves out"

# What one config launches on each timed step: (page_size, seqlen_q, block_m, tiles, splits)
Launches = tuple[tuple[int, int, int, int, int], ...]


@dataclass(frozen=True)
class DecodeSpace:
    """What a decode tune samples.

    Attributes:
        choices: each field's values, Optuna's categorical distributions.
        representative: each fitting config -> its class's representative, the config timed for it.
        unfit: each config of the table that does not fit the device -> why (decode_plan.check).
        launches: each representative -> what it launches on the timed steps.
        default, incumbent: the baseline and the config the file holds (None: none, or it does not fit).
        incumbent_unfit: why the file's config is no longer a candidate, or None.
    """

    choices: dict[str, tuple[int, ...]]
    representative: dict[DecodeConfig, DecodeConfig]
    unfit: dict[DecodeConfig, str]
    launches: dict[DecodeConfig, Launches]
    default: DecodeConfig
    incumbent: DecodeConfig | None
    incumbent_unfit: str | None

    @property
    def classes(self) -> list[DecodeConfig]:
        """The representatives, the default's and the incumbent's first."""
        return list(self.launches)


def launches(config: DecodeConfig, steps: tuple[Workload, ...], *, heads: int, kv_heads: int,
             sm_count: int) -> Launches:  # fmt: skip
    """What `config` launches on each step: its cache's page size and query tokens, and the launcher's (block_m,
    tiles, splits) (decode_plan.launch_shape)."""
    return tuple(
        (w.page_size, w.seqlen_q, *decode_plan.launch_shape(config, batch=w.batch, seqlen_q=w.seqlen_q, heads_q=heads,
                                                            kv_heads=kv_heads, capacity=w.capacity,
                                                            sm_count=sm_count))
        for w in steps
    )  # fmt: skip


def build(search: dict[str, tuple[int, ...]], device: DeviceInfo, head_dim: int, dtype: torch.dtype,
          steps: tuple[Workload, ...], *, heads: int, kv_heads: int, default: DecodeConfig,
          incumbent: DecodeConfig | None) -> DecodeSpace:  # fmt: skip
    """The space of `search`'s combinations, the default and the incumbent, on `device` for these steps."""
    unfit_incumbent = None if incumbent is None else decode_plan.check(incumbent, device, head_dim, dtype)
    if unfit_incumbent is not None:
        incumbent = None  # the model of shared memory changed since it was tuned: it is no longer a candidate
    configs = [DecodeConfig(**dict(zip(FIELDS, values, strict=True)))
               for values in itertools.product(*(search[name] for name in FIELDS))]  # fmt: skip
    configs = list(dict.fromkeys([default, *([incumbent] if incumbent else []), *configs]))
    choices = {name: tuple(sorted({getattr(c, name) for c in configs})) for name in FIELDS}
    unfit, members = {}, {}
    for config in configs:
        reason = decode_plan.check(config, device, head_dim, dtype)
        if reason is not None:
            unfit[config] = reason
            continue
        launched = launches(config, steps, heads=heads, kv_heads=kv_heads, sm_count=device.sm_count)
        members.setdefault((config.block_n, config.num_warps, config.num_stages, launched), []).append(config)
    representative, launched_by = {}, {}
    for key, group in members.items():  # the default's and the incumbent's classes first: they lead `configs`
        chosen = min(group, key=lambda c: (c != default, c != incumbent, _distance(c, default)))
        launched_by[chosen] = key[3]
        representative.update(dict.fromkeys(group, chosen))
    return DecodeSpace(choices, representative, unfit, launched_by, default, incumbent,
                       None if unfit_incumbent is None else f"is no longer a candidate ({unfit_incumbent})")


def _distance(config: DecodeConfig, default: DecodeConfig) -> float:
    """How far a config's fields are from the default's, in factors of two: the representative's tie-break."""
    return sum(abs(math.log2(getattr(config, name) / getattr(default, name))) for name in FIELDS)
