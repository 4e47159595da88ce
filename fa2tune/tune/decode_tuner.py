"""The decode tune: one Optuna study over the decode kernel's configs (decode_space) on one device, scored by the
geometric mean of the timed steps' medians (decode_workload), its winner verified and made a store entry.

TPE proposes configs of the space's fields; a proposal that does not fit the device is pruned with its reason, one
whose class (decode_space) was timed before is told that reading again, and a config that fails to build or run
scores inf with its reason: nothing a config does ends the search. The budget counts the classes timed (--trials),
and the search ends early once every class is timed. The finish times the fastest few again (and the default, and
the config the file held) with time_cuda's full budget, timing.FINAL_ROUNDS rounds in alternating order, ranks them
by the means over those rounds alone, as the attention tune does (fa2tune.tune.finish), and keeps the first
that matches the float64 reference (verification.check_decode); the file's config stays unless beaten by more than
finish.INCUMBENT_MARGIN.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import optuna
import torch

from ..config import decode_plan, planner, store
from ..config.decode_config import DECODE_KERNEL, DecodeConfig
from ..config.device import device_info
from ..config.inputs import DTYPES_BY_NAME
from ..kernels import codegen
from . import decode_space, decode_workload, verification
from .finish import INCUMBENT_MARGIN
from .records import STORED_ORIGIN, OnTrial, Options, TimingClock, TrialRecord, failure_reason
from .strategy import REPEATS_BEFORE_EXPLORING
from .timing import Timing, final_readings

REMEASURE_TOP = Options.remeasure_top  # the fastest configs the finish times again, as the attention tuner's


@dataclass(frozen=True)
class DecodeSpec:
    """What to tune: the decode kernel at one head dim and dtype, timed on steps of `heads` query heads over `kv_heads`
    K/V heads (the interpreter's tiny steps take decode_workload.CPU_HEADS), and how long: `trials` classes timed at
    most, no new one timeout_s after the first (records.TimingClock; timeout_counts_builds: after the tune's start)."""

    head_dim: int
    dtype: str  # "bf16" | "fp16" | "fp32"
    heads: int
    kv_heads: int
    trials: int = 40
    timeout_s: float | None = None
    timeout_counts_builds: bool = False  # timeout_s is a share of the run's wall time (records.Options)
    seed: int = 0
    incumbent: DecodeConfig | None = None  # the config the file the tune writes holds for the key
    incumbent_origin: str = STORED_ORIGIN  # where it comes from, in words, for the tune's note (job.Incumbent)

    @property
    def key(self) -> store.EntryKey:
        return store.EntryKey(head_dim=self.head_dim, dtype=self.dtype, causal=False, kernel=DECODE_KERNEL)


@dataclass(frozen=True)
class DecodeResult:
    """What a decode tune found. ms: geometric means over the timed steps of their medians (the finish's: each the
    mean over its rounds); gbps likewise of K and V read / time (None under the interpreter); readings: each step's
    Timing of the winner in the finish, the mean over its rounds."""

    study_name: str
    best: DecodeConfig
    best_ms: float
    gbps: float | None
    readings: tuple[Timing, ...]
    default: DecodeConfig
    default_ms: float
    default_gbps: float | None
    measured: int
    pruned: int
    failed: int
    wall_s: float
    incumbent_note: str | None = None
    history: tuple[TrialRecord, ...] = field(repr=False, default=())


class Bench(Protocol):
    """Where a decode study's readings come from: decode_workload.DecodeBench, or recorded readings in tests."""

    on_gpu: bool
    gigabytes: list[float]  # each timed step's K and V read, GB

    def readings(self, config: DecodeConfig, *, quick: bool = False) -> list[Timing]: ...


def run(spec: DecodeSpec, device_name: str, *, on_trial: OnTrial | None = None,
        compile_pool=None) -> tuple[DecodeResult, store.Entry]:  # fmt: skip
    """Tunes the decode kernel on one device ("cuda:N", or "cpu": the interpreter's tiny steps); returns the result
    and its store entry. compile_pool: a CompilePool whose processes build each class's kernels ahead of its timing
    (a GPU tune's), released once the search has timed its classes, so that no build left queued runs beside the
    finish's timings; None: the timing process's JIT builds them."""
    start = time.time()
    info, dtype, cpu = device_info(device_name), DTYPES_BY_NAME[spec.dtype], device_name == "cpu"
    if not cpu:  # timing (do_bench's events), the checks and every allocation belong on the tuned GPU
        torch.cuda.set_device(torch.device(device_name))
    heads, kv_heads = decode_workload.CPU_HEADS if cpu else (spec.heads, spec.kv_heads)
    steps = decode_workload.workloads(cpu)
    space = decode_space.build(decode_space.CPU_SEARCH if cpu else decode_space.SEARCH, info, spec.head_dim, dtype,
                               steps, heads=heads, kv_heads=kv_heads,
                               default=decode_plan.default_config(info, spec.head_dim, dtype),
                               incumbent=spec.incumbent)  # fmt: skip
    bench = decode_workload.DecodeBench(steps, heads=heads, kv_heads=kv_heads, head_dim=spec.head_dim, dtype=dtype,
                                        device=device_name)  # fmt: skip
    built = _start_builds(space, compile_pool, heads=heads, kv_heads=kv_heads, head_dim=spec.head_dim, dtype=dtype,
                          device=device_name)  # fmt: skip
    verify = lambda config: verification.check_decode(config, heads=heads, kv_heads=kv_heads, head_dim=spec.head_dim,
                                                      dtype=dtype, device=device_name)  # fmt: skip
    result = tune(spec, space, bench, name=f"{info.slug}/{DECODE_KERNEL}/d{spec.head_dim}/{spec.dtype}",
                  verify=verify, tolerance=verification.REL_TOLERANCE[dtype], built=built, on_trial=on_trial,
                  start=start, on_timed=compile_pool.release if compile_pool is not None else None)  # fmt: skip
    return result, _entry(spec, result, on_gpu=not cpu)


def tune(spec: DecodeSpec, space: decode_space.DecodeSpace, bench: Bench, *, name: str,
         verify: Callable[[DecodeConfig], float], tolerance: float,
         built: Callable[[DecodeConfig], str | None] = lambda config: None, on_trial: OnTrial | None = None,
         start: float | None = None, on_timed: Callable[[], None] | None = None) -> DecodeResult:  # fmt: skip
    """The study of `space` with `bench`'s readings: the search, then the finish (the module's text).

    Args:
        name: the study's name in messages, e.g. nvidia-h200/decode/d128/bf16.
        verify: a config's worst relative error against the reference; `tolerance` the most it may be.
        built: wait(config) -> why its kernels failed to build, or None (_start_builds).
        start: when the tune started (time.time()), for --timeout and the wall time; None: now.
        on_timed: called between the search and the finish (where the compile processes are let go).
    """
    start = time.time() if start is None else start
    search = _Search(space, lambda config: _score(bench, config, built), spec, on_trial, start)
    search.run()
    if on_timed is not None:
        on_timed()
    best, second, note = _finish(search, space, bench, verify, tolerance, name, spec.incumbent_origin)
    ms = lambda config: _geomean([t.median_ms for t in second[config]])
    gbps = lambda config: _geomean(bench.gigabytes) / (ms(config) * 1e-3) if bench.on_gpu else None
    return DecodeResult(
        study_name=name, best=best, best_ms=ms(best), gbps=gbps(best), readings=tuple(second[best]),
        default=space.default, default_ms=ms(space.default), default_gbps=gbps(space.default),
        measured=len(search.measured), pruned=search.pruned, failed=len(search.failures),
        wall_s=time.time() - start, incumbent_note=note, history=tuple(search.history),
    )  # fmt: skip


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _mean_of_rounds(rounds: list[list[Timing]]) -> list[Timing]:
    """Each step's Timing over the finish's rounds (a list of the steps' Timings a round): the means of its median,
    20th and 80th percentiles."""
    return [Timing(*(statistics.fmean(getattr(t, field) for t in step) for field in ("median_ms", "p20_ms", "p80_ms")))
            for step in zip(*rounds, strict=True)]  # fmt: skip


def _start_builds(space: decode_space.DecodeSpace, pool, **sizes) -> Callable[[DecodeConfig], str | None]:
    """wait(config) -> why its kernels failed to build, or None: every class's build started in `pool` at once, the
    first class of each compiled shape (block_n, num_warps, num_stages) ahead of the rest, so that the processes do
    not compile one kernel side by side at the start; without a pool, nothing to wait for (the JIT builds)."""
    if pool is None:
        return lambda config: None
    firsts, rest, shapes = [], [], set()
    for config in space.classes:
        shape = (config.block_n, config.num_warps, config.num_stages)
        (rest if shape in shapes else firsts).append(config)
        shapes.add(shape)
    build = functools.partial(decode_workload.build_kernels, **sizes)
    calls = {}
    for config in firsts + rest:  # one call a distinct launch, so that a class's kernels build side by side
        launched = dict.fromkeys((page, seqlen_q, splits) for page, seqlen_q, *_, splits in space.launches[config])
        calls[config] = [(build, (config, (launch,))) for launch in launched]
    return pool.start_calls(calls)


def _score(bench: Bench, config: DecodeConfig, built: Callable[[DecodeConfig], str | None]) -> list[Timing]:
    """config's search readings on every step; raises with the reason where its kernels failed to build."""
    reason = built(config)
    if reason is not None:
        raise RuntimeError(reason)
    return bench.readings(config, quick=True)


class _Search:
    """The ask/tell loop: TPE proposes, the space maps a proposal to its class, each class is timed once.

    Attributes:
        measured: each class's first reading, the geometric mean of its steps' medians (ms).
        failures: classes that failed to build or run, with the reason (scored inf).
        pruned: proposals that do not fit the device.
        history: what became of each class timed, in order.
    """

    def __init__(self, space: decode_space.DecodeSpace, score: Callable[[DecodeConfig], list[Timing]],
                 spec: DecodeSpec, on_trial: OnTrial | None, start: float) -> None:  # fmt: skip
        self.space, self.score, self.spec, self.on_trial, self.start = space, score, spec, on_trial, start
        self.measured: dict[DecodeConfig, float] = {}
        self.failures: dict[DecodeConfig, str] = {}
        self.history: list[TrialRecord] = []
        self.pruned = 0
        self.rng = random.Random(spec.seed)
        self.clock = TimingClock(spec.timeout_s, start if spec.timeout_counts_builds else None)

    def run(self) -> None:
        optuna.logging.set_verbosity(logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.spec.seed, multivariate=True, n_startup_trials=3)
        study = optuna.create_study(direction="minimize", sampler=sampler)
        distributions = {name: optuna.distributions.CategoricalDistribution(values)
                         for name, values in self.space.choices.items()}  # fmt: skip
        for first in (self.space.default, self.space.incumbent):  # timed first: the baseline, then the file's
            if first is not None:
                study.enqueue_trial(first.to_dict(), skip_if_exists=True)
        budget = self._budget()
        # Each proposal either times a class or, after a few in a row that do not, leads to one enqueued: the loop
        # ends within budget · (REPEATS_BEFORE_EXPLORING + 1) asks
        repeats = 0
        while self._timed() < budget and not self._timed_out():
            trial = study.ask(distributions)
            timed = self._tell(study, trial, DecodeConfig(**trial.params))
            repeats = 0 if timed else repeats + 1
            if repeats >= REPEATS_BEFORE_EXPLORING:
                untimed = [c for c in self.space.classes if c not in self.measured and c not in self.failures]
                study.enqueue_trial(self.rng.choice(untimed).to_dict())
                repeats = 0

    def _timed(self) -> int:
        return len(self.measured) + len(self.failures)

    def _budget(self) -> int:
        """Classes to time: --trials, or every class where the space has fewer."""
        return min(self.spec.trials, len(self.space.classes))

    def _timed_out(self) -> bool:
        """Whether no new class is to be timed: the timeout passed since the first class was timed."""
        return self.clock.spent()

    def _tell(self, study: optuna.Study, trial: optuna.trial.Trial, proposed: DecodeConfig) -> bool:
        """Tells the trial its config's score; True when a class was timed for it."""
        config = self.space.representative.get(proposed)
        if config is None:
            trial.set_user_attr("reason", self.space.unfit.get(proposed, "not in the search space"))
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            self.pruned += 1
            return False
        if config in self.measured or config in self.failures:
            study.tell(trial, self.measured.get(config, math.inf))
            return False
        try:
            ms = _geomean([t.median_ms for t in self.score(config)])
        except Exception as exc:  # failures are data: the config scores inf and the search goes on
            ms, self.failures[config] = math.inf, failure_reason(exc)
            trial.set_user_attr("reason", self.failures[config])
        else:
            self.measured[config] = ms
            self.clock.reading_in()  # a failure does not start it: the search goes on until one class is timed
        self.history.append(TrialRecord(trial.number, config, ms if config in self.measured else None,
                                        self.failures.get(config)))  # fmt: skip
        study.tell(trial, ms)
        if self.on_trial is not None and self.measured:
            self.on_trial(self._timed(), self._budget(), min(self.measured.values()), time.time() - self.start)
        return True


def _finish(search: _Search, space: decode_space.DecodeSpace, bench: Bench,
            verify: Callable[[DecodeConfig], float], tolerance: float, name: str,
            origin: str = STORED_ORIGIN):  # fmt: skip
    """(winner, the readings of each config timed again (each step's Timing, the mean over the finish's rounds), what
    became of the incumbent): the fastest REMEASURE_TOP classes, the default and the incumbent timed again
    (timing.final_readings) and ranked by their score over those means; the first whose relative error against the
    reference is within `tolerance` wins, the incumbent kept unless beaten by more than INCUMBENT_MARGIN; origin:
    where the incumbent comes from, for the note. Raises RuntimeError when nothing was measured or nothing verifies,
    or the default failed to run in a round (a default that runs only sometimes gives no baseline to trust)."""
    if not search.measured:
        raise RuntimeError(f"{name}: no config could be measured; reasons: {list(search.failures.values())[:5]}")
    again = sorted(search.measured, key=search.measured.get)[:REMEASURE_TOP]
    again += [c for c in (space.default, space.incumbent) if c is not None and c not in again]
    problems = {}

    def read(config: DecodeConfig) -> list[Timing]:
        try:
            return bench.readings(config)
        except Exception as exc:  # the default too may fail on a device (it then has no baseline reading)
            problems[config] = failure_reason(exc)
            raise

    second = {config: _mean_of_rounds(rounds) for config, rounds in final_readings(again, read).items()}
    score = lambda config: _geomean([t.median_ms for t in second[config]])
    ranked = sorted(second, key=score)
    best = note = None
    for config in ranked:
        error = verify(config)
        if error <= tolerance:
            best = config
            break
        problems[config] = f"relative error {error:.1e} against the reference"
    if best is None or space.default not in second:
        raise RuntimeError(f"{name}: no measured config passed verification, or the default could not run: {problems}")
    kept = space.incumbent
    if kept is not None and kept == best:
        note = f"kept {origin}: the fastest measured"
    elif kept is not None and kept in second and kept not in problems:
        if score(best) > score(kept) * (1 - INCUMBENT_MARGIN) and verify(kept) <= tolerance:
            best, note = kept, f"kept {origin}: nothing measured more than {INCUMBENT_MARGIN:.0%} faster"
        else:
            note = f"replaced {origin} {kept.label()} ({score(kept):.4f} ms)"
    elif kept is not None:
        note = f"replaced {origin} {kept.label()}: {problems[kept]}"
    elif space.incumbent_unfit is not None:
        note = f"replaced {origin}: it {space.incumbent_unfit}"
    return best, second, note


def _entry(spec: DecodeSpec, result: DecodeResult, *, on_gpu: bool) -> store.Entry:
    """The store entry of the tune's winner: its ms and GB/s (None under the interpreter), the default's beside, and
    its spread, the worst (p80 − p20) / median over the steps."""
    measured = lambda value: None if value is None else round(value, 1)
    spread = max((t.p80_ms - t.p20_ms) / t.median_ms for t in result.readings) if on_gpu else None
    return store.Entry(
        key=spec.key, config=result.best, ms=round(result.best_ms, 4), tflops=None,
        baseline={"name": "planner-default", "config": result.default.to_dict(), "ms": round(result.default_ms, 4),
                  "gbps": measured(result.default_gbps)},
        trials=result.measured, spread=None if spread is None else round(spread, 4),
        triton_version=planner.triton_version(), torch_version=str(torch.__version__),
        template_hash=codegen.decode_code_hash(), date=datetime.date.today().isoformat(),
        gbps=measured(result.gbps),
    )  # fmt: skip
