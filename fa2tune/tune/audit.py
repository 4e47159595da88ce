"""Tuned entries timed against what their calls would run without them, to find the ones a template change has left
behind: an entry keeps the config that won under the templates of its tune, and a change that speeds up other forms
more (or restamping it without a re-tune: docs/TUNING.md, "Stale entries") can leave its fallback faster.
`scripts/audit_entries.py` is the command; a flagged entry is re-tuned with `fa2tune tune` for its key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from ..api import selection
from ..config import store
from ..config.entries import DECODE_KERNEL, Entry, EntryKey
from ..config.inputs import DTYPES_BY_NAME
from ..config.lengths import TUNING_LENGTHS
from ..config.types import DeviceInfo, KernelConfig
from ..kernels import codegen
from . import job, workload
from .compile_pool import CompilePool

ROUNDS = 2  # each config timed this many times, alternating with its rival, and the fastest reading kept


@dataclass(frozen=True)
class AuditRow:
    """One entry's audit: its config and the fallback's — what a call of its key on the audited GPU would run were
    the entry not in its file (selection.resolve's lookup, that entry passed over: another entry of the file or of
    the search path, or the planner's default; `fallback_source` says which) —, timed at the entry's tuning lengths
    as its study times them (ms summed over the lengths); `note` says why a row has no timing."""

    key: EntryKey
    entry: KernelConfig
    fallback: KernelConfig | None = None
    fallback_source: str = ""
    seqlens: tuple[int, ...] = ()
    entry_ms: float | None = None
    fallback_ms: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """The entry's time over the fallback's: above 1, the entry is slower than running without it."""
        if self.entry_ms is None or self.fallback_ms is None:
            return None
        return self.entry_ms / self.fallback_ms

    def behind(self, threshold: float) -> bool:
        """Whether the fallback is faster than the entry by more than `threshold` (a fraction): re-tune it."""
        return self.ratio is not None and self.ratio > 1 + threshold

    @property
    def failed(self) -> bool:
        return self.note.startswith("failed")


def study_spec(key: EntryKey, path: Path, heads: list[int] | None = None,
               info: DeviceInfo | None = None) -> job.StudySpec | None:  # fmt: skip
    """The study that would re-tune `key` into the file at `path`, at the lengths a tune times it at (job's
    unserved_lengths for an "all" entry beside bucket entries) and the heads its entry records (Entry.heads); None
    for a band-mask entry, whose tuning window the file does not record, and for a grouped-query entry that records
    no heads."""
    if key.window or (key.gqa and heads is None):
        return None
    query_heads, kv_heads = heads if heads is not None else (None, None)
    spec = job.StudySpec(kernel=key.kernel, head_dim=key.head_dim, dtype=key.dtype, causal=key.causal,
                         seqlens=TUNING_LENGTHS[key.seqlen_bucket], varlen=key.varlen,
                         seqlen_bucket=key.seqlen_bucket, heads=query_heads, kv_heads=kv_heads)  # fmt: skip
    return replace(spec, seqlens=job.unserved_lengths(spec, path, info))


def fallback(key: EntryKey, path: Path, info: DeviceInfo) -> tuple[KernelConfig, str]:
    """(config, source) a call of `key` (at its bucket's lengths) on the GPU `info` would run if the file at `path`,
    read as the GPU's first file, held no entry for `key`: selection.lookup, resolve's own, with that one entry
    passed over — the file's other entries (a bucket entry's "all" one, the other 16-bit dtype's), the search path's,
    a same-chip GPU's —, stale and unfit entries skipped as at run time; else the planner's default."""
    return selection.lookup(key, info, first=path, passed_over=(path, key))


def selected(entries: Iterable[Entry], *, kernels=None, head_dims=None, dtypes=None, buckets=None) -> list[Entry]:
    """The entries whose key matches every filter given (None: any), the first of each key only (what lookups
    read)."""
    seen: set[EntryKey] = set()
    kept = []
    for entry in entries:
        key = entry.key
        if key in seen:
            continue
        seen.add(key)
        if ((kernels is None or key.kernel in kernels) and (head_dims is None or key.head_dim in head_dims)
                and (dtypes is None or key.dtype in dtypes) and (buckets is None or key.seqlen_bucket in buckets)):
            kept.append(entry)  # fmt: skip
    return kept


def _untimed(entry: Entry, info: DeviceInfo) -> str | None:
    """Why an entry is not timed, or None: kinds the audit does not time, and entries calls pass over anyway."""
    key = entry.key
    if key.kernel == DECODE_KERNEL:
        return "skipped: a decode entry (`fa2tune tune --kernel decode` times its candidates against it)"
    if key.window:
        return "skipped: a band-mask entry's window is not recorded"
    if key.gqa and entry.heads is None:
        return "skipped: a grouped-query entry whose heads are not recorded"
    if entry.template_hash != codegen.entry_code_hash(key, entry.config):
        return "stale: calls pass it over (tuned on other kernel code); re-tune it"
    reason = selection.unfit(entry, info)
    return None if reason is None else f"unfit: calls on this GPU pass it over ({reason})"


def audit(
    path: Path,
    device_name: str,
    *,
    kernels=None,
    head_dims=None,
    dtypes=None,
    buckets=None,
    rounds: int = ROUNDS,
    compile_workers: int = 0,
    measure_factory: Callable = workload.make_measure,
    on_row: Callable[[AuditRow], None] | None = None,
) -> list[AuditRow]:
    """Each selected entry of the file at `path` (selected's filters) against its fallback on `device_name`: the
    configs to time compiled first, in a pool of compile_workers processes (0: none, each compiled when first
    timed), then timed `rounds` times in turn by measure_factory (workload.make_measure's signature: the tuner's
    objective). on_row: called with each row as it is done."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    path = Path(path)
    _, entries = store.read_file(path)
    info = selection.device_info(device_name)
    plans: list[AuditRow | tuple[job.StudySpec, AuditRow]] = []
    for entry in selected(entries, kernels=kernels, head_dims=head_dims, dtypes=dtypes, buckets=buckets):
        why = _untimed(entry, info)
        if why is not None:
            plans.append(AuditRow(entry.key, entry.config, note=why))
            continue
        spec = study_spec(entry.key, path, entry.heads, info)
        config, source = fallback(entry.key, path, info)
        row = AuditRow(entry.key, entry.config, config, source, spec.seqlens)
        if config == entry.config:
            plans.append(replace(row, note="the fallback is the entry's config"))
        else:
            plans.append((spec, row))
    timed = [plan for plan in plans if not isinstance(plan, AuditRow)]
    failures: dict[EntryKey, str] = {}
    if compile_workers > 0 and timed:
        failures = _compiled(timed, device_name, compile_workers)
    rows = []
    for plan in plans:
        if isinstance(plan, AuditRow):
            row = plan
        else:
            spec, row = plan
            problem = failures.get(row.key)
            row = replace(row, note=problem) if problem else _timed(spec, row, device_name, rounds, measure_factory)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _compiled(timed: list, device_name: str, workers: int) -> dict[EntryKey, str]:
    """Compiles both configs of each (spec, row) of `timed` at once; {row's key: "failed: ..."} for those whose
    compile failed, naming the config (selected keeps one entry a key)."""
    failures = {}
    pool = CompilePool(workers)
    try:
        waits = [pool.start(spec.kernel, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.mask,
                            [row.entry, row.fallback], seqlens=spec.seqlens, device=device_name, varlen=spec.varlen,
                            group=spec.group)
                 for spec, row in timed]  # fmt: skip
        for wait, (_, row) in zip(waits, timed, strict=True):
            for name, config in (("the entry", row.entry), ("the fallback", row.fallback)):
                reason = wait(config)
                if reason:
                    failures[row.key] = f"failed: {name}'s config does not compile: {str(reason)[:200]}"
                    break
    except BaseException:
        pool.release()  # an interrupted audit does not wait for the queued compiles
        raise
    finally:
        pool.close()
    return failures


def _timed(spec: job.StudySpec, row: AuditRow, device_name: str, rounds: int, measure_factory: Callable) -> AuditRow:
    """row with both configs timed (the fastest of `rounds` readings each, taken in turn), or a note of what failed:
    the inputs, or which config."""
    try:
        measure = measure_factory(spec.kernel, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.mask,
                                  seqlens=spec.seqlens, device=device_name, varlen=spec.varlen,
                                  with_forward=spec.in_training_call, heads=spec.head_counts)  # fmt: skip
    except Exception as error:  # the inputs run a forward, which can fail (memory) as a config can
        return replace(row, note=f"failed: the inputs: {type(error).__name__}: {str(error)[:200]}")
    readings: dict[str, list[float]] = {"the entry": [], "the fallback": []}
    for _ in range(rounds):
        for name, config in (("the entry", row.entry), ("the fallback", row.fallback)):
            try:
                readings[name].append(measure(config))
            except Exception as error:  # a config that no longer runs is itself the finding; say whose
                return replace(row, note=f"failed: {name}'s config: {type(error).__name__}: {str(error)[:200]}")
    return replace(row, entry_ms=min(readings["the entry"]), fallback_ms=min(readings["the fallback"]))


def report(rows: list[AuditRow], threshold: float) -> str:
    """The rows as a text table, the entries behind their fallback by more than `threshold` marked "re-tune"."""
    lines = [f"{'kernel':<9} {'d':>4} {'dtype':<5} {'mask':<17} {'bucket':<7} {'entry':<44} {'fallback':<44} "
             f"{'ms':>9} {'ms':>9} {'ratio':>6}  verdict"]  # fmt: skip
    for row in rows:
        key = row.key
        mask = ("causal" if key.causal else "plain") + ("+window" if key.window else "+varlen" if key.varlen else "")
        mask += "+gqa" if key.gqa else ""
        fallback_label = row.fallback.label() if row.fallback is not None else "-"
        if row.ratio is None:
            times, verdict = f"{'-':>9} {'-':>9} {'-':>6}", row.note
        else:
            verdict = "re-tune" if row.behind(threshold) else "ok"
            times = f"{row.entry_ms:>9.3f} {row.fallback_ms:>9.3f} {row.ratio:>6.3f}"
        if row.fallback_source and row.fallback_source != selection.PLANNER_DEFAULT:
            verdict += f" (fallback: {row.fallback_source})"
        lines.append(f"{key.kernel:<9} {key.head_dim:>4} {key.dtype:<5} {mask:<17} {key.seqlen_bucket:<7} "
                     f"{row.entry.label():<44} {fallback_label:<44} {times}  {verdict}")  # fmt: skip
    return "\n".join(lines)
