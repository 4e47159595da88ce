"""Tuning jobs: one worker process per device on one shared Optuna journal file (run here under the interpreter)."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import optuna
import pytest
import torch

from fa2tune.config import store
from fa2tune.config.types import KernelConfig, Mask
from fa2tune.tune import job, processes, search_space, study_storage, study_trials, tuner, workers


@pytest.fixture
def interpreter_only():
    if torch.cuda.is_available():
        pytest.skip("runs the workers under Triton's interpreter; on a GPU machine use `fa2tune tune --device all`")


def _study(path, spec):
    """The study as a plain Optuna storage reads it (no heartbeats: reading it here fails no stale trial)."""
    path, journal = str(path), optuna.storages.journal.JournalFileBackend
    storage = path if "://" in path else optuna.storages.JournalStorage(journal(path))
    name = f"cpu-interpreter/{spec.kernel}/d{spec.head_dim}/bfloat16/{'causal' if spec.causal else 'full'}"
    return optuna.load_study(study_name=name, storage=storage)


def _timed(study) -> list[KernelConfig]:
    """The configs the study's trials timed (each timing keeps where its time went), once per timing."""
    return [KernelConfig.from_params(t.params) for t in study.trials if "timing" in t.user_attrs]


def test_two_workers_share_one_journal_and_lose_nothing(tmp_path, interpreter_only):
    journal = tmp_path / "studies" / "tune.journal"
    spec = job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=True, trials=4, storage=str(journal))
    result, entry, codes = workers.run_parallel(spec, ["cpu", "cpu"])
    assert codes == {"0:cpu": 0, "1:cpu": 0}
    # Four configs between the two workers (the budget is theirs together), none timed twice: a config another
    # worker timed, or is timing (even one proposed to both at the same instant), is not timed again.
    timed = _timed(_study(journal, spec))
    assert len(timed) == len(set(timed)) == 4
    assert result.measured == 4 and entry.config in timed
    # the entry records the winner's finish reading (the re-timing the ranking uses: tuner.tune), not its first
    assert entry.ms == round(result.best_ms, 4) and result.best == entry.config
    path = job.write(entry, "cpu", tmp_path / "configs")
    assert store.read_file(path)[1] == [entry]


def test_a_dead_worker_does_not_stop_the_others(tmp_path, interpreter_only):
    journal = tmp_path / "tune.journal"
    spec = job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=False, trials=4, storage=str(journal))
    said = []
    result, entry, codes = workers.run_parallel(spec, ["cpu", "cuda:7"], report=said.append)
    assert codes["0:cpu"] == 0 and codes["1:cuda:7"] != 0
    assert said == [f"worker 1 on cuda:7 died (exit code {codes['1:cuda:7']}); the others carry on with its work"]
    # The dead worker's share of the study went to the live one: the whole budget was timed.
    assert result.measured == 4 and entry.config == result.best


def test_a_dead_worker_s_shares_of_several_studies_are_timed_by_another(tmp_path, interpreter_only):
    journal = str(tmp_path / "tune.journal")
    specs = [job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=c, trials=2, storage=journal)
             for c in (False, True)]  # fmt: skip
    done = workers.run_parallel_many(specs, ["cpu", "cuda:7"], report=lambda line: None)
    assert [entry.key.causal for _, entry, _ in done] == [False, True]
    assert all(result.measured == 2 for result, _, _ in done)  # each study's full budget, both shares


def test_parallel_needs_a_shared_storage():
    spec = job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=False)
    with pytest.raises(ValueError, match="needs a shared storage"):
        workers.run_parallel(spec, ["cpu", "cpu"])


def test_workers_live_across_studies(tmp_path, interpreter_only):
    # `fa2tune tune --device a,b` with several studies: the same two workers serve every study.
    journal = str(tmp_path / "tune.journal")
    specs = [job.StudySpec(kernel=k, head_dim=16, dtype="bf16", causal=c, trials=2, storage=journal)
             for k, c in (("fwd", False), ("bwd_dq", True))]  # fmt: skip
    done = workers.run_parallel_many(specs, ["cpu", "cpu"])
    assert [entry.key.kernel for _, entry, _ in done] == ["fwd", "bwd_dq"]
    assert all(codes == {"0:cpu": 0, "1:cpu": 0} for _, _, codes in done)
    assert all(result.measured >= 2 and result.within_2pct_at is not None for result, _, _ in done)


def test_an_impossible_timing_is_refused_before_it_is_written():
    # The bug this guards against: do_bench timed cuda:0 while the kernels ran on cuda:1 (~13,000 "TFLOP/s").
    from fa2tune.config import device
    from fa2tune.config.types import KernelConfig
    from fa2tune.tune import tuner

    h200 = device.known_gpu("h200")
    assert 1000 < device.tflops_ceiling(h200) < 2000  # above the 989 datasheet peak, far below a broken timing
    assert device.tflops_ceiling(device.INTERPRETER) is None
    result = tuner.TuneResult("nvidia-h200/fwd/d64/bfloat16/full", KernelConfig(128, 64, 8, 3), 0.2161,
                              KernelConfig(128, 64, 8, 3), 0.2161, 0.3, 16, 0, 0, 10.0, 1)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"13,357 TFLOP/s, above the 1,406 .* Nothing was written"):
        job._check_plausible(result, lambda ms: 13357.2 if ms else None, h200)
    job._check_plausible(result, lambda ms: 427.0, h200)  # a real timing passes


def test_workers_report_each_timed_trial_for_the_progress_line(tmp_path, interpreter_only):
    journal = str(tmp_path / "tune.journal")
    spec = job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=False, trials=4, storage=journal)
    seen = []
    workers.run_parallel_many([spec], ["cpu", "cpu"], progress=lambda *message: seen.append(message))
    assert {worker for _, worker, _ in seen} == {0, 1}
    for index, _, (timed, trials, best_ms, elapsed) in seen:
        assert index == 0 and 1 <= timed and trials == 4 and best_ms > 0 and elapsed >= 0
    # The count is the study's, both workers' trials together: it reaches the budget.
    assert max(state[0] for _, _, state in seen) >= 4


def test_every_worker_gets_every_study_with_the_whole_budget_shared():
    specs = [job.StudySpec(kernel=k, head_dim=64, dtype="bf16", causal=c, trials=40, storage="j.journal")
             for k in ("fwd", "bwd_dq") for c in (False, True)][:3]  # fmt: skip
    plans = workers.deal(specs, 2, run="r1")
    # Every study's whole budget, shared as run r1 (tuner.tune stops all of the run's workers once it is spent),
    # starting at different studies (no two workers open on one study's first compile), with different seeds so
    # the workers' first proposals differ.
    assert [[(kind, index, spec.trials, spec.run) for kind, index, spec in plan] for plan in plans] == [
        [("trials", 0, 40, "r1"), ("trials", 1, 40, "r1"), ("trials", 2, 40, "r1")],
        [("trials", 1, 40, "r1"), ("trials", 2, 40, "r1"), ("trials", 0, 40, "r1")],
    ]
    assert all(plans[0][j][2].seed != plans[1][(j + 2) % 3][2].seed for j in range(3))
    # More workers than studies still start spread out.
    plans = workers.deal(specs[:2], 3, run="r2")
    assert [[index for _, index, _ in plan] for plan in plans] == [[0, 1], [0, 1], [1, 0]]
    # One GPU: every study, in order.
    assert [index for _, index, _ in workers.deal(specs, 1, run="r3")[0]] == [0, 1, 2]


class _RecordingPool:
    def __init__(self):
        self.started = []

    def start(self, kernel, head_dim, dtype, causal, configs, **kwargs):
        self.started.append((kernel, head_dim, list(configs)))
        return lambda cfg: None


def test_the_next_study_s_first_configs_compile_during_this_one():
    # A tune of several studies on one GPU: while a study is timed, the configs the next one times first are
    # already compiling, so the next study does not start with a compile round of its own.
    from fa2tune.config import device, planner
    from fa2tune.tune import tuner

    h200 = device.known_gpu("h200")
    spec = job.StudySpec(kernel="bwd_dq", head_dim=64, dtype="bf16", causal=True, trials=40)
    pool = _RecordingPool()
    job._prefetch(spec, "cuda:0", h200, pool)
    [(kernel, head_dim, configs)] = pool.started
    space = [c for c, _ in planner.plan(h200, 64, torch.bfloat16, "bwd_dq").accepted]
    assert (kernel, head_dim) == ("bwd_dq", 64) and len(configs) == 1 + 40 // 2
    # ... and they are what that study's tune enqueues first: the first trials it times, in order.
    timed = []

    def measure(cfg):
        timed.append(cfg)
        return 1.0 + cfg.block_m / 1000

    tuner.tune(
        tuner.Target(device=h200, kernel="bwd_dq", head_dim=64, dtype=torch.bfloat16, causal=True, space=space),
        measure,
        tuner.Options(trials=40, remeasure_top=1),
    )
    assert timed[: len(configs)] == configs


@pytest.mark.parametrize("start", ["fork server", "forked from this process"])
def test_the_compile_pool_answers_for_each_config_on_its_own(interpreter_only, start):
    # The tuner times a config as soon as its own compile is done: wait(config) returns that config's failure or
    # None, and None at once for a config that was never started. Both ways a pool's processes start: from the
    # fork server (a tune in this process), forked from the process itself (a worker, fa2tune.tune.processes).
    from fa2tune.config.types import KernelConfig, Mask
    from fa2tune.tune import compile_pool, processes

    good, other = KernelConfig(64, 64, 4, 1), KernelConfig(32, 64, 4, 1)
    context = processes.fork_context() if start == "forked from this process" else None
    with compile_pool.CompilePool(2, context=context) as pool:
        wait_good = pool.start("fwd", 16, torch.bfloat16, Mask(), [good], seqlens=(64,), device="cpu")
        wait_bad = pool.start("fwd", 16, torch.bfloat16, Mask(), [good], seqlens=(64,), device="no-such-device")
        assert wait_good(good) is None and wait_good(other) is None
        assert "no-such-device" in wait_bad(good)
        assert pool.compile("fwd", 16, torch.bfloat16, Mask(), [good, other], seqlens=(64,), device="cpu") == {}


@pytest.mark.parametrize("released", [False, True])
def test_a_released_compile_pool_skips_the_compiles_not_yet_begun(interpreter_only, released):
    # A tune ends with batches queued that nobody will time: after release() the processes skip them and exit,
    # instead of close() building them all. Built on a device that does not exist, every config that is
    # compiled fails with a reason; one that is skipped answers None.
    from fa2tune.config.types import KernelConfig, Mask
    from fa2tune.tune import compile_pool

    configs = [KernelConfig(m, n, 4, 1) for m in (16, 32, 64) for n in (16, 32, 64, 128)]
    pool = compile_pool.CompilePool(1)
    wait = pool.start("fwd", 16, torch.bfloat16, Mask(), configs, seqlens=(64,), device="no-such-device")
    if released:
        pool.release()
    pool.close()
    assert pool.released == released
    if released:
        assert wait(configs[-1]) is None
    else:
        assert all("no-such-device" in wait(cfg) for cfg in configs)


def test_a_worker_answers_a_share_of_a_spent_budget_without_starting_the_study(tmp_path, interpreter_only):
    from dataclasses import replace

    spec = job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=False, trials=2,
                             storage=str(tmp_path / "tune.journal"), run="run-1")  # fmt: skip
    assert not workers._spent(spec, "cpu")  # no worker has opened the study yet
    job.run_study(spec, "cpu", finalize=False)
    assert workers._spent(spec, "cpu")
    # The budget is the study's distinct configs timed: another run (a resumed tune) finds it spent, a larger
    # budget does not.
    assert workers._spent(replace(spec, run="run-2"), "cpu")
    assert not workers._spent(replace(spec, trials=3), "cpu")


def _stopped_worker_with_a_busy_child(outbox):
    import multiprocessing
    import time

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    child.start()
    outbox.put(("child", child.pid))
    outbox.put(("done", "finish", 0, 0, None, None))  # an answer still in the feeder's buffer when it leaves
    workers._leave_now(outbox)
    raise AssertionError("_leave_now returned")


def _gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_stopped_worker_leaves_at_once_ending_its_compile_processes_and_losing_no_answer():
    # A worker told to stop does not wait for its compile processes (a compile nobody will load, then their
    # teardown: seconds at the end of every multi-GPU tune): they are ended, the answers still buffered are
    # flushed, and the worker exits with 0 — not through multiprocessing's exit path, which would join the child.
    import multiprocessing
    import os
    import signal
    import time

    context = multiprocessing.get_context("fork")
    outbox = context.Queue()
    worker = context.Process(target=_stopped_worker_with_a_busy_child, args=(outbox,))
    worker.start()
    messages = [outbox.get(timeout=60), outbox.get(timeout=60)]
    worker.join(timeout=60)
    assert worker.exitcode == 0
    assert messages[1] == ("done", "finish", 0, 0, None, None)
    child = messages[0][1]
    deadline = time.monotonic() + 60
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the busy child outlived the worker")


def test_short_backward_studies_time_the_whole_training_call(interpreter_only, monkeypatch):
    # At N <= 1k a call can wait for the host; a backward with faster kernels but costlier launches then times
    # faster alone and slower in the call (docs/PERF.md, "Length buckets"). The short bucket's backward studies time the
    # forward and the backward as one run, and count that run's FLOPs; other studies time their kernel alone.
    from fa2tune.config.types import KernelConfig, Mask
    from fa2tune.tune import workload

    short_dq = job.StudySpec(kernel="bwd_dq", head_dim=16, dtype="fp16", causal=True, seqlen_bucket="short")
    assert short_dq.in_training_call and short_dq.timed_mode == "fwd+bwd"
    assert not job.StudySpec(kernel="bwd_dq", head_dim=16, dtype="fp16", causal=True).in_training_call
    short_fwd = job.StudySpec(kernel="fwd", head_dim=16, dtype="fp16", causal=True, seqlen_bucket="short")
    assert not short_fwd.in_training_call and short_fwd.timed_mode == "fwd"
    ran = []
    real = workload.run_kernel
    monkeypatch.setattr(
        workload, "run_kernel", lambda kernel, cfg, *a: ran.append((kernel, cfg)) or real(kernel, cfg, *a)
    )
    cfg = KernelConfig(16, 16, 4, 1)
    for with_forward, expected in ((True, [("fwd", None), ("bwd_dq", cfg)]), (False, [("bwd_dq", cfg)])):
        measure = workload.make_measure("bwd_dq", 16, torch.float16, Mask(causal=True), seqlens=(32,), device="cpu",
                                       tokens=32, width=32, with_forward=with_forward)  # fmt: skip
        ran.clear()
        assert measure(cfg) > 0
        assert ran == expected * 2  # a first call (renders the variant), then the timed one
    with pytest.raises(ValueError, match="with_forward times a backward kernel"):
        workload.make_measure("fwd", 16, torch.float16, Mask(), seqlens=(32,), device="cpu", with_forward=True)
    # ... and a short backward study's tune does it: each timed run launches the forward first.
    ran.clear()
    result, entry = job.run_study(replace(short_dq, dtype="bf16", trials=2), "cpu")
    assert ran and [kernel for kernel, _ in ran] == ["fwd", "bwd_dq"] * (len(ran) // 2)
    assert entry.key.seqlen_bucket == "short" and result.measured >= 1


def test_a_dq_study_times_its_configs_beside_the_resolved_dkdv_config_without_fused_dq(interpreter_only, monkeypatch):
    # Where the dK/dV config a call resolves fuses dQ in, no dQ kernel runs: a dQ study timing beside it would time
    # the same backward for every dQ config (seen on the H200: 16x32 and 128x64 dQ tiles within 1 %). It times beside
    # that config's twin without fused dQ, the pairing its entry serves; a resolved config without it is left as is.
    from fa2tune.api import ops, selection
    from fa2tune.config.types import KernelConfig, Mask
    from fa2tune.tune import workload

    x = workload.kernel_inputs("bwd_dq", Mask(causal=True), 1, 2, 32, 16, dtype=torch.float16, device="cpu")
    plain = KernelConfig(16, 16, 4, 1)
    fused = KernelConfig(64, 128, 4, 2, warp_specialized=True, fused_dq=True)
    seen = []
    monkeypatch.setattr(ops, "backward", lambda *a, **kw: seen.append(kw))
    drained = replace(fused, drain_before_dq=True)
    for resolved, partner in ((fused, replace(fused, fused_dq=False)), (drained, replace(fused, fused_dq=False)),
                              (plain, None)):  # fmt: skip
        monkeypatch.setattr(selection, "config_for", lambda config, kernel, *a, resolved=resolved: config or resolved)
        seen.clear()
        workload.run_kernel("bwd_dq", plain, x, Mask(causal=True))
        assert seen[0]["dq_config"] == plain and seen[0]["dkdv_config"] == partner
        seen.clear()
        workload.run_kernel("bwd_dkdv", plain, x, Mask(causal=True))  # a dK/dV study times its own config alone
        assert seen[0]["dkdv_config"] == plain and "dq_config" not in seen[0]


def test_an_all_study_beside_bucket_entries_is_tuned_at_the_lengths_it_serves(tmp_path):
    from fa2tune.config.types import KernelConfig

    def entry(bucket, causal=False, kernel="fwd"):
        key = store.EntryKey(head_dim=64, dtype="bf16", causal=causal, kernel=kernel, seqlen_bucket=bucket)
        return store.Entry(key=key, config=KernelConfig(64, 64, 4, 2), ms=1.0, tflops=None, baseline={}, trials=1,
                           spread=None, triton_version="3.6.0", torch_version="2.13.0", template_hash="x",
                           date="2026-11-30")  # fmt: skip

    path = tmp_path / "gpu.yaml"
    spec = job.StudySpec(kernel="fwd", head_dim=64, dtype="bf16", causal=False)
    assert job.unserved_lengths(spec, path) == (1024, 4096, 16384)  # no file: every default length
    store.write_entries(path, {"name": "x", "slug": "gpu"}, [entry("short")])
    assert job.unserved_lengths(spec, path) == (4096, 16384)  # 1k is the short entry's
    store.write_entries(path, {"name": "x", "slug": "gpu"}, [entry("medium"), entry("short", causal=True)])
    assert job.unserved_lengths(spec, path) == (8192, 16384)  # only 16k left: 8k joins it
    # Another key's buckets (the causal one's short entry is there, not its medium) and bucket studies: unchanged.
    causal = replace(spec, causal=True)
    assert job.unserved_lengths(causal, path) == (4096, 16384)
    assert job.unserved_lengths(replace(spec, kernel="bwd_dkdv"), path) == (1024, 4096, 16384)
    short = replace(spec, seqlen_bucket="short", seqlens=(512, 1024))
    assert job.unserved_lengths(short, path) == (512, 1024)
    path.write_text("{not yaml")  # an unreadable file leaves the lengths as they are
    assert job.unserved_lengths(spec, path) == (1024, 4096, 16384)


# Storages shared by processes (fa2tune tune --storage): opened at once, a process killed while timing, resumed.

_AT_ONCE = 5  # processes opening one fresh storage together


def _open_at_once(url, barrier, answers):
    barrier.wait(timeout=120)
    try:
        optuna.create_study(study_name="s", storage=study_storage.open_storage(url), load_if_exists=True)
        answers.put(None)
    except Exception as exc:
        answers.put(f"{type(exc).__name__}: {exc}"[:300])


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_processes_opening_one_fresh_storage_at_once_all_open_it(tmp_path, kind):
    # Two `fa2tune tune --storage sqlite:///x.db` starting together on a fresh file crashed about 1 run in 3: both
    # created its tables ("table ... already exists", or the schema version stamped twice); four processes opening
    # one at the same instant failed 11 times in 12. Five open a fresh storage together, three times: all open it.
    context = processes.context()
    for attempt in range(3):
        url = f"sqlite:///{tmp_path}/{attempt}.db" if kind == "sqlite" else str(tmp_path / f"{attempt}.journal")
        barrier, answers = context.Barrier(_AT_ONCE), context.Queue()
        children = [context.Process(target=_open_at_once, args=(url, barrier, answers)) for _ in range(_AT_ONCE)]
        for child in children:
            child.start()
        problems = [answers.get(timeout=120) for _ in children]
        for child in children:
            child.join(timeout=60)
        assert problems == [None] * _AT_ONCE, f"attempt {attempt}"


def _tune(spec):
    job.run_study(spec, "cpu", finalize=False)


def _tune_stuck_in_its_first_timing(spec):
    """_tune, but its first timing never ends: whatever the machine's load, the trial is still RUNNING when the test
    kills the process (a timing that ended between the test's look and its kill made the trial COMPLETE)."""
    import time

    from fa2tune.tune import cost

    cost.Cost._time = lambda self, trial, cfg: time.sleep(3600)
    _tune(spec)


def _kill_while_timing(context, spec, url) -> int:
    """Starts a process tuning spec alone and SIGKILLs it while it times a config; returns that trial's number."""
    import os
    import signal
    import time

    child = context.Process(target=_tune_stuck_in_its_first_timing, args=(spec,))
    child.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.is_alive():
        if timing := _timing(url, spec):
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=60)
            return timing[0]
        time.sleep(0.01)
    child.kill()
    raise AssertionError("the tune ended, or never timed a config, before it could be killed")


def _timing(url, spec) -> list[int]:
    """The numbers of the study's trials being timed (RUNNING, their config chosen); [] before the study exists."""
    import sqlalchemy.exc

    try:
        trials = _study(url, spec).trials
    except (KeyError, sqlalchemy.exc.SQLAlchemyError):  # not created yet, or its tables being created now
        return []
    running = optuna.trial.TrialState.RUNNING
    return [t.number for t in trials if t.state == running and study_trials.proposed(t) is not None]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_killed_tune_s_trial_is_failed_and_its_resume_times_only_what_the_budget_lacks(
    tmp_path, monkeypatch, interpreter_only, kind
):
    # Without heartbeats, a process killed while it times a config leaves its trial RUNNING forever, and the resumed
    # tune times --trials configs more, re-proposing the timed ones until it has asked 20x the budget (113 trials for
    # --trials 3). So each trial a process holds has a heartbeat: once stale, the next process to open the study fails
    # it, and --trials counts distinct configs in the study, so the resume times what the budget still lacks.
    import time

    monkeypatch.setenv(study_storage.STALE_AFTER_ENV, "2")
    url = f"sqlite:///{tmp_path}/tune.db" if kind == "sqlite" else str(tmp_path / "tune.journal")
    spec = job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=False, trials=4, storage=url)
    killed = _kill_while_timing(processes.context(), spec, url)
    assert _study(url, spec).trials[killed].state == optuna.trial.TrialState.RUNNING
    time.sleep(study_storage.stale_after_s() + 1)  # resumed after the killed trial's heartbeat went stale
    result, entry = job.run_study(spec, "cpu")
    study = _study(url, spec)
    trial = study.trials[killed]
    assert trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs["reason"] == study_storage.STALE_REASON
    assert not [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    # The killed trial may have finished its timing just before the kill without telling it: a reading the study
    # never got, so neither the budget nor this count takes it.
    timed = [KernelConfig.from_params(t.params) for t in study.trials
             if "timing" in t.user_attrs and t.number != killed]  # fmt: skip
    assert len(timed) == len(set(timed)) == spec.trials  # the budget, each config timed once
    assert result.measured == spec.trials and entry.config in timed
    assert len(study.trials) <= 3 * spec.trials


def test_a_config_another_process_is_timing_is_not_timed_again(tmp_path):
    # Two processes tuning one study (independent tunes sharing --storage, or hosts): a config one of them is
    # timing counts against the budget and is never timed by the other. The second process runs inside the
    # first one's first timing, so the interleaving is fixed.
    space = [KernelConfig(m, n, 4, 1) for m in (16, 32) for n in (16, 32)]
    storage = study_storage.open_storage(str(tmp_path / "tune.journal"))
    target = tuner.Target(device=job.selection.device_info("cpu"), kernel="fwd", head_dim=16, dtype=torch.bfloat16,
                          causal=False, space=space, default=space[0])  # fmt: skip
    kwargs = dict(storage=storage, remeasure_top=1)
    calls, other_calls = [], []

    def measure(cfg):
        calls.append(cfg)
        if len(calls) == 1:
            tuner.tune(target, lambda c: other_calls.append(c) or 1.0 + c.block_m,
                       tuner.Options(seed=1, trials=3, **kwargs))  # fmt: skip
        return 1.0 + cfg.block_n

    tuner.tune(target, measure, tuner.Options(trials=3, **kwargs))
    assert calls[0] == space[0] and space[0] not in other_calls
    assert len(calls + other_calls) == len(set(calls + other_calls)) == 3


def test_a_config_a_process_timed_while_another_waited_for_its_compile_is_not_timed_again(tmp_path):
    # A process asks a config, then waits for its compile (prepare's wait) before it marks the config as being
    # timed: meanwhile another process times the same config. Marking it after, the first finds it timed and
    # takes its stored reading instead of timing it again.
    a, b = KernelConfig(16, 16, 4, 1), KernelConfig(32, 32, 4, 1)
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    calls = []

    def other_process_times_a():
        study = optuna.load_study(study_name="cpu-interpreter/fwd/d16/bfloat16/full", storage=url)
        values = lambda dim: sorted({search_space.params(c)[dim] for c in (a, b)})
        choices = {dim: optuna.distributions.CategoricalDistribution(values(dim)) for dim in search_space.DIMS}
        study.add_trial(optuna.trial.create_trial(params=search_space.params(a), distributions=choices, value=2.0,
                                                  user_attrs={"timed_by": 1, "timing": {}}))  # fmt: skip

    def prepare(configs):
        return lambda cfg: other_process_times_a() if cfg == a else None

    cpu = job.selection.device_info("cpu")
    result = tuner.tune(
        tuner.Target(
            device=cpu, kernel="fwd", head_dim=16, dtype=torch.bfloat16, causal=False, space=[a, b], default=a
        ),
        lambda cfg: calls.append(cfg) or 3.0,
        tuner.Options(
            storage=study_storage.open_storage(url), remeasure_top=1, trials=2, prepare=prepare, batch_size=1
        ),
    )
    assert calls == [b]
    assert result.measured == 2 and result.best == a and result.best_ms == 2.0  # a's stored reading


def test_a_study_asks_nothing_past_its_space_or_its_budget(tmp_path):
    # A budget larger than the space (or a resumed study whose budget is spent) must stop the asking; otherwise every
    # proposal is a repeat told again from its stored value, until 20x the budget has been asked.
    space = [KernelConfig(m, n, 4, 1) for m in (16, 32) for n in (16, 32)]
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    target = tuner.Target(device=job.selection.device_info("cpu"), kernel="fwd", head_dim=16, dtype=torch.bfloat16,
                          causal=False, space=space, default=space[0])  # fmt: skip
    measure = lambda cfg: 1.0 + cfg.block_m + cfg.block_n / 100
    kwargs = dict(storage=study_storage.open_storage(url), remeasure_top=1)
    result = tuner.tune(target, measure, tuner.Options(trials=10, **kwargs))
    study = optuna.load_study(study_name=result.study_name, storage=url)
    assert result.measured == len(space) and len(study.trials) <= 2 * len(space)
    stored = len(study.trials)
    assert tuner.tune(target, measure, tuner.Options(trials=len(space), **kwargs)).best == result.best
    assert len(optuna.load_study(study_name=result.study_name, storage=url).trials) == stored


def test_a_finish_waits_for_the_configs_other_processes_are_timing_and_ranks_them(tmp_path):
    # Two hosts tune one study; this one's trials end while the other is still timing a config: the finish waits
    # for its reading and ranks it with its own, so each host chooses among every config of the budget. The other
    # host's trial is made here (marked by another pid, its heartbeat this process's) and told a second later.
    import threading

    a, b, other = KernelConfig(16, 16, 4, 1), KernelConfig(32, 32, 4, 1), KernelConfig(64, 16, 4, 1)
    spec = job.StudySpec(kernel="fwd", head_dim=16, dtype="bf16", causal=False, trials=2,
                             storage=str(tmp_path / "tune.journal"))  # fmt: skip
    cpu = job.selection.device_info("cpu")
    study = optuna.create_study(study_name=spec.study_name(cpu), storage=study_storage.open_storage(spec.storage))
    study.enqueue_trial(search_space.params(other))
    trial = study.ask()
    for dim, value in search_space.params(other).items():
        assert trial.suggest_categorical(dim, sorted({search_space.params(c)[dim] for c in (a, b, other)})) == value
    trial.set_user_attr("timed_by", 1)
    told = threading.Timer(1.0, lambda: study.tell(trial, 2.0))
    told.start()
    readings = {a: 1.0, b: 3.0, other: 0.5}  # the other host read 2.0 for it; here it is the fastest
    result = tuner.tune(
        tuner.Target(
            device=cpu, kernel="fwd", head_dim=16, dtype=torch.bfloat16, causal=False, space=[a, b, other], default=a
        ),
        readings.get,
        tuner.Options(
            storage=study_storage.open_storage(spec.storage),
            trials=2,
            on_timed=lambda: job._await_others(spec, cpu, poll_s=0.05),
        ),
    )
    told.join()
    assert result.measured == 2
    assert result.best == other and result.best_ms == 0.5  # ranked by its reading here, like this host's own


def test_a_trial_failed_as_stale_while_its_process_times_it_does_not_end_the_tune(tmp_path, caplog):
    # A live process whose heartbeat was late (a starved thread, hosts' clocks apart) finds its trial failed as
    # stale by another process: telling it raised UpdateFinishedTrialError and ended the tune with a traceback.
    space = [KernelConfig(m, n, 4, 1) for m in (16, 32) for n in (16, 32)]
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    calls = []

    def measure(cfg):
        calls.append(cfg)
        if len(calls) == 1:  # another process fails this trial as stale while it is timed here
            study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
            (running,) = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
            study.tell(running.number, state=optuna.trial.TrialState.FAIL)
        return 1.0 + cfg.block_n + cfg.block_m / 100

    result = tuner.tune(
        tuner.Target(
            device=job.selection.device_info("cpu"),
            kernel="fwd",
            head_dim=16,
            dtype=torch.bfloat16,
            causal=False,
            space=space,
            default=space[0],
        ),
        measure,
        tuner.Options(storage=study_storage.open_storage(url), remeasure_top=1, trials=3),
    )
    assert result.best is not None and result.measured >= 2
    assert "failed as stale by another process" in caplog.text


def test_a_running_trial_without_any_heartbeat_goes_stale_from_its_start(tmp_path, monkeypatch):
    # A journal written without heartbeats (or by a process that died before its first beat) holds RUNNING trials
    # with no heartbeat: unless they go stale from their start they are never failed, and count against --trials
    # for ever.
    import time

    path = str(tmp_path / "tune.journal")
    old = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    study = optuna.create_study(study_name="s", storage=old)
    trial = study.ask()
    trial.set_user_attr("timed_by", "another-host:1")
    monkeypatch.setenv(study_storage.STALE_AFTER_ENV, "2")
    time.sleep(study_storage.stale_after_s() + 1)
    study = optuna.load_study(study_name="s", storage=study_storage.open_storage(path))
    (frozen,) = study.get_trials()
    assert frozen.state == optuna.trial.TrialState.FAIL and frozen.user_attrs["reason"] == study_storage.STALE_REASON



def test_a_dq_study_resolves_its_dkdv_partner_once_an_input_not_in_every_timed_run(interpreter_only, monkeypatch):
    # The partner is a store lookup: inside the timed run it would add host time to every reading of a dQ config.
    from fa2tune.config.types import KernelConfig, Mask
    from fa2tune.tune import workload

    real, resolved = workload.dq_partner, []
    monkeypatch.setattr(workload, "dq_partner", lambda x, causal: resolved.append(x) or real(x, causal))
    measure = workload.make_measure("bwd_dq", 16, torch.float16, Mask(causal=True), seqlens=(32, 64), device="cpu",
                                    tokens=64, width=32)  # fmt: skip
    assert resolved == measure.inputs  # one an input
    resolved.clear()
    assert measure(KernelConfig(16, 16, 4, 1)) > 0 and not resolved


def test_a_grouped_tunes_compile_example_builds_the_timed_calls_binary(monkeypatch):
    # the example's group is the timed calls' (2·group query heads over 2 K/V heads), and its dK/dV split theirs:
    # forced to what a full grid takes, where the example's small grid would split for its tail
    from fa2tune.config import group_split
    from fa2tune.tune import compile_pool

    monkeypatch.delenv(group_split.DKDV_HEADS_ENV, raising=False)
    seen = []

    def run_kernel(kernel, cfg, x, causal):
        seen.append((kernel, x.q.shape[1], x.k.shape[1], os.environ.get(group_split.DKDV_HEADS_ENV)))

    monkeypatch.setattr(compile_pool, "kernel_inputs", lambda kernel, causal, batch, heads, n, d, *, dtype, device,
                        varlen, heads_kv: SimpleNamespace(q=torch.empty(batch, heads, n, d),
                                                          k=torch.empty(batch, heads_kv, n, d)))  # fmt: skip
    monkeypatch.setattr(compile_pool, "run_kernel", run_kernel)
    fused = KernelConfig(64, 128, 4, 2, warp_specialized=True, fused_dq=True)
    for kernel, config, causal, group in (("bwd_dkdv", fused, Mask(causal=True), 8), ("bwd_dkdv", fused, False, 8),
                                          ("fwd", KernelConfig(64, 64, 4, 2), True, 8), ("bwd_dkdv", fused, True, 1),
                                          ("bwd_dkdv", fused, Mask(causal=True, window=(16, 0)), 8)):  # fmt: skip
        compile_pool._run_attention(kernel, 64, torch.float16, causal, config, 256, "cpu", False, group)
    assert seen == [("bwd_dkdv", 16, 2, "4"), ("bwd_dkdv", 16, 2, "8"), ("fwd", 16, 2, None), ("bwd_dkdv", 2, 2, None),
                    ("bwd_dkdv", 16, 2, "8")]  # fmt: skip
    assert group_split.DKDV_HEADS_ENV not in os.environ  # restored after each


def test_a_study_of_grouped_heads_writes_a_grouped_key():
    spec = job.StudySpec(kernel="bwd_dkdv", head_dim=128, dtype="bf16", causal=True, heads=32, kv_heads=8)
    assert spec.grouped and spec.group == 4 and spec.key.gqa and spec.variant == "gqa32x8"
    # a study times one grouping: another's is another study (a shared or stored one would mix their readings)
    assert replace(spec, kv_heads=4).variant == "gqa32x4" and replace(spec, heads=None, kv_heads=None).variant == ""
    mha = replace(spec, kv_heads=32)
    assert not mha.grouped and mha.group == 1 and not mha.key.gqa and mha.variant == "heads32"
    assert replace(spec, seqlen_bucket="short", seqlens=(512, 1024)).variant == "gqa32x8+short"
    # a study timed at other lengths, or another batch·N, is another study: its sums are not comparable
    assert replace(spec, seqlens=(8192, 16384)).variant == "gqa32x8+at8192,16384"
    assert replace(spec, seqlen_bucket="short", seqlens=(512, 1024), tokens=8192).variant == "gqa32x8+short+tokens8192"
    for heads, kv_heads in ((32, 5), (32, None), (None, 8), (32, 0), (-8, -8)):
        with pytest.raises(ValueError, match="heads and kv_heads come together, positive, kv_heads dividing heads"):
            replace(spec, heads=heads, kv_heads=kv_heads)
