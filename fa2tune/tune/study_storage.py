"""Optuna storages that tuning processes share, with heartbeats: a trial whose process died is failed once stale.

`open_storage(url)` gives one storage per URL and process: in memory (None), a database (sqlite:///, postgresql://,
... through SQLAlchemy) or an Optuna journal file. Optuna records heartbeats only inside Study.optimize; a tune
drives its study by ask and tell, so these storages beat for every trial their process holds themselves
(_Heartbeats), and fail a study's stale trials, as Study.optimize would, whenever a process opens the study or asks
for a trial.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

import optuna

# A trial whose process has sent no heartbeat for this long is failed (its process was killed, or its host lost),
# so it stops counting against the budget and its config can be timed again; FA2TUNE_STALE_AFTER_S overrides it. A
# live process beats every quarter of it from a thread of its own, so a trial is failed only after several beats
# are missed: a timing or a compile in the timing process takes seconds, not a minute.
STALE_AFTER_S = 60
STALE_AFTER_ENV = "FA2TUNE_STALE_AFTER_S"
STALE_REASON = "its process stopped sending heartbeats (killed, or its host lost)"
HEARTBEAT_ATTR = "fa2tune:heartbeat"  # a journal trial's last heartbeat (time.time()); RDB storages keep their own
# Two processes opening one fresh database at once both create its tables (and stamp its schema version): the
# slower one fails with one of these. Opening it again finds them there.
_CREATION_RACE = ("already exists", "unique constraint", "duplicate key", "database is locked")
_CREATION_ATTEMPTS = 8
# What Study.ask says of a storage with a heartbeat outside Study.optimize: these storages beat for every trial
# their process holds, asked or not (_Heartbeats), so it does not apply.
_ASK_WARNING = "Heartbeat of storage is supposed to be used with Study.optimize"
_storages: dict[tuple[str, int, int], object] = {}  # opened by this process: (url, pid, stale_after) -> storage


def stale_after_s() -> int:
    """STALE_AFTER_S, or FA2TUNE_STALE_AFTER_S (whole seconds, at least 2: a heartbeat goes every quarter)."""
    text = os.environ.get(STALE_AFTER_ENV)
    if text is None:
        return STALE_AFTER_S
    if not text.strip().isdigit() or int(text) < 2:
        raise ValueError(f"{STALE_AFTER_ENV} must be a whole number of seconds >= 2, got {text!r}")
    return int(text)


def _heartbeat_interval(stale_after: int) -> int:
    return max(1, stale_after // 4)


def open_storage(url: str | None):
    """An Optuna storage: None (in memory), a database URL, or a journal file (a path ending in .journal/.log).

    One per URL and process, with heartbeats: a trial of a process that dies is failed once it is stale (see
    STALE_AFTER_S), by the next process that opens the study or asks for a trial."""
    if url is None:
        return None
    key = (url, os.getpid(), stale_after_s())
    if key not in _storages:
        _storages[key] = _create(url, key[2])
    return _storages[key]


def existing_file_problem(url: str, path: Path) -> str | None:
    """Why the existing file `path` that the storage `url` names is not one open_storage keeps trials in (a log
    file, a text file named .db), or None (missing or empty: it is created). Checked before a tune, so that a file
    named by mistake fails in one line, not in a traceback from inside Optuna, nor gets trials appended to it. A
    journal's first line is an Optuna operation (a JSON object with an op_code: Optuna's reader skips lines it
    cannot parse); a database is opened and read."""
    import json

    if not path.is_file() or path.stat().st_size == 0:
        return None
    if "://" not in url:
        try:
            with open(path, encoding="utf-8") as handle:
                first = json.loads(handle.readline())
            if isinstance(first, dict) and "op_code" in first:
                return None
        except (OSError, UnicodeDecodeError, ValueError):
            pass
        return f"{path} exists and is not an Optuna journal (its first line is not an Optuna operation)"
    try:
        optuna.get_all_study_summaries(open_storage(url), include_best_trial=False)
    except Exception as exc:  # SQLAlchemy or Optuna errors, whatever the file held
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        return f"{path} exists and is not an Optuna database ({first_line})"
    return None


def _create(url: str, stale_after: int):
    import warnings

    warnings.filterwarnings("ignore", message=_ASK_WARNING)
    if "://" not in url:
        Path(url).parent.mkdir(parents=True, exist_ok=True)
        return _JournalStorage(optuna.storages.journal.JournalFileBackend(url), stale_after)
    import sqlalchemy.exc

    # SQLite: a writer waits up to a minute for another's lock (the driver's default, 5 s, fails under a few
    # processes telling trials at once).
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    for attempt in range(1, _CREATION_ATTEMPTS + 1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeat_interval's
                return _RDBStorage(url, engine, stale_after)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            if attempt == _CREATION_ATTEMPTS or not any(s in str(exc).lower() for s in _CREATION_RACE):
                raise
            time.sleep(0.05 * 2**attempt * random.uniform(0.5, 1.5))  # apart, so the next try finds them created
    raise AssertionError("unreachable")


class _Heartbeats:
    """Heartbeats for a storage driven by ask and tell: Optuna records them only inside Study.optimize.

    Every trial this process holds RUNNING (asked, or an enqueued one it popped) gets one at once and then every
    interval from a daemon thread, until it is told; a study's stale trials (RUNNING, last heartbeat older than the
    grace period) are failed with a reason when a process opens the study and before it asks for a new trial, as
    Study.optimize does before each of its trials.
    """

    def _start_heartbeats(self, stale_after: int) -> None:
        import threading

        self._interval, self._stale_after = _heartbeat_interval(stale_after), stale_after
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        self._beating: threading.Thread | None = None

    def _hold(self, trial_id: int) -> None:
        import threading

        self.record_heartbeat(trial_id)  # at once: a trial without a heartbeat is never judged stale
        with self._held_lock:
            self._held.add(trial_id)
            if self._beating is None:
                self._beating = threading.Thread(target=self._beat, name="fa2tune-heartbeat", daemon=True)
                self._beating.start()

    def _let_go(self, trial_id: int) -> None:
        with self._held_lock:
            self._held.discard(trial_id)

    def _beat(self) -> None:
        while True:
            time.sleep(self._interval)
            with self._held_lock:
                held = list(self._held)
            for trial_id in held:
                try:
                    self.record_heartbeat(trial_id)
                except (optuna.exceptions.UpdateFinishedTrialError, KeyError):
                    self._let_go(trial_id)  # told meanwhile, or failed as stale by another process
                except Exception:  # the database did not answer this time: the next beat may land
                    continue

    def fail_stale(self, study_id: int) -> int:
        """Fails the study's stale trials, each with STALE_REASON; returns how many this call failed."""
        failed = 0
        for trial_id in self._get_stale_trial_ids(study_id):
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # another process was first
                self.set_trial_user_attr(trial_id, "reason", STALE_REASON)
                failed += self.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
        return failed

    def get_heartbeat_interval(self) -> int:
        return self._interval

    def get_heartbeat_stale_trial_callback(self):
        return None

    def get_study_id_from_name(self, study_name: str) -> int:
        study_id = super().get_study_id_from_name(study_name)
        self.fail_stale(study_id)
        return study_id

    def set_trial_state_values(self, trial_id, state, values=None) -> bool:
        changed = super().set_trial_state_values(trial_id, state, values)
        if state == optuna.trial.TrialState.RUNNING:
            if changed:  # an enqueued trial this process popped
                self._hold(trial_id)
        else:
            self._let_go(trial_id)
        return changed


class _RDBStorage(_Heartbeats, optuna.storages.RDBStorage):
    """Optuna's RDB storage with its heartbeat (a table of its own, compared with the database's clock)."""

    def __init__(self, url: str, engine_kwargs: dict | None, stale_after: int) -> None:
        super().__init__(url, engine_kwargs, heartbeat_interval=_heartbeat_interval(stale_after),
                         grace_period=stale_after)  # fmt: skip
        self._start_heartbeats(stale_after)

    def _create_new_trial(self, study_id, template_trial=None):  # what ask() and enqueue_trial() reach
        self.fail_stale(study_id)
        trial = super()._create_new_trial(study_id, template_trial)
        if trial.state == optuna.trial.TrialState.RUNNING:
            self._hold(trial._trial_id)
        return trial


class _JournalStorage(_Heartbeats, optuna.storages.JournalStorage, optuna.storages._heartbeat.BaseHeartbeat):
    """Optuna's journal storage, which has no heartbeat of its own: a trial's last one is a system attribute."""

    def __init__(self, backend, stale_after: int) -> None:
        super().__init__(backend)
        self._start_heartbeats(stale_after)

    def record_heartbeat(self, trial_id: int) -> None:
        self.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        # A trial with no heartbeat yet counts from its start: one written before heartbeats existed (or by a
        # process that died before its first) would otherwise stay RUNNING, and count as being timed, for ever.
        now = time.time()
        running = self.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        return [t._trial_id for t in running if now - _last_sign_of_life(t, now) > self._stale_after]

    def create_new_trial(self, study_id, template_trial=None) -> int:
        self.fail_stale(study_id)
        trial_id = super().create_new_trial(study_id, template_trial)
        if template_trial is None or template_trial.state == optuna.trial.TrialState.RUNNING:
            self._hold(trial_id)
        return trial_id


def _last_sign_of_life(trial: optuna.trial.FrozenTrial, now: float) -> float:
    beat = trial.system_attrs.get(HEARTBEAT_ATTR)
    if beat is not None:
        return beat
    return trial.datetime_start.timestamp() if trial.datetime_start is not None else now
