"""Tuned entries timed against what their calls would run without them, to find the ones a template change has left
behind: an entry keeps the config that won under the templates of its tune, and a change that speeds up other forms
more (or restamping it without a re-tune: docs/TUNING.md, "Stale entries") can leave the untuned default faster.
`scripts/audit_entries.py` is the command; a flagged entry is re-tuned with `fa2tune tune` for its key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from ..api import selection
from ..config import store
from ..config.entries import Entry, EntryKey
from ..config.inputs import DTYPES_BY_NAME
from ..config.lengths import TUNING_LENGTHS
from ..config.types import KernelConfig
from . import job, workload
from .compile_pool import CompilePool

ROUNDS = 2  # each config timed this many times, alternating with its rival, and the fastest reading kept


@dataclass(frozen=True)
class AuditRow:
    """One entry's audit: its config and the fallback's (what a call of its key runs without it: the planner's
    default, or for a length bucket's entry the "all" entry), timed at the entry's tuning lengths as its study times
    them (ms summed over the lengths); `note` says why a row has no timing."""

    key: EntryKey
    entry: KernelConfig
    fallback: KernelConfig | None = None
    fallback_name: str = ""
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


def study_spec(key: EntryKey, path: Path) -> job.StudySpec | None:
    """The study that would re-tune `key` into the file at `path`, at the lengths a tune times it at (job's
    unserved_lengths for an "all" entry beside bucket entries); None for a band-mask entry, whose tuning window the
    file does not record."""
    if key.window:
        return None
    spec = job.StudySpec(kernel=key.kernel, head_dim=key.head_dim, dtype=key.dtype, causal=key.causal,
                         seqlens=TUNING_LENGTHS[key.seqlen_bucket], varlen=key.varlen,
                         seqlen_bucket=key.seqlen_bucket)  # fmt: skip
    return replace(spec, seqlens=job.unserved_lengths(spec, path))


def selected(entries: Iterable[Entry], *, kernels=None, head_dims=None, dtypes=None, buckets=None) -> list[Entry]:
    """The entries whose key matches every filter given (None: any), the first of each key only (store.lookup
    reads the first)."""
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
    """Each selected entry of the file at `path` (selected's filters) against its fallback on `device_name`: both
    configs compiled first, in a pool of compile_workers processes (0: none, each compiled when first timed), then
    timed `rounds` times in turn by measure_factory (workload.make_measure's signature: the tuner's objective).
    on_row: called with each row as it is done."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    _, entries = store.read_file(path)
    info = None if device_name == "cpu" else selection.device_info(device_name)
    plans = []
    for entry in selected(entries, kernels=kernels, head_dims=head_dims, dtypes=dtypes, buckets=buckets):
        spec = study_spec(entry.key, path)
        if spec is None:
            plans.append(AuditRow(entry.key, entry.config, note="skipped: a band-mask entry's window is not recorded"))
            continue
        fallback, name = job.baseline(spec, device_name, info)
        plans.append((entry, spec, AuditRow(entry.key, entry.config, fallback, name, spec.seqlens)))
    timed = [plan for plan in plans if not isinstance(plan, AuditRow)]
    if compile_workers > 0 and timed:
        with CompilePool(compile_workers) as pool:  # every config compiled at once, then timed one by one
            waits = [pool.start(spec.kernel, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.mask,
                                [row.entry, row.fallback], seqlens=spec.seqlens, device=device_name,
                                varlen=spec.varlen)
                     for _, spec, row in timed]  # fmt: skip
            for wait, (_, _, row) in zip(waits, timed, strict=True):
                wait(row.entry), wait(row.fallback)
    rows = []
    for plan in plans:
        row = plan if isinstance(plan, AuditRow) else _timed(*plan[1:], device_name, rounds, measure_factory)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _timed(spec: job.StudySpec, row: AuditRow, device_name: str, rounds: int, measure_factory: Callable) -> AuditRow:
    """row with both configs timed (the fastest of `rounds` readings each, taken in turn), or a note of why not."""
    if row.fallback == row.entry:
        return replace(row, note="the fallback is the entry's config")
    measure = measure_factory(spec.kernel, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.mask, seqlens=spec.seqlens,
                              device=device_name, varlen=spec.varlen, with_forward=spec.in_training_call)  # fmt: skip
    readings: dict[str, list[float]] = {"entry": [], "fallback": []}
    try:
        for _ in range(rounds):
            readings["entry"].append(measure(row.entry))
            readings["fallback"].append(measure(row.fallback))
    except Exception as error:  # a config that no longer compiles or runs is itself the finding
        return replace(row, note=f"failed: {type(error).__name__}: {str(error)[:200]}")
    return replace(row, entry_ms=min(readings["entry"]), fallback_ms=min(readings["fallback"]))


def report(rows: list[AuditRow], threshold: float) -> str:
    """The rows as a text table, the entries behind their fallback by more than `threshold` marked "re-tune"."""
    lines = [f"{'kernel':<9} {'d':>4} {'dtype':<5} {'mask':<6} {'bucket':<7} {'entry':<44} {'fallback':<44} "
             f"{'ms':>9} {'ms':>9} {'ratio':>6}  verdict"]  # fmt: skip
    for row in rows:
        key = row.key
        mask = "causal" if key.causal else "plain"
        mask += "+win" if key.window else "+var" if key.varlen else ""
        fallback = row.fallback.label() if row.fallback is not None else "-"
        if row.ratio is None:
            times, verdict = f"{'-':>9} {'-':>9} {'-':>6}", row.note
        else:
            verdict = "re-tune" if row.behind(threshold) else "ok"
            times = f"{row.entry_ms:>9.3f} {row.fallback_ms:>9.3f} {row.ratio:>6.3f}"
        lines.append(f"{key.kernel:<9} {key.head_dim:>4} {key.dtype:<5} {mask:<6} {key.seqlen_bucket:<7} "
                     f"{row.entry.label():<44} {fallback:<44} {times}  {verdict}")  # fmt: skip
    return "\n".join(lines)
