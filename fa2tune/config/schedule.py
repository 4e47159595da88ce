"""How the programs of a warp-specialized kernel walk its tiles: one frozen, hashable record, a field of KernelConfig
and so of every launch plan's key, stored entry and tuner trial.

A persistent program takes work units p, p + P, … of the launch (templates/*_ws.py.jinja): causal tiles go in pairs,
a head's j-th longest with its j-th shortest, so programs P units apart get equal work. The grid's unit counts are
powers of two against 132 SMs, so the last round is part empty; the split tail fills it in a forward without a mask,
where a model of the programs' steps says the launch gains (fa2tune.launch.split_tail.plan). FA2TUNE_SPLIT_TAIL
overrides it for debugging and A/B runs: unset, the schedule decides; "0" or empty, off; anything else, on. A launch
plan's key holds it (launch.plans.plan_key), as it changes what runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

SPLIT_TAIL_ENV = "FA2TUNE_SPLIT_TAIL"
PROGRAMS_PER_SM = (1, 2)
SCHEDULE_WORDS = ("persistent", "x2", "no-split-tail")  # Schedule.label's words, in order
# Fields a schedule no longer has, which files and tuner studies written before their removal may still hold: read as
# absent (config.entries, KernelConfig.from_params). causal_tail, a causal launch's last heads' tiles dealt one at a
# time, times the same on as off on the H200 (geomean 1.003, docs/PERF.md "The causal tail"): no schedule has it.
RETIRED_FIELDS = ("causal_tail",)


@dataclass(frozen=True)
class Schedule:
    """Which programs a launch runs and how they share its tiles (the warp-specialized kernels; the Triton templates
    run one program a tile).

    Attributes:
        persistent: programs_per_sm programs per SM walk the tiles, the producer loading the next tile's operands
            while the consumers finish this one (the templates' `persistent` switch); False: one program a tile.
        programs_per_sm: 1, or 2 for one-consumer programs (KernelConfig.two_an_sm_shape), each compiled for half
            the register file (planner.WS_TWO_AN_SM_REGISTERS) and in half the shared memory, so one runs under the
            other's tile prologue and epilogue — what a one-consumer program lacks at N <= 1k, where its loads and
            stores are a large share of a tile.
        split_tail: a persistent forward without a mask, one program an SM, cuts its last round's tiles into pieces
            of keys where split_tail.plan's model says the launch gains (the other schedules and masks have no
            split tail). On by default: measured +0.95 % on average over the rows it cuts.
    """

    persistent: bool = False
    programs_per_sm: int = 1
    split_tail: bool = True

    def __post_init__(self) -> None:
        # Any combination of valid values builds (a tuner samples each field on its own); KernelConfig's
        # combination_error says which make no config.
        for name in ("persistent", "split_tail"):
            if type(getattr(self, name)) is not bool:
                value = getattr(self, name)
                raise TypeError(f"Schedule.{name} must be a bool, got {type(value).__name__} {value!r}")
        if type(self.programs_per_sm) is not int:
            value = self.programs_per_sm
            raise TypeError(f"Schedule.programs_per_sm must be an int, got {type(value).__name__} {value!r}")
        if self.programs_per_sm not in PROGRAMS_PER_SM:
            raise ValueError(f"programs_per_sm must be one of {PROGRAMS_PER_SM}, got {self.programs_per_sm!r}")

    @property
    def programs_an_sm(self) -> int:
        """Programs of a persistent grid on each SM; 1 for a grid of one program a tile (which has no such cap)."""
        return self.programs_per_sm if self.persistent else 1

    def error(self) -> str | None:
        """Why these fields make no schedule, or None: the switches of persistent programs off one."""
        if self.persistent:
            return None
        off_default = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                       if f.name != "persistent" and getattr(self, f.name) != f.default]  # fmt: skip
        if off_default:
            return (
                f"warpspec's programs_per_sm and split_tail are switches of persistent schedules, got "
                f"{', '.join(off_default)} with persistent=False"
            )
        return None

    def splits_tail(self, kernel: str, causal: bool) -> bool:
        """Whether a launch of `kernel` (KERNELS) with this schedule and mask may cut its last round's tiles (plan
        decides whether it does): a forward without a mask, persistent, one program an SM; FA2TUNE_SPLIT_TAIL
        overrides split_tail."""
        if kernel != "fwd" or causal or not self.persistent or self.programs_per_sm != 1:
            return False
        forced = env_override(SPLIT_TAIL_ENV)
        return self.split_tail if forced is None else forced

    def to_dict(self) -> dict[str, bool | int]:
        """The fields off their defaults, as YAML stores them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        """A schedule from a mapping (to_dict's); unknown keys are an error, not silently dropped."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown Schedule keys {sorted(unknown)}")
        return cls(**data)

    def label(self) -> str:
        """Short words for logs (SCHEDULE_WORDS): "" (one program a tile), "persistent", "persistent x2", then the
        split tail switched off ("no-split-tail")."""
        return " ".join(word for word, on in zip(SCHEDULE_WORDS, self._words(), strict=True) if on)

    def _words(self) -> tuple[bool, ...]:
        return (self.persistent, self.programs_per_sm == 2, not self.split_tail)

    @classmethod
    def from_words(cls, words: set[str]) -> Schedule:
        """The schedule label()'s words name (others are ignored)."""
        persistent, two, no_split = (word in words for word in SCHEDULE_WORDS)
        return cls(persistent=persistent, programs_per_sm=2 if two else 1, split_tail=not no_split)


PER_TILE = Schedule()  # one program a tile: the Triton templates' grid, and the warpspec kernels' without persistent
PERSISTENT = Schedule(persistent=True)
TWO_AN_SM = Schedule(persistent=True, programs_per_sm=2)


def env_override(name: str) -> bool | None:
    """The debugging override in environment variable `name`: None unset, False for "" or "0", True otherwise."""
    value = os.environ.get(name)
    return None if value is None else value not in ("", "0")
