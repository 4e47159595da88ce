"""Tuned configs on disk: one YAML file per GPU slug, read at run time, written by the tuner.

File layout (schema 2)::

    schema_version: 2
    device: {name: NVIDIA H200, slug: nvidia-h200, capability: [9, 0], sm_count: 132, smem_per_block: 232448}
    entries:
    - key: {head_dim: 128, dtype: bf16, causal: false, kernel: fwd, seqlen_bucket: all, window: false, varlen: false}
      config: {block_m: 128, block_n: 128, num_warps: 4, num_stages: 2, warp_specialized: true,
               schedule: {persistent: true}}   # KernelConfig.to_dict: switches off are left out
      ms: 2.16            # median over the tuning lengths
      tflops: 509.3
      baseline: {name: planner-default, config: {...}, tflops: 487.0}
      trials: 40
      spread: 0.012       # (p80 - p20) / median of the winner's timing
      triton_version: 3.6.0
      torch_version: 2.11.0
      template_hash: b42404956400aab5   # codegen.code_hash: the rendered kernel code this entry runs
      date: '2026-11-29'
    - key: {head_dim: 128, dtype: bf16, causal: false, kernel: decode, seqlen_bucket: all, window: false, varlen: false}
      config: {block_n: 64, num_warps: 4, num_stages: 3, max_block_m: 64, programs_per_sm: 2, min_split_keys: 512}
      ms: 0.21            # geometric mean over the decode workloads (fa2tune.tune.decode_workload)
      tflops: null
      gbps: 4170.0        # K and V read / time, the same mean
      ...                 # baseline, trials, spread, versions, template_hash, date as above

An entry's records and the checks that read them: config.entries. Files of schema 1, whose configs spelled the
template and schedule as integer codes (`warpspec`, `persistent`), are read as the same configs (config.schema_v1); a
write rewrites the whole file in schema 2.

Writes are atomic (temporary file, flushed to disk, then renamed over the old one) under an inter-process lock, and
merge: an entry replaces only the entry with the same key. Reads never raise: a missing, unreadable, corrupt or
stale file is skipped with one warning per cause, and lookup moves on down the search path; a malformed entry is
skipped with one warning per file and the file's other entries are used. A file is parsed once per content (the
safe C loader where PyYAML has libyaml): lookups of many shapes re-read its bytes, never re-parse them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from . import paths
from .entries import SCHEMA_VERSION, Entry, EntryKey, is_int, shown
from .types import DeviceInfo, KernelConfig

READABLE_VERSIONS = (1, SCHEMA_VERSION)  # what reads read: schema 1's configs through config.schema_v1

# bf16 and fp16 move the same bytes through the same tensor-core rate, so their tuned configs agree: tuned apart on
# an H200, 20 of 29 keys picked the same config in both and the other 9 a neighbour (a pipeline stage or the
# persistent schedule apart). A key with no entry of its own dtype reads the other's (find_for_device).
SAME_COST_DTYPES = {"bf16": "fp16", "fp16": "bf16"}

# Bounds on what a file may hold before it is parsed or walked, so that no file (hand-edited, truncated, hostile)
# costs more than a moment or breaks attention(). A file of every key a GPU can have tuned in practice is ~1 MiB and
# ~100k values, nested 6 deep (entries > entry > baseline > config > value).
MAX_FILE_BYTES = 8 * 2**20
MAX_NODES = 1_000_000  # values in a file, counting an alias as a copy: a "billion laughs" file stops here
MAX_ENTRY_NODES = 10_000  # values in one entry (a tuned one holds ~40); past it the entry alone is skipped
MAX_DEPTH = 16  # nesting levels; deeper would make later recursive walks (asdict, repr, the dumper) overflow
TOP_LEVEL_KEYS = ("schema_version", "device", "entries")


def config_dirs() -> list[Path]:
    """Where lookup searches, in order: $FA2TUNE_CONFIG_DIR, the user cache dir, the shipped tuned_configs/."""
    dirs = []
    named = env_config_dir()
    if named is not None:
        if not os.path.exists(named):  # a misspelt path would otherwise leave a model on untuned kernels unsaid
            _warn_once(f"fa2tune: FA2TUNE_CONFIG_DIR names {named}, which does not exist; lookups read the other "
                       "sources (a tune writes its file there, creating it)")  # fmt: skip
        dirs.append(named)
    dirs.append(user_config_dir())
    dirs.append(shipped_config_dir())
    return dirs


def env_config_dir() -> Path | None:
    """$FA2TUNE_CONFIG_DIR, where it is set and not empty: the first directory lookups read (config_dirs) and a tune
    without --config-dir writes to. Read as it is, without config_dirs' warning for one that does not exist yet."""
    named = os.environ.get("FA2TUNE_CONFIG_DIR")
    return Path(named) if named else None


def user_config_dir() -> Path:
    return paths.cache_dir("configs")


def shipped_config_dir() -> Path:
    package = Path(__file__).resolve().parent.parent
    installed = package / "tuned_configs"  # the wheel layout (pyproject maps tuned_configs/ into the package)
    return installed if installed.is_dir() else package.parent / "tuned_configs"


_warned: set[object] = set()


def _warn_once(message: str, key: object = None) -> None:
    """A RuntimeWarning the first time a process meets `key` (default: the message itself). Recorded after it is
    issued: where warnings are errors, each call that meets the problem raises, not only the first."""
    key = message if key is None else key
    if key not in _warned:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        _warned.add(key)


class _UniqueKeys:
    """A safe loader's mixin that refuses a mapping with a key twice: YAML forbids it, and PyYAML would keep the
    last one silently, so a hand-edit's duplicate is an error rather than a guess."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a merge key (<<) may repeat what it merges; a collection key fails as unhashable
            if (key_node.tag, key_node.value) in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {shown(key_node.value)}",
                                                        key_node.start_mark)  # fmt: skip
            seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep)


def loader_on(base: type) -> type:
    """The store's loader on PyYAML's safe loader `base`: keys unique (_UniqueKeys), and an unquoted date kept as its
    text, for Entry.from_dict to check in its entry — a date PyYAML cannot build (month 13) would otherwise fail the
    whole file's parse, every entry with it."""
    loader = type("_Loader", (_UniqueKeys, base), {})
    loader.add_constructor("tag:yaml.org,2002:timestamp", lambda self, node: self.construct_scalar(node))
    return loader


# Safe loading only (YAML tags never build Python objects), by libyaml's parser where PyYAML was built with it: ~6x
# the pure-Python one's speed (0.015 s against 0.09 s for the shipped file).
_Loader = loader_on(getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@dataclass(frozen=True)
class _Parsed:
    """One file's contents: its top-level mapping, its well-formed entries and why the rest were left out."""

    data: dict
    entries: tuple[Entry, ...]
    problems: tuple[str, ...]


# Each file's last parse, by path: (sha256 of its bytes, what they parse to, or why they do not). Keyed by content,
# not by stat: an in-place edit within the file system's timestamp granularity changes neither size nor mtime.
_parsed: dict[str, tuple[bytes, _Parsed | str]] = {}


def _read_bytes(path: Path) -> bytes:
    """The bytes of the regular file at `path` (a symlink is followed). Raises OSError, or ValueError for a
    directory, FIFO, device or socket (opened without blocking: a FIFO with no writer would wait forever) and for a
    file over MAX_FILE_BYTES."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
            raise ValueError(f"not a regular file: {kind}")
        with os.fdopen(os.dup(fd), "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES:,} bytes, more than any tuned-config file holds")
    return raw


def _measure(value: object, depth: int, limit: int) -> tuple[int, int]:
    """(values, deepest level) in `value` at nesting level `depth`, counting an alias as a copy; stops counting past
    `limit` values and descending past MAX_DEPTH. Iterative: deep or self-referencing data cannot overflow it."""
    count, deepest, todo = 0, depth, [(value, depth)]
    while todo and count <= limit:
        value, level = todo.pop()
        count += 1
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            continue
        if isinstance(value, dict):
            todo.extend((v, level + 1) for pair in value.items() for v in pair)
        elif isinstance(value, (list, tuple, set)):
            todo.extend((v, level + 1) for v in value)
    return count, deepest


def _shape_error(count: int, deepest: int, limit: int) -> str | None:
    if count > limit:
        return f"more than {limit:,} values (counting each alias as a copy)"
    if deepest > MAX_DEPTH:
        return f"nested more than {MAX_DEPTH} levels deep"
    return None


def _parse(raw: bytes) -> _Parsed:
    """Parses one file's bytes. Raises ValueError saying what is wrong with the file as a whole."""
    try:
        data = yaml.load(raw.decode("utf-8-sig"), Loader=_Loader)  # _Loader is a safe loader
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text: {exc}") from None
    except RecursionError:  # the pure-Python parser on deep nesting (libyaml stops at 1000 levels itself)
        raise ValueError("nested too deep to parse") from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:  # a constructor's: an int past the limit
        message = " ".join(str(exc).split()).replace('in "<unicode string>", ', "at ")  # YAML errors span lines
        raise ValueError(message) from None
    if not isinstance(data, dict):
        raise ValueError("not a mapping at the top level")
    raw_entries = data.get("entries")
    head = {k: v for k, v in data.items() if k != "entries"}
    total, deepest = _measure(head, 1, MAX_NODES)
    problem = _shape_error(total, deepest, MAX_NODES)
    if problem is not None:
        raise ValueError(problem)
    version = data.get("schema_version")
    if not is_int(version) or version not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise ValueError(f"schema_version {shown(version)}, this fa2tune reads {readable}")
    if raw_entries is None:
        raw_entries = []
    if not isinstance(raw_entries, list):
        raise ValueError(f"'entries' must be a list, got {shown(raw_entries)}")
    problems = [f"unknown top-level key {shown(k)} ignored" for k in data if k not in TOP_LEVEL_KEYS]
    if not isinstance(data.get("device", {}), dict):
        problems.append(f"'device' must be a mapping, got {shown(data['device'])}")
    entries: dict[EntryKey, Entry] = {}
    first_of: dict[EntryKey, int] = {}
    for i, item in enumerate(raw_entries):
        count, deepest = _measure(item, 3, MAX_ENTRY_NODES)
        total += count
        if total > MAX_NODES:
            raise ValueError(_shape_error(total, deepest, MAX_NODES))
        try:
            problem = _shape_error(count, deepest, MAX_ENTRY_NODES)
            if problem is not None:
                raise ValueError(problem)
            entry = Entry.from_dict(item, version)
        except (TypeError, ValueError) as exc:
            problems.append(f"entry {i}: {' '.join(str(exc).split())}")
            continue
        if entry.key in entries:
            problems.append(f"entry {i}: the key of entry {first_of[entry.key]} again (that one is used)")
            continue
        entries[entry.key], first_of[entry.key] = entry, i
    return _Parsed(data, tuple(entries.values()), tuple(problems))


def _load(path: Path) -> _Parsed:
    """The parse of the file at `path`, from _parsed while its bytes are unchanged. Raises OSError, or ValueError
    saying what is wrong with the file as a whole."""
    raw = _read_bytes(path)
    digest = hashlib.sha256(raw).digest()
    cached = _parsed.get(str(path))
    if cached is None or cached[0] != digest:
        try:
            result: _Parsed | str = _parse(raw)
        except ValueError as exc:
            result = str(exc)
        cached = _parsed[str(path)] = (digest, result)
    if isinstance(cached[1], str):
        raise ValueError(cached[1])
    return cached[1]


def _problems_summary(problems: tuple[str, ...], shown: int = 3) -> str:
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def read_file(path: Path) -> tuple[dict, list[Entry]]:
    """(top-level mapping, well-formed entries) of one file. Raises OSError, or ValueError saying what is wrong with
    the file as a whole; malformed entries are left out with one warning per file."""
    parsed = _load(Path(path))
    if parsed.problems:
        _warn_once(f"fa2tune: {path}: skipped what is malformed ({_problems_summary(parsed.problems)}); "
                   "using its other entries")  # fmt: skip
    return dict(parsed.data), list(parsed.entries)


def lookup(
    slug: str, key: EntryKey, *, template_hash: str | Callable[[KernelConfig], str]
) -> tuple[Entry, Path] | None:
    """The first usable entry for `key` in `<dir>/<slug>.yaml` along config_dirs(), or None.

    An entry tuned against other kernel templates (a different template_hash) is stale: skipped with a warning.
    template_hash may be a function of the entry's config, for configs whose switches select other code.
    """
    return _lookup_in(own_files(slug), key, template_hash)


def own_files(slug: str) -> list[Path]:
    """The files a GPU's lookups read first: `<dir>/<slug>.yaml` in each of config_dirs()."""
    return [directory / f"{slug}.yaml" for directory in config_dirs()]


def _lookup_in(
    paths: list[Path], key: EntryKey, template_hash: str | Callable[[KernelConfig], str] | None,
    passed_over: tuple[Path, EntryKey] | None = None,
) -> tuple[Entry, Path] | None:
    """The first usable entry for `key` in the files `paths`, in order (lookup's rules), or None. template_hash None:
    stale entries count too (a tune's incumbent). passed_over (file, key): that file is read as if it held no entry
    for that key (find_for_device's)."""
    for path in paths:
        if passed_over is not None and passed_over[1] == key and _same_file(path, passed_over[0]):
            continue
        try:
            _, entries = read_file(path)
        except FileNotFoundError:
            if os.path.lexists(path):  # a link to nothing: someone meant a file here
                _warn_once(
                    f"fa2tune: ignoring tuned configs in {path}: a link to a missing file; using the next source"
                )
            continue
        except (OSError, ValueError) as exc:  # ValueError also for a path with a NUL byte from the environment
            _warn_once(f"fa2tune: ignoring tuned configs in {path}: {exc}; using the next source")
            continue
        for entry in entries:
            if entry.key != key:
                continue
            expected = template_hash(entry.config) if callable(template_hash) else template_hash
            if expected is not None and entry.template_hash != expected:
                _warn_once(  # once a file: a template change leaves many of its entries stale at once
                    f"fa2tune: {path} holds entries tuned for other kernel templates, which calls skip for the next "
                    f"source (the first met: {key}, tuned for kernel templates {entry.template_hash}, these are "
                    f"{expected} (stale)); re-run `fa2tune tune`",
                    key=(str(path), "stale"),
                )
                break
            return entry, path
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a == b or os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def dtype_twins(keys: list[EntryKey]) -> list[EntryKey]:
    """`keys` (all of one dtype), then the same keys in the dtype of the same cost (SAME_COST_DTYPES), if any."""
    own = keys[0].dtype if keys else None
    return keys + ([replace(key, dtype=SAME_COST_DTYPES[own]) for key in keys] if own in SAME_COST_DTYPES else [])


# The device fields that decide which configs fit and how they run. A tuned file whose `device` records the same
# values as the GPU a call runs on was tuned on the same chip as far as the kernels can tell: an H100 SXM and an
# H200 are one die (132 SMs, 227 KiB a program) with different memory, and on an H100 the H200's entries ran
# forward + backward up to 24 % faster than the planner's defaults of the time (−3 to +24 % a shape: docs/PERF.md,
# "On an H100"). find_for_device reads such files after the GPU's own entries of each length bucket.
CHIP_FIELDS = ("capability", "sm_count", "smem_per_block")
# Decode entries stay the card's own: the decode kernel is bound by memory bandwidth, which is where GPUs of one chip
# differ (an H100's 3.35 TB/s, an H200's 4.8), and no decode config was measured across them. (Sharing the H200's
# would change one config, d=64 bf16's, measured 0.8 % faster than the default there: docs/PERF.md, "On an H100".)
CHIP_BLIND_KERNELS = ("decode",)
_MAX_GPU_NAME = 80  # a file's device name shown in sources and messages; longer or odd names show the file's stem


@dataclass(frozen=True)
class SameChipGPU:
    """Another GPU whose tuned files record the chip fields of the GPU a call runs on: its name, and its files in
    search-path order."""

    name: str
    paths: tuple[Path, ...]


@dataclass(frozen=True)
class Found:
    """An entry find_for_device found: the file it is in, whether it is of the other 16-bit dtype, and the GPU it
    was tuned on where that is not the caller's."""

    entry: Entry
    path: Path
    other_dtype: bool
    tuned_on: str | None

    @property
    def source(self) -> str:
        text = str(self.path) + (f" ({self.entry.key.dtype} entry)" if self.other_dtype else "")
        return text + (f" (tuned on {self.tuned_on}, the same chip)" if self.tuned_on else "")


def _found_in(paths: list[Path], keys: list[EntryKey], template_hash, tuned_on: str | None,
              passed_over: tuple[Path, EntryKey] | None = None) -> Iterator[Found]:  # fmt: skip
    own = keys[0].dtype if keys else None
    for key in dtype_twins(keys):
        found = _lookup_in(paths, key, template_hash, passed_over)
        if found is not None:
            yield Found(found[0], found[1], key.dtype != own, tuned_on)


def _chip(device: object) -> tuple | None:
    """A file's `device` mapping's CHIP_FIELDS as comparable values, or None where one is missing or malformed."""
    if not isinstance(device, dict):
        return None
    values = tuple(device.get(field) for field in CHIP_FIELDS)
    capability, rest = values[0], values[1:]
    if not (isinstance(capability, (list, tuple)) and len(capability) == 2 and all(map(is_int, capability))):
        return None
    if not all(map(is_int, rest)):
        return None
    return (tuple(capability), *rest)


def _gpu_name(device: dict, path: Path) -> str:
    name = device.get("name")
    if isinstance(name, str) and 0 < len(name) <= _MAX_GPU_NAME and name.isprintable():
        return name
    return path.stem


# same_chip_gpus' last answer per GPU (slug and chip fields): (the config directories' *.yaml listing with sizes,
# times and inodes, answer), so a lookup that misses reads no file while the listing is unchanged.
_same_chip: dict[tuple, tuple[tuple, tuple[SameChipGPU, ...]]] = {}


def _listing() -> tuple[list[Path], tuple]:
    paths, stamps = [], []
    for directory in config_dirs():
        try:
            found = sorted(directory.glob("*.yaml"))
        except OSError:
            continue
        for path in found:
            try:
                st = path.stat()
            except OSError:
                continue
            paths.append(path)
            stamps.append((str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))  # ctime: no utime sets it
    return paths, tuple(stamps)


def same_chip_gpus(info: DeviceInfo) -> list[SameChipGPU]:
    """The other GPUs whose tuned files along config_dirs() record info's CHIP_FIELDS, in the order their first file
    comes along the search path (by name within a directory), each with its matching files in that order. A file
    is another GPU's by its `device` slug (else its file name); info's own files — its slug's name, or a copy whose
    `device` records info's slug or name — are not. Files that cannot be read, or whose `device` does not match, are
    passed over silently (no call reads them)."""
    paths, stamps = _listing()
    own_chip = _chip({field: getattr(info, field) for field in CHIP_FIELDS})
    cached = _same_chip.get((info.slug, own_chip))
    if cached is not None and cached[0] == stamps:
        return list(cached[1])
    groups: dict[str, tuple[str, list[Path]]] = {}
    for path in paths:
        if path.stem == info.slug:
            continue
        try:
            device = _load(path).data.get("device")
        except (OSError, ValueError):
            continue
        if _chip(device) != own_chip:
            continue
        slug = device.get("slug") if isinstance(device.get("slug"), str) else path.stem
        if slug == info.slug or device.get("name") == info.name:  # a copy of the GPU's own file
            continue
        groups.setdefault(slug, (_gpu_name(device, path), []))[1].append(path)
    answer = tuple(SameChipGPU(name, tuple(files)) for name, files in groups.values())
    _same_chip[(info.slug, own_chip)] = (stamps, answer)
    return list(answer)


# What _warn_if_another_gpus has read, as (path, GPU slug, the file's size and mtime): a lookup finds several entries
# of one file, and each call signature's resolution looks again, so a file's `device` is read once while it is
# unchanged
_device_checked: set[tuple] = set()


def _warn_if_another_gpus(path: Path, info: DeviceInfo) -> None:
    """Says once that a GPU's own file (by its name) records another GPU in its `device` (neither info's slug nor its
    name): a file copied or renamed from another GPU's carries that GPU's timings. Its entries are still read as the
    name says, since whoever put it there may mean it; each must fit this GPU as any entry must."""
    try:
        stat = path.stat()
        checked = (str(path), info.slug, stat.st_size, stat.st_mtime_ns)
        if checked in _device_checked:
            return
    except OSError:
        return
    try:
        device = _load(path).data.get("device")
    except (OSError, ValueError):
        device = None
    recorded = _another_gpu(device, info, path)
    if recorded is not None:  # recorded as checked after the warning: under -W error each call raises
        _warn_once(f"fa2tune: {path} is read as {info.name}'s tuned configs (its file name) but records another "
                   f"GPU, {recorded!r}, in its `device`: entries tuned there are used here. Rename the file to that "
                   "GPU's slug or move it aside (a tune here would merge into it and keep them)")  # fmt: skip
    _device_checked.add(checked)


def _another_gpu(device: object, info: DeviceInfo, path: Path) -> str | None:
    """The GPU a file's `device` records where it is neither info's slug nor its name (as the warning names it),
    else None."""
    if not isinstance(device, dict):
        return None
    slug, name = device.get("slug"), device.get("name")
    if (slug is None and name is None) or slug == info.slug or name == info.name:
        return None
    return _gpu_name(device, path) if isinstance(name, str) else str(slug)[:_MAX_GPU_NAME]


def find_for_device(
    info: DeviceInfo, keys: list[EntryKey], *, template_hash: str | Callable[[KernelConfig], str] | None,
    first: Path | None = None, passed_over: tuple[Path, EntryKey] | None = None,
) -> Iterator[Found]:
    """Each usable entry for `keys` (tried in order, all of one dtype and kernel) a call on the GPU `info` may read,
    in the order it reads them, a length bucket at a time (keys' runs of one seqlen_bucket: the call's own, then
    "all"): the GPU's own files along config_dirs() (its dtype's keys, then the same-cost dtype's: dtype_twins), then
    each other GPU of the same chip's files the same way (same_chip_gpus; not for decode entries), then the next
    bucket's. So a same-chip GPU's bucket entry comes before the GPU's own "all" one: an "all" entry is tuned at the
    lengths the bucket entries leave it, the same-chip GPU's among them (tune.job.unserved_lengths), and for a call
    of a bucket's lengths an entry tuned at them on the same chip is the nearer measurement. The caller takes the
    first that fits its device; the same-chip files are looked for only when it asks past the GPU's own entries of a
    bucket. template_hash None: stale entries count too.
    first: a file read before the GPU's own, as one of them (the file an audit examines: tune.audit);
    passed_over (file, key): that file's entry for that key is read as absent — what calls would read without it."""
    own = own_files(info.slug)
    if first is not None:
        own = [first, *(path for path in own if not _same_file(path, first))]
    chip_blind = not keys or keys[0].kernel in CHIP_BLIND_KERNELS
    chip = None  # same_chip_gpus(info), listed once a lookup, when it first asks past the GPU's own entries
    for _, bucket_keys in itertools.groupby(keys, key=lambda key: key.seqlen_bucket):
        bucket_keys = list(bucket_keys)
        for found in _found_in(own, bucket_keys, template_hash, None, passed_over):
            if first is None or not _same_file(found.path, first):  # the audited file may be another GPU's on purpose
                _warn_if_another_gpus(found.path, info)
            yield found
        if chip_blind:
            continue
        chip = same_chip_gpus(info) if chip is None else chip
        for gpu in chip:
            paths = list(gpu.paths) if first is None else [path for path in gpu.paths if not _same_file(path, first)]
            yield from _found_in(paths, bucket_keys, template_hash, gpu.name, passed_over)


@contextlib.contextmanager
def _locked(path: Path):
    """Holds an exclusive lock on lock_path(path) (a file of its own: the data file is replaced, not rewritten)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(path), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _keep_aside(path: Path) -> Path:
    """Keeps the file at `path` as `<name>.corrupt-<UTC time>[-n]` beside it, never over an earlier one: a hard
    link, so readers see the old file until the new one replaces it; moved where links are not supported."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in itertools.count():
        backup = path.with_name(f"{path.name}.corrupt-{stamp}" + (f"-{n}" if n else ""))
        if os.path.lexists(backup):
            continue
        try:
            os.link(path, backup)
        except FileExistsError:
            continue
        except OSError:
            os.replace(path, backup)  # under the lock no writer takes the name; lexists just said it is free
        return backup


def lock_path(path: Path) -> Path:
    """The lock file beside the config file `path` that write_entries holds while it merges."""
    return path.with_name(path.name + ".lock")


def written_file(path: Path) -> Path:
    """The file write_entries writes for `path`: a symbolic link's target (a config file linked from a shared place
    is updated there, not replaced by a copy beside the link)."""
    return Path(os.path.realpath(path))


def write_entries(path: Path, device: dict, new_entries: list[Entry]) -> None:
    """Merges entries into the file at `path` (created if missing): same key replaced, every other key kept.

    A file this fa2tune cannot use as a whole (corrupt, another schema) or with malformed entries is first kept
    aside as `<name>.corrupt-<time>` (one per occasion, none overwritten), with a warning; the rewritten file holds
    its well-formed entries. A file that cannot be read (permissions, I/O) raises: merging nothing into it would
    lose its entries. A symbolic link is written through (written_file).
    """
    path = written_file(Path(path))
    with _locked(path):
        entries: dict[EntryKey, Entry] = {}
        try:
            parsed = _load(path)
        except FileNotFoundError:
            parsed = None
        except ValueError as exc:
            if not path.is_file():
                raise ValueError(f"cannot write tuned configs to {path}: {exc}") from None
            backup = _keep_aside(path)
            _warn_once(f"fa2tune: {path} is not a file this fa2tune reads ({exc}); kept aside as {backup.name}")
            parsed = None
        if parsed is not None and parsed.problems:
            backup = _keep_aside(path)
            _warn_once(f"fa2tune: {path} had malformed parts ({_problems_summary(parsed.problems)}); left out of "
                       f"the rewritten file, the original kept aside as {backup.name}")  # fmt: skip
        if parsed is not None:
            entries = {e.key: e for e in parsed.entries}
        for entry in new_entries:
            entries[entry.key] = entry
        ordered = sorted(entries.values(), key=lambda e: tuple(asdict(e.key).values()))
        document = {"schema_version": SCHEMA_VERSION, "device": device, "entries": [e.to_dict() for e in ordered]}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                yaml.safe_dump(document, handle, sort_keys=False)
                handle.flush()
                os.fsync(handle.fileno())  # on disk before the rename: a crash leaves the old file or the new
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; shipped files must be readable by everyone
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
