"""The search strategy: Optuna's TPE asks for configs, batch by batch, until the study's budget is spent.

The study starts with the configs `search_space.first_configs` names (enqueued once, whoever shares the study),
then TPE proposes. A proposal the planner rejects is a pruned trial with the reason and costs no compile; a
config that failed before fails again at once; one timed before is told its reading (TPE repeating its best makes
the search enqueue an untried config instead). With `Options.prepare` two batches are in flight: the next one
compiles (on the CPUs) while this one is timed (on the GPU); TPE's constant liar lets it be asked before this one
is told.
"""

from __future__ import annotations

import logging
import random
from collections import deque

import optuna

from ..config import planner
from ..config.types import KernelConfig
from . import study_trials
from .cost import Cost
from .records import Options, Target, TimingClock, TrialRecord, Wait
from .search_space import Space, first_configs, params

Batch = list[tuple[optuna.trial.Trial, KernelConfig]]
NOT_TIMED = "not timed: the study's timeout passed"  # a trial asked before the timeout, reached after it
REPEATS_BEFORE_EXPLORING = 5  # proposals of configs timed before, in a row, before an untried one is enqueued


def open_study(target: Target, options: Options) -> optuna.Study:
    """The study of target, created or loaded from options.storage (a resumed or shared one), TPE as its sampler."""
    optuna.logging.set_verbosity(logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=options.seed, multivariate=True, n_startup_trials=3,
                                         constant_liar=options.batch_size > 1)  # fmt: skip
    return optuna.create_study(
        study_name=target.name, storage=options.storage, sampler=sampler, direction="minimize", load_if_exists=True
    )


def search(study: optuna.Study, target: Target, space: Space, options: Options, cost: Cost, start: float) -> None:
    """Times trials of the study through cost until the budget (options.trials, by every process sharing the
    study), the space or the timeout (records.TimingClock: from the first reading, or from `start`, the study's,
    with Options.timeout_counts_builds) is spent. Ctrl-C fails the trials this process holds, then propagates."""
    _enqueue_first(study, target, space, options.trials)
    _Search(study, target, space, options, cost, start).run()


def _enqueue_first(study: optuna.Study, target: Target, space: Space, budget: int) -> None:
    # Trials other workers ran or enqueued already (enqueued ones carry their params as "fixed_params").
    tried = {cfg for t in study.trials if (cfg := study_trials.proposed(t)) is not None}
    first = first_configs(device=target.device, kernel=target.kernel, head_dim=target.head_dim, dtype=target.dtype,
                          causal=target.causal, trials=budget, space=space.candidates, default=space.default,
                          incumbent=space.incumbent)  # fmt: skip
    for cfg in first:
        if cfg not in tried:
            study.enqueue_trial(params(cfg), skip_if_exists=True)  # workers sharing a study enqueue once
            tried.add(cfg)


class _Search:
    """The ask/tell loop of one process over one study."""

    def __init__(self, study, target: Target, space: Space, options: Options, cost: Cost, start: float) -> None:
        self.study, self.target, self.space, self.options, self.cost = study, target, space, options, cost
        self.asked = 0
        self.repeats = 0
        self.rng = random.Random(options.seed)
        self.opened: list[optuna.trial.Trial] = []  # every trial this process asked: told FAIL on Ctrl-C if running
        # Batches asked of Optuna, each with the wait for its compile.
        self.in_flight: deque[tuple[Batch, Wait]] = deque()
        self.depth = 2 if options.prepare is not None else 1
        self.clock = TimingClock(options.timeout_s, start if options.timeout_counts_builds else None)

    def run(self) -> None:
        try:
            while True:
                while len(self.in_flight) < self.depth and (batch := self._ask_batch()):
                    self.in_flight.append((batch, self._launch(batch)))
                if not self.in_flight:
                    break
                batch, wait = self.in_flight.popleft()
                for trial, cfg in batch:
                    # A batch asked ahead is not timed past the timeout either; a config timed (or failed) already
                    # still gets its reading.
                    known = cfg in self.cost.measured or cfg in self.cost.failures
                    if self.clock.spent() and not known:
                        self.cost.prune(trial, cfg, NOT_TIMED)
                    else:
                        self.cost.time_trial(trial, cfg, wait)
                        if self.cost.measured or self.cost.failures:
                            self.clock.reading_in()
        except KeyboardInterrupt:
            study_trials.abandon(self.study, self.opened)
            raise

    def _planned(self, batch: Batch) -> set[KernelConfig]:
        """The configs of the batches in flight and of the batch being asked."""
        return {cfg for b, _ in self.in_flight for _, cfg in b} | {cfg for _, cfg in batch}

    def _ask_batch(self) -> Batch:
        """Asks until the batch holds batch_size configs, or the budget (counting batches in flight) is spent."""
        batch: Batch = []
        max_asks = 20 * self.options.trials + 50
        while len({cfg for _, cfg in batch}) < self.options.batch_size and self.asked < max_asks:
            if self._spent(batch):
                break
            trial = self.study.ask()
            self.asked += 1
            self.opened.append(trial)
            choices = self.space.choices.items()
            cfg = KernelConfig.from_params({dim: trial.suggest_categorical(dim, values) for dim, values in choices})
            if not self._told_at_once(trial, cfg, batch):
                batch.append((trial, cfg))  # a config already in a batch is timed once, with that batch
        return batch

    def _spent(self, batch: Batch) -> bool:
        """Whether to ask no more: the budget, the space or the time is spent."""
        timed_or_planned = study_trials.timed_configs(self.study) | self._planned(batch)
        if len(timed_or_planned) >= self.options.trials:
            return True
        if all(c in timed_or_planned or c in self.cost.failures for c in self.space.feasible):
            return True  # the whole space is timed or failed: asking again would only repeat configs
        return self.clock.spent()

    def _told_at_once(self, trial: optuna.trial.Trial, cfg: KernelConfig, batch: Batch) -> bool:
        """Tells the trial now where it needs no timing: the planner rejects cfg (pruned), cfg failed before
        (failed), or cfg was timed before (its reading again, no device time spent)."""
        t, cost = self.target, self.cost
        reason = planner.check(cfg, t.device, t.head_dim, t.dtype, t.kernel)
        if reason is None and cfg not in self.space.allowed:
            reason = "not in the search space"
        if reason is not None:
            cost.prune(trial, cfg, reason)
            return True
        if cfg in cost.failures:
            cost.fail(trial, cfg, cost.failures[cfg])
            return True
        if cfg not in cost.measured and cost.shared:  # another worker may have timed it meanwhile
            cost.refresh()
        if cfg not in cost.measured:
            return False
        self._repeated(batch)
        self.study.tell(trial, cost.measured[cfg])
        cost.history.append(TrialRecord(trial.number, cfg, cost.measured[cfg]))
        return True

    def _repeated(self, batch: Batch) -> None:
        """TPE proposed a config timed before: after a few in a row, an untried config is enqueued instead."""
        self.repeats += 1
        done = self.cost.measured.keys() | self.cost.failures.keys() | self._planned(batch)
        untried = [c for c in self.space.feasible if c not in done]
        if self.repeats >= REPEATS_BEFORE_EXPLORING and untried:
            self.study.enqueue_trial(params(self.rng.choice(untried)), skip_if_exists=True)
            self.repeats = 0

    def _launch(self, batch: Batch) -> Wait:
        """Starts compiling the batch's new configs; returns wait(config) -> its failure or None."""
        in_flight = self._planned([])
        new = list(dict.fromkeys(cfg for _, cfg in batch if cfg not in self.cost.measured and cfg not in in_flight))
        prepare = self.options.prepare
        return prepare(new) if prepare is not None and new else lambda cfg: None
