"""The Optuna study that picks a kernel's config: `tune(target, measure, options)`.

One study per (GPU, kernel, head_dim, dtype, causal, variant). Its parts, one module each:

- search_space: the planner's candidates as Optuna dimensions, and the configs timed first (the planner's default
  first, so the winner is never slower than it as measured);
- strategy: TPE's ask/tell loop in batches, within the budget; a config the planner rejects is a pruned trial with
  the reason and costs no compile;
- cost: one config timed in its trial (`measure(config) -> ms` is injected, so the study runs the same on a GPU,
  under the interpreter, or over a recorded table in tests); a config that fails to compile or run is a failed
  trial with its reason; neither stops the study;
- finish: the top few measured again (rounds in alternating order), the winner verified, the incumbent kept unless
  beaten.

The records tune() takes and returns live in records.py; the names below are the tuner's API for its callers.
"""

from __future__ import annotations

import time

from . import finish, search_space, strategy
from .cost import Cost
from .finish import INCUMBENT_MARGIN
from .records import Measure, Options, Target, TrialRecord, TuneResult, study_name
from .search_space import first_configs, promising
from .study_trials import fail_abandoned, process_tag, timed_configs
from .timing import FINAL_ROUNDS

__all__ = [
    "FINAL_ROUNDS",
    "INCUMBENT_MARGIN",
    "Options",
    "Target",
    "TrialRecord",
    "TuneResult",
    "fail_abandoned",
    "first_configs",
    "process_tag",
    "promising",
    "study_name",
    "timed_configs",
    "tune",
]


def tune(target: Target, measure: Measure, options: Options | None = None) -> TuneResult:
    """Runs (or resumes, with a persistent Options.storage) the study of target and returns the winner."""
    options = options if options is not None else Options()
    start = time.time()
    space = search_space.build(target)
    study = strategy.open_study(target, options)
    cost = Cost(study, measure, options, start)
    strategy.search(study, target, space, options, cost, start)
    if options.on_timed is not None:
        options.on_timed()
    return finish.finish(study, target, space, options, cost, start)
