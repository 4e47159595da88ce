"""The tuner over recorded H200 timings (no GPU needed): it finds the recorded best, and failures are data."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fa2tune.config import defaults, planner
from fa2tune.config.device import known_gpu
from fa2tune.config.schedule import PERSISTENT, TWO_AN_SM
from fa2tune.config.types import KernelConfig
from fa2tune.tune import search_space, study_trials, tuner
from fa2tune.tune.cost import load_sweep

from ._scripts import load_script

SWEEP = Path(__file__).resolve().parent.parent / "docs" / "bench" / "nvidia-h200-sweep-fwd-v1.csv"


# The recorded sweep timed the Triton template only: studies over it start from that template's default, not the
# warp-specialized one the planner prefers on the H200 (it has no timing here).
_TRITON_DEFAULT = defaults.default_config(128, torch.bfloat16, device=known_gpu("h200"), warp_specialized=False)


def _recorded(head_dim: int, causal: bool) -> dict[KernelConfig, float]:
    return load_sweep(SWEEP, head_dim=head_dim, causal=causal)


def _replay(table):
    calls = []

    def measure(cfg: KernelConfig) -> float:
        calls.append(cfg)
        if cfg not in table:
            raise RuntimeError(f"no recorded timing for {cfg}")
        return table[cfg]

    return measure, calls


@pytest.mark.parametrize("head_dim, causal", [(128, False), (128, True), (64, False), (64, True)])
def test_tuner_nears_the_recorded_best_in_a_quarter_of_the_trials(head_dim, causal):
    # Start from the median config, not the planner's default (which was set from this very sweep).
    table = _recorded(head_dim, causal)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    median = sorted(table, key=table.get)[len(table) // 2]
    measure, _ = _replay(table)
    budget = len(space) // 4  # a quarter of exhaustive
    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=head_dim,
            dtype=torch.bfloat16,
            causal=causal,
            space=space,
            default=median,
        ),
        measure,
        tuner.Options(trials=budget, seed=0),
    )
    best = min(table.values())
    # Within 5 % of exhaustive at a quarter of its trials (within 2 % in 15 of 20 seeded runs: docs/TUNING.md).
    assert result.best_ms <= best * 1.05, f"{result.best} at {result.best_ms:.3f} vs recorded best {best:.3f}"
    assert result.history[0].config == median and result.best_ms <= result.default_ms
    assert result.within_2pct_at <= budget and result.median_ms >= result.best_ms


def test_rejected_and_failed_configs_are_recorded_and_never_stop_the_study():
    table = _recorded(128, False)
    measure, _ = _replay(table)  # only 46 of the 163 configs the planner accepts have a timing: the rest fail
    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=False,
            default=_TRITON_DEFAULT,
        ),
        measure,
        tuner.Options(trials=12, seed=1),
    )
    reasons = [r.reason for r in result.history if r.ms is None]
    assert result.measured >= 1 and result.best in table
    # pruned: configs that do not fit, and sampled field combinations that make no config (warpspec's rules) or are
    # outside the candidates
    pruned_reasons = ("shared memory", "registers", "warpspec", "block_m=192 needs warpspec", "not in the search space",
                      "persistent is a switch of the warpspec", "persistent=2 (two programs an SM)")  # fmt: skip
    assert result.pruned == sum(1 for r in reasons if r.startswith(pruned_reasons))
    assert result.failed == sum(1 for r in reasons if r.startswith("RuntimeError: no recorded timing"))
    assert result.pruned + result.failed > 0


def test_verification_failure_moves_to_the_next_best():
    table = _recorded(64, True)
    measure, _ = _replay(table)
    best = min(table, key=table.get)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"), kernel="fwd", head_dim=64, dtype=torch.bfloat16, causal=True, space=space
        ),
        measure,
        tuner.Options(trials=len(space), verify=lambda cfg: "wrong output" if cfg == best else None),
    )
    assert result.best != best
    assert any(r.reason == "failed verification: wrong output" for r in result.history)


def test_a_persistent_study_resumes(tmp_path):
    table = _recorded(128, True)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    measure, calls = _replay(table)
    target = tuner.Target(device=known_gpu("h200"), kernel="fwd", head_dim=128, dtype=torch.bfloat16, causal=True,
                          space=space)  # fmt: skip
    kwargs = dict(storage=storage, remeasure_top=1)
    first = tuner.tune(target, measure, tuner.Options(trials=6, **kwargs))
    n_first = len(calls)
    second = tuner.tune(target, measure, tuner.Options(trials=12, **kwargs))
    assert second.measured >= 12 and second.best_ms <= first.best_ms
    assert len(calls) - n_first <= 12  # what the first run measured is not measured again


def test_processes_of_one_run_share_its_budget_and_stop_when_it_is_spent(tmp_path):
    # Two workers of a multi-GPU run on one study (workers.run_parallel_many): the budget is theirs together, and
    # one stops before its next timing once the other has spent it. The "other worker" runs inside this one's
    # second timing, so the interleaving is fixed: this one times 2, the other the remaining 5.
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    target = tuner.Target(device=known_gpu("h200"), kernel="fwd", head_dim=128, dtype=torch.bfloat16, causal=False,
                          space=space, default=_TRITON_DEFAULT)  # fmt: skip
    kwargs = dict(storage=f"sqlite:///{tmp_path / 'tune.db'}", remeasure_top=1, trials=7)
    other_measure, other_calls = _replay(table)
    calls = []

    def measure(cfg):
        calls.append(cfg)
        if len(calls) == 2:
            tuner.tune(target, other_measure, tuner.Options(run="run-1", seed=1, **kwargs))
        return table[cfg]

    tuner.tune(target, measure, tuner.Options(run="run-1", **kwargs))
    assert (len(calls), len(other_calls)) == (2, 5)
    assert not set(calls) & set(other_calls)  # nothing timed twice
    # The budget is the study's distinct configs timed: spent for any later process, of this run or another (a
    # resumed tune); a larger one times only the difference, none of the configs timed already.
    late, late_calls = _replay(table)
    tuner.tune(target, late, tuner.Options(run="run-1", seed=2, **kwargs))
    tuner.tune(target, late, tuner.Options(run="run-2", seed=2, **kwargs))
    assert late_calls == []
    tuner.tune(target, late, tuner.Options(run="run-2", seed=2, **{**kwargs, "trials": 10}))
    assert len(late_calls) == 3 and not set(late_calls) & (set(calls) | set(other_calls))


def test_a_config_two_workers_both_timed_keeps_its_best_reading():
    # Two workers proposing one config at the same instant can both time it: the study's number for it (what a
    # finishing worker names the winner by, and reports as its ms) is the better reading, whichever came last.
    import optuna

    cfg = KernelConfig(64, 32, 4, 2)
    params = search_space.params(cfg)
    choices = {dim: optuna.distributions.CategoricalDistribution([value]) for dim, value in params.items()}
    for readings in ((1.0, 1.5), (1.5, 1.0)):
        study = optuna.create_study()
        for value in readings:
            study.add_trial(optuna.trial.create_trial(params=params, distributions=choices, value=value))
        assert study_trials.completed(study) == {cfg: 1.0}


def test_a_trial_another_process_is_still_suggesting_is_not_read_as_a_config():
    # A shared study's running trial can hold block_m and not yet block_n (the other process suggests them one
    # at a time): reading it as a KernelConfig raised TypeError and failed a worker's study.
    from types import SimpleNamespace

    assert study_trials.proposed(SimpleNamespace(params={"block_m": 64}, system_attrs={})) is None
    assert study_trials.proposed(SimpleNamespace(params={}, system_attrs={})) is None
    whole = KernelConfig(64, 32, 4, 2).to_dict()
    assert study_trials.proposed(SimpleNamespace(params=whole, system_attrs={})) == KernelConfig(64, 32, 4, 2)
    enqueued = SimpleNamespace(params={}, system_attrs={"fixed_params": whole})
    assert study_trials.proposed(enqueued) == KernelConfig(64, 32, 4, 2)


def test_batched_study_compiles_each_batch_before_timing_it():
    # The GPU tune asks for a batch, compiles it at once (prepare), then times it; compile failures are failed
    # trials and are never timed.
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    broken = set(space[::7])  # "fail to compile"
    events = []

    def prepare(configs):  # compiles at once; the tuner waits for each config through the returned callable
        assert len(configs) == len(set(configs)) <= 4
        events.append(("compile", tuple(configs)))
        return lambda cfg: "CompilationError: boom" if cfg in broken and cfg in configs else None

    def measure(cfg):
        assert any(cfg in batch for kind, batch in events if kind == "compile"), "timed before it was compiled"
        assert cfg not in broken
        events.append(("time", cfg))
        return table[cfg]

    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=False,
            space=space,
            default=_TRITON_DEFAULT,
        ),
        measure,
        tuner.Options(trials=16, seed=3, prepare=prepare, batch_size=4, remeasure_top=1),
    )
    compiled = [c for kind, batch in events if kind == "compile" for c in batch]
    assert len(compiled) == len(set(compiled))  # nothing compiled twice
    assert result.measured == 16 and result.best not in broken
    failed = [r for r in result.history if r.reason == "CompilationError: boom"]
    assert failed and result.failed == len(failed)
    assert result.best_ms == min(table[c] for c in compiled if c not in broken)


def test_a_config_the_pool_has_not_built_yet_is_timed_at_once_not_waited_for(tmp_path, capsys):
    # At a study's start the compile processes are still creating their CUDA contexts: a config they have not
    # built when its turn comes is timed at once (measure builds it through the JIT); one they have built, or
    # failed to build, is taken from them.
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    built_by_pool, waited, timed = set(space[::2]), [], []
    broken = set(space[::4])  # built by the pool, with a failure

    def prepare(configs):
        def wait(cfg):
            assert cfg in built_by_pool, "waited for a config the pool had not built"
            waited.append(cfg)
            return "CompilationError: boom" if cfg in broken else None

        wait.ready = lambda cfg: cfg in built_by_pool
        return wait

    def measure(cfg):
        timed.append(cfg)
        return table[cfg]

    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=False,
            space=space,
            default=_TRITON_DEFAULT,
        ),
        measure,
        tuner.Options(trials=12, seed=5, prepare=prepare, batch_size=4, remeasure_top=1, storage=storage),
    )
    assert result.measured == 12
    assert any(c not in built_by_pool for c in timed)  # timed without a wait
    assert not set(timed) & broken  # the pool's failures are still never timed
    assert set(waited) <= built_by_pool
    # Each timed trial keeps where its time went (scripts/tune_timeline.py reads it back), built_here included.
    import optuna

    study = optuna.load_study(study_name=result.study_name, storage=storage)
    timings = {KernelConfig.from_params(t.params): t.user_attrs["timing"] for t in study.trials
               if "timing" in t.user_attrs}  # fmt: skip
    assert set(timings) == set(timed)
    assert all(timing["built_here"] == (cfg not in built_by_pool) for cfg, timing in timings.items())
    assert all(timing["wait_s"] >= 0 and timing["measure_s"] >= 0 for timing in timings.values())
    assert sorted(timings, key=lambda cfg: timings[cfg]["start"]) == timed  # when each was turned to, in order
    # The script prints them per study, and sums them per process: this one timed all twelve.
    import os

    script = load_script("tune_timeline")
    assert script.main([storage]) == 0
    out = capsys.readouterr().out
    assert f"{result.study_name}: 12 timed trials" in out
    assert out.strip().splitlines()[-1].split()[:2] == [str(os.getpid()), "12"]
    gaps = script.gaps(script.timeline(study))  # each trial's gap since its process's previous one: all but the first
    assert len(gaps) == 11 and all(gap >= 0 for gap in gaps.values())


def test_the_next_batch_compiles_while_this_one_is_timed():
    # prepare: batch k+1 is asked and its compile started before batch k is timed; a config is timed only
    # after the wait for its own compile has returned (not the whole batch's); failures are still never timed.
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    broken = set(space[::7])
    events, finished, started = [], set(), set()

    def prepare(configs):
        number = sum(kind == "start" for kind, _ in events)
        events.append(("start", number))
        started.update(configs)

        def wait(cfg):
            events.append(("wait", number))
            if cfg in configs:
                finished.add(cfg)
            return "CompilationError: boom" if cfg in broken and cfg in configs else None

        return wait

    def measure(cfg):
        assert cfg in finished, "timed before its compile was waited for"
        events.append(("time", cfg))
        return table[cfg]

    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=False,
            space=space,
            default=_TRITON_DEFAULT,
        ),
        measure,
        tuner.Options(trials=16, seed=3, prepare=prepare, batch_size=4, remeasure_top=1),
    )
    assert events[:3] == [("start", 0), ("start", 1), ("wait", 0)]  # batch 1 compiles before batch 0 is timed
    assert events[3][0] == "time"  # the first config is timed after its own wait, not the batch's
    assert sum(kind == "start" for kind, _ in events) >= 4
    assert finished == started  # every config whose compile was started was waited for
    assert result.measured == 16 and result.best not in broken
    assert result.best_ms == min(table[c] for c in finished if c not in broken)


def test_the_default_is_timed_again_like_the_top_configs():
    # A cold first reading (clocks ramping up) must not make the default look slower than it is.
    table = _recorded(128, True)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    from fa2tune.config import planner

    h200 = known_gpu("h200")
    feasible = [c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is None]
    default = max(feasible, key=table.get)  # the slowest the planner accepts: never among the top three
    readings = []

    def measure(cfg):
        readings.append(cfg)
        first = readings.count(cfg) == 1
        return table[cfg] * (1.5 if cfg == default and first else 1.0)

    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=True,
            space=space,
            default=default,
        ),
        measure,
        tuner.Options(trials=8, seed=0),
    )
    assert readings.count(default) == 1 + tuner.FINAL_ROUNDS
    assert result.default_ms == pytest.approx(table[default])


def test_on_timed_is_called_once_between_the_trials_and_the_finish():
    # Where a tune lets its compile processes go (job.run_study, CompilePool.release): after the last trial's
    # timing and before the winner is re-timed and verified, so they exit while the finish runs.
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))[:20]
    measure, calls = _replay(table)
    events = []

    def verify(cfg):
        events.append(("verify", len(calls)))

    tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=False,
            space=space,
            default=space[0],
        ),
        measure,
        tuner.Options(trials=6, verify=verify, on_timed=lambda: events.append(("timed", len(calls)))),
    )
    (timed, at), (first_verify, _) = events[0], events[1]
    assert [e for e, _ in events].count("timed") == 1 and (timed, first_verify) == ("timed", "verify")
    assert at == 6 < len(calls)  # the six trials were timed before it; the re-timings of the best after it


def test_a_dead_process_s_trial_in_timing_stops_counting_against_the_run_s_budget(tmp_path):
    # A worker marks a trial timed_in=run (and timed_by=its pid) before timing it; if it dies there, the trial
    # stays RUNNING and the run would time one config fewer. fail_abandoned fails that process's trials only.
    import optuna

    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    study = optuna.create_study(study_name="s", storage=storage)

    def timing(run, pid, block_m):  # a trial of config (block_m, 64, 4, 2), marked as its process marks it
        study.enqueue_trial(search_space.params(KernelConfig(block_m, 64, 4, 2)))
        trial = study.ask()
        trial.set_user_attr("timed_in", run)
        trial.set_user_attr("timed_by", tuner.process_tag(pid))
        return trial

    dead, alive, other_run = timing("run-1", 111, 16), timing("run-1", 222, 32), timing("run-2", 111, 64)
    assert len(tuner.timed_configs(study)) == 3
    assert tuner.fail_abandoned(storage, "run-1", 111) == 1
    states = {t.number: t.state for t in study.get_trials()}
    assert states[dead.number] == optuna.trial.TrialState.FAIL
    assert states[alive.number] == states[other_run.number] == optuna.trial.TrialState.RUNNING
    assert len(tuner.timed_configs(study)) == 2
    assert tuner.fail_abandoned(storage, "run-1", 111) == 0  # once


def test_a_warpspec_forward_default_is_timed_beside_its_other_schedule():
    # The default's twin with `persistent` flipped comes right after it (a short tune sampling the switch on its own
    # misses the faster schedule; docs/PERF.md, "The tuner's strategy and budget"); not for Triton defaults or a
    # twin that does not fit (three stages of 128-row K/V tiles beside a persistent program's O buffer at d=128)
    h200 = known_gpu("h200")
    space = planner.candidates("fwd")
    first = lambda default, kernel="fwd": tuner.first_configs(device=h200, kernel=kernel, head_dim=128,
                                                              dtype=torch.bfloat16, causal=True, trials=10,
                                                              space=space, default=default)  # fmt: skip
    pingpong = KernelConfig(128, 128, 4, 2, warp_specialized=True, pingpong=True)
    configs = first(pingpong)
    assert configs[:2] == [pingpong, replace(pingpong, schedule=PERSISTENT)]
    assert len(configs) == len(set(configs)) == 2 + 5
    ws = KernelConfig(128, 64, 4, 3, warp_specialized=True)
    assert first(replace(ws, schedule=PERSISTENT))[1] == ws
    for default in (KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 4, 3, warp_specialized=True)):
        assert replace(default, schedule=PERSISTENT) not in first(default)
    dq = tuner.first_configs(device=h200, kernel="bwd_dq", head_dim=128, dtype=torch.bfloat16, causal=True,
                             trials=10, space=planner.candidates("bwd_dq"),
                             default=KernelConfig(128, 64, 4, 3, warp_specialized=True))  # fmt: skip
    assert dq[1] == KernelConfig(128, 64, 4, 3, warp_specialized=True, schedule=PERSISTENT)


def test_first_picks_take_turns_between_the_warpspec_kernels_and_the_triton_template():
    # Ranked together by tile size, the Triton template's 128x256 / 256x128 / 64x256 shapes crowd out the
    # warp-specialized kernel's (128, 128): a 16-trial d=64 causal N <= 1k study never timed it, and it is 13 %
    # faster than the config that study kept (docs/TUNING.md, "How close the search gets to trying everything").
    # So the two families alternate, warpspec first.
    h200 = known_gpu("h200")
    space = planner.candidates("fwd")
    feasible = [c for c in space if planner.check(c, h200, 64, torch.bfloat16, "fwd") is None]
    picks = tuner.promising(feasible, 64, "fwd", k=8)
    assert [c.warp_specialized for c in picks] == [True, False] * 4
    assert KernelConfig(128, 128, 4, 3, warp_specialized=True, schedule=PERSISTENT) in picks
    for family in (True, False):  # one config per block shape (and warpspec mode) within a family
        shapes = [(c.block_m, c.block_n, c.pingpong, c.fused_dq) for c in picks if c.warp_specialized == family]
        assert len(shapes) == len(set(shapes))
    # Where the space has no warp-specialized configs (not Hopper), the picks are the Triton ones as before.
    triton_only = [c for c in feasible if not c.warp_specialized]
    assert tuner.promising(triton_only, 64, "fwd", k=4) == [c for c in picks if not c.warp_specialized]


def test_two_programs_an_sm_is_a_shape_of_its_own_among_the_first_picks():
    # two programs an SM (one-consumer forwards) changes the schedule as ping-pong does: ranked with the
    # persistent one-consumer config of the same tiles it would never be picked beside it, and it is the d=64
    # causal N <= 1k forward's winner, 6 % ahead (docs/PERF.md, "Two programs an SM").
    h200 = known_gpu("h200")
    feasible = [c for c in planner.candidates("fwd") if planner.check(c, h200, 64, torch.bfloat16, "fwd") is None]
    picks = [c for c in tuner.promising(feasible, 64, "fwd", k=12) if c.warp_specialized]
    assert KernelConfig(64, 128, 4, 3, warp_specialized=True, schedule=TWO_AN_SM) in picks
    assert KernelConfig(64, 128, 4, 3, warp_specialized=True, schedule=PERSISTENT) in picks
    wider = [c for c in tuner.promising(feasible, 64, "fwd", k=20) if c.schedule == TWO_AN_SM]
    assert [c.block_n for c in wider] == [128, 64]


def test_the_config_a_key_runs_now_is_timed_second_and_kept_unless_beaten():
    # A short re-tune (10-16 trials) can replace a shipped config by one it never timed beside it (docs/HISTORY.md,
    # "Tuner and measurement"). So the incumbent, the config the written file holds for the key, is timed right after
    # the default, re-timed with the top few, and stays unless a config measures faster.
    table = _recorded(128, True)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    h200 = known_gpu("h200")
    feasible = [c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is None]
    ranked = sorted(feasible, key=table.get)
    early = tuner.promising(feasible, 128, "fwd", k=4)
    default = ranked[len(ranked) // 2]
    # The incumbent: a config nothing else would time early, made the fastest of all.
    incumbent = next(c for c in reversed(ranked) if c not in early and c != default)
    table = {**table, incumbent: min(table.values()) * 0.9}
    measure, calls = _replay(table)
    result = tuner.tune(
        tuner.Target(
            device=h200,
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=True,
            space=space,
            default=default,
            incumbent=incumbent,
        ),
        measure,
        tuner.Options(trials=4, seed=0),
    )
    assert calls[:2] == [default, incumbent] and calls.count(incumbent) == 1 + tuner.FINAL_ROUNDS
    assert result.best == incumbent and result.incumbent_ms == pytest.approx(table[incumbent])
    # A config the planner rejects today (its rules changed since the entry was written) is not timed.
    rejected = next(c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is not None)
    measure, calls = _replay(table)
    result = tuner.tune(
        tuner.Target(
            device=h200,
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=True,
            space=space,
            default=default,
            incumbent=rejected,
        ),
        measure,
        tuner.Options(trials=4, seed=0),
    )
    assert rejected not in calls and result.incumbent is None and result.incumbent_ms is None
    # Beaten within the noise (INCUMBENT_MARGIN) the incumbent stays; beaten by more it is replaced. The challenger:
    # the default (always timed), made the fastest of all.
    fastest = min(table.values()) * 0.8
    for ratio, kept in ((1 + tuner.INCUMBENT_MARGIN / 2, True), (1 + 2 * tuner.INCUMBENT_MARGIN, False)):
        measure, calls = _replay({**table, default: fastest, incumbent: fastest * ratio})
        result = tuner.tune(
            tuner.Target(
                device=h200,
                kernel="fwd",
                head_dim=128,
                dtype=torch.bfloat16,
                causal=True,
                space=space,
                default=default,
                incumbent=incumbent,
            ),
            measure,
            tuner.Options(trials=4, seed=0),
        )
        assert result.best == (incumbent if kept else default), ratio
    # ... and kept only if it verifies: then the fastest that does wins
    measure, calls = _replay({**table, default: fastest, incumbent: fastest * (1 + tuner.INCUMBENT_MARGIN / 2)})
    result = tuner.tune(
        tuner.Target(
            device=h200,
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=True,
            space=space,
            default=default,
            incumbent=incumbent,
        ),
        measure,
        tuner.Options(trials=4, seed=0, verify=lambda cfg: "wrong output" if cfg == incumbent else None),
    )
    assert result.best == default


def test_the_winner_is_ranked_by_its_finish_readings_not_a_flattering_first():
    # On the H200 the first config a process times reads 3-8 % faster than when timed second, whichever it is
    # (docs/PERF.md, "How it is measured"), and the default is timed first: its first reading must not decide. Here the
    # default's first reading is 10 % fast, its true time 5 % behind a challenger's.
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    h200 = known_gpu("h200")
    feasible = sorted((c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is None), key=table.get)
    challenger, default = feasible[0], feasible[len(feasible) // 2]
    table = {**table, default: table[challenger] * 1.05}
    replay, calls = _replay(table)

    def measure(cfg):
        first_call = not calls
        return replay(cfg) * (0.9 if first_call else 1.0)

    result = tuner.tune(
        tuner.Target(
            device=h200, kernel="fwd", head_dim=128, dtype=torch.bfloat16, causal=False, space=space, default=default
        ),
        measure,
        tuner.Options(trials=len(space), seed=0),
    )
    assert calls[0] == default and calls.count(default) == 1 + tuner.FINAL_ROUNDS  # first, then with the best
    assert result.best == challenger and result.best_ms == pytest.approx(table[challenger])


def test_a_drift_through_the_finish_does_not_decide_the_winner():
    # On an H100 a config re-timed last in the finish read 11 % above its search reading (finish.FINAL_ROUNDS). Here
    # the incumbent is the fastest config by 2 %, but its search reading was a cold one, so the finish re-times it
    # after the top three; and each reading of the finish is 3 % slower than the one before. One re-timing in that
    # order would replace it by the default; the rounds in alternating order keep it.
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    h200 = known_gpu("h200")
    feasible = sorted((c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is None), key=table.get)
    default, incumbent = feasible[0], feasible[-1]
    table = {**table, incumbent: table[default] * 0.98}
    timed, finish, readings = [], [], {}

    def measure(cfg):
        if cfg in timed or finish:  # the search times a config once: a second reading is the finish's
            finish.append(cfg)
        cold = cfg == incumbent and not finish
        timed.append(cfg)
        reading = table[cfg] * (10.0 if cold else 1 + 0.03 * len(finish))
        if finish:
            readings.setdefault(cfg, []).append(reading)
        return reading

    target = tuner.Target(device=h200, kernel="fwd", head_dim=128, dtype=torch.bfloat16, causal=False, space=space,
                          default=default, incumbent=incumbent)  # fmt: skip
    result = tuner.tune(
        target,
        measure,
        tuner.Options(trials=8, seed=0),
    )
    assert result.best == incumbent and result.default_ms > result.incumbent_ms
    mean = lambda cfg: sum(readings[cfg]) / len(readings[cfg])
    assert (result.incumbent_ms, result.default_ms) == pytest.approx((mean(incumbent), mean(default)))
    assert all(len(values) == tuner.FINAL_ROUNDS for values in readings.values())
    n = len(finish) // tuner.FINAL_ROUNDS  # readings a round: the incumbent last of the first, first of the second
    assert finish[n - 1] == incumbent and finish[n : 2 * n] == finish[:n][::-1]
    # a kept incumbent is named beside the fastest other config the finish timed, not a search reading
    assert result.incumbent_note.startswith("kept") and f"{mean(finish[0]):.3f} ms" in result.incumbent_note


def test_an_incumbent_that_fails_to_run_in_the_finish_is_replaced_and_the_note_says_so():
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    h200 = known_gpu("h200")
    feasible = sorted((c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is None), key=table.get)
    default, incumbent = feasible[1], feasible[0]  # the incumbent the fastest: in the finish's top three
    replay, calls = _replay(table)

    def measure(cfg):
        if cfg == incumbent and calls.count(incumbent) == 2:  # after its search reading and the finish's first round
            raise RuntimeError("an illegal memory access was encountered")
        return replay(cfg)

    target = tuner.Target(device=h200, kernel="fwd", head_dim=128, dtype=torch.bfloat16, causal=False, space=space,
                          default=default, incumbent=incumbent)  # fmt: skip
    result = tuner.tune(target, measure, tuner.Options(trials=6, seed=0))
    assert result.best != incumbent and calls.count(incumbent) == 2  # one good finish reading does not keep it
    assert "which failed to run in the finish (RuntimeError: an illegal memory access" in result.incumbent_note
    assert any(r.config == incumbent and "failed to run in the finish" in (r.reason or "") for r in result.history)


def test_the_incumbent_is_timed_whatever_the_budget_and_the_note_says_what_became_of_it():
    # A 1-trial re-tune timed only the default and replaced a stored config 4x faster by it, never timed beside it.
    table = _recorded(128, True)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    h200 = known_gpu("h200")
    feasible = sorted((c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is None), key=table.get)
    default, stored = feasible[len(feasible) // 2], feasible[-1]

    def study(table, incumbent=stored, verify=None, **origin):
        measure, calls = _replay(table)
        result = tuner.tune(
            tuner.Target(
                device=h200,
                kernel="fwd",
                head_dim=128,
                dtype=torch.bfloat16,
                causal=True,
                space=space,
                default=default,
                incumbent=incumbent,
                **origin,
            ),
            measure,
            tuner.Options(trials=1, seed=0, verify=verify),
        )
        return result, calls

    fast = {**table, stored: table[default] / 4}
    result, calls = study(fast)
    assert calls[0] == default and stored in calls and result.best == stored
    assert result.incumbent_note.startswith(f"kept the stored config {stored.label()} ({fast[stored]:.3f} ms")
    # Beaten, it is replaced; and the note says so, with both readings.
    result, _ = study({**table, stored: table[default] * 2})
    assert result.best == default
    assert result.incumbent_note == (f"replaced the stored config {stored.label()} ({2 * table[default]:.3f} ms) "
                                     f"by {default.label()} ({table[default]:.3f} ms)")  # fmt: skip
    # A stored config that no longer runs, verifies or fits is replaced, however fast it was.
    result, _ = study({cfg: ms for cfg, ms in fast.items() if cfg != stored})
    assert result.best == default and "which failed to run (RuntimeError: no recorded timing" in result.incumbent_note
    result, _ = study(fast, verify=lambda cfg: "wrong output" if cfg == stored else None)
    assert result.best == default and "which failed verification (wrong output)" in result.incumbent_note
    rejected = next(c for c in table if planner.check(c, h200, 128, torch.bfloat16, "fwd") is not None)
    result, calls = study({**fast, rejected: 0.001}, incumbent=rejected)
    assert rejected not in calls and result.best == default
    assert f"replaced the stored config {rejected.label()}, which is no longer a candidate (" in result.incumbent_note
    assert study(table, incumbent=None)[0].incumbent_note is None  # nothing stored: nothing to say
    # An incumbent the target file does not hold (what calls read from another file, or another GPU's) is named so.
    origin = "the config calls read now (from /x/nvidia-h200.yaml (tuned on NVIDIA H200, the same chip))"
    result, _ = study({**table, stored: table[default] * 2}, incumbent_origin=origin)
    assert result.incumbent_note.startswith(f"replaced {origin} {stored.label()} (")


def test_a_timeout_shorter_than_the_first_timing_still_times_one_config():
    # A study whose timeout passes before its first ask still times one config, rather than timing nothing and
    # raising "no config could be measured".
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    measure, calls = _replay(table)
    result = tuner.tune(
        tuner.Target(
            device=known_gpu("h200"),
            kernel="fwd",
            head_dim=128,
            dtype=torch.bfloat16,
            causal=False,
            space=space,
            default=_TRITON_DEFAULT,
        ),
        measure,
        tuner.Options(trials=8, timeout_s=0.0),
    )
    assert result.best == _TRITON_DEFAULT and calls[0] == _TRITON_DEFAULT and result.measured == 1


def test_batches_asked_ahead_are_not_timed_past_the_timeout(monkeypatch):
    # Two batches of 8 are asked before any is timed (one compiles while the other is timed); each timing takes 4 s
    # of a clock the test moves. With a 10 s timeout, counted from the first reading (in at 4 s), the study times
    # four configs (starting at 0, 4, 8 and 12 s) and tells the rest of its batches pruned, untimed, with the reason.
    from fa2tune.tune import records, strategy

    clock = [1000.0]
    monkeypatch.setattr(records.time, "time", lambda: clock[0])  # the time module: the tuner's clock too
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    replay, _ = _replay(table)

    def measure(cfg):
        clock[0] += 4.0
        return replay(cfg)

    target = tuner.Target(device=known_gpu("h200"), kernel="fwd", head_dim=128, dtype=torch.bfloat16, causal=False,
                          space=space, default=_TRITON_DEFAULT)  # fmt: skip
    options = tuner.Options(trials=40, timeout_s=10.0, batch_size=8, remeasure_top=1,
                            prepare=lambda configs: lambda cfg: None)  # fmt: skip
    result = tuner.tune(target, measure, options)
    assert result.measured == 4
    untimed = [r for r in result.history if r.ms is None and r.reason == strategy.NOT_TIMED]
    assert len(untimed) == 16 - 4
    # A batch may repeat a config timed before the timeout (TPE proposes its best again): that trial gets its
    # reading, never "not timed". A later cut, other seeds, so that batches repeat timed configs.
    for seed in (2, 3):
        result = tuner.tune(target, measure, replace(options, timeout_s=60.0, seed=seed))
        timed = {r.config for r in result.history if r.ms is not None}
        assert timed and not timed & {r.config for r in result.history if r.reason == strategy.NOT_TIMED}


def test_the_timeout_counts_from_the_first_reading_not_from_the_first_builds(monkeypatch):
    # A lone study's first batch builds for 30 s (warp-specialized kernels at a head dim the cache has not seen)
    # before anything can be timed. Counted from the study's start, a 10 s timeout left it one config; counted from
    # its first reading it times configs for 10 s whatever the builds took.
    from fa2tune.tune import records

    clock = [1000.0]
    monkeypatch.setattr(records.time, "time", lambda: clock[0])
    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    replay, _ = _replay(table)
    built = set()

    def measure(cfg):
        clock[0] += 4.0
        return replay(cfg)

    def prepare(configs):
        def wait(cfg):
            if not built:  # the first build of the study: the only slow one
                clock[0] += 30.0
            built.add(cfg)
            return None

        return wait

    target = tuner.Target(device=known_gpu("h200"), kernel="fwd", head_dim=128, dtype=torch.bfloat16, causal=False,
                          space=space, default=_TRITON_DEFAULT)  # fmt: skip
    options = tuner.Options(trials=40, timeout_s=10.0, batch_size=8, remeasure_top=1, prepare=prepare)
    result = tuner.tune(target, measure, options)
    assert built and result.measured == 4  # read at 34 s, then timings starting at 34, 38 and 42 s
    # A share of a run's wall time (a tune without --timeout) counts the builds: past it at the first reading
    built.clear()
    result = tuner.tune(target, measure, replace(options, timeout_counts_builds=True))
    assert result.measured == 1


def test_an_interrupted_study_leaves_no_trial_running_in_its_storage(tmp_path):
    # Ctrl-C during a timing left that trial RUNNING in the storage for good.
    import optuna

    table = _recorded(128, False)
    space = sorted(table, key=lambda c: tuple(c.to_dict().values()))
    replay, calls = _replay(table)

    def measure(cfg):
        if len(calls) == 2:
            raise KeyboardInterrupt
        return replay(cfg)

    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    with pytest.raises(KeyboardInterrupt):
        tuner.tune(
            tuner.Target(
                device=known_gpu("h200"),
                kernel="fwd",
                head_dim=128,
                dtype=torch.bfloat16,
                causal=False,
                space=space,
                default=_TRITON_DEFAULT,
            ),
            measure,
            tuner.Options(trials=6, storage=storage),
        )
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()
    states = [t.state for t in trials]
    assert optuna.trial.TrialState.RUNNING not in states and states.count(optuna.trial.TrialState.COMPLETE) == 2
    assert [t.user_attrs.get("reason") for t in trials if t.state == optuna.trial.TrialState.FAIL] == ["interrupted"]


def test_final_readings_alternate_the_order_and_leave_out_a_finalist_that_fails_once():
    from fa2tune.tune.timing import final_readings

    order, failures = [], {"c": 2}  # "c" fails on its second reading

    def read(name):
        order.append(name)
        if failures.get(name) == order.count(name):
            raise RuntimeError("launch failed")
        return len(order)

    readings = final_readings(["a", "b", "c"], read, rounds=3)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b"]  # "c" is not read again once it failed
    assert readings == {"a": [1, 6, 7], "b": [2, 5, 8]}
