"""The study's finish: the best few timed again, the winner verified, the incumbent kept unless clearly beaten.

A single timing can be lucky, so the top few (and the default and the incumbent, for a fair comparison) are timed
again, timing.FINAL_ROUNDS rounds in alternating order (timing.final_readings), and ranked by the mean of those
readings alone; the fastest that passes `verify` wins, except that the incumbent stays where nothing beats it by
more than INCUMBENT_MARGIN.
"""

from __future__ import annotations

import statistics
import time

import optuna

from ..config.types import KernelConfig
from .cost import Cost
from .records import Options, Target, TrialRecord, TuneResult, Verify, failure_reason
from .search_space import Space
from .timing import final_readings

# A re-tune keeps the config a key runs now unless another measures faster by more than this fraction: readings of
# one config differ by up to ~1 % (do_bench medians, L2 flushed; one process's rounds), and a swap on a 0.1 % "win"
# (a d=128 short dK/dV entry at 1.196 against 1.197 ms) rewrites a shipped entry — and every measurement made with
# it — for nothing.
INCUMBENT_MARGIN = 0.01

def finish(study: optuna.Study, target: Target, space: Space, options: Options, cost: Cost, start: float) -> TuneResult:
    """Names the study's winner among the configs timed (cost.measured, with what processes sharing the study timed
    by now); raises RuntimeError if none was measured or none verifies."""
    if options.storage is not None:  # ranked too: what other processes sharing the study timed by now
        cost.refresh()
    incumbent = space.incumbent
    if incumbent is not None and incumbent not in cost.measured and incumbent not in cost.failures:
        # The budget ended before the incumbent's turn: it is timed now, outside the budget, so it stays unless
        # beaten (a 1-trial re-tune that timed only the default could replace a stored config 4x faster by it).
        cost.time_outside_budget(incumbent, space.choices)
    problem = space.incumbent_unfit  # why the stored config cannot be kept, for the note
    if incumbent is not None and incumbent in cost.failures:
        problem = f"failed to run ({cost.failures[incumbent]})"
    if not cost.measured:
        reasons = [r.reason for r in cost.history][:5]
        raise RuntimeError(f"{target.name}: no config could be measured; reasons: {reasons}")
    finals, failed = _final_readings(cost, space, options.remeasure_top)
    if incumbent is not None and incumbent in failed:
        problem = f"failed to run in the finish ({failed[incumbent]})"
    best, unverified = _first_verified(_ranking(finals, incumbent), options.verify, cost.history, incumbent)
    if unverified is not None:
        problem = unverified
    if best is None:
        raise RuntimeError(f"{target.name}: no measured config passed verification")
    return _result(study, target, space, cost, finals, best, problem, start)


def _final_readings(cost: Cost, space: Space,
                    remeasure_top: int) -> tuple[dict[KernelConfig, float], dict[KernelConfig, str]]:  # fmt: skip
    """(each finalist's reading, why a finalist failed to run): the top few configs timed again (with remeasure_top
    1: their only reading), and the default and the incumbent with them: a first reading can be a cold one, and
    tuned-vs-default (and -incumbent) needs a fair one. Each is the mean of its timing.FINAL_ROUNDS readings
    (final_readings); one that fails to run in a round is left out, with its reason, also in the history.

    The winner is ranked by these readings alone, not with its first: on the H200 the first config a process times
    reads 3-8 % faster than when timed second, whichever config it is, and the default is timed first: the better
    of its readings would keep the flattering one, and the default would win."""
    measured = cost.measured
    ranked = sorted(measured, key=measured.get)[: max(1, remeasure_top)]
    if remeasure_top <= 1:
        return {cfg: measured[cfg] for cfg in ranked}, {}
    for base in (space.default, space.incumbent):
        if base in measured and base not in ranked:
            ranked.append(base)

    failed = {}

    def read(cfg: KernelConfig) -> float:
        try:
            return float(cost.measure(cfg))
        except Exception as exc:
            failed[cfg] = failure_reason(exc)
            cost.history.append(TrialRecord(-1, cfg, None, f"failed to run in the finish: {failed[cfg]}"))
            raise

    readings = final_readings(ranked, read)
    return {cfg: statistics.fmean(values) for cfg, values in readings.items()}, failed


def _ranking(finals: dict[KernelConfig, float], incumbent: KernelConfig | None) -> list[KernelConfig]:
    """Fastest first, except the incumbent first where the fastest is within INCUMBENT_MARGIN of it."""
    order = sorted(finals, key=finals.get)
    if incumbent in finals and finals[order[0]] > finals[incumbent] * (1 - INCUMBENT_MARGIN):
        order.remove(incumbent)  # the fastest is within the noise of the config the key runs now: keep that
        order.insert(0, incumbent)
    return order


def _first_verified(
    order: list[KernelConfig], verify: Verify | None, history: list[TrialRecord], incumbent: KernelConfig | None
) -> tuple[KernelConfig | None, str | None]:
    """The first config of `order` that verifies (None if none does), and why the incumbent failed verification
    if it was tried and did; each failure goes to history."""
    unverified = None
    for cfg in order:
        problem = verify(cfg) if verify is not None else None
        if problem is None:
            return cfg, unverified
        history.append(TrialRecord(-1, cfg, None, f"failed verification: {problem}"))
        if cfg == incumbent:
            unverified = f"failed verification ({problem})"
    return None, unverified


def _incumbent_note(
    stored: KernelConfig | None, origin: str, problem: str | None, best: KernelConfig, ms: dict[KernelConfig, float],
    finals: dict[KernelConfig, float],
) -> str | None:
    """What became of the incumbent, in words, naming where it came from (origin: Target.incumbent_origin); ms:
    each config's deciding reading (the finish's where it has one); finals: the configs the finish timed, among
    which the rival a kept incumbent is named beside (a search reading escaped the finish's drift)."""
    if stored is None:
        return None
    if problem is not None:
        return f"replaced {origin} {stored.label()}, which {problem}, by {best.label()} ({ms[best]:.3f} ms)"
    if best == stored:
        others = [cfg for cfg in finals if cfg != stored]
        rival = min(others, key=ms.get) if others else None
        beside = f"; the fastest other, {rival.label()}, {ms[rival]:.3f} ms" if rival is not None else ""
        return f"kept {origin} {stored.label()} ({ms[stored]:.3f} ms{beside})"
    return f"replaced {origin} {stored.label()} ({ms[stored]:.3f} ms) by {best.label()} ({ms[best]:.3f} ms)"


def _within_2pct_at(study: optuna.Study, history: list[TrialRecord]) -> int | None:
    """The first measured trial (1-based) within 2 % of the best reading."""
    values = [r.ms for r in history if r.ms is not None]
    if not values:  # finishing a study other processes ran (multi-GPU): their trials, in the order they were told
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        values = [t.value for t in sorted(done, key=lambda t: t.datetime_complete or t.datetime_start)]
    return next((i + 1 for i, v in enumerate(values) if v <= min(values) * 1.02), None)


def _result(study, target: Target, space: Space, cost: Cost, finals: dict[KernelConfig, float],
            best: KernelConfig, problem: str | None, start: float) -> TuneResult:  # fmt: skip
    measured, default, incumbent = cost.measured, space.default, space.incumbent
    within = _within_2pct_at(study, cost.history)
    return TuneResult(
        study_name=target.name,
        best=best,
        best_ms=finals[best],
        default=default,
        default_ms=finals.get(default, measured.get(default)),
        incumbent=incumbent,
        incumbent_ms=finals.get(incumbent, measured.get(incumbent)) if incumbent is not None else None,
        incumbent_note=_incumbent_note(target.incumbent, target.incumbent_origin, problem, best,
                                       {**measured, **finals}, finals),
        median_ms=statistics.median(measured.values()),
        measured=len(measured),
        pruned=sum(1 for t in study.trials if t.state == optuna.trial.TrialState.PRUNED),
        failed=sum(1 for t in study.trials if t.state == optuna.trial.TrialState.FAIL),
        wall_s=time.time() - start,
        within_2pct_at=within,
        history=tuple(cost.history),
        timed=tuple(sorted(measured.items(), key=lambda item: item[1])),
    )
