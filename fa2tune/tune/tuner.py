"""The Optuna study that picks a kernel's config: search space from the planner, objective from timing.

One study per (GPU, kernel, head_dim, dtype, causal). The planner's default is enqueued first, so the winner is
never slower than it as measured. Configs the planner rejects are recorded as pruned trials with the reason and
cost no compile; a config that fails to compile or run is a failed trial with its reason; neither stops the study.
The top few are measured again before a winner is named, and the winner must pass `verify`.

Timing is injected (`measure(config) -> ms`), so the study runs the same on a GPU (tuner.gpu_measure), under the
interpreter, or over a recorded table in tests.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import optuna
import torch

from ..config import planner
from ..config.schedule import PER_TILE, PERSISTENT
from ..config.types import PARAM_NAMES, REQUIRED_PARAMS, DeviceInfo, KernelConfig
from .timing import failure_reason

_log = logging.getLogger(__name__)

Measure = Callable[[KernelConfig], float]
Verify = Callable[[KernelConfig], str | None]
# Starts compiling configs (in the background, or at once); returns wait(config) -> its failure reason or None.
Wait = Callable[[KernelConfig], str | None]
Prepare = Callable[[list[KernelConfig]], Wait]


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
    incumbent: KernelConfig | None = None  # the config the key ran before this tune (tune()'s incumbent), if timed
    incumbent_ms: float | None = None
    incumbent_note: str | None = None  # what became of the incumbent, in words: kept, or replaced and why
    history: tuple[TrialRecord, ...] = field(repr=False, default=())


def study_name(
    device: DeviceInfo, kernel: str, head_dim: int, dtype: torch.dtype, causal: bool, variant: str = ""
) -> str:
    """e.g. nvidia-h200/fwd/d128/bfloat16/causal, with /window or /varlen for those template variants."""
    name = f"{device.slug}/{kernel}/d{head_dim}/{str(dtype).removeprefix('torch.')}/{'causal' if causal else 'full'}"
    return f"{name}/{variant}" if variant else name


_DIMS = PARAM_NAMES  # the search dimensions: KernelConfig.params
_REQUIRED = REQUIRED_PARAMS  # the switches and the schedule have defaults
# A re-tune keeps the config a key runs now unless another measures faster by more than this fraction: readings of
# one config differ by up to ~1 % (do_bench medians, L2 flushed; one process's rounds, docs/PERF.md v22), and a swap
# on a 0.1 % "win" (session 22's d=128 short dK/dV, 1.196 against 1.197 ms) rewrites a shipped entry — and every
# measurement made with it — for nothing.
INCUMBENT_MARGIN = 0.01


def _params(cfg: KernelConfig) -> dict[str, int | bool]:
    # Every dimension, switches off included: an enqueued trial missing one would have Optuna sample it.
    return cfg.params()


def _completed(study: optuna.Study) -> dict[KernelConfig, float]:
    """Each config the study timed, with its best reading: a study stored before processes claimed a config before
    timing it (_claim) can hold two readings of one, and the winner's ms is its best reading."""
    best: dict[KernelConfig, float] = {}
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        cfg = KernelConfig.from_params(trial.params)
        best[cfg] = min(trial.value, best.get(cfg, trial.value))
    return best


def _proposed(trial: optuna.trial.FrozenTrial) -> KernelConfig | None:
    """The config a trial stands for: its parameters, or those it was enqueued with; None while another process
    is still suggesting them one by one (a shared study's running trial can hold block_m and not yet block_n)."""
    params = trial.params or trial.system_attrs.get("fixed_params", {})
    return KernelConfig.from_params(params) if all(dim in params for dim in _REQUIRED) else None


def _built(wait: Wait, cfg: KernelConfig) -> bool:
    """Whether to take the compile processes' word on cfg: yes once they have built it (or failed to). If not yet,
    the timing process does not wait: measure() builds it through the JIT itself. That is mostly a study's first
    configs, while the pool's processes are still creating their CUDA contexts (on the 2×H200 host the first
    pool-built config came 10-12 s into a study; the timing process's own compile takes ~2 s); later the pool is
    a batch ahead, except for a worker that joins a study late (docs/TUNING.md, session 6)."""
    ready = getattr(wait, "ready", None)
    return ready is None or ready(cfg)


def timed_configs(study: optuna.Study, but: int | None = None) -> set[KernelConfig]:
    """The distinct configs the study has timed (a COMPLETE trial) or is timing (a RUNNING trial its process marked
    timed_by before timing it), by any process; but: leave out the trial of this number. This is what `trials`
    counts: a config is timed once and counted once, whoever proposes it again. A process that dies while timing
    leaves its trial RUNNING until it is failed (`fail_abandoned`, or as stale by the storage's heartbeat,
    tunejob._Heartbeats): then it stops counting, and its config can be timed again."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
    return {cfg for t in study.get_trials(deepcopy=False, states=states)
            if t.number != but and (t.state == optuna.trial.TrialState.COMPLETE or "timed_by" in t.user_attrs)
            and (cfg := _proposed(t)) is not None}  # fmt: skip


def process_tag(pid: int | None = None) -> str:
    """Who times a trial (its timed_by): host and process id, as processes of several hosts share one study and
    containers on different hosts often run with the same pid."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}"


def _claim(study: optuna.Study, trial: optuna.trial.Trial, cfg: KernelConfig, run: str | None) -> bool:
    """Marks the trial as timing cfg (timed_by=process_tag(), timed_in=run), then whether it is this process's to time:
    no other trial holds cfg timed or marked. Of processes that mark one config at once at most one goes on — each
    looks after marking, so the later ones see the first one's mark (both may see each other's and leave it: the
    config is then timed when it is proposed again); nothing locks a shared study between ask and tell."""
    if run is not None:
        trial.set_user_attr("timed_in", run)  # for fail_abandoned, if this process dies
    trial.set_user_attr("timed_by", process_tag())
    return cfg not in timed_configs(study, but=trial.number)


@contextlib.contextmanager
def _unless_failed_as_stale(trial: optuna.trial.Trial):
    """Writing a trial another process has failed as stale (this one's heartbeat was late: a starved thread, hosts'
    clocks apart) raises UpdateFinishedTrialError: the reading stays this process's own (its ranking has it) and
    the tune goes on, where it would have ended with a traceback."""
    try:
        yield
    except optuna.exceptions.UpdateFinishedTrialError:
        _log.warning("trial %d was failed as stale by another process; its reading is kept here only", trial.number)


def _abandon(study: optuna.Study, trials: list[optuna.trial.Trial]) -> None:
    """Tells FAIL each of `trials` not told yet (a tune interrupted by Ctrl-C), so none stays RUNNING in a storage
    that outlives the process (and counts as a config being timed)."""
    for trial in trials:
        with contextlib.suppress(Exception):  # told already (set_user_attr refuses a finished trial), or no storage
            trial.set_user_attr("reason", "interrupted")
            study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


def _time_outside_budget(study, cfg, measure, measured, failures, history, choices, storage) -> None:
    """Times cfg once, as a trial of its own beside the budget's, unless another process sharing the study has."""
    if storage is not None:
        measured.update(_completed(study))
        if cfg in measured:
            return
    try:
        measured[cfg] = float(measure(cfg))
    except Exception as exc:  # a config that no longer runs is replaced, as any failed config is never kept
        failures[cfg] = failure_reason(exc)
        history.append(TrialRecord(-1, cfg, None, failures[cfg]))
        return
    distributions = {dim: optuna.distributions.CategoricalDistribution(values) for dim, values in choices.items()}
    study.add_trial(optuna.trial.create_trial(params=_params(cfg), distributions=distributions, value=measured[cfg]))
    history.append(TrialRecord(-1, cfg, measured[cfg]))


def _incumbent_note(
    stored: KernelConfig | None, problem: str | None, best: KernelConfig, ms: dict[KernelConfig, float]
) -> str | None:
    """What became of the config the file held for the key, in words; ms: each config's deciding reading."""
    if stored is None:
        return None
    if problem is not None:
        return f"replaced the stored config {stored.label()}, which {problem}, by {best.label()} ({ms[best]:.3f} ms)"
    if best == stored:
        others = [cfg for cfg in ms if cfg != stored]
        rival = min(others, key=ms.get) if others else None
        beside = f"; the fastest other, {rival.label()}, {ms[rival]:.3f} ms" if rival is not None else ""
        return f"kept the stored config {stored.label()} ({ms[stored]:.3f} ms{beside})"
    return f"replaced the stored config {stored.label()} ({ms[stored]:.3f} ms) by {best.label()} ({ms[best]:.3f} ms)"


def fail_abandoned(storage, run: str, pid: int) -> int:
    """Tells FAIL every trial of every study in `storage` that process `pid` of `run` marked and was still timing
    — after that process died — so the run's budget no longer counts it (a process still on the study times
    another config in its place). Returns how many."""
    running = (optuna.trial.TrialState.RUNNING,)
    abandoned = 0
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        for trial in study.get_trials(deepcopy=False, states=running):
            if trial.user_attrs.get("timed_in") == run and trial.user_attrs.get("timed_by") == process_tag(pid):
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                abandoned += 1
    return abandoned


def promising(candidates: Sequence[KernelConfig], head_dim: int, kernel: str, k: int = 3) -> list[KernelConfig]:
    """One config for each of the k block shapes (block_m, block_n) a roofline argument ranks first, taken in turn
    from the warp-specialized kernels and the Triton template where the space holds both; the warp-specialized
    kernels' modes (the forward's ping-pong, the dK/dV kernel's fused dQ, two programs an SM) count as shapes of
    their own, as they change the schedule more than warps and stages do.

    Timed right after the default, these spread the first trials over the shapes — the choice that matters most —
    before TPE refines warps and stages. A program's arithmetic intensity grows with its tile (block_m·block_n),
    so larger tiles first, as long as their fp32 accumulators stay well inside the register file (≤ 192 per
    thread; past ~256 they spill); per shape, 3 pipeline stages (a load hidden behind one loop step), more warps,
    and a persistent grid. On the recorded H200 sweeps this start takes the study from 7 to 15 of 20 runs within 2 %
    of the best at a quarter of the exhaustive budget (docs/TUNING.md). The two kernel families take turns because
    ranking all shapes together let the Triton template's larger tiles crowd out the warp-specialized kernel's
    smaller ones: a 16-trial tune of the d=64 causal N ≤ 1k forward never timed the (128, 128) warpspec persistent
    config, 13 % faster than the one it kept (docs/PERF.md v17).
    """

    def score(cfg: KernelConfig):
        regs = planner.accumulators_per_thread(cfg, head_dim, kernel)
        persistent = cfg.schedule.persistent * cfg.schedule.programs_per_sm  # two an SM, one, one program a tile
        return (regs > 192, -cfg.block_m * cfg.block_n, abs(cfg.num_stages - 3), -cfg.num_warps, -persistent)

    by_family: dict[bool, list[KernelConfig]] = {True: [], False: []}  # warpspec first
    for cfg in sorted(candidates, key=score):
        family = by_family[cfg.warp_specialized]
        shape = lambda c: (c.block_m, c.block_n, c.pingpong, c.fused_dq, c.schedule.programs_an_sm == 2)
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
    schedule (a warpspec kernel's `persistent` flipped, when that fits), then one `promising` config per block
    shape. tune() enqueues them; a tune of several studies compiles the next study's while this one is timed, so
    the next starts timing at once.

    The incumbent: a re-tune after a template change samples a space of ~50-100 configs with 10-16 trials and twice
    replaced a shipped config by one it never timed beside it (docs/PERF.md v12, v13); timed, it stays unless beaten.
    The twin: which schedule wins depends on the length and the mask (persistent is 10-25 % faster at N <= 2k and
    slower on long causal calls, docs/PERF.md v12), and a 10-16 trial study sampling the switch on its own missed
    the better one for a short-length entry."""
    if trials <= 0:
        return []
    if default is None:
        default = planner.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=device)
    candidates = [*space, default] if default not in space else space  # as tune() extends its space
    fits = lambda cfg: planner.check(cfg, device, head_dim, dtype, kernel) is None
    feasible = [c for c in candidates if fits(c)]
    # feasible holds a twin only where the switch exists (KernelConfig.combination_error) and the config fits
    twin = replace(default, schedule=PER_TILE if default.schedule.persistent else PERSISTENT)
    first = [default]
    for cfg in (incumbent, twin if twin in feasible else None):
        if cfg is not None and cfg not in first and fits(cfg):
            first.append(cfg)
    picks = [c for c in promising(feasible, head_dim, kernel, k=max(3, trials // 2)) if c not in first]
    return [*first, *picks]


def tune(
    *,
    device: DeviceInfo,
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    measure: Measure,
    trials: int = 40,
    timeout_s: float | None = None,
    space: Sequence[KernelConfig] | None = None,
    storage: str | None = None,
    verify: Verify | None = None,
    remeasure_top: int = 3,
    default: KernelConfig | None = None,
    incumbent: KernelConfig | None = None,
    seed: int = 0,
    on_trial: Callable[[int, int, float | None, float], None] | None = None,
    variant: str = "",
    prepare: Prepare | None = None,
    batch_size: int = 1,
    run: str | None = None,
    on_timed: Callable[[], None] | None = None,
) -> TuneResult:
    """Runs (or resumes, with a persistent `storage`) the study and returns the winner.

    Args:
        trials: distinct configs the study is to hold timed, by every process sharing it (timed_configs; pruned
            and failed trials and repeats do not count): a resumed study times only what it still lacks, and a
            config another process timed or is timing is not timed again. The tune also stops once every config
            of the space is timed or failed.
        timeout_s: stop asking for new trials after this many seconds (once a config is timed: a study always
            times its first).
        space: candidate configs; default: every planner candidate (rejected ones are pruned with their reason).
        storage: an Optuna storage URL (sqlite:///tune.db, a journal file, an RDB server) shared by workers.
        verify: checks a winner's output; returns a reason to reject it, or None.
        default: the baseline enqueued first; default: planner.default_config for the device.
        incumbent: the config the file the tune writes holds for this key (stale or not), timed right after the
            default — or, where the budget ends first, after the trials, outside the budget — and re-timed with the
            top few: a re-tune replaces it only by a config whose second reading is more than INCUMBENT_MARGIN
            faster. Replaced, and not timed, if the planner rejects it now; replaced if it fails to run or to verify.
        on_trial: progress callback (measured so far, trials, best ms so far, elapsed s).
        variant: the template variant tuned beyond causal ("window", "varlen", "window+varlen"), in the study name.
        prepare: starts compiling a batch of configs (in parallel processes) and returns wait(config) for one
            config's failure or None. With it the study keeps two batches in flight: the next one compiles (on
            the CPUs) while this one is timed (on the GPU), and a config is timed as soon as its own compile is
            done. If wait has ready(config) -> bool, a config not built yet when its turn comes is timed at once
            (measure builds it, _built) instead of waited for: a study waits for no compile round at all.
        batch_size: new configs asked of Optuna before each prepare + timing round. With more than one, the
            sampler is told of pending trials (constant liar), so a batch spreads out instead of repeating itself;
            compiling batch_size configs at once is what makes this worth it.
        run: several processes of one tune sharing the study (multi-GPU, tunejob.run_parallel_many): each marks a
            trial it times with the user attribute timed_in=run (and timed_by=its pid, as every process on a
            shared storage does), so the tune can fail a dead worker's trial at once (fail_abandoned). Every
            process stops — before its next timing — once the study holds `trials` timed or being timed: the
            processes end within one timing of each other, whatever their speed.
        on_timed: called once the trials are timed, before the finish (the best re-timed and verified): where a
            caller lets its compile processes go (CompilePool.release), and waits for other processes still timing
            configs of a shared study (tunejob.run_study), whose readings the finish then ranks with its own.
    """
    start = time.time()
    name = study_name(device, kernel, head_dim, dtype, causal, variant)
    candidates = list(space) if space is not None else planner.candidates(kernel)
    allowed = set(candidates)
    choices = {dim: sorted({params[dim] for params in map(_params, candidates)}) for dim in _DIMS}
    if default is None:
        default = planner.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=device)
    stored, stored_problem = incumbent, None  # the incumbent as given, and why it cannot be kept, for the note
    if incumbent is not None and (unfit := planner.check(incumbent, device, head_dim, dtype, kernel)) is not None:
        incumbent = None  # the planner's rules changed since it was tuned: it is no longer a candidate
        stored_problem = f"is no longer a candidate ({unfit})"
    for base in (default, incumbent):  # always candidates: tuned >= both by construction
        if base is not None and base not in allowed:
            candidates.append(base)
            allowed.add(base)
            for dim in choices:
                choices[dim] = sorted(set(choices[dim]) | {_params(base)[dim]})

    optuna.logging.set_verbosity(logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=3, constant_liar=batch_size > 1)
    study = optuna.create_study(
        study_name=name, storage=storage, sampler=sampler, direction="minimize", load_if_exists=True
    )
    measured = _completed(study)  # a resumed or shared study keeps what was measured
    # Trials other workers ran or enqueued already (enqueued ones carry their params as "fixed_params").
    tried = {cfg for t in study.trials if (cfg := _proposed(t)) is not None}
    feasible = [c for c in candidates if planner.check(c, device, head_dim, dtype, kernel) is None]
    first = first_configs(device=device, kernel=kernel, head_dim=head_dim, dtype=dtype, causal=causal, trials=trials,
                          space=candidates, default=default, incumbent=incumbent)  # fmt: skip
    for cfg in first:
        if cfg not in tried:
            study.enqueue_trial(_params(cfg), skip_if_exists=True)  # workers sharing a study enqueue once
            tried.add(cfg)

    history: list[TrialRecord] = []
    asked = 0
    opened: list[optuna.trial.Trial] = []  # every trial this process asked: told FAIL on Ctrl-C if still running
    repeats = 0
    rng = random.Random(seed)
    failures: dict[KernelConfig, str] = {}  # configs that failed to compile or run: never tried again
    # Batches asked of Optuna, each with the wait for its compile. With prepare two are in flight: the next batch
    # compiles while this one is timed (TPE's constant liar lets it be asked before this one is told).
    in_flight: deque[tuple[list[tuple[optuna.trial.Trial, KernelConfig]], Wait]] = deque()
    depth = 2 if prepare is not None else 1

    def fail(trial, cfg, reason):
        with _unless_failed_as_stale(trial):
            trial.set_user_attr("reason", reason)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        history.append(TrialRecord(trial.number, cfg, None, reason))

    def in_flight_configs() -> set[KernelConfig]:
        return {cfg for batch, _ in in_flight for _, cfg in batch}

    def spent() -> int:
        """Configs timed against the budget: the study's, by any process (timed_configs)."""
        return len(timed_configs(study))

    def ask_batch() -> list[tuple[optuna.trial.Trial, KernelConfig]]:
        """Asks until the batch holds batch_size configs, or the budget (counting batches in flight) is spent."""
        nonlocal asked, repeats
        batch: list[tuple[optuna.trial.Trial, KernelConfig]] = []

        def planned() -> set[KernelConfig]:
            return in_flight_configs() | {cfg for _, cfg in batch}

        while len({cfg for _, cfg in batch}) < batch_size and asked < 20 * trials + 50:
            timed_or_planned = timed_configs(study) | planned()
            if len(timed_or_planned) >= trials:
                break
            if all(c in timed_or_planned or c in failures for c in feasible):
                break  # the whole space is timed or failed: asking again would only repeat configs
            if timeout_s is not None and time.time() - start > timeout_s and (measured or failures):
                break
            trial = study.ask()
            asked += 1
            opened.append(trial)
            cfg = KernelConfig.from_params({dim: trial.suggest_categorical(dim, v) for dim, v in choices.items()})
            reason = planner.check(cfg, device, head_dim, dtype, kernel)
            if reason is None and cfg not in allowed:
                reason = "not in the search space"
            if reason is not None:
                trial.set_user_attr("reason", reason)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                history.append(TrialRecord(trial.number, cfg, None, reason))
                continue
            if cfg in failures:
                fail(trial, cfg, failures[cfg])
                continue
            if cfg not in measured and storage is not None:  # another worker may have timed it meanwhile
                measured.update(_completed(study))
            if cfg in measured:  # a config timed before: reuse the number, spend no device time
                repeats += 1
                untried = [c for c in feasible if c not in measured and c not in failures and c not in planned()]
                if repeats >= 5 and untried:  # TPE keeps proposing its best so far: explore an untried config instead
                    study.enqueue_trial(_params(rng.choice(untried)), skip_if_exists=True)
                    repeats = 0
                study.tell(trial, measured[cfg])
                history.append(TrialRecord(trial.number, cfg, measured[cfg]))
                continue
            batch.append((trial, cfg))  # a config already in a batch is timed once, with that batch
        return batch

    def launch(batch) -> Wait:
        """Starts compiling the batch's new configs; returns wait(config) -> its failure or None."""
        new = list(dict.fromkeys(cfg for _, cfg in batch if cfg not in measured and cfg not in in_flight_configs()))
        return prepare(new) if prepare is not None and new else lambda cfg: None

    def run_batch(batch, wait: Wait):
        for trial, cfg in batch:
            if storage is not None and cfg not in measured:
                measured.update(_completed(study))  # another process may have timed it meanwhile
                if cfg not in measured and spent() >= trials:  # other processes spent the study's budget
                    trial.set_user_attr("reason", "the budget was spent by other processes")
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    continue
            wait_start = time.time()
            built_here = cfg not in measured and cfg not in failures and not _built(wait, cfg)
            if cfg not in measured and cfg not in failures and not built_here and (reason := wait(cfg)):
                failures[cfg] = reason
            waited = time.time() - wait_start
            if cfg in failures:
                fail(trial, cfg, failures[cfg])
                continue
            if cfg not in measured and storage is not None and not _claim(study, trial, cfg, run):
                measured.update(_completed(study))
                if cfg not in measured:  # another process is timing it: its reading will be the study's
                    trial.set_user_attr("reason", "timed by another process")
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    continue
            if cfg not in measured:  # a config asked twice is timed once
                measuring = time.time()
                try:
                    measured[cfg] = float(measure(cfg))
                except Exception as exc:  # a failed compile or launch is data, never the end of the study
                    failures[cfg] = failure_reason(exc)
                    fail(trial, cfg, failures[cfg])
                    continue
                # Where a trial's time went, kept in the storage for scripts/tune_timeline.py: waiting for the
                # compile processes, and measuring (which includes building the config if built_here).
                timing = {"pid": os.getpid(), "start": round(wait_start, 3), "wait_s": round(waited, 3),
                          "built_here": built_here, "measure_s": round(time.time() - measuring, 3)}  # fmt: skip
            else:
                timing = None
            with _unless_failed_as_stale(trial):
                if timing is not None:
                    trial.set_user_attr("timing", timing)
                study.tell(trial, measured[cfg])
            history.append(TrialRecord(trial.number, cfg, measured[cfg]))
            if on_trial is not None:
                on_trial(spent(), trials, min(measured.values()), time.time() - start)

    try:
        while True:
            while len(in_flight) < depth and (batch := ask_batch()):
                in_flight.append((batch, launch(batch)))
            if not in_flight:
                break
            run_batch(*in_flight.popleft())
    except KeyboardInterrupt:
        _abandon(study, opened)
        raise

    if on_timed is not None:
        on_timed()
    if storage is not None:  # ranked too: what other processes sharing the study timed by now (on_timed may wait)
        measured.update(_completed(study))
    if incumbent is not None and incumbent not in measured and incumbent not in failures:
        # The budget ended before the incumbent's turn: it is timed now, outside the budget, so it stays unless
        # beaten (a 1-trial re-tune timed only the default and replaced a stored config 4x faster by it).
        _time_outside_budget(study, incumbent, measure, measured, failures, history, choices, storage)
    if incumbent is not None and incumbent in failures:
        stored_problem = f"failed to run ({failures[incumbent]})"
    if not measured:
        raise RuntimeError(f"{name}: no config could be measured; reasons: {[r.reason for r in history][:5]}")
    # Re-measure the top few: a single timing can be lucky. The winner is the best second reading that verifies —
    # the second alone, not the better of the two: the first config a process times read 3-8 % faster than when
    # timed second, whichever config it was, on the H200 (docs/PERF.md v27), and the default is timed first, so the
    # better-of-two kept that flattering reading and the default won.
    ranked = sorted(measured, key=measured.get)[: max(1, remeasure_top)]
    for base in (default, incumbent) if remeasure_top > 1 else ():
        if base in measured and base not in ranked:
            ranked.append(base)  # a first reading can be a cold one: tuned-vs-default (and -incumbent) needs a fair one
    second = {}
    for cfg in ranked:
        try:
            second[cfg] = float(measure(cfg)) if remeasure_top > 1 else measured[cfg]
        except Exception:
            continue
    best, best_ms = None, None
    order = sorted(second, key=second.get)
    if incumbent in second and second[order[0]] > second[incumbent] * (1 - INCUMBENT_MARGIN):
        order.remove(incumbent)  # the fastest is within the noise of the config the key runs now: keep that
        order.insert(0, incumbent)
    for cfg in order:
        problem = verify(cfg) if verify is not None else None
        if problem is None:
            best, best_ms = cfg, second[cfg]
            break
        history.append(TrialRecord(-1, cfg, None, f"failed verification: {problem}"))
        if cfg == incumbent:
            stored_problem = f"failed verification ({problem})"
    if best is None:
        raise RuntimeError(f"{name}: no measured config passed verification")
    values = [r.ms for r in history if r.ms is not None]
    if not values:  # finishing a study other processes ran (multi-GPU): their trials, in the order they were told
        values = [t.value for t in sorted(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)),
                                          key=lambda t: t.datetime_complete or t.datetime_start)]  # fmt: skip
    within = next((i + 1 for i, v in enumerate(values) if v <= min(values) * 1.02), None)
    return TuneResult(
        study_name=name,
        best=best,
        best_ms=best_ms,
        default=default,
        default_ms=second.get(default, measured.get(default)),
        incumbent=incumbent,
        incumbent_ms=second.get(incumbent, measured.get(incumbent)) if incumbent is not None else None,
        incumbent_note=_incumbent_note(stored, stored_problem, best, {**measured, **second}),
        median_ms=statistics.median(measured.values()),
        measured=len(measured),
        pruned=sum(1 for t in study.trials if t.state == optuna.trial.TrialState.PRUNED),
        failed=sum(1 for t in study.trials if t.state == optuna.trial.TrialState.FAIL),
        wall_s=time.time() - start,
        within_2pct_at=within,
        history=tuple(history),
    )
