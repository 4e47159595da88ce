"""A tune on several GPUs: one worker process per device, every study shared through its storage.

`run_parallel_many` deals every study to every worker (`deal`) with the study's whole budget shared as one run, and
sends each worker its plan at once: no barrier anywhere. A study is finished by one worker once its budget is spent
and no worker is timing it. A worker that dies is reported; its work goes to the others.

The workers come from the fork server (fa2tune.tune.processes), which imports this module, and with it everything
a worker runs, once for all of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import optuna
import torch

from ..api import selection
from ..config import store
from . import processes, tuner
from .compile_pool import CompilePool
from .job import StudySpec, interpreted, run_study
from .records import failure_reason
from .study_storage import open_storage

Progress = Callable[[int, int, tuple[int, int, float, float]], None]
Job = tuple[str, int, StudySpec]  # (kind, study index, spec: its run and budget, this worker's seed)
Result = tuple[tuner.TuneResult, store.Entry, dict[str, int]]  # per study: result, entry, each worker's exit code


class _Worker(NamedTuple):
    name: str  # its device
    process: object  # a multiprocessing Process
    inbox: object  # a multiprocessing Queue: its jobs


def run_parallel(spec: StudySpec, device_names: list[str], *, report: Callable[[str], None] = print) -> Result:
    """run_parallel_many for one study."""
    return run_parallel_many([spec], device_names, report=report)[0]


def deal(specs: list[StudySpec], count: int, run: str) -> list[list[Job]]:
    """Each of `count` workers' jobs, in order: every study, worker i starting at study i·len(specs)/count and
    taking the rest in turn, each worker with its own sampler seed, all with the study's whole budget shared
    as `run` (tuner.tune stops every worker of a run once the run has timed the budget).

    Shared budgets keep the GPUs equally busy whatever the studies cost: a worker times its first study until
    the budget is spent, by itself or with the others once they get there, then moves on; the last trials of
    the tune are timed by every worker, and they stop within one timing of each other. Fixed shares (half of
    every study each) leave one GPU idle for the other's last trials: 8 s of a 95 s tune on the 2×H200 host,
    where causal trials take 1.85 s and non-causal 1.4 s. Each worker compiles the first configs of its next
    study while it times this one (run_study's `then`).
    """
    plans: list[list[Job]] = [[] for _ in range(count)]
    for i, plan in enumerate(plans):
        first = i * len(specs) // count
        for index in [(first + j) % len(specs) for j in range(len(specs))]:
            plan.append(("trials", index, replace(specs[index], seed=specs[index].seed + i, run=run)))
    return plans


def run_parallel_many(
    specs: list[StudySpec],
    device_names: list[str],
    *,
    report: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> list[Result]:
    """One worker process per device for the whole list of studies, sharing them through their storage.

    The work is dealt by `deal` and sent at once, so no worker waits at a barrier. A study is finished — by
    the worker with the least left to do — as soon as its budget is spent (a worker's job on it ended) and no
    worker is still timing it: workers whose job on it is still queued will find nothing left to time. A worker
    that dies is reported; the jobs it had not answered go to the live worker with the least left to do (what
    it had timed is in the storage and counts against the budget), and the others carry on.

    Returns per study: the result, its entry, and each worker's exit code (0 if alive at the end, non-zero if it
    died). A study no worker could finish is finished in this process on the first device once the workers are
    done, so nothing else is timed meanwhile. progress(study index, worker number, (timed by the run, trials,
    best ms, elapsed s)) is called for each trial a worker times.
    """
    if any(spec.storage is None for spec in specs):
        raise ValueError("run_parallel needs a shared storage (an Optuna URL or a journal file path)")
    for url in dict.fromkeys(spec.storage for spec in specs):
        open_storage(url)  # its tables created here, before the workers open it: not by two of them at once
    context = processes.context()  # forked from the fork server: torch and fa2tune are imported there once
    outbox = context.Queue()
    workers = _start_workers(context, device_names, outbox)
    dispatch = _Dispatch(specs, workers, report, run=uuid.uuid4().hex)
    try:
        dispatch.serve(outbox, progress)
    except BaseException:  # Ctrl-C, or a failure here: the workers stop now, not after the jobs they were sent
        for worker in workers:
            worker.process.terminate()
        raise
    finally:
        for worker in workers:
            if worker.process.is_alive():
                worker.inbox.put(None)
        for worker in workers:
            worker.process.join(timeout=60)
    return _results(specs, device_names, dispatch)


def _start_workers(context, device_names: list[str], outbox) -> list[_Worker]:
    compile_workers = max(1, (os.cpu_count() or 1) // len(device_names))  # the host's cores, shared by the workers
    workers = []
    for number, name in enumerate(device_names):
        inbox = context.Queue()
        process = context.Process(target=_worker, args=(number, name, compile_workers, dict(os.environ), inbox, outbox))
        process.start()
        workers.append(_Worker(name, process, inbox))
    return workers


def _results(specs: list[StudySpec], device_names: list[str], dispatch: _Dispatch) -> list[Result]:
    codes = {f"{i}:{worker.name}": dispatch.dead.get(i, 0) for i, worker in enumerate(dispatch.workers)}
    results = []
    for index, spec in enumerate(specs):
        if index not in dispatch.finished:  # no live worker could finish it: finish here (one that cannot raises)
            dispatch.finished[index] = run_study(replace(spec, trials=0), device_names[0])
        results.append((*dispatch.finished[index], dict(codes)))
    return results


class _Dispatch:
    """The main process's side of a run: the jobs each worker has not answered yet, and each study's state."""

    def __init__(self, specs: list[StudySpec], workers: list[_Worker], report: Callable[[str], None], run: str):
        self.specs, self.workers, self.report = specs, workers, report
        self.run = run  # marks the trials this run's workers time: their shared budgets count them
        self.pending: dict[int, list[Job]] = {i: [] for i in range(len(workers))}  # sent, not yet answered, in order
        self.dead: dict[int, int] = {}  # worker -> its exit code
        self.finished: dict[int, tuple[tuner.TuneResult, store.Entry]] = {}
        self.ended: set[int] = set()  # studies a worker's trials job ended on: their budget is spent
        self.finishing: set[int] = set()  # studies whose finish job was sent

    def serve(self, outbox, progress: Progress | None) -> None:
        """Sends the plans, then answers the workers' messages until every job is answered."""
        for i, plan in enumerate(deal(self.specs, len(self.workers), run=self.run)):
            self._send_plan(i, plan)
        while any(self.pending.values()):
            message = _next_message(outbox)
            if message is not None and message[0] == "progress":
                if progress is not None:
                    progress(*message[1:])
            elif message is not None and message[3] not in self.dead:
                self._answered(message[1], message[2], *message[3:])
            for i, worker in enumerate(self.workers):
                if i not in self.dead and not worker.process.is_alive():
                    self._died(i, worker.process.exitcode if worker.process.exitcode else 1)

    def _send(self, i: int, job: Job) -> None:
        self.pending[i].append(job)
        self.workers[i].inbox.put(job)

    def _send_plan(self, i: int, plan: list[Job]) -> None:
        """The worker's jobs in one message: all there when it looks at its first (it lets its compile pool go
        after its last trials job)."""
        self.pending[i].extend(plan)
        self.workers[i].inbox.put(list(plan))

    def _least_busy(self) -> int | None:
        """The live worker with the least left to do. A share of a study whose budget is spent is nothing to do
        (the worker answers it at once, or after the one trial it is timing), so the last studies' finishes go to
        different GPUs, not one after the other to the same."""
        alive = [i for i in range(len(self.workers)) if i not in self.dead]
        left = lambda i: sum(not (job[0] == "trials" and job[1] in self.ended) for job in self.pending[i])
        return min(alive, key=lambda i: (left(i), i)) if alive else None

    def _answered(self, kind: str, index: int, i: int, problem: str | None, payload) -> None:
        pending = self.pending
        pending[i].remove(next(job for job in pending[i] if job[:2] == (kind, index)))
        if problem:
            self.report(f"worker {i} on {self.workers[i].name} failed study {index} ({problem}); the others carry on")
        elif payload is not None:
            self.finished[index] = payload
        # A job that ended well leaves the study's budget spent; one that failed says so only if it was the last.
        if kind == "trials" and (problem is None or not any(job[:2] == ("trials", index) for jobs in pending.values()
                                                             for job in jobs)):  # fmt: skip
            self.ended.add(index)
        self._send_finishes()

    def _send_finishes(self) -> None:
        """Sends the finish of every ended study no worker is timing now (a worker works on its oldest job)."""
        current = {jobs[0][:2] for i, jobs in self.pending.items() if jobs and i not in self.dead}
        for index in sorted(self.ended - self.finishing):
            if ("trials", index) not in current and (j := self._least_busy()) is not None:
                self.finishing.add(index)
                self._send(j, ("finish", index, replace(self.specs[index], trials=0)))

    def _died(self, i: int, code: int) -> None:
        self.dead[i] = code
        name = self.workers[i].name
        self.report(f"worker {i} on {name} died (exit code {code}); the others carry on with its work")
        # A trial it was timing stays RUNNING and would count against the budget: fail it, so it does not.
        for url in dict.fromkeys(spec.storage for spec in self.specs):
            if abandoned := tuner.fail_abandoned(open_storage(url), self.run, self.workers[i].process.pid):
                self.report(f"worker {i} was timing {abandoned} config(s) when it died: marked failed")
        jobs, self.pending[i] = self.pending[i], []
        for job in jobs:
            if (j := self._least_busy()) is not None:
                self._send(j, job)
        self._send_finishes()


def _next_message(outbox, timeout_s: float = 2.0):
    """The next message from the workers, or None after a few seconds (so deaths are noticed)."""
    import queue

    try:
        return outbox.get(timeout=timeout_s)
    except queue.Empty:
        return None


def _worker(number: int, device_name: str, compile_workers: int, environment: dict[str, str], inbox, outbox) -> None:
    """A worker of run_parallel_many: runs the jobs it is sent (its plan first, as one list), in order, until it is
    sent None. A job is ("trials", index, spec): time the study, with the run's other workers, until its budget
    is spent; or ("finish", index, spec): re-time its best configs, verify, and send back the (result, entry).
    Every job is answered on outbox with ("done", kind, index, worker number, problem or None, payload); each
    timed trial is told as ("progress", index, worker number, (timed by the run, trials, best ms, elapsed s)).

    It lives for the whole tune, so its CUDA context and its compile pool start once, not once per study; it
    knows the jobs queued behind the current one, so the next study's first configs compile meanwhile.
    """
    pool = _start_worker(device_name, compile_workers, environment)
    jobs: deque = deque()
    try:
        while True:
            _take(inbox, jobs)
            if (job := jobs.popleft()) is None:
                break
            _run_job(job, jobs, number, device_name, pool, outbox)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    _leave_now(outbox)


def _start_worker(device_name: str, compile_workers: int, environment: dict[str, str]) -> CompilePool | None:
    """The worker's environment, signals, compile pool (None under the interpreter) and device."""
    processes.adopt(environment)  # the caller's, not the fork server's (fa2tune.tune.processes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it stops the workers (SIGTERM)
    # The pool first, forked from this process before it touches CUDA (forked children of a process that has
    # cannot use it): its processes start with torch and fa2tune imported; each creates its CUDA context with its
    # first compile, after this one has its own.
    pool = None
    if not interpreted(device_name):
        pool = CompilePool(compile_workers, context=processes.fork_context())
    signal.signal(signal.SIGTERM, _stop_now)
    if device_name.startswith("cuda"):
        torch.cuda.set_device(torch.device(device_name))
    return pool


def _take(inbox, jobs: deque) -> None:
    """Moves the messages in inbox to jobs, waiting for one if jobs is empty. A message is a job, None (stop), or
    a list of jobs: the worker's whole plan, sent at once."""
    import queue

    def take(message) -> None:
        if isinstance(message, list):
            jobs.extend(message)
        else:
            jobs.append(message)

    if not jobs:
        take(inbox.get())
    with contextlib.suppress(queue.Empty):
        while True:
            take(inbox.get_nowait())


def _run_job(job: Job, jobs: deque, number: int, device_name: str, pool: CompilePool | None, outbox) -> None:
    """Runs one job and answers it on outbox; jobs: those queued behind it."""
    kind, index, spec = job
    # The pool serves this worker's trials jobs, all sent at the start in one message; after the last, it is let
    # go while the study's finish runs. A job of a worker that died can come later: it runs with a pool of its own.
    live_pool = pool if pool is not None and not pool.released else None
    release = kind == "trials" and not any(j is not None and j[0] == "trials" for j in jobs)
    if kind == "trials" and _spent(spec, device_name):  # others used the budget: answer at once
        if release and live_pool is not None:
            live_pool.release()
        outbox.put(("done", kind, index, number, None, None))
        return
    then = next((j[2] for j in jobs if j is not None and j[0] != "finish"), None)

    def on_trial(*state) -> None:  # (timed, trials, best ms, elapsed s), for the progress line
        outbox.put(("progress", index, number, state))

    try:
        done = run_study(spec, device_name, finalize=kind == "finish", compile_pool=live_pool, on_trial=on_trial,
                         then=then, release_pool=release)  # fmt: skip
        outbox.put(("done", kind, index, number, None, done if kind == "finish" else None))
    except Exception as exc:  # one study failing here is reported; the worker carries on with the next
        outbox.put(("done", kind, index, number, failure_reason(exc), None))


def _spent(spec: StudySpec, device_name: str) -> bool:
    """Whether the study holds its whole budget timed already (tuner.timed_configs: by the run's workers, or before
    the run) — read from the storage, without the inputs, planner and compile-ahead a study's start costs (1-2 s a
    job on the H200 host)."""
    if spec.storage is None:
        return False
    try:
        study = optuna.load_study(study_name=spec.study_name(selection.device_info(device_name)),
                                  storage=open_storage(spec.storage))  # fmt: skip
    except KeyError:  # no worker has opened it yet
        return False
    return len(tuner.timed_configs(study)) >= spec.trials


def _stop_now(signum, frame) -> None:
    """A worker stopped in the middle of its jobs (the tune was interrupted): its compile processes go with it,
    as in _leave_now; left behind, they would wait for work forever."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
    os._exit(128 + signum)


def _leave_now(outbox) -> None:
    """Ends a worker that was told to stop, every answer sent, without waiting for anything else.

    Its compile processes may still be in a compile nobody will load (the pool was released during the last
    finish): closing the pool waits for those compiles and for the processes to tear down their CUDA contexts,
    and the main process, which joins this one, waits with it — at the end of a 2-GPU tune on the 2×H200 host,
    2.4 s between the last finish and the workers' exit. So they are sent SIGTERM and left to exit (their
    results are unwanted; Triton writes a cache entry under a temporary name and renames it, so a killed compile
    leaves at most a stray temporary directory, never a broken entry), the answers still buffered are flushed,
    and the process exits at once, skipping multiprocessing's exit path (which would join the children again).
    """
    import multiprocessing
    import sys

    for child in multiprocessing.active_children():  # the compile pool's processes: this worker's only children
        child.terminate()
    outbox.close()
    outbox.join_thread()  # every answer is in the pipe before the process goes
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
