"""The decode kernel's launch config (templates/decode.py.jinja): a frozen record of its tunables, its own checks and
its YAML spelling. Torch-free, so that the store reads it where the CLI has not imported torch. What the fields
are used for — the default configs, the shared-memory model, the split rule — is fa2tune.config.decode_plan's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .types import integer

DECODE_KERNEL = "decode"  # the store's kernel name of a decode entry (config.entries.ENTRY_KERNELS)
MAX_PROGRAMS_PER_SM = 32  # resident programs an SM holds at most, on every GPU from sm_80 on

# The values each field takes: sizes the templates compile, ranges the split rule reads
_CHOICES = {"block_n": (16, 32, 64, 128, 256), "num_warps": (1, 2, 4, 8, 16), "max_block_m": (16, 32, 64, 128)}
_RANGES = {"num_stages": (1, 8), "programs_per_sm": (1, MAX_PROGRAMS_PER_SM), "min_split_keys": (1, 1 << 30)}


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel and the two parameters of its split rule (decode_plan.num_splits).

    Attributes:
        block_n: keys a loop step reads (one page at most when the page size is a multiple of it: then a step looks
            up one page; otherwise each key's page is looked up).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loop.
        max_block_m: the most packed query rows a program takes; more rows are cut into tiles of this many (each
            tile reads the K/V head again).
        programs_per_sm: the programs an SM a split launch aims at. Two by default, so that each SM has the K/V
            loads of more than one program in flight: one program's pipeline alone does not keep HBM busy.
        min_split_keys: the fewest keys a split reads. 512 by default: below it, a split's start and end and its
            partial's store and merge cost about what its K/V reads do.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    max_block_m: int = 64
    programs_per_sm: int = 2
    min_split_keys: int = 512

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int:  # a NumPy integer becomes a Python int; a bool or a float is refused
                if integer(value) is None:
                    raise TypeError(f"DecodeConfig.{f.name} must be an int, got {type(value).__name__} {value!r}")
                object.__setattr__(self, f.name, integer(value))
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"DecodeConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name, (low, high) in _RANGES.items():
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"DecodeConfig.{name} must be in {low}..{high}, got {getattr(self, name)!r}")

    def label(self) -> str:
        """A short human name, as logs print it: "n64 w4 s3 m64 2/SM 512/split"."""
        return (f"n{self.block_n} w{self.num_warps} s{self.num_stages} m{self.max_block_m} "
                f"{self.programs_per_sm}/SM {self.min_split_keys}/split")  # fmt: skip

    def to_dict(self) -> dict[str, int]:
        """Every field, as a store entry's config spells it."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> DecodeConfig:
        """The config of a mapping (to_dict's, a YAML entry's; fields left out take their defaults); an unknown key
        is an error, not silently dropped."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown DecodeConfig keys {sorted(unknown)}")
        return cls(**data)
