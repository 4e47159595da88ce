"""The study's cost function: a trial's config timed once, in a study other processes may share.

Timing is injected (`measure(config) -> ms`), so the study runs the same on a GPU (workload.make_measure), under
the interpreter, or over a recorded table in tests. A config that fails to compile or run is a failed trial with its
reason, never the end of the study; a config timed before (by this process or another) is told its reading again,
not timed again. `load_sweep` reads a recorded table that stands in for measure, for replays without a GPU.
"""

from __future__ import annotations

import csv
import os
import time

import optuna

from ..config.types import KernelConfig
from . import study_trials
from .records import Measure, Options, TrialRecord, Wait, failure_reason
from .search_space import params

_PRUNED, _FAIL = optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL


def _built(wait: Wait, cfg: KernelConfig) -> bool:
    """Whether to take the compile processes' word on cfg: yes once they have built it (or failed to). If not yet,
    the timing process does not wait: measure() builds it through the JIT itself. That is mostly a study's first
    configs, while the pool's processes are still creating their CUDA contexts (on the 2×H200 host the first
    pool-built config comes 10-12 s into a study; the timing process's own compile takes ~2 s); later the pool is
    a batch ahead, except for a worker that joins a study late."""
    ready = getattr(wait, "ready", None)
    return ready is None or ready(cfg)


class Cost:
    """What the study has learnt of its configs, and the timing of one more.

    Attributes:
        measured: each config's reading (ms), the study's (a resumed or shared study keeps what was measured) and
            this process's own.
        failures: configs that failed to compile or run, with the reason: never tried again.
        history: what became of each trial this process handled, in order.
    """

    def __init__(self, study: optuna.Study, measure: Measure, options: Options, start: float) -> None:
        self.study, self.measure, self.start = study, measure, start
        self.shared = options.storage is not None  # other processes may time configs of this study meanwhile
        self.budget, self.run, self.on_trial = options.trials, options.run, options.on_trial
        self.measured: dict[KernelConfig, float] = study_trials.completed(study)
        self.failures: dict[KernelConfig, str] = {}
        self.history: list[TrialRecord] = []

    def refresh(self) -> None:
        """Takes in the readings other processes sharing the study have told meanwhile."""
        self.measured.update(study_trials.completed(self.study))

    def spent(self) -> int:
        """Configs timed against the budget: the study's, by any process (study_trials.timed_configs)."""
        return len(study_trials.timed_configs(self.study))

    def fail(self, trial: optuna.trial.Trial, cfg: KernelConfig, reason: str) -> None:
        with study_trials.unless_failed_as_stale(trial):
            trial.set_user_attr("reason", reason)
            self.study.tell(trial, state=_FAIL)
        self.history.append(TrialRecord(trial.number, cfg, None, reason))

    def prune(self, trial: optuna.trial.Trial, cfg: KernelConfig, reason: str) -> None:
        """Tells the trial pruned, untimed, with the reason: it counts against no budget."""
        trial.set_user_attr("reason", reason)
        self.study.tell(trial, state=_PRUNED)
        self.history.append(TrialRecord(trial.number, cfg, None, reason))

    def time_trial(self, trial: optuna.trial.Trial, cfg: KernelConfig, wait: Wait) -> None:
        """Tells the trial cfg's reading, timing cfg unless it has one; wait: its compile's (Options.prepare).

        The trial is pruned if other processes spent the budget or are timing cfg, and failed if cfg failed to
        compile or run."""
        if self._spent_by_others(trial, cfg):
            return
        wait_start = time.time()
        built_here = self._await_build(cfg, wait)
        waited = time.time() - wait_start
        if cfg in self.failures:
            self.fail(trial, cfg, self.failures[cfg])
            return
        if self._timed_by_another(trial, cfg):
            return
        timing = None
        if cfg not in self.measured:  # a config asked twice is timed once
            measure_s = self._time(trial, cfg)
            if measure_s is None:
                return
            # Where a trial's time went, kept in the storage for scripts/tune_timeline.py: waiting for the
            # compile processes, and measuring (which includes building the config if built_here).
            timing = {"pid": os.getpid(), "start": round(wait_start, 3), "wait_s": round(waited, 3),
                      "built_here": built_here, "measure_s": round(measure_s, 3)}  # fmt: skip
        with study_trials.unless_failed_as_stale(trial):
            if timing is not None:
                trial.set_user_attr("timing", timing)
            self.study.tell(trial, self.measured[cfg])
        self.history.append(TrialRecord(trial.number, cfg, self.measured[cfg]))
        if self.on_trial is not None:
            self.on_trial(self.spent(), self.budget, min(self.measured.values()), time.time() - self.start)

    def _spent_by_others(self, trial: optuna.trial.Trial, cfg: KernelConfig) -> bool:
        """Prunes the trial if other processes spent the study's budget while cfg waited for its turn."""
        if not self.shared or cfg in self.measured:
            return False
        self.refresh()  # another process may have timed it meanwhile
        if cfg in self.measured or self.spent() < self.budget:
            return False
        self.prune(trial, cfg, "the budget was spent by other processes")
        return True

    def _await_build(self, cfg: KernelConfig, wait: Wait) -> bool:
        """Waits for cfg's compile where the compile processes have it (a failed one goes to failures); returns
        whether measure() builds it here instead (_built)."""
        if cfg in self.measured or cfg in self.failures:
            return False
        if not _built(wait, cfg):
            return True
        if reason := wait(cfg):
            self.failures[cfg] = reason
        return False

    def _timed_by_another(self, trial: optuna.trial.Trial, cfg: KernelConfig) -> bool:
        """Claims cfg for this process (study_trials.claim); prunes the trial if another process is timing it: its
        reading will be the study's."""
        if cfg in self.measured or not self.shared or study_trials.claim(self.study, trial, cfg, self.run):
            return False
        self.refresh()
        if cfg in self.measured:
            return False
        self.prune(trial, cfg, "timed by another process")
        return True

    def _time(self, trial: optuna.trial.Trial, cfg: KernelConfig) -> float | None:
        """Times cfg into measured; returns the seconds it took, or None where it failed (the trial failed)."""
        measuring = time.time()
        try:
            self.measured[cfg] = float(self.measure(cfg))
        except Exception as exc:  # a failed compile or launch is data, never the end of the study
            self.failures[cfg] = failure_reason(exc)
            self.fail(trial, cfg, self.failures[cfg])
            return None
        return time.time() - measuring

    def time_outside_budget(self, cfg: KernelConfig, choices: dict[str, list[int]]) -> None:
        """Times cfg once, as a trial of its own beside the budget's, unless another process sharing the study has."""
        if self.shared:
            self.refresh()
            if cfg in self.measured:
                return
        try:
            self.measured[cfg] = float(self.measure(cfg))
        except Exception as exc:  # a config that no longer runs is replaced, as any failed config is never kept
            self.failures[cfg] = failure_reason(exc)
            self.history.append(TrialRecord(-1, cfg, None, self.failures[cfg]))
            return
        distributions = {dim: optuna.distributions.CategoricalDistribution(values) for dim, values in choices.items()}
        trial = optuna.trial.create_trial(params=params(cfg), distributions=distributions, value=self.measured[cfg])
        self.study.add_trial(trial)
        self.history.append(TrialRecord(-1, cfg, self.measured[cfg]))


def load_sweep(path, *, head_dim: int, causal: bool) -> dict[KernelConfig, float]:
    """{config: cost} from a scripts/sweep_configs.py CSV, cost = 1000 / TFLOP/s (lower is better, ∝ time).

    Configs that failed in the sweep are absent. Replaying such a table as `measure` lets the tuner be tested and
    compared with exhaustive search without a GPU (tests/test_tuner.py, scripts/replay_tuner.py).
    """
    table = {}
    with open(path) as handle:
        for row in csv.DictReader(handle):
            if int(row["head_dim"]) == head_dim and row["causal"] == str(causal) and row["tflops"] != "nan":
                fields = ("block_m", "block_n", "num_warps", "num_stages")
                table[KernelConfig(*(int(row[f]) for f in fields))] = 1000.0 / float(row["tflops"])
    return table
