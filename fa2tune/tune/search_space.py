"""The study's search space: the planner's candidates as Optuna categorical dimensions, and the configs timed first.

`build` turns a Target into the Space the strategy samples: the candidates (with the default and the incumbent
always among them, so a tuned config is never slower than either as measured), each dimension's values, and the
candidates the planner accepts for the key. `first_configs` are the configs a study enqueues before TPE proposes
any: the default, the incumbent, the default's other schedule and padding, then one `promising` config per block
shape, each config with dQ fused in followed by its twin with the step drained before its dQ share (or not).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..config import defaults, planner
from ..config.schedule import PER_TILE, PERSISTENT
from ..config.types import PARAM_NAMES, REQUIRED_PARAMS, DeviceInfo, KernelConfig
from .records import Target

DIMS = PARAM_NAMES  # the search dimensions: KernelConfig.params
REQUIRED = REQUIRED_PARAMS  # the switches and the schedule have defaults


def params(cfg: KernelConfig) -> dict[str, int | bool]:
    """cfg as Optuna parameters: every dimension, switches off included (an enqueued trial missing one would have
    Optuna sample it)."""
    return cfg.params()


@dataclass(frozen=True)
class Space:
    """What a study samples, for one Target.

    Attributes:
        candidates: the configs a trial may stand for (the given space or the planner's, plus default and incumbent).
        allowed: the same, as a set: a sampled combination outside it is pruned ("not in the search space").
        choices: each dimension's values over the candidates, Optuna's categorical distributions.
        feasible: the candidates the planner accepts for the key.
        default: the baseline, resolved (defaults.default_config where the Target has none).
        incumbent: the Target's incumbent, or None where there is none or the planner rejects it now.
        incumbent_unfit: why the Target's incumbent is no longer a candidate, or None.
    """

    candidates: list[KernelConfig]
    allowed: frozenset[KernelConfig]
    choices: dict[str, list[int]]
    feasible: list[KernelConfig]
    default: KernelConfig
    incumbent: KernelConfig | None
    incumbent_unfit: str | None


def build(target: Target) -> Space:
    """The Space of target: its candidates, with the default and the (still fitting) incumbent added."""
    t = target
    candidates = list(t.space) if t.space is not None else planner.candidates(t.kernel, t.head_dim)
    allowed = set(candidates)
    choices = {dim: sorted({p[dim] for p in map(params, candidates)}) for dim in DIMS}
    default = t.default
    if default is None:
        default = defaults.default_config(t.head_dim, t.dtype, causal=t.causal, kernel=t.kernel, device=t.device)
    incumbent, unfit = t.incumbent, None
    reason = planner.check(incumbent, t.device, t.head_dim, t.dtype, t.kernel) if incumbent is not None else None
    if reason is not None:
        incumbent = None  # the planner's rules changed since it was tuned: it is no longer a candidate
        unfit = f"is no longer a candidate ({reason})"
    for base in (default, incumbent):  # always candidates: tuned >= both by construction
        if base is not None and base not in allowed:
            candidates.append(base)
            allowed.add(base)
            for dim in choices:
                choices[dim] = sorted(set(choices[dim]) | {params(base)[dim]})
    feasible = [c for c in candidates if planner.check(c, t.device, t.head_dim, t.dtype, t.kernel) is None]
    return Space(candidates, frozenset(allowed), choices, feasible, default, incumbent, unfit)


def promising(candidates: Sequence[KernelConfig], head_dim: int, kernel: str, k: int = 3) -> list[KernelConfig]:
    """One config for each of the k block shapes (block_m, block_n) a roofline argument ranks first, taken in turn
    from the warp-specialized kernels and the Triton template where the space holds both; the warp-specialized
    kernels' modes (the forward's ping-pong, the dK/dV kernel's fused dQ and split roles, two programs an SM) count
    as shapes of their own, as they change the schedule more than warps and stages do.

    Timed right after the default, these spread the first trials over the shapes — the choice that matters most —
    before TPE refines warps and stages. A program's arithmetic intensity grows with its tile (block_m·block_n),
    so larger tiles first, as long as their fp32 accumulators stay well inside the register file (≤ 192 per
    thread; past ~256 they spill); per shape, 3 pipeline stages (a load hidden behind one loop step), more warps,
    and a persistent grid. On the recorded H200 sweeps this start takes the study from 7 to 15 of 20 runs within 2 %
    of the best at a quarter of the exhaustive budget (scripts/replay_tuner.py). The two kernel families take turns
    because, ranked together, the Triton template's larger tiles crowd out the warp-specialized kernel's smaller
    ones: a 16-trial tune of the d=64 causal N ≤ 1k forward ranked that way never times the (128, 128) warpspec
    persistent config, 13 % faster than the one it keeps.
    """

    def score(cfg: KernelConfig):
        regs = planner.accumulators_per_thread(cfg, head_dim, kernel)
        persistent = cfg.schedule.persistent * cfg.schedule.programs_per_sm  # two an SM, one, one program a tile
        # split roles last: it reads each Q and dO tile for 64 K/V rows, not 128, and pays where the two-block forms
        # do not fit (d > 128), where it is first as the only warp-specialized dK/dV form left
        return (cfg.split_roles, regs > 192, -cfg.block_m * cfg.block_n, abs(cfg.num_stages - 3), -cfg.num_warps,
                -persistent)

    by_family: dict[bool, list[KernelConfig]] = {True: [], False: []}  # warpspec first
    for cfg in sorted(candidates, key=score):
        family = by_family[cfg.warp_specialized]
        shape = lambda c: (c.block_m, c.block_n, c.pingpong, c.fused_dq, c.split_roles, c.schedule.programs_an_sm == 2)
        if all(shape(p) != shape(cfg) for p in family):
            family.append(cfg)
    turns = itertools.zip_longest(by_family[True], by_family[False])
    return [cfg for pair in turns for cfg in pair if cfg is not None][:k]


def first_configs(
    *, device: DeviceInfo, kernel: str, head_dim: int, dtype: torch.dtype, causal: bool, trials: int,
    space: Sequence[KernelConfig], default: KernelConfig | None = None, incumbent: KernelConfig | None = None,
) -> list[KernelConfig]:  # fmt: skip
    """The configs tune() with these arguments times first, known before any trial: the default, the incumbent
    (the config the written file holds for this key, if it fits), the default's twin with the other program
    schedule (a warpspec kernel's `persistent` flipped, when that fits), its twin with the head dim padded to fewer
    chunks or not (pad_head_dim flipped, where a pad changes the chunks; where that twin does not fit, the most
    promising config of the other padding that does), then one `promising` config per block shape; each of them
    with dQ fused in is followed by its twin with drain_before_dq flipped. tune() enqueues them; a tune of several
    studies compiles the next study's while this one is timed, so the next starts timing at once.

    The incumbent: a re-tune after a template change samples a space of ~50-100 configs with 10-16 trials, and can
    replace a shipped config by one it never timed beside it; timed, it stays unless beaten. The twin: which
    schedule wins depends on the length and the mask (persistent is 10-25 % faster at N <= 2k and slower on long
    causal calls), and a 10-16 trial study sampling the switch on its own can miss the better one for a
    short-length entry. The drain: which order of a fused step is faster depends on the head dim and the mask
    (KernelConfig.drain_before_dq), by a few per cent, where TPE's early samples would rarely pair it with the
    right shape."""
    if trials <= 0:
        return []
    if default is None:
        default = defaults.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=device)
    candidates = [*space, default] if default not in space else space  # as build() extends its space
    fits = lambda cfg: planner.check(cfg, device, head_dim, dtype, kernel) is None
    feasible = [c for c in candidates if fits(c)]
    # feasible holds a twin only where the switch exists (KernelConfig.combination_error) and the config fits
    twin = replace(default, schedule=PER_TILE if default.schedule.persistent else PERSISTENT)
    # the default's shape padded to fewer chunks (or not, if it is), else the most promising such config that fits
    padded = replace(default, pad_head_dim=not default.pad_head_dim)
    if padded not in feasible:
        others = [c for c in feasible if c.warp_specialized and c.pad_head_dim != default.pad_head_dim]
        padded = next(iter(promising(others, head_dim, kernel, k=1)), None)
    first = [default]
    for cfg in (incumbent, twin if twin in feasible else None, padded):
        if cfg is not None and cfg not in first and fits(cfg):
            first.append(cfg)
    picks = [c for c in promising(feasible, head_dim, kernel, k=max(3, trials // 2)) if c not in first]
    ordered = []
    for cfg in (*first, *picks):  # each fused dK/dV config then its twin drained (or not) before its dQ share
        drained = replace(cfg, drain_before_dq=not cfg.drain_before_dq) if cfg.fused_dq else None
        ordered += [c for c in (cfg, drained) if c is not None and c not in ordered and (c is cfg or c in feasible)]
    return ordered
