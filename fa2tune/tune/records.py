"""The tuner's records: what to tune (Target), how to run the study (Options), one trial (TrialRecord), what the
study found (TuneResult), how a failure is written down (failure_reason), and a study's --timeout (TimingClock)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config.types import DeviceInfo, KernelConfig

if TYPE_CHECKING:
    import optuna
    import torch

Measure = Callable[[KernelConfig], float]
Verify = Callable[[KernelConfig], str | None]
# Starts compiling configs (in the background, or at once); returns wait(config) -> its failure reason or None.
Wait = Callable[[KernelConfig], str | None]
Prepare = Callable[[list[KernelConfig]], Wait]
# Progress: (configs timed so far, trials, best ms so far, elapsed s).
OnTrial = Callable[[int, int, float | None, float], None]
# Where an incumbent comes from, in a tune's note (job.incumbent): the file the tune writes holds it for the key.
STORED_ORIGIN = "the stored config"


@dataclass(frozen=True)
class Target:
    """What one study tunes: a kernel for one (GPU, head_dim, dtype, mask) key, and where its search starts.

    Attributes:
        variant: the template variant tuned beyond causal ("window", "varlen", "window+varlen"), in the study name.
        space: candidate configs; None: every planner candidate (rejected ones are pruned with their reason).
        default: the baseline enqueued first; None: defaults.default_config for the device.
        incumbent: the config the file the tune writes holds for this key (stale or not), timed right after the
            default — or, where the budget ends first, after the trials, outside the budget — and re-timed with the
            top few: a re-tune replaces it only by a config whose finish readings (timing.final_readings) are more
            than finish.INCUMBENT_MARGIN faster. Replaced, and not timed, if the planner rejects it now; replaced if it
            fails to run or to verify.
    """

    device: DeviceInfo
    kernel: str
    head_dim: int
    dtype: torch.dtype
    causal: bool
    variant: str = ""
    space: Sequence[KernelConfig] | None = None
    default: KernelConfig | None = None
    incumbent: KernelConfig | None = None
    incumbent_origin: str = STORED_ORIGIN  # where the incumbent comes from, in words (job.Incumbent.origin)

    @property
    def name(self) -> str:
        return study_name(self.device, self.kernel, self.head_dim, self.dtype, self.causal, self.variant)


@dataclass(frozen=True)
class Options:
    """How one study runs: its budget, its storage, its callbacks.

    Attributes:
        trials: distinct configs the study is to hold timed, by every process sharing it (study_trials.timed_configs;
            pruned and failed trials and repeats do not count): a resumed study times only what it still lacks,
            and a config another process timed or is timing is not timed again. The tune also stops once every
            config of the space is timed or failed.
        timeout_s: after this many seconds, ask no new trials and time none of those asked ahead (told pruned,
            strategy.NOT_TIMED) — once a config is timed: a study always times its first. Counted from the first
            reading (TimingClock), or from the study's start with timeout_counts_builds.
        timeout_counts_builds: the timeout is a share of a run's wall time (a tune without --timeout), which the
            builds before the first reading spend too.
        storage: an Optuna storage or URL (sqlite:///tune.db, a journal file, an RDB server) shared by workers.
        verify: checks a winner's output; returns a reason to reject it, or None.
        remeasure_top: how many of the fastest configs the finish times again before naming a winner (1: none).
        on_trial: progress callback (measured so far, trials, best ms so far, elapsed s).
        prepare: starts compiling a batch of configs (in parallel processes) and returns wait(config) for one
            config's failure or None. With it the study keeps two batches in flight: the next one compiles (on
            the CPUs) while this one is timed (on the GPU), and a config is timed as soon as its own compile is
            done. If wait has ready(config) -> bool, a config not built yet when its turn comes is timed at once
            (measure builds it, cost._built) instead of waited for: a study waits for no compile round at all.
        batch_size: new configs asked of Optuna before each prepare + timing round. With more than one, the
            sampler is told of pending trials (constant liar), so a batch spreads out instead of repeating itself;
            compiling batch_size configs at once is what makes this worth it.
        run: several processes of one tune sharing the study (multi-GPU, workers.run_parallel_many): each marks a
            trial it times with the user attribute timed_in=run (and timed_by=its process tag, as every process on
            a shared storage does), so the tune can fail a dead worker's trial at once (study_trials.fail_abandoned).
            Every process stops — before its next timing — once the study holds `trials` timed or being timed: the
            processes end within one timing of each other, whatever their speed.
        on_timed: called once the trials are timed, before the finish (the best re-timed and verified): where a
            caller lets its compile processes go (CompilePool.release), and waits for other processes still timing
            configs of a shared study (job.run_study), whose readings the finish then ranks with its own.
    """

    trials: int = 40
    timeout_s: float | None = None
    timeout_counts_builds: bool = False
    storage: str | optuna.storages.BaseStorage | None = None
    verify: Verify | None = None
    remeasure_top: int = 3
    seed: int = 0
    on_trial: OnTrial | None = None
    prepare: Prepare | None = None
    batch_size: int = 1
    run: str | None = None
    on_timed: Callable[[], None] | None = None


@dataclass(frozen=True)
class TrialRecord:
    number: int
    config: KernelConfig
    ms: float | None  # None: not measured
    reason: str | None = None  # why not: the planner's rejection or the failure


@dataclass(frozen=True)
class TuneResult:
    """What one study found. `ms` values are the objective: the sum over the tuning lengths of median times."""

    study_name: str
    best: KernelConfig
    best_ms: float
    default: KernelConfig
    default_ms: float | None
    median_ms: float | None  # median over every measured candidate
    measured: int
    pruned: int
    failed: int
    wall_s: float
    within_2pct_at: int | None  # the first measured trial (1-based) within 2 % of the winner
    incumbent: KernelConfig | None = None  # the config the key ran before this tune (Target.incumbent), if timed
    incumbent_ms: float | None = None
    incumbent_note: str | None = None  # what became of the incumbent, in words: kept, or replaced and why
    history: tuple[TrialRecord, ...] = field(repr=False, default=())
    # every config the study timed, by any process sharing it (history holds this process's trials only), with its
    # first reading, fastest first
    timed: tuple[tuple[KernelConfig, float], ...] = field(repr=False, default=())


def study_name(
    device: DeviceInfo, kernel: str, head_dim: int, dtype: torch.dtype, causal: bool, variant: str = ""
) -> str:
    """e.g. nvidia-h200/fwd/d128/bfloat16/causal, with /window or /varlen for those template variants."""
    name = f"{device.slug}/{kernel}/d{head_dim}/{str(dtype).removeprefix('torch.')}/{'causal' if causal else 'full'}"
    return f"{name}/{variant}" if variant else name


def failure_reason(exc: BaseException) -> str:
    """One line saying why a config failed: the exception's type and the first line of its message."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0][:200] if message else ''}"


class TimingClock:
    """A study's timeout: counted from its first reading (a config timed, or failed to build or run), or, where it is
    a share of a run's wall time, from the study's start.

    What comes before the first reading is the build of the first configs, which a study needs whatever its budget:
    a warp-specialized kernel at a head dim the cache has not seen takes 20-40 s to compile, and counted against a
    --timeout of 20 s it left a lone study (one not prefetched by the one before it) with one config timed. A share
    of RUN_BUDGET_S (a tune without --timeout) counts those builds, so that the run keeps to its wall time. Either
    way no config is timed past the timeout once one has a reading: a study always times its first.
    """

    def __init__(self, timeout_s: float | None, started_at: float | None = None) -> None:
        """started_at: when the clock starts, where the timeout counts the builds (time.time()); None: at the first
        reading."""
        self.timeout_s = timeout_s
        self.started_at = started_at
        self.has_reading = False

    def reading_in(self) -> None:
        """Notes that a reading came in; the first one starts a clock that has not started."""
        if not self.has_reading:
            self.has_reading = True
            if self.started_at is None:
                self.started_at = time.time()

    def spent(self) -> bool:
        """Whether the timeout has passed (never before the first reading)."""
        if self.timeout_s is None or not self.has_reading:
            return False
        return time.time() - self.started_at > self.timeout_s
