"""Tuned configs on disk: one YAML file per GPU slug, read at run time, written by the tuner.

File layout (schema 1)::

    schema_version: 1
    device: {name: NVIDIA H200, slug: nvidia-h200, capability: [9, 0], sm_count: 132, smem_per_block: 232448}
    entries:
    - key: {head_dim: 128, dtype: bf16, causal: false, kernel: fwd, seqlen_bucket: all, window: false, varlen: false}
      config: {block_m: 256, block_n: 64, num_warps: 8, num_stages: 4}
      ms: 2.16            # median over the tuning lengths
      tflops: 509.3
      baseline: {name: planner-default, config: {...}, tflops: 487.0}
      trials: 40
      spread: 0.012       # (p80 - p20) / median of the winner's timing
      triton_version: 3.6.0
      torch_version: 2.11.0
      template_hash: b42404956400aab5   # codegen.code_hash: the rendered kernel code this entry runs
      date: '2026-11-29'

Writes are atomic (temporary file + rename) under an inter-process lock, and merge: an entry replaces only the
entry with the same key. Reads never raise: a missing, unreadable, corrupt or stale file or entry is skipped with
one warning per cause, and lookup moves on down the search path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from .types import KernelConfig

SCHEMA_VERSION = 1
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # inputs.DTYPE_NAMES' values; no torch needed to read YAML
KERNEL_NAMES = ("fwd", "bwd_dkdv", "bwd_dq")  # planner.KERNELS; repeated so reading YAML needs no torch import
# Configs per sequence length: "all" serves every length; "short" (optional) serves calls whose longer side,
# max(seqlen_q, seqlen_k), is at most SHORT_SEQLEN — there a tile grid of a few programs per head and the masked
# diagonal tiles weigh more, and the best config can differ from the long-sequence one (docs/TUNING.md); "medium"
# (optional) serves SHORT_SEQLEN < length <= MEDIUM_SEQLEN: the "all" entry is tuned where the longest of its lengths
# weighs most, and at N = 2k a causal d=64 forward ran 20 % slower with it than with the best config there
# (docs/PERF.md v17).
SEQLEN_BUCKETS = ("all", "short", "medium")
SHORT_SEQLEN = 1024
MEDIUM_SEQLEN = 4096
# The lengths each bucket serves, lowest excluded: (lowest, highest].
BUCKET_RANGES = {"short": (0, SHORT_SEQLEN), "medium": (SHORT_SEQLEN, MEDIUM_SEQLEN)}


def bucket_of(seqlen: int | None) -> str:
    """The length bucket of a call whose longer side is `seqlen` (None: unknown, "all")."""
    if seqlen is not None:
        for bucket, (low, high) in BUCKET_RANGES.items():
            if low < seqlen <= high:
                return bucket
    return "all"


def buckets_for(seqlen: int | None) -> tuple[str, ...]:
    """The buckets a call of this length looks up, in order: its own, then "all"."""
    bucket = bucket_of(seqlen)
    return (bucket, "all") if bucket != "all" else ("all",)


@dataclass(frozen=True)
class EntryKey:
    """What a tuned config is for."""

    head_dim: int
    dtype: str  # "bf16" | "fp16" | "fp32"
    causal: bool
    kernel: str  # "fwd" | "bwd_dkdv" | "bwd_dq"
    seqlen_bucket: str = "all"
    window: bool = False  # the band-mask variant (sliding window, prefix-LM); absent in older files = False
    varlen: bool = False  # the packed-sequence variant

    def __post_init__(self) -> None:
        # A hand-edited or foreign file must fail here (and be skipped with a warning), not at launch time.
        if not isinstance(self.head_dim, int) or not 1 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be an int in 1..256, got {self.head_dim!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        for name in ("causal", "window", "varlen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.kernel not in KERNEL_NAMES:
            raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {self.kernel!r}")
        if self.seqlen_bucket not in SEQLEN_BUCKETS:
            raise ValueError(f"seqlen_bucket must be one of {SEQLEN_BUCKETS}, got {self.seqlen_bucket!r}")


@dataclass(frozen=True)
class Entry:
    """One tuned result."""

    key: EntryKey
    config: KernelConfig
    ms: float
    tflops: float
    baseline: dict
    trials: int
    spread: float | None  # None: not measured (CPU runs)
    triton_version: str
    torch_version: str
    template_hash: str
    date: str

    def to_dict(self) -> dict:
        data = asdict(self)
        data["config"] = self.config.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Entry:
        fields = dict(data)
        fields["key"] = EntryKey(**fields["key"])
        fields["config"] = KernelConfig.from_dict(fields["config"])
        return cls(**fields)


def config_dirs() -> list[Path]:
    """Where lookup searches, in order: $FA2TUNE_CONFIG_DIR, the user cache dir, the shipped tuned_configs/."""
    dirs = []
    if os.environ.get("FA2TUNE_CONFIG_DIR"):
        dirs.append(Path(os.environ["FA2TUNE_CONFIG_DIR"]))
    dirs.append(user_config_dir())
    dirs.append(shipped_config_dir())
    return dirs


def user_config_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fa2tune" / "configs"


def shipped_config_dir() -> Path:
    here = Path(__file__).resolve().parent
    installed = here / "tuned_configs"  # the wheel layout (pyproject maps tuned_configs/ into the package)
    return installed if installed.is_dir() else here.parent / "tuned_configs"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def read_file(path: Path) -> tuple[dict, list[Entry]]:
    """Parses one YAML file strictly. Raises ValueError (or OSError) saying what is wrong."""
    with open(path) as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise ValueError("not a mapping at the top level")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"schema_version {data.get('schema_version')!r}, this fa2tune reads {SCHEMA_VERSION}")
    raw = data.get("entries") or []
    if not isinstance(raw, list):
        raise ValueError("'entries' is not a list")
    entries = []
    for i, item in enumerate(raw):
        try:
            entries.append(Entry.from_dict(item))
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"entry {i} is malformed: {exc}") from None
    return data, entries


def lookup(
    slug: str, key: EntryKey, *, template_hash: str | Callable[[KernelConfig], str]
) -> tuple[Entry, Path] | None:
    """The first usable entry for `key` in `<dir>/<slug>.yaml` along config_dirs(), or None.

    An entry tuned against other kernel templates (a different template_hash) is stale: skipped with a warning.
    template_hash may be a function of the entry's config, for configs whose switches select other code.
    """
    for directory in config_dirs():
        path = directory / f"{slug}.yaml"
        if not path.is_file():
            continue
        try:
            _, entries = read_file(path)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            reason = " ".join(str(exc).split())  # YAML errors span lines; a warning should not
            _warn_once(f"fa2tune: ignoring tuned configs in {path}: {reason}; using the next source")
            continue
        for entry in entries:
            if entry.key != key:
                continue
            expected = template_hash(entry.config) if callable(template_hash) else template_hash
            if entry.template_hash != expected:
                _warn_once(
                    f"fa2tune: the tuned config for {key} in {path} was tuned for kernel templates "
                    f"{entry.template_hash}, these are {expected} (stale); re-run `fa2tune tune`. "
                    "Using the next source"
                )
                break
            return entry, path
    return None


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def write_entries(path: Path, device: dict, new_entries: list[Entry]) -> None:
    """Merges entries into the file at `path` (created if missing): same key replaced, every other key kept.

    A corrupt existing file is kept aside as `<name>.corrupt` rather than silently overwritten.
    """
    path = Path(path)
    with _locked(path):
        entries: dict[EntryKey, Entry] = {}
        if path.is_file():
            try:
                _, old = read_file(path)
                entries = {e.key: e for e in old}
            except (OSError, ValueError, yaml.YAMLError) as exc:
                os.replace(path, path.with_suffix(path.suffix + ".corrupt"))
                _warn_once(f"fa2tune: {path} was unreadable ({exc}); moved aside to {path.name}.corrupt")
        for entry in new_entries:
            entries[entry.key] = entry
        ordered = sorted(entries.values(), key=lambda e: tuple(asdict(e.key).values()))
        document = {"schema_version": SCHEMA_VERSION, "device": device, "entries": [e.to_dict() for e in ordered]}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                yaml.safe_dump(document, handle, sort_keys=False)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; shipped files must be readable by everyone
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
