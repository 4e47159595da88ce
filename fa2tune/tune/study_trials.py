"""A study's trials as configs, in a study that processes on several GPUs and hosts may share.

Nothing locks a shared study between ask and tell, so processes coordinate through what the trials say: a process
marks a trial it is about to time (`claim`: timed_by, timed_in), `timed_configs` is the budget every process
counts, and the trials of a process that died are failed (`fail_abandoned`, or as stale by the storage's
heartbeat: storage.py) so they stop counting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

import optuna

from ..config.types import KernelConfig
from .search_space import REQUIRED

_log = logging.getLogger(__name__)


def completed(study: optuna.Study) -> dict[KernelConfig, float]:
    """Each config the study timed, with its best reading: a study stored before processes claimed a config before
    timing it (claim) can hold two readings of one, and the winner's ms is its best reading."""
    best: dict[KernelConfig, float] = {}
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        cfg = KernelConfig.from_params(trial.params)
        best[cfg] = min(trial.value, best.get(cfg, trial.value))
    return best


def proposed(trial: optuna.trial.FrozenTrial) -> KernelConfig | None:
    """The config a trial stands for: its parameters, or those it was enqueued with; None while another process
    is still suggesting them one by one (a shared study's running trial can hold block_m and not yet block_n)."""
    params = trial.params or trial.system_attrs.get("fixed_params", {})
    return KernelConfig.from_params(params) if all(dim in params for dim in REQUIRED) else None


def timed_configs(study: optuna.Study, but: int | None = None) -> set[KernelConfig]:
    """The distinct configs the study has timed (a COMPLETE trial) or is timing (a RUNNING trial its process marked
    timed_by before timing it), by any process; but: leave out the trial of this number. This is what `trials`
    counts: a config is timed once and counted once, whoever proposes it again. A process that dies while timing
    leaves its trial RUNNING until it is failed (`fail_abandoned`, or as stale by the storage's heartbeat,
    storage._Heartbeats): then it stops counting, and its config can be timed again."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
    return {cfg for t in study.get_trials(deepcopy=False, states=states)
            if t.number != but and (t.state == optuna.trial.TrialState.COMPLETE or "timed_by" in t.user_attrs)
            and (cfg := proposed(t)) is not None}  # fmt: skip


def process_tag(pid: int | None = None) -> str:
    """Who times a trial (its timed_by): host and process id, as processes of several hosts share one study and
    containers on different hosts often run with the same pid."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}"


def claim(study: optuna.Study, trial: optuna.trial.Trial, cfg: KernelConfig, run: str | None) -> bool:
    """Marks the trial as timing cfg (timed_by=process_tag(), timed_in=run), then whether it is this process's to time:
    no other trial holds cfg timed or marked. Of processes that mark one config at once at most one goes on — each
    looks after marking, so the later ones see the first one's mark (both may see each other's and leave it: the
    config is then timed when it is proposed again); nothing locks a shared study between ask and tell."""
    if run is not None:
        trial.set_user_attr("timed_in", run)  # for fail_abandoned, if this process dies
    trial.set_user_attr("timed_by", process_tag())
    return cfg not in timed_configs(study, but=trial.number)


@contextlib.contextmanager
def unless_failed_as_stale(trial: optuna.trial.Trial):
    """Writing a trial another process has failed as stale (this one's heartbeat was late: a starved thread, hosts'
    clocks apart) raises UpdateFinishedTrialError: the reading stays this process's own (its ranking has it) and
    the tune goes on, where it would have ended with a traceback."""
    try:
        yield
    except optuna.exceptions.UpdateFinishedTrialError:
        _log.warning("trial %d was failed as stale by another process; its reading is kept here only", trial.number)


def abandon(study: optuna.Study, trials: list[optuna.trial.Trial]) -> None:
    """Tells FAIL each of `trials` not told yet (a tune interrupted by Ctrl-C), so none stays RUNNING in a storage
    that outlives the process (and counts as a config being timed)."""
    for trial in trials:
        with contextlib.suppress(Exception):  # told already (set_user_attr refuses a finished trial), or no storage
            trial.set_user_attr("reason", "interrupted")
            study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


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
