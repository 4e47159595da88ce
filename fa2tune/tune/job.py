"""One tuning job: for a device, plan → compile in parallel → Optuna study → verify → a store entry.

`run_study` does it on one device. `run_parallel_many` runs one worker process per device over a list of studies
kept in a shared storage (an Optuna journal file by default): every worker times its share of every study, with
no barrier anywhere. A worker that dies is reported; its work goes to the others.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import optuna
import torch
import yaml

from ..api import selection
from ..config import lengths, planner, store
from ..config.inputs import DTYPES_BY_NAME
from ..config.types import DeviceInfo, Mask
from ..kernels import codegen
from . import processes, timing, tuner, verification

BATCH = 16  # configs compiled together, then timed: one per process of a 16-core machine's compile pool


@dataclass(frozen=True)
class StudySpec:
    """What to tune, and how long."""

    kernel: str
    head_dim: int
    dtype: str  # "bf16" | "fp16" | "fp32"
    causal: bool
    seqlens: tuple[int, ...] = (1024, 4096, 16384)
    tokens: int = 16384
    trials: int = 40
    timeout_s: float | None = None
    storage: str | None = None
    seed: int = 0  # workers of one study get different seeds, so their first proposals differ
    window: tuple[int, int] | None = None  # tune the band-mask variant at this (left, right) window
    varlen: bool = False  # tune the packed-sequence variant (the batch packed as equal-length sequences)
    seqlen_bucket: str = "all"  # "short" / "medium": an entry for calls of those lengths only (lengths.BUCKET_RANGES)
    run: str | None = None  # set by run_parallel_many: `trials` is the budget of all its workers together
    # The config the file this tune writes holds for the key now (stale or not): timed beside the new candidates,
    # kept unless one is measured faster (tuner.first_configs says why). See incumbent().
    incumbent: planner.KernelConfig | None = None

    @property
    def in_training_call(self) -> bool:
        """Whether the study times its backward kernel inside the whole training call, forward launched first
        (timing.make_measure's with_forward): for the N <= 1k entries, whose calls can wait for the host."""
        return self.seqlen_bucket == "short" and self.kernel != "fwd"

    @property
    def timed_mode(self) -> str:
        """What one timed run does, for its FLOPs (timing.attention_flops' mode)."""
        return "fwd" if self.kernel == "fwd" else "fwd+bwd" if self.in_training_call else "bwd"

    @property
    def key(self) -> store.EntryKey:
        """The entry this study writes."""
        return store.EntryKey(head_dim=self.head_dim, dtype=self.dtype, causal=self.causal, kernel=self.kernel,
                              seqlen_bucket=self.seqlen_bucket, window=self.window is not None,
                              varlen=self.varlen)  # fmt: skip

    @property
    def mask(self) -> Mask:
        return Mask(causal=self.causal, window=self.window or (-1, -1))

    @property
    def variant(self) -> str:
        """The study-name suffix: the template variant ("window", "varlen") and the length bucket ("short",
        "medium"), joined by "+"; "" for the plain variant at every length."""
        bucket = self.seqlen_bucket
        parts = (("window", self.window is not None), ("varlen", self.varlen), (bucket, bucket != "all"))
        return "+".join(name for name, on in parts if on)


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


def _storage(url: str | None):
    """An Optuna storage: None (in memory), a database URL, or a journal file (a path ending in .journal/.log).

    One per URL and process, with heartbeats: a trial of a process that dies is failed once it is stale (see
    STALE_AFTER_S), by the next process that opens the study or asks for a trial."""
    if url is None:
        return None
    key = (url, os.getpid(), stale_after_s())
    if key not in _storages:
        _storages[key] = _open_storage(url, key[2])
    return _storages[key]


def _open_storage(url: str, stale_after: int):
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


def _interpreted(device_name: str) -> bool:
    return device_name == "cpu"


def run_study(
    spec: StudySpec,
    device_name: str,
    *,
    on_trial: Callable | None = None,
    finalize: bool = True,
    compile_pool: timing.CompilePool | None = None,
    then: StudySpec | None = None,
    release_pool: bool = False,
) -> tuple[tuner.TuneResult, store.Entry]:
    """Tunes one kernel on one device; with finalize=False only times trials (a worker of run_parallel).

    On a GPU the study asks Optuna for BATCH configs at a time, compiles them at once in compile_pool (one of its
    own if None), then times them, the next batch compiling while this one is timed: a tune compiles what it
    times, not the whole search space. `then`, the study run next on this device: its first configs (known
    before it starts) compile in the pool meanwhile, so it does not wait for a compile round of its own.
    release_pool: the caller will compile nothing more in compile_pool; it is released (CompilePool.release) as
    soon as the trials are timed, so its processes exit during the finish. A pool of its own always is.
    """
    info = selection.device_info(device_name)
    dtype = DTYPES_BY_NAME[spec.dtype]
    cpu = _interpreted(device_name)
    if not cpu:  # timing (do_bench's events), the checks and every allocation belong on the tuned GPU
        torch.cuda.set_device(torch.device(device_name))
    seqlens = tuple(min(n, 64) for n in spec.seqlens[:2]) if cpu else spec.seqlens
    space = _space(spec, info, cpu)
    default, default_name = baseline(spec, device_name, info)
    own_pool = compile_pool is None and not cpu and spec.trials > 0
    pool = None if cpu else timing.CompilePool(os.cpu_count() or 1) if own_pool else compile_pool
    batches = 0

    def prepare(configs):
        nonlocal batches
        wait = pool.start(spec.kernel, spec.head_dim, dtype, spec.mask, configs, seqlens=seqlens,
                          device=device_name, varlen=spec.varlen)  # fmt: skip
        batches += 1
        # The pool takes jobs in order: the next study's first configs go in behind this study's first two batches
        # (both asked at its start), or behind its only one.
        if then is not None and batches == min(2, -(-spec.trials // BATCH)):
            _prefetch(then, device_name, info, pool)
        return wait

    width = 2 * spec.head_dim if cpu else 2048
    tokens = 64 if cpu else spec.tokens
    measure = timing.make_measure(spec.kernel, spec.head_dim, dtype, spec.mask, seqlens=seqlens,
                                 device=device_name, tokens=tokens, width=width, varlen=spec.varlen,
                                 with_forward=spec.in_training_call)  # fmt: skip
    shape = (1, 2, 1, 70, 70, spec.head_dim) if cpu else (2, 8, 2, 1000, 1000, spec.head_dim)

    def verify(cfg):
        if spec.kernel == "fwd":
            r = verification.check_forward(shape, dtype=dtype, causal=spec.mask, device=device_name, config=cfg,
                                        varlen=spec.varlen)  # fmt: skip
            return None if r.passed else f"relative error {r.rel_err:.1e}"
        key = "dkdv_config" if spec.kernel == "bwd_dkdv" else "dq_config"
        err = verification.check_backward(shape, dtype=dtype, causal=spec.mask, device=device_name,
                                       varlen=spec.varlen, **{key: cfg})  # fmt: skip
        return None if err <= 2 * verification.REL_TOLERANCE[dtype] else f"gradient relative error {err:.1e}"

    def timed():  # the trials are timed, before the finish
        if pool is not None and (own_pool or release_pool):
            pool.release()
        if finalize:
            _await_others(spec, info)

    try:
        result = tuner.tune(
            device=info, kernel=spec.kernel, head_dim=spec.head_dim, dtype=dtype, causal=spec.causal,
            measure=measure, trials=spec.trials, timeout_s=spec.timeout_s, space=space, storage=_storage(spec.storage),
            verify=verify if finalize else None, remeasure_top=3 if finalize else 1, on_trial=on_trial,
            seed=spec.seed, variant=spec.variant, prepare=prepare if pool is not None else None,
            batch_size=BATCH if pool is not None else 1, default=default, incumbent=spec.incumbent, run=spec.run,
            on_timed=timed,
        )  # fmt: skip
    finally:
        if own_pool:
            pool.close()
    flops = 0.0 if cpu else sum(
        timing.attention_flops(max(1, tokens // n), max(1, width // spec.head_dim), n, n, spec.head_dim,
                              causal=spec.mask, mode=spec.timed_mode)
        for n in seqlens
    )  # fmt: skip
    tflops = lambda ms: round(flops / (ms * 1e-3) / 1e12, 1) if ms and flops else None
    _check_plausible(result, tflops, info)
    key = spec.key
    entry = store.Entry(
        key=key,
        config=result.best, ms=round(result.best_ms, 4), tflops=tflops(result.best_ms),
        baseline={"name": default_name, "config": result.default.to_dict(),
                  "ms": result.default_ms, "tflops": tflops(result.default_ms)},
        trials=result.measured, spread=measure.spread(result.best) if finalize else None,
        triton_version=planner.triton_version(), torch_version=str(torch.__version__),
        template_hash=codegen.entry_code_hash(key, result.best),
        date=datetime.date.today().isoformat(),
    )  # fmt: skip
    return result, entry


def baseline(spec: StudySpec, device_name: str, info: DeviceInfo | None = None) -> tuple[planner.KernelConfig, str]:
    """(config, name) a study must beat, timed first: the planner's default; for a length bucket's study ("short",
    "medium"), the config calls of those lengths run without its entry — the "all" entry, tuned at other lengths — so
    a bucket's entry is written only as at least as fast as that at its own lengths (a tuned config is never slower
    than its baseline).
    info: the device's DeviceInfo, if already read.
    """
    dtype = DTYPES_BY_NAME[spec.dtype]
    if spec.seqlen_bucket != "all":
        config, source = selection.resolve(spec.kernel, spec.head_dim, dtype, spec.causal, device_name,
                                           window=spec.window is not None, varlen=spec.varlen)  # fmt: skip
        if source != "planner-default":
            return config, "seqlen_bucket all"
    info = info or selection.device_info(device_name)
    default = planner.default_config(spec.head_dim, dtype, causal=spec.causal, kernel=spec.kernel, device=info)
    return default, "planner-default"


def incumbent(spec: StudySpec, path: Path) -> planner.KernelConfig | None:
    """The config the tuned-config file at `path` holds for spec's key, or None (no file, no entry, unreadable).

    Stale entries count: their config won under the templates of their day, a strong first guess under today's."""
    try:
        _, entries = store.read_file(path)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return next((e.config for e in entries if e.key == spec.key), None)


# The lengths an "all" study falls back to where bucket entries leave it fewer than two (the longest grid lengths).
LONG_LENGTHS = (8192, 16384)


def unserved_lengths(spec: StudySpec, path: Path) -> tuple[int, ...]:
    """spec's lengths less those a short or medium entry in the file at `path` serves for the same key, so an "all"
    entry is tuned where calls will use it (docs/PERF.md v17: tuned at 1k + 4k + 16k beside both bucket entries,
    the d=64 causal forward's "all" entry chose a config ~4 % slower at N = 16k, the one length it served); where
    fewer than two remain, LONG_LENGTHS join them. A bucket study's own lengths are returned as they are."""
    if spec.seqlen_bucket != "all":
        return spec.seqlens
    try:
        _, entries = store.read_file(path)
    except (OSError, ValueError, yaml.YAMLError):
        return spec.seqlens
    keys = {e.key for e in entries}
    served = {bucket for bucket in lengths.BUCKET_RANGES if replace(spec, seqlen_bucket=bucket).key in keys}
    kept = tuple(n for n in spec.seqlens if lengths.bucket_of(n) not in served)  # the store's own length rule
    return kept if len(kept) >= 2 else tuple(sorted({*kept, *LONG_LENGTHS}))


def _space(spec: StudySpec, info: DeviceInfo, cpu: bool) -> list[planner.KernelConfig]:
    if cpu:  # a few small tiles: the interpreter's time grows with the tile count
        return [planner.INTERPRETER_CONFIG, *(planner.KernelConfig(m, n, 4, 1) for m in (16, 64) for n in (16, 64))]
    return [c for c, _ in planner.plan(info, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.kernel).accepted]


def _prefetch(spec: StudySpec, device_name: str, info: DeviceInfo, pool: timing.CompilePool) -> None:
    """Starts compiling the configs `spec`'s study will time first; nobody waits: they land in Triton's cache."""
    dtype = DTYPES_BY_NAME[spec.dtype]
    space = _space(spec, info, cpu=False)
    first = tuner.first_configs(device=info, kernel=spec.kernel, head_dim=spec.head_dim, dtype=dtype,
                                causal=spec.causal, trials=spec.trials, space=space,
                                default=baseline(spec, device_name, info)[0], incumbent=spec.incumbent)  # fmt: skip
    pool.start(spec.kernel, spec.head_dim, dtype, spec.mask, first, seqlens=spec.seqlens, device=device_name,
               varlen=spec.varlen)  # fmt: skip


def _check_plausible(result: tuner.TuneResult, tflops: Callable, info: DeviceInfo) -> None:
    """Refuses a result whose timing no GPU of this kind could produce, before it reaches a config file."""
    from ..config.device import tflops_ceiling

    ceiling, best = tflops_ceiling(info), tflops(result.best_ms)
    if ceiling is not None and best is not None and best > ceiling:
        raise RuntimeError(
            f"{result.study_name}: the winner measured {best:,.0f} TFLOP/s, above the {ceiling:,.0f} that "
            f"{info.name}'s tensor cores can reach: the timing did not measure the kernel (were the events recorded "
            "on another GPU?). Nothing was written."
        )


def device_summary(info: DeviceInfo) -> dict:
    return {"name": info.name, "slug": info.slug, "capability": list(info.capability), "sm_count": info.sm_count,
            "smem_per_block": info.smem_per_block}  # fmt: skip


def config_path(device_name: str, config_dir: Path) -> Path:
    """The file a tune on this device writes: <config_dir>/<gpu slug>.yaml."""
    return Path(config_dir) / f"{selection.device_info(device_name).slug}.yaml"


def write(entry: store.Entry, device_name: str, config_dir: Path) -> Path:
    info = selection.device_info(device_name)
    path = config_path(device_name, config_dir)
    store.write_entries(path, device_summary(info), [entry])
    return path


def _worker(number: int, device_name: str, compile_workers: int, environment: dict[str, str], inbox, outbox) -> None:
    """A worker of run_parallel_many: runs the jobs it is sent (its plan first, as one list), in order, until it is
    sent None. A job is ("trials", index, spec): time the study, with the run's other workers, until its budget
    is spent; or ("finish", index, spec): re-time its best configs, verify, and send back the (result, entry).
    Every job is answered on outbox with ("done", kind, index, worker number, problem or None, payload); each
    timed trial is told as ("progress", index, worker number, (timed by the run, trials, best ms, elapsed s)).

    It lives for the whole tune, so its CUDA context and its compile pool start once, not once per study; it
    knows the jobs queued behind the current one, so the next study's first configs compile meanwhile.
    """
    import queue

    processes.adopt(environment)  # the caller's, not the fork server's (fa2tune.tune.processes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it stops the workers (SIGTERM)
    # The pool first, forked from this process before it touches CUDA (forked children of a process that has
    # cannot use it): its processes start with torch and fa2tune imported; each creates its CUDA context with its
    # first compile, after this one has its own.
    pool = None
    if not _interpreted(device_name):
        pool = timing.CompilePool(compile_workers, context=processes.fork_context())
    signal.signal(signal.SIGTERM, _stop_now)
    if device_name.startswith("cuda"):
        torch.cuda.set_device(torch.device(device_name))
    jobs: deque = deque()

    def take(message) -> None:  # a job, None (stop), or a list of jobs: the worker's whole plan, sent at once
        if isinstance(message, list):
            jobs.extend(message)
        else:
            jobs.append(message)

    try:
        while True:
            if not jobs:
                take(inbox.get())
            with contextlib.suppress(queue.Empty):
                while True:
                    take(inbox.get_nowait())
            if (job := jobs.popleft()) is None:
                break
            kind, index, spec = job
            # The pool serves this worker's trials jobs, all sent at the start in one message; after the last, it
            # is let go while the study's finish runs. A job of a worker that died can come later: it runs with a
            # pool of its own.
            live_pool = pool if pool is not None and not pool.released else None
            release = kind == "trials" and not any(j is not None and j[0] == "trials" for j in jobs)
            if kind == "trials" and _spent(spec, device_name):  # others used the budget: answer at once
                if release and live_pool is not None:
                    live_pool.release()
                outbox.put(("done", kind, index, number, None, None))
                continue
            then = next((j[2] for j in jobs if j is not None and j[0] != "finish"), None)

            def on_trial(*state, index=index):  # (timed, trials, best ms, elapsed s), for the progress line
                outbox.put(("progress", index, number, state))

            try:
                done = run_study(spec, device_name, finalize=kind == "finish", compile_pool=live_pool,
                                 on_trial=on_trial, then=then, release_pool=release)  # fmt: skip
                outbox.put(("done", kind, index, number, None, done if kind == "finish" else None))
            except Exception as exc:  # one study failing here is reported; the worker carries on with the next
                outbox.put(("done", kind, index, number, timing.failure_reason(exc), None))
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    _leave_now(outbox)


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
    and the main process, which joins this one, waits with it — the end of a 2-GPU tune on the 2×H200 host spent
    2.4 s between the last finish and the workers' exit (docs/TUNING.md, session 7). So they are sent SIGTERM and
    left to exit (their results are unwanted; Triton writes a cache entry under a temporary name and renames it,
    so a killed compile leaves at most a stray temporary directory, never a broken entry), the answers still
    buffered are flushed, and the process exits at once, skipping multiprocessing's exit path (which would join
    the children again).
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


def _study_name(spec: StudySpec, info: DeviceInfo) -> str:
    return tuner.study_name(info, spec.kernel, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.causal, spec.variant)


# The longest a finish waits for other processes' timings (_await_others): a process that still beats its heartbeat
# but never tells its trial (hung) does not hold the others' finish for ever.
AWAIT_OTHERS_S = 600.0


def _await_others(spec: StudySpec, info: DeviceInfo, poll_s: float = 0.5) -> None:
    """Waits while other processes sharing spec's study are timing configs of it (RUNNING trials marked timed_by),
    so a finish ranks every config the budget holds: a tune on another host that is still timing when this one's
    trials end would otherwise be left out of this host's choice. A dead process's trial ends as stale (each
    opening of the study fails those), so the wait ends within STALE_AFTER_S of a crash; at most AWAIT_OTHERS_S."""
    if spec.storage is None:
        return
    running, deadline = (optuna.trial.TrialState.RUNNING,), time.monotonic() + AWAIT_OTHERS_S
    me = tuner.process_tag()
    while time.monotonic() < deadline:
        study = optuna.load_study(study_name=_study_name(spec, info), storage=_storage(spec.storage))
        trials = study.get_trials(deepcopy=False, states=running)
        if not any(t.user_attrs.get("timed_by", me) != me for t in trials):
            return
        time.sleep(poll_s)


def _spent(spec: StudySpec, device_name: str) -> bool:
    """Whether the study holds its whole budget timed already (tuner.timed_configs: by the run's workers, or before
    the run) — read from the storage, without the inputs, planner and compile-ahead a study's start costs (1-2 s a
    job on the H200 host)."""
    if spec.storage is None:
        return False
    try:
        study = optuna.load_study(study_name=_study_name(spec, selection.device_info(device_name)),
                                  storage=_storage(spec.storage))  # fmt: skip
    except KeyError:  # no worker has opened it yet
        return False
    return len(tuner.timed_configs(study)) >= spec.trials


def run_parallel(
    spec: StudySpec, device_names: list[str], *, report: Callable[[str], None] = print
) -> tuple[tuner.TuneResult, store.Entry, dict[str, int]]:
    """run_parallel_many for one study."""
    return run_parallel_many([spec], device_names, report=report)[0]


Progress = Callable[[int, int, tuple[int, int, float, float]], None]
Job = tuple[str, int, StudySpec]  # (kind, study index, spec: its run and budget, this worker's seed)


def deal(specs: list[StudySpec], count: int, run: str) -> list[list[Job]]:
    """Each of `count` workers' jobs, in order: every study, worker i starting at study i·len(specs)/count and
    taking the rest in turn, each worker with its own sampler seed, all with the study's whole budget shared
    as `run` (tuner.tune stops every worker of a run once the run has timed the budget).

    Shared budgets keep the GPUs equally busy whatever the studies cost: a worker times its first study until
    the budget is spent, by itself or with the others once they get there, then moves on; the last trials of
    the tune are timed by every worker, and they stop within one timing of each other. Fixed shares (half of
    every study each, sessions 3-5) left one GPU idle for the other's last trials: 8 s of a 95 s tune on the
    2×H200 host, where causal trials take 1.85 s and non-causal 1.4 s. Each worker compiles the first configs
    of its next study while it times this one (run_study's `then`).
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
) -> list[tuple[tuner.TuneResult, store.Entry, dict[str, int]]]:
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
        _storage(url)  # its tables created here, before the workers open it: not by two of them at once
    context = processes.context()  # forked from the fork server: torch and fa2tune are imported there once
    count = len(device_names)
    compile_workers = max(1, (os.cpu_count() or 1) // count)  # the host's cores, shared by the workers
    outbox = context.Queue()
    workers = []
    for number, name in enumerate(device_names):
        inbox = context.Queue()
        process = context.Process(target=_worker, args=(number, name, compile_workers, dict(os.environ), inbox, outbox))
        process.start()
        workers.append((name, process, inbox))
    run = uuid.uuid4().hex  # marks the trials this run's workers time: their shared budgets count them
    pending: dict[int, list[Job]] = {i: [] for i in range(count)}  # jobs sent and not yet answered, in order
    dead: dict[int, int] = {}
    finished: dict[int, tuple[tuner.TuneResult, store.Entry]] = {}
    ended: set[int] = set()  # studies a worker's trials job ended on: their budget is spent
    finishing: set[int] = set()  # studies whose finish job was sent

    def send(i: int, job: Job) -> None:
        pending[i].append(job)
        workers[i][2].put(job)

    def send_plan(i: int, plan: list[Job]) -> None:
        """The worker's jobs in one message: all there when it looks at its first (it lets its compile pool go
        after its last trials job)."""
        pending[i].extend(plan)
        workers[i][2].put(list(plan))

    def least_busy() -> int | None:
        """The live worker with the least left to do. A share of a study whose budget is spent is nothing to do
        (the worker answers it at once, or after the one trial it is timing), so the last studies' finishes go to
        different GPUs, not one after the other to the same."""
        alive = [i for i in range(count) if i not in dead]
        left = lambda i: sum(not (job[0] == "trials" and job[1] in ended) for job in pending[i])
        return min(alive, key=lambda i: (left(i), i)) if alive else None

    def answered(kind: str, index: int, i: int, problem: str | None, payload) -> None:
        pending[i].remove(next(job for job in pending[i] if job[:2] == (kind, index)))
        if problem:
            report(f"worker {i} on {workers[i][0]} failed study {index} ({problem}); the others carry on")
        elif payload is not None:
            finished[index] = payload
        # A job that ended well leaves the study's budget spent; one that failed says so only if it was the last.
        if kind == "trials" and (problem is None or not any(job[:2] == ("trials", index) for jobs in pending.values()
                                                             for job in jobs)):  # fmt: skip
            ended.add(index)
        send_finishes()

    def send_finishes() -> None:
        """Sends the finish of every ended study no worker is timing now (a worker works on its oldest job)."""
        current = {jobs[0][:2] for i, jobs in pending.items() if jobs and i not in dead}
        for index in sorted(ended - finishing):
            if ("trials", index) not in current and (j := least_busy()) is not None:
                finishing.add(index)
                send(j, ("finish", index, replace(specs[index], trials=0)))

    def died(i: int, code: int) -> None:
        dead[i] = code
        report(f"worker {i} on {workers[i][0]} died (exit code {code}); the others carry on with its work")
        # A trial it was timing stays RUNNING and would count against the budget: fail it, so it does not.
        for url in dict.fromkeys(spec.storage for spec in specs):
            if abandoned := tuner.fail_abandoned(_storage(url), run, workers[i][1].pid):
                report(f"worker {i} was timing {abandoned} config(s) when it died: marked failed")
        jobs, pending[i] = pending[i], []
        for job in jobs:
            if (j := least_busy()) is not None:
                send(j, job)
        send_finishes()

    try:
        for i, plan in enumerate(deal(specs, count, run=run)):
            send_plan(i, plan)
        while any(pending.values()):
            message = _next_message(outbox)
            if message is not None and message[0] == "progress":
                if progress is not None:
                    progress(*message[1:])
            elif message is not None and message[3] not in dead:
                answered(message[1], message[2], *message[3:])
            for i, (_, process, _) in enumerate(workers):
                if i not in dead and not process.is_alive():
                    died(i, process.exitcode if process.exitcode else 1)
    except BaseException:  # Ctrl-C, or a failure here: the workers stop now, not after the jobs they were sent
        for _, process, _ in workers:
            process.terminate()
        raise
    finally:
        for _, process, inbox in workers:
            if process.is_alive():
                inbox.put(None)
        for _, process, _ in workers:
            process.join(timeout=60)
    codes = {f"{i}:{name}": dead.get(i, 0) for i, (name, _, _) in enumerate(workers)}
    results = []
    for index, spec in enumerate(specs):
        if index not in finished:  # no live worker could finish it: finish here (one that cannot finish raises)
            finished[index] = run_study(replace(spec, trials=0), device_names[0])
        results.append((*finished[index], dict(codes)))
    return results


def _next_message(outbox, timeout_s: float = 2.0):
    """The next message from the workers, or None after a few seconds (so deaths are noticed)."""
    import queue

    try:
        return outbox.get(timeout=timeout_s)
    except queue.Empty:
        return None
