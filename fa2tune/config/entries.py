"""The records of a tuned-config file, and the checks that read them from YAML: an entry's key (what it is for), its
config and its measurement record. Each field is checked for its type before a record is built, so a hand-edited or
foreign file fails here, one entry at a time, and never at launch time. Schema 2 spells configs as KernelConfig.to_dict
does, a decode entry's as DecodeConfig.to_dict; schema 1 (integer codes) is read through config.schema_v1.

A decode entry (kernel "decode") is keyed by head_dim and dtype alone: one decode kernel serves every mask and length,
so its other key fields keep their defaults. It records GB/s (K and V read / time) where the others record TFLOP/s.
Both additions leave the files of schema 2 as they were; an fa2tune older than them skips a decode entry with its
one warning about the file and uses the others (and a write of its own drops the entry, keeping the file aside).

A schedule field fa2tune no longer has (schedule.RETIRED_FIELDS: causal_tail) is read as absent, whatever its value.
An entry whose launches ran the causal tail (on, causal, persistent) has the tail's code in its template_hash, code
that no config runs now, so lookup finds it stale (one warning, the next source); any other runs what it always ran.
"""

from __future__ import annotations

import datetime
import math
import reprlib
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass

from . import schema_v1
from .decode_config import DECODE_KERNEL, DecodeConfig
from .lengths import SEQLEN_BUCKETS
from .schedule import RETIRED_FIELDS
from .types import DTYPE_CHOICES, KERNELS, KernelConfig

SCHEMA_VERSION = 2  # what the store writes; it reads schema 1 too
MAX_HEADS = 65535  # the most heads an entry's record names: CUDA's cap on a grid axis, past any model's
ENTRY_KERNELS = (*KERNELS, DECODE_KERNEL)  # what an entry may be for: the attention kernels and the decode kernel


@dataclass(frozen=True)
class EntryKey:
    """What a tuned config is for."""

    head_dim: int
    dtype: str  # "bf16" | "fp16" | "fp32"
    causal: bool
    kernel: str  # "fwd" | "bwd_dkdv" | "bwd_dq" | "decode"
    seqlen_bucket: str = "all"  # lengths.SEQLEN_BUCKETS
    window: bool = False  # the band-mask variant (sliding window, prefix-LM); absent in older files = False
    varlen: bool = False  # the packed-sequence variant
    # Tuned on grouped-query calls (fewer K/V heads than query heads): GQA calls read such an entry before the plain
    # one (selection.lookup_keys), MHA calls never. The same kernel code: a separate key because the grouped calls'
    # best config differs (docs/TUNING.md, "Grouped-query attention"). Absent in older files = False, and written only
    # when true, so files without such entries read as they always have.
    gqa: bool = False

    def __post_init__(self) -> None:
        # A hand-edited or foreign file must fail here (and be skipped with a warning), not at launch time.
        # A bool is an int to Python; `head_dim: true` is not head_dim 1.
        if not is_int(self.head_dim) or not 1 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be an int in 1..256, got {shown(self.head_dim)}")
        for name, allowed in (("dtype", DTYPE_CHOICES), ("kernel", ENTRY_KERNELS), ("seqlen_bucket", SEQLEN_BUCKETS)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {shown(getattr(self, name))}")
        for name in ("causal", "window", "varlen", "gqa"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {shown(getattr(self, name))}")
        decode_key = (self.causal, self.window, self.varlen, self.gqa, self.seqlen_bucket)
        if self.kernel == DECODE_KERNEL and decode_key != _DECODE_KEY:
            raise ValueError(
                "a decode entry is keyed by head_dim and dtype alone (one decode kernel serves every mask, length and "
                "head grouping): causal, window, varlen and gqa must be false and seqlen_bucket all, got "
                f"causal={self.causal}, window={self.window}, varlen={self.varlen}, gqa={self.gqa}, "
                f"seqlen_bucket={self.seqlen_bucket}"
            )

    def to_dict(self) -> dict:
        """The key as YAML stores it: gqa only where true (an fa2tune older than the field reads the others)."""
        data = asdict(self)
        if not self.gqa:
            del data["gqa"]
        return data


# A decode key's causal, window, varlen, gqa and seqlen_bucket: the defaults
_DECODE_KEY = (False, False, False, False, "all")


@dataclass(frozen=True)
class Entry:
    """One tuned result."""

    key: EntryKey
    config: KernelConfig | DecodeConfig  # a DecodeConfig for kernel "decode"
    ms: float
    tflops: float | None  # None: not measured (CPU runs), or a decode entry (gbps)
    baseline: dict
    trials: int
    spread: float | None  # None: not measured (CPU runs)
    triton_version: str
    torch_version: str
    template_hash: str
    date: str
    gbps: float | None = None  # a decode entry's GB/s of K and V read; None for the others and CPU runs
    # [query heads, K/V heads] of the calls a tune timed, where it was told them (`fa2tune tune --heads --kv-heads`):
    # what an audit times the entry at again. None: the grid's heads (heads·d = 2048, as many K/V heads).
    heads: list[int] | None = None

    def __post_init__(self) -> None:
        if self.heads is not None:
            pair = self.heads
            if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(h) and 1 <= h <= MAX_HEADS for h in pair)
                    and pair[0] % pair[1] == 0):  # fmt: skip
                raise ValueError(f"heads must be [query heads, K/V heads], ints in 1..{MAX_HEADS} with the K/V heads "
                                 f"dividing the query heads, got {shown(pair)}")  # fmt: skip
            if self.key.gqa != (pair[1] < pair[0]):
                raise ValueError(f"heads {shown(pair)} {'do not group' if self.key.gqa else 'group'} query heads, "
                                 f"and the key's gqa is {str(self.key.gqa).lower()}")  # fmt: skip

    def to_dict(self) -> dict:
        """The entry as YAML stores it; gbps and heads only where measured or told, so the other entries read as
        they always have."""
        data = asdict(self)
        data["key"] = self.key.to_dict()
        data["config"] = self.config.to_dict()
        for name in ("gbps", "heads"):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict, version: int = SCHEMA_VERSION) -> Entry:
        """Builds an entry from a YAML mapping of schema `version`, checking every field's type. Raises ValueError
        saying which is wrong."""
        data = _fields_of(data, cls, "entry")
        record = {}
        for name, value in data.items():
            if name in ("key", "config"):
                continue
            if name == "date" and isinstance(value, datetime.date):  # a hand-edited file's unquoted date
                value = value.isoformat()
            allowed = _RECORD_TYPES[name]
            if not isinstance(value, allowed) or isinstance(value, bool):  # no field takes a bool
                names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise ValueError(f"{name} must be {names}, got {shown(value)}")
            if name == "date" and not is_iso_date(value):
                raise ValueError(f"date must be a date as YYYY-MM-DD, got {shown(value)}")
            if name in _MEASURES and value is not None and not (
                math.isfinite(value) and (value > 0 if name == "ms" else value >= 0)
            ):
                least = "> 0" if name == "ms" else ">= 0"
                raise ValueError(f"{name} must be a finite number {least}, got {shown(value)}")
            record[name] = value
        key_fields = _fields_of(data["key"], EntryKey, "key")
        try:
            key = EntryKey(**key_fields)
        except ValueError as exc:  # its checks name the field, not where it sits
            raise ValueError(f"key {exc}") from None
        if version == 1:
            record["baseline"] = _baseline_from_v1(record["baseline"], key.kernel)
        return cls(key=key, config=_config_from_yaml(data["config"], version, key.kernel), **record)


# The YAML types of an entry's record fields (null: an unmeasured spread, a CPU run's TFLOP/s, no baseline).
_NUMBER = (int, float)
_RECORD_TYPES = {"ms": _NUMBER, "tflops": (*_NUMBER, type(None)), "baseline": (dict, type(None)), "trials": (int,),
                 "spread": (*_NUMBER, type(None)), "triton_version": (str,), "torch_version": (str,),
                 "template_hash": (str,), "date": (str,), "gbps": (*_NUMBER, type(None)),
                 "heads": (list, type(None))}  # fmt: skip
# The fields a tune measured or counted: never negative, never NaN or infinite, a time never 0 (a tune compares its
# candidates against them).
_MEASURES = ("ms", "tflops", "trials", "spread", "gbps")
assert set(_RECORD_TYPES) == {f.name for f in fields(Entry)} - {"key", "config"}, "an Entry field without a YAML type"


def is_iso_date(text: str) -> bool:
    """A date written YYYY-MM-DD that exists."""
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def is_int(value: object) -> bool:
    """An int that is not a bool (YAML's true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40


def shown(value: object) -> str:
    """A short repr for messages: a file's value may be huge, or an alias bomb."""
    if is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        return _REPR.repr(value)
    except ValueError:  # an int inside, past Python's digit limit for str()
        return f"a {type(value).__name__}"


def _fields_of(data: object, cls: type, what: str) -> dict:
    """`data` as the keyword arguments of dataclass `cls`: a mapping of string keys, none unknown, none missing."""
    required = [f.name for f in fields(cls) if MISSING is f.default is f.default_factory]
    return _mapping_of(data, [f.name for f in fields(cls)], required, what)


def _mapping_of(data: object, names, required, what: str) -> dict:
    """`data` as a mapping of these names: string keys, none unknown, none of `required` missing."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a mapping, got {shown(data)}")
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ValueError(f"{what} has unknown keys {shown(unknown)}")
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{what} lacks {missing}")
    return data


def _typed(data: dict, cls: type, what: str) -> None:
    """Checks that each value of `data` has the type of dataclass `cls`'s field of its name, read off the field's
    default (a required field is an int): an int is not a bool, a float or a string (KernelConfig.from_dict would
    coerce those), nor wider than 64 bits; a flag is true or false; a nested record a mapping of its own fields."""
    for f in fields(cls):
        if f.name not in data:
            continue
        kind, value = type(f.default) if f.default is not MISSING else int, data[f.name]
        if is_dataclass(kind):
            _typed(_fields_of(value, kind, f"{what} {f.name}"), kind, f"{what} {f.name}")
        elif kind is bool and not isinstance(value, bool):
            raise ValueError(f"{what} {f.name} must be true or false, got {shown(value)}")
        elif kind is int and (not is_int(value) or value.bit_length() > 64):
            raise ValueError(f"{what} {f.name} must be an integer, got {shown(value)}")


def _config_from_yaml(data: object, version: int, kernel: str) -> KernelConfig | DecodeConfig:
    """A KernelConfig (a DecodeConfig for a decode entry) from an entry's YAML mapping in schema `version` for
    `kernel`: every field of its type (_typed; schema 1's are all integers), then the config's own range checks."""
    try:
        if kernel == DECODE_KERNEL:
            if version == 1:
                raise ValueError("config: schema 1 has no decode entries")
            _typed(_fields_of(data, DecodeConfig, "config"), DecodeConfig, "config")
            return DecodeConfig.from_dict(data)
        if version == 1:
            data = _mapping_of(data, schema_v1.FIELDS, schema_v1.REQUIRED, "config")
            for name, value in data.items():
                if not is_int(value) or value.bit_length() > 64:
                    raise ValueError(f"config {name} must be an integer, got {shown(value)}")
            return schema_v1.config(data, kernel)
        data = _without_retired(_fields_of(data, KernelConfig, "config"))
        _typed(data, KernelConfig, "config")
        return KernelConfig.from_dict(data)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("config") else f"config {message}") from None


def _without_retired(data: dict) -> dict:
    """A schema-2 config mapping without the schedule fields fa2tune no longer has (RETIRED_FIELDS), as a copy."""
    schedule = data.get("schedule")
    if not isinstance(schedule, dict) or not any(name in schedule for name in RETIRED_FIELDS):
        return data
    return {**data, "schedule": {k: v for k, v in schedule.items() if k not in RETIRED_FIELDS}}


def _baseline_from_v1(baseline: dict | None, kernel: str) -> dict | None:
    """A schema-1 entry's baseline record with its config in today's fields where it reads as one (the record is
    for people: one that does not is kept as it is)."""
    if not isinstance(baseline, dict) or "config" not in baseline:
        return baseline
    try:
        return {**baseline, "config": _config_from_yaml(baseline["config"], 1, kernel).to_dict()}
    except (TypeError, ValueError):
        return baseline
