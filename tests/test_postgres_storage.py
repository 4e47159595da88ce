"""Tuning on several hosts through one PostgreSQL database (docs/TUNING.md, "Several hosts"): real `fa2tune tune`
processes on one study, one of them killed mid-run and resumed.

Needs a server: FA2TUNE_TEST_POSTGRES_URL names a database whose user may create databases (each test works in a
database of its own). `.ci/run` starts one on localhost and sets it; without it these tests are skipped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pytest

from fa2tune.config import store
from fa2tune.config.types import KernelConfig
from fa2tune.tune import study_storage, tuner

URL_ENV = "FA2TUNE_TEST_POSTGRES_URL"
STALE_AFTER_S = 3  # the children's FA2TUNE_STALE_AFTER_S: a killed worker's trial is failed this soon
STUDY = "cpu-interpreter/fwd/d16/bfloat16/full"
TRIALS = 4  # of the 5 configs the interpreter's space holds (job._space)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not os.environ.get(URL_ENV), reason=f"no PostgreSQL server: {URL_ENV} is not set"),
]


@pytest.fixture
def database():
    """A database of its own on the server, dropped afterwards; its URL."""
    import sqlalchemy

    server = sqlalchemy.engine.make_url(os.environ[URL_ENV])
    name = f"fa2tune_test_{uuid.uuid4().hex[:12]}"
    engine = sqlalchemy.create_engine(server, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        engine.dispose()


def _tune(url: str, config_dir, log) -> subprocess.Popen:
    """`fa2tune tune` as a host runs it: its own config dir, the shared database."""
    command = [sys.executable, "-m", "fa2tune", "tune", "--device", "cpu", "--head-dim", "16", "--kernel", "fwd",
               "--causal", "no", "--trials", str(TRIALS), "--storage", url,
               "--config-dir", str(config_dir)]  # fmt: skip
    environment = {**os.environ, study_storage.STALE_AFTER_ENV: str(STALE_AFTER_S)}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)


def _trials(url: str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials, read as Optuna reads them (no heartbeats: reading fails no stale trial); [] before it
    exists."""
    import sqlalchemy.exc

    try:
        return optuna.load_study(study_name=STUDY, storage=url).trials
    except (KeyError, sqlalchemy.exc.SQLAlchemyError):  # not created yet, or its tables being created now
        return []


def _timing(url: str, pid: int) -> list[int]:
    running = optuna.trial.TrialState.RUNNING
    tag = tuner.process_tag(pid)
    return [t.number for t in _trials(url) if t.state == running and t.user_attrs.get("timed_by") == tag]


def _kill_the_first_timing(url: str, workers: dict[str, subprocess.Popen]) -> tuple[str, int]:
    """SIGKILLs the first of the workers seen timing a config; returns its name and that trial's number. The worker
    is stopped first and its trial read again: one seen timing may have told its trial (pruned, complete) before the
    kill lands, and a trial that ended so is not the one this test kills (seen once in three CI runs)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(worker.poll() is None for worker in workers.values()):
        for name, worker in workers.items():
            if timing := _timing(url, worker.pid):
                worker.send_signal(signal.SIGSTOP)  # frozen: its trial's state cannot change under the check
                if timing[0] in _timing(url, worker.pid):
                    worker.send_signal(signal.SIGKILL)
                    worker.wait(timeout=60)
                    return name, timing[0]
                worker.send_signal(signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("the workers ended, or never timed a config, before one could be killed")


def _said_timed(log_path) -> dict[KernelConfig, float]:
    """What a worker printed it timed ("fwd causal=False timed: 64x64 w4 s1 51.416, ..."): config -> ms."""
    timed = {}
    for line in log_path.read_text().splitlines():
        if " timed: " in line:
            for block_m, block_n, warps, stages, ms in re.findall(r"(\d+)x(\d+) w(\d+) s(\d+) (\d+\.\d+)", line):
                timed[KernelConfig(int(block_m), int(block_n), int(warps), int(stages))] = float(ms)
    return timed


@pytest.mark.slow
def test_workers_on_one_database_lose_nothing_when_one_is_killed_and_resumed(database, tmp_path):
    # Two hosts start on a fresh database at once (both create its tables); the first worker seen timing a config
    # is killed there; the other finishes; the killed one's host runs the same command again once its trial is
    # stale.
    hosts = {name: tmp_path / name for name in ("a", "b")}
    logs = {name: tmp_path / f"{name}.log" for name in hosts}
    with open(logs["a"], "w") as log_a, open(logs["b"], "w") as log_b:
        workers = {"a": _tune(database, hosts["a"], log_a), "b": _tune(database, hosts["b"], log_b)}
        dead, killed = _kill_the_first_timing(database, workers)
        killed_at = time.monotonic()
        [alive] = set(workers) - {dead}
        assert workers[alive].wait(timeout=300) == 0, logs[alive].read_text()
    assert workers[dead].returncode == -signal.SIGKILL
    time.sleep(max(0.0, killed_at + STALE_AFTER_S + 1 - time.monotonic()))
    logs["resumed"] = tmp_path / "resumed.log"
    with open(logs["resumed"], "w") as log:
        resumed = _tune(database, hosts[dead], log)
        assert resumed.wait(timeout=300) == 0, logs["resumed"].read_text()

    trials = _trials(database)
    # The killed worker's trial is failed (its heartbeat went stale), not RUNNING forever; none is left RUNNING.
    assert trials[killed].state == optuna.trial.TrialState.FAIL
    assert trials[killed].user_attrs["reason"] == study_storage.STALE_REASON
    assert [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING] == []
    # The budget, the study's distinct configs, each timed once by one of the hosts. The killed trial is not counted:
    # a kill that lands after its timing is stored and before its result is told leaves the timing on a failed
    # trial, whose config is then timed again.
    complete = {KernelConfig.from_params(t.params): t.value for t in trials
                if t.state == optuna.trial.TrialState.COMPLETE}  # fmt: skip
    timed = [KernelConfig.from_params(t.params) for t in trials if "timing" in t.user_attrs and t.number != killed]
    assert len(timed) == len(set(timed)) == TRIALS
    # Every trial a finished worker timed is in the database, with the reading it printed. The resumed host may find
    # the budget spent: the alive one, slowed by a loaded machine, can time the whole budget before the killed trial
    # goes stale (seen in a CI run: 4 of 4 timed by it, none left), so only the two together must have timed some.
    said = {name: _said_timed(logs[name]) for name in (alive, "resumed")}
    assert said[alive] or said["resumed"]
    for timings in said.values():
        assert all(complete.get(cfg) == pytest.approx(ms, abs=1e-3) for cfg, ms in timings.items())
    # Each host wrote its entry into its own file (per GPU model: <config-dir>/<gpu slug>.yaml), a config the
    # study timed.
    for host in hosts.values():
        [entry] = store.read_file(host / "cpu-interpreter.yaml")[1]
        assert entry.key.head_dim == 16 and entry.key.kernel == "fwd" and not entry.key.causal
        assert entry.config in complete
