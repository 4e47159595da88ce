"""One tuning job: for a device, plan → compile in parallel → Optuna study → verify → a store entry.

`StudySpec` says what to tune; `run_study` does it on one device, with the planner's space, the baseline it must
beat and the incumbent the file holds (`baseline`, `incumbent`), and returns the result and its store entry.
A tune on several GPUs runs it in one worker process per device (workers.py).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import optuna
import torch
import yaml

from ..api import selection
from ..config import defaults, lengths, planner, store
from ..config.inputs import DTYPES_BY_NAME
from ..config.types import DeviceInfo, Mask
from ..kernels import codegen
from . import timing, tuner, verification, workload
from .compile_pool import CompilePool
from .records import STORED_ORIGIN
from .study_storage import open_storage

BATCH = 16  # configs compiled together, then timed: one per process of a 16-core machine's compile pool


@dataclass(frozen=True)
class StudySpec:
    """What to tune, and how long."""

    kernel: str
    head_dim: int
    dtype: str  # "bf16" | "fp16" | "fp32"
    causal: bool
    seqlens: tuple[int, ...] = lengths.TUNING_LENGTHS["all"]
    tokens: int = lengths.TUNING_TOKENS
    trials: int = 40
    timeout_s: float | None = None
    timeout_counts_builds: bool = False  # timeout_s is a share of the run's wall time (records.Options)
    storage: str | None = None
    seed: int = 0  # workers of one study get different seeds, so their first proposals differ
    window: tuple[int, int] | None = None  # tune the band-mask variant at this (left, right) window
    varlen: bool = False  # tune the packed-sequence variant (the batch packed as equal-length sequences)
    seqlen_bucket: str = "all"  # "short" / "medium": an entry for calls of those lengths only (lengths.BUCKET_RANGES)
    # The timed calls' query and K/V heads (None: the grid's, heads·d = 2048 with as many K/V heads). Fewer K/V heads
    # than query heads make the entry a grouped-query one (EntryKey.gqa), which GQA calls read before the
    # plain entry of the same length bucket.
    heads: int | None = None
    kv_heads: int | None = None
    run: str | None = None  # set by run_parallel_many: `trials` is the budget of all its workers together
    # The config the file this tune writes holds for the key now (stale or not): timed beside the new candidates,
    # kept unless one is measured faster (tuner.first_configs says why). See incumbent().
    incumbent: planner.KernelConfig | None = None
    incumbent_origin: str = STORED_ORIGIN  # where it comes from, in words, for the tune's note (Incumbent.origin)

    @property
    def in_training_call(self) -> bool:
        """Whether the study times its backward kernel inside the whole training call, forward launched first
        (workload.make_measure's with_forward): for the N <= 1k entries, whose calls can wait for the host."""
        return self.seqlen_bucket == "short" and self.kernel != "fwd"

    @property
    def timed_mode(self) -> str:
        """What one timed run does, for its FLOPs (timing.attention_flops' mode)."""
        return "fwd" if self.kernel == "fwd" else "fwd+bwd" if self.in_training_call else "bwd"

    def __post_init__(self) -> None:
        given = (self.heads, self.kv_heads)
        if given != (None, None) and not (None not in given and min(given) >= 1 and self.heads % self.kv_heads == 0):
            raise ValueError(f"heads and kv_heads come together, positive, kv_heads dividing heads; got {self.heads} "
                             f"and {self.kv_heads}")  # fmt: skip

    @property
    def grouped(self) -> bool:
        """Whether the timed calls are grouped-query attention (fewer K/V heads than query heads)."""
        return self.heads is not None and self.kv_heads < self.heads

    @property
    def head_counts(self) -> tuple[int, int] | None:
        """(query heads, K/V heads) of the timed calls; None: the grid's."""
        return (self.heads, self.kv_heads) if self.heads is not None else None

    @property
    def group(self) -> int:
        """Query heads a K/V head in the timed calls: what the kernels' GQA code is compiled for (CompilePool)."""
        return self.heads // self.kv_heads if self.heads is not None else 1

    @property
    def key(self) -> store.EntryKey:
        """The entry this study writes."""
        return store.EntryKey(head_dim=self.head_dim, dtype=self.dtype, causal=self.causal, kernel=self.kernel,
                              seqlen_bucket=self.seqlen_bucket, window=self.window is not None,
                              varlen=self.varlen, gqa=self.grouped)  # fmt: skip

    @property
    def mask(self) -> Mask:
        return Mask(causal=self.causal, window=self.window or (-1, -1))

    @property
    def variant(self) -> str:
        """The study-name suffix: the template variant ("window", "varlen"), the heads where they are given
        ("gqa32x8" for 32 query heads over 8 K/V heads, "heads32" for 32 without grouping: a study times one grouping,
        and a stored or shared study resumed at another would count its readings as this one's), the length bucket
        ("short", "medium"), and for the same reason the lengths and batch·N where they are not the bucket's defaults
        ("at8192,16384", "tokens32768": an "all" study beside bucket entries is timed at fewer lengths), joined by
        "+"; "" for the plain variant at the default lengths."""
        bucket = self.seqlen_bucket
        heads = f"gqa{self.heads}x{self.kv_heads}" if self.grouped else f"heads{self.heads}" if self.heads else ""
        at = "at" + ",".join(map(str, self.seqlens))
        parts = (("window", self.window is not None), ("varlen", self.varlen), (heads, bool(heads)),
                 (bucket, bucket != "all"), (at, tuple(self.seqlens) != lengths.TUNING_LENGTHS[bucket]),
                 (f"tokens{self.tokens}", self.tokens != lengths.TUNING_TOKENS))  # fmt: skip
        return "+".join(name for name, on in parts if on)

    def study_name(self, info: DeviceInfo) -> str:
        """The name of this spec's study on the device (tuner.study_name)."""
        return tuner.study_name(info, self.kernel, self.head_dim, DTYPES_BY_NAME[self.dtype], self.causal, self.variant)


def interpreted(device_name: str) -> bool:
    """Whether a study on this device runs through Triton's interpreter (tiny shapes, no compile pool)."""
    return device_name == "cpu"


def run_study(
    spec: StudySpec,
    device_name: str,
    *,
    on_trial: Callable | None = None,
    finalize: bool = True,
    compile_pool: CompilePool | None = None,
    then: StudySpec | None = None,
    release_pool: bool = False,
) -> tuple[tuner.TuneResult, store.Entry]:
    """Tunes one kernel on one device; with finalize=False only times trials (a worker of workers.run_parallel).

    On a GPU the study asks Optuna for BATCH configs at a time, compiles them at once in compile_pool (one of its
    own if None), then times them, the next batch compiling while this one is timed: a tune compiles what it
    times, not the whole search space. `then`, the study run next on this device: its first configs (known
    before it starts) compile in the pool meanwhile, so it does not wait for a compile round of its own.
    release_pool: the caller will compile nothing more in compile_pool; it is released (CompilePool.release) as
    soon as the trials are timed, so its processes exit during the finish. A pool of its own always is.
    """
    info = selection.device_info(device_name)
    dtype = DTYPES_BY_NAME[spec.dtype]
    cpu = interpreted(device_name)
    if not cpu:  # timing (do_bench's events), the checks and every allocation belong on the tuned GPU
        torch.cuda.set_device(torch.device(device_name))
    sizes = _sizes(spec, cpu)
    space = _space(spec, info, cpu)
    default, default_name = baseline(spec, device_name, info)
    own_pool = compile_pool is None and not cpu and spec.trials > 0
    pool = None if cpu else CompilePool(os.cpu_count() or 1) if own_pool else compile_pool
    measure = workload.make_measure(spec.kernel, spec.head_dim, dtype, spec.mask, seqlens=sizes.seqlens,
                                    device=device_name, tokens=sizes.tokens, width=sizes.width, varlen=spec.varlen,
                                    with_forward=spec.in_training_call, heads=sizes.heads)  # fmt: skip

    def timed():  # the trials are timed, before the finish
        if pool is not None and (own_pool or release_pool):
            pool.release()
        if finalize:
            _await_others(spec, info)

    try:
        target = tuner.Target(device=info, kernel=spec.kernel, head_dim=spec.head_dim, dtype=dtype, causal=spec.causal,
                              variant=spec.variant, space=space, default=default, incumbent=spec.incumbent,
                              incumbent_origin=spec.incumbent_origin)  # fmt: skip
        options = tuner.Options(
            trials=spec.trials, timeout_s=spec.timeout_s, timeout_counts_builds=spec.timeout_counts_builds,
            storage=open_storage(spec.storage),
            verify=_verifier(spec, dtype, device_name, sizes.shape) if finalize else None,
            remeasure_top=3 if finalize else 1, seed=spec.seed, on_trial=on_trial,
            prepare=_preparer(spec, device_name, info, sizes.seqlens, pool, then) if pool is not None else None,
            batch_size=BATCH if pool is not None else 1, run=spec.run, on_timed=timed,
        )  # fmt: skip
        result = tuner.tune(target, measure, options)
    finally:
        if own_pool:
            pool.close()
    return result, _entry(spec, result, info, measure, default_name, sizes, finalize)


@dataclass(frozen=True)
class _Sizes:
    """What a study times and checks: the tuning lengths at batch·N = tokens and heads·d = width (or `heads`, the
    spec's (query, K/V) heads), and the shape (batch, heads_q, heads_kv, N_q, N_k, d) its winner is verified at: on
    a GPU GQA 8 over a grid short of the SMs, so that a dK/dV winner is also checked split (config.group_split): every
    warp-specialized one, and Triton's with K/V tiles of 64 rows or more. Small under the interpreter, whose time
    grows with them (a grouped spec's heads there: 2 over 1)."""

    seqlens: tuple[int, ...]
    tokens: int
    width: int
    shape: tuple[int, int, int, int, int, int]
    interpreted: bool
    heads: tuple[int, int] | None = None

    @property
    def query_heads(self) -> int:
        """The timed calls' query heads, for their FLOPs."""
        return self.heads[0] if self.heads is not None else max(1, self.width // self.shape[-1])


def _sizes(spec: StudySpec, cpu: bool) -> _Sizes:
    if cpu:
        seqlens = tuple(min(n, 64) for n in spec.seqlens[:2])
        heads = (2, 1) if spec.grouped else None
        return _Sizes(seqlens, 64, 2 * spec.head_dim, (1, 2, 1, 70, 70, spec.head_dim), interpreted=True, heads=heads)
    return _Sizes(spec.seqlens, spec.tokens, 2048, (2, 16, 2, 1000, 1000, spec.head_dim), interpreted=False,
                  heads=spec.head_counts)


def _preparer(spec: StudySpec, device_name: str, info: DeviceInfo, seqlens: tuple[int, ...], pool: CompilePool,
              then: StudySpec | None) -> Callable:  # fmt: skip
    """The tuner's prepare(configs): starts compiling them in pool; with this study's first batches queued, `then`'s
    first configs too."""
    dtype = DTYPES_BY_NAME[spec.dtype]
    batches = 0

    def prepare(configs):
        nonlocal batches
        wait = pool.start(spec.kernel, spec.head_dim, dtype, spec.mask, configs, seqlens=seqlens,
                          device=device_name, varlen=spec.varlen, group=spec.group)  # fmt: skip
        batches += 1
        # The pool takes jobs in order: the next study's first configs go in behind this study's first two batches
        # (both asked at its start), or behind its only one.
        if then is not None and batches == min(2, -(-spec.trials // BATCH)):
            _prefetch(then, device_name, info, pool)
        return wait

    return prepare


def _verifier(spec: StudySpec, dtype: torch.dtype, device_name: str, shape: tuple[int, ...]) -> Callable:
    """The tuner's verify(config): the forward's output, or a backward kernel's gradients, against the reference
    at `shape`; a reason to reject the config, or None."""

    def verify(cfg):
        if spec.kernel == "fwd":
            r = verification.check_forward(shape, dtype=dtype, causal=spec.mask, device=device_name, config=cfg,
                                           varlen=spec.varlen)  # fmt: skip
            return None if r.passed else f"relative error {r.rel_err:.1e}"
        key = "dkdv_config" if spec.kernel == "bwd_dkdv" else "dq_config"
        err = verification.check_backward(shape, dtype=dtype, causal=spec.mask, device=device_name,
                                          varlen=spec.varlen, **{key: cfg})  # fmt: skip
        return None if err <= 2 * verification.REL_TOLERANCE[dtype] else f"gradient relative error {err:.1e}"

    return verify


def _entry(spec: StudySpec, result: tuner.TuneResult, info: DeviceInfo, measure, default_name: str, sizes: _Sizes,
           finalize: bool) -> store.Entry:  # fmt: skip
    """The store entry of the study's winner, with TFLOP/s from the FLOPs of what was timed (none under the
    interpreter); refuses a timing no GPU of this kind could produce (_check_plausible)."""
    flops = 0.0 if sizes.interpreted else sum(
        timing.attention_flops(max(1, sizes.tokens // n), sizes.query_heads, n, n, spec.head_dim,
                               causal=spec.mask, mode=spec.timed_mode)
        for n in sizes.seqlens
    )  # fmt: skip
    tflops = lambda ms: round(flops / (ms * 1e-3) / 1e12, 1) if ms and flops else None
    _check_plausible(result, tflops, info)
    key = spec.key
    return store.Entry(
        key=key,
        config=result.best, ms=round(result.best_ms, 4), tflops=tflops(result.best_ms),
        baseline={"name": default_name, "config": result.default.to_dict(),
                  "ms": result.default_ms, "tflops": tflops(result.default_ms)},
        trials=result.measured, spread=measure.spread(result.best) if finalize else None,
        triton_version=planner.triton_version(), torch_version=str(torch.__version__),
        template_hash=codegen.entry_code_hash(key, result.best),
        date=datetime.date.today().isoformat(),
        heads=list(sizes.heads) if spec.grouped else None,  # a plain entry as before: older readers take it
    )  # fmt: skip


def baseline(spec: StudySpec, device_name: str, info: DeviceInfo | None = None) -> tuple[planner.KernelConfig, str]:
    """(config, name) a study must beat, timed first: the planner's default (the bucket's: defaults.default_config's
    seqlen_bucket); for a length bucket's study ("short", "medium"), the config calls of those lengths run without the
    GPU's own entries of its key, in the store's order (selection.lookup_keys, store.find_for_device): the other
    dtype's entry of the bucket, a same-chip GPU's, for a grouped study its bucket's plain entry, else the "all" entry,
    tuned at other lengths — so a bucket's entry is written only as at least as fast as that at its own lengths (a
    tuned config is never slower than its baseline); named "seqlen_bucket <bucket>", with "(plain)", "(<dtype>)" and
    "(<GPU>)" where the entry is a grouped study's plain one, of the other dtype or another GPU's.
    info: the device's DeviceInfo, if already read.
    """
    dtype = DTYPES_BY_NAME[spec.dtype]
    info = info or selection.device_info(device_name)
    if spec.seqlen_bucket != "all":
        # what its calls read without its entry, which the tune writes into a file of the GPU's own
        found = selection.first_fitting(info, selection.lookup_keys(spec.key), fresh=True,
                                        skip=lambda found: found.tuned_on is None and found.entry.key == spec.key)
        if found is not None:
            key = found.entry.key
            words = [f"seqlen_bucket {key.seqlen_bucket}", "(plain)" if spec.grouped and not key.gqa else "",
                     f"({key.dtype})" if key.dtype != spec.dtype else "",
                     f"({found.tuned_on})" if found.tuned_on else ""]  # fmt: skip
            return found.entry.config, " ".join(word for word in words if word)
    default = defaults.default_config(spec.head_dim, dtype, causal=spec.causal, kernel=spec.kernel, device=info,
                                      seqlen_bucket=spec.seqlen_bucket)  # fmt: skip
    return default, "planner-default"


class Incumbent(NamedTuple):
    """A tune's incumbent config and where it comes from, in words for the tune's note: "the stored config" (the
    target file's entry for the key), "the config calls read now" (an entry found along the search path, of the
    GPU or of one of the same chip: `source` says which), or "the stored <dtype> config" (the target file's entry of
    the same-cost dtype)."""

    config: planner.KernelConfig
    origin: str
    source: str | None = None  # the file (and GPU) of an entry calls read, as store.Found.source words it


def incumbent(spec: StudySpec, path: Path, info: DeviceInfo | None = None) -> Incumbent | None:
    """The config a study times beside its candidates and keeps unless one is measured faster (tuner.first_configs):
    the one the tuned-config file at `path`, which the tune writes, holds for spec's key; where it holds none and
    `info` is given, the first entry for the key that calls on that GPU read and the GPU can run
    (store.find_for_device: its own files along the search path, its dtype's key before the same-cost dtype's, then
    a GPU's of the same chip; for a grouped-query key, then its bucket's plain key's, which such calls read without
    one; each bucket before "all"); then
    the file's entry for the key in the same-cost dtype (store.SAME_COST_DTYPES); None where there is none. The first
    entry for a key in a file counts, as at run time (store.lookup).

    Stale entries count: their config won under the templates of their day, a strong first guess under today's."""
    held = _held(path, [spec.key])
    if held is not None:
        return Incumbent(held, STORED_ORIGIN)
    if info is not None:
        # a grouped key's calls read the plain entry of its bucket next; "all" is a bucket study's baseline
        read = [k for k in selection.lookup_keys(spec.key) if k.seqlen_bucket == spec.key.seqlen_bucket]
        found = selection.first_fitting(info, read, fresh=False)
        if found is not None:
            return Incumbent(found.entry.config, "the config calls read now", found.source)
    twin = store.dtype_twins([spec.key])[1:]
    held = _held(path, twin)
    return Incumbent(held, f"the stored {twin[0].dtype} config") if held is not None else None


def with_incumbent(spec, path: Path, info: DeviceInfo | None):
    """`spec` (a StudySpec or decode_tuner.DecodeSpec) with its incumbent (incumbent()) and where that comes from."""
    found = incumbent(spec, path, info)
    if found is None:
        return replace(spec, incumbent=None)
    origin = found.origin + (f" (from {found.source})" if found.source else "")
    return replace(spec, incumbent=found.config, incumbent_origin=origin)


def _held(path: Path, keys: list[store.EntryKey]) -> planner.KernelConfig | None:
    """incumbent's reading of one file: its config for the first of `keys` it holds; None if none or unreadable."""
    try:
        _, entries = store.read_file(path)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    stored: dict = {}
    for e in entries:
        stored.setdefault(e.key, e.config)
    return next((stored[key] for key in keys if key in stored), None)


# The lengths an "all" study falls back to where bucket entries leave it fewer than two (the longest grid lengths).
LONG_LENGTHS = (8192, 16384)


def unserved_lengths(spec: StudySpec, path: Path, info: DeviceInfo | None = None) -> tuple[int, ...]:
    """spec's lengths less those a short or medium entry serves for the same key, whatever reads before the "all"
    entry in the store's order (store.find_for_device): for a grouped key its plain twin's too (selection.lookup_keys),
    the same-cost dtype's (store.dtype_twins) — in the file at `path`, which the tune writes, and where `info` (a
    DeviceInfo) is given in the files its calls read: the GPU's own along the search path (store.own_files: the
    shipped one among them) and those of GPUs of the same chip (store.same_chip_gpus), an entry counting only where
    calls would read it (fresh, fitting the GPU: selection.first_fitting). So an "all" entry is tuned
    where calls will use it (tuned at 1k + 4k + 16k beside both bucket entries, the d=64 causal forward's "all" entry
    chose a config ~4 % slower at N = 16k, the one length it served: docs/PERF.md, "Length buckets"); where fewer
    than two remain, LONG_LENGTHS join them. A bucket study's own lengths are returned as they are."""
    if spec.seqlen_bucket != "all":
        return spec.seqlens
    # what a call of the key reads in a bucket before "all" (selection.lookup_keys; store.dtype_twins)
    bucket_keys = lambda bucket: [replace(spec.key, seqlen_bucket=bucket, gqa=gqa)
                                  for gqa in dict.fromkeys((spec.key.gqa, False))]  # fmt: skip
    if info is not None:  # an entry calls read: fresh, fitting the GPU, `path` read first
        served = {bucket for bucket in lengths.BUCKET_RANGES
                  if selection.first_fitting(info, bucket_keys(bucket), fresh=True, first=Path(path)) is not None}
    else:
        try:
            keys = {e.key for e in store.read_file(Path(path))[1]}
        except (OSError, ValueError, yaml.YAMLError):
            keys = set()
        served = {bucket for bucket in lengths.BUCKET_RANGES if set(store.dtype_twins(bucket_keys(bucket))) & keys}
    kept = tuple(n for n in spec.seqlens if lengths.bucket_of(n) not in served)  # the store's own length rule
    return kept if len(kept) >= 2 else tuple(sorted({*kept, *LONG_LENGTHS}))


def _space(spec: StudySpec, info: DeviceInfo, cpu: bool) -> list[planner.KernelConfig]:
    if cpu:  # a few small tiles: the interpreter's time grows with the tile count
        return [defaults.INTERPRETER_CONFIG, *(planner.KernelConfig(m, n, 4, 1) for m in (16, 64) for n in (16, 64))]
    return [c for c, _ in planner.plan(info, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.kernel).accepted]


def _prefetch(spec: StudySpec, device_name: str, info: DeviceInfo, pool: CompilePool) -> None:
    """Starts compiling the configs `spec`'s study will time first; nobody waits: they land in Triton's cache."""
    dtype = DTYPES_BY_NAME[spec.dtype]
    space = _space(spec, info, cpu=False)
    first = tuner.first_configs(device=info, kernel=spec.kernel, head_dim=spec.head_dim, dtype=dtype,
                                causal=spec.causal, trials=spec.trials, space=space,
                                default=baseline(spec, device_name, info)[0], incumbent=spec.incumbent)  # fmt: skip
    pool.start(spec.kernel, spec.head_dim, dtype, spec.mask, first, seqlens=spec.seqlens, device=device_name,
               varlen=spec.varlen, group=spec.group)  # fmt: skip


def _check_plausible(result: tuner.TuneResult, tflops: Callable, info: DeviceInfo) -> None:
    """Refuses a result whose timing no GPU of this kind could produce, before it reaches a config file."""
    from ..config.device import tflops_ceiling

    ceiling, best = tflops_ceiling(info), tflops(result.best_ms)
    if ceiling is not None and best is not None and best > ceiling:
        raise RuntimeError(
            f"{result.study_name}: the winner measured {best:,.0f} TFLOP/s, above the {ceiling:,.0f} that "
            f"{info.name}'s tensor cores can reach: the timing did not measure the kernel (were the events recorded "
            "on another GPU?). Nothing was written."
        )


def device_summary(info: DeviceInfo) -> dict:
    """The `device` a tuned file records: the GPU's name and slug, and the fields that tell its chip
    (store.CHIP_FIELDS), by which a GPU of the same chip with no file of its own reads this one."""
    chip = {field: getattr(info, field) for field in store.CHIP_FIELDS}
    return {"name": info.name, "slug": info.slug, **chip, "capability": list(info.capability)}


def config_path(device_name: str, config_dir: Path) -> Path:
    """The file a tune on this device writes: <config_dir>/<gpu slug>.yaml."""
    return Path(config_dir) / f"{selection.device_info(device_name).slug}.yaml"


def write(entry: store.Entry, device_name: str, config_dir: Path) -> Path:
    info = selection.device_info(device_name)
    path = config_path(device_name, config_dir)
    store.write_entries(path, device_summary(info), [entry])
    return path


# The longest a finish waits for other processes' timings (_await_others): a process that still beats its heartbeat
# but never tells its trial (hung) does not hold the others' finish for ever.
AWAIT_OTHERS_S = 600.0


def _await_others(spec: StudySpec, info: DeviceInfo, poll_s: float = 0.5) -> None:
    """Waits while other processes sharing spec's study are timing configs of it (RUNNING trials marked timed_by),
    so a finish ranks every config the budget holds: a tune on another host that is still timing when this one's
    trials end would otherwise be left out of this host's choice. A dead process's trial ends as stale (each
    opening of the study fails those), so the wait ends within STALE_AFTER_S of a crash; at most AWAIT_OTHERS_S."""
    if spec.storage is None:
        return
    running, deadline = (optuna.trial.TrialState.RUNNING,), time.monotonic() + AWAIT_OTHERS_S
    me = tuner.process_tag()
    while time.monotonic() < deadline:
        study = optuna.load_study(study_name=spec.study_name(info), storage=open_storage(spec.storage))
        trials = study.get_trials(deepcopy=False, states=running)
        if not any(t.user_attrs.get("timed_by", me) != me for t in trials):
            return
        time.sleep(poll_s)
