"""One tuning job: for a device, plan → compile in parallel → Optuna study → verify → a store entry.

`run_study` does it on one device. `run_parallel_many` runs one worker process per device on shared studies (an
Optuna journal file by default), without a barrier between studies, and has the workers finish the studies too
(best trials timed again, winner verified). A worker that dies is reported and does not stop the others.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import bench, codegen, planner, selection, selfcheck, store, tuner
from .inputs import DTYPES_BY_NAME
from .types import DeviceInfo, Mask

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

    @property
    def mask(self) -> Mask:
        return Mask(causal=self.causal, window=self.window or (-1, -1))

    @property
    def variant(self) -> str:
        """The study-name suffix of the template variant: "", "window", "varlen" or "window+varlen"."""
        return "+".join(name for name, on in (("window", self.window is not None), ("varlen", self.varlen)) if on)


def _storage(url: str | None):
    """An Optuna storage: None (in memory), a database URL, or a journal file (a path ending in .journal/.log)."""
    if url is None or "://" in url:
        return url
    import optuna

    Path(url).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))


def _interpreted(device_name: str) -> bool:
    return device_name == "cpu"


def run_study(
    spec: StudySpec,
    device_name: str,
    *,
    on_trial: Callable | None = None,
    finalize: bool = True,
    compile_pool: bench.CompilePool | None = None,
) -> tuple[tuner.TuneResult, store.Entry]:
    """Tunes one kernel on one device; with finalize=False only times trials (a worker of run_parallel).

    On a GPU the study asks Optuna for BATCH configs at a time, compiles them at once in compile_pool (one of its
    own if None), then times them, the next batch compiling while this one is timed: a tune compiles what it
    times, not the whole search space.
    """
    info = selection.device_info(device_name)
    dtype = DTYPES_BY_NAME[spec.dtype]
    cpu = _interpreted(device_name)
    if not cpu:  # timing (do_bench's events), the checks and every allocation belong on the tuned GPU
        torch.cuda.set_device(torch.device(device_name))
    seqlens = tuple(min(n, 64) for n in spec.seqlens[:2]) if cpu else spec.seqlens
    if cpu:  # a few small tiles: the interpreter's time grows with the tile count
        space = [planner.INTERPRETER_CONFIG, *(planner.KernelConfig(m, n, 4, 1) for m in (16, 64) for n in (16, 64))]
    else:
        space = [c for c, _ in planner.plan(info, spec.head_dim, dtype, spec.kernel).accepted]
    own_pool = compile_pool is None and not cpu and spec.trials > 0
    pool = None if cpu else bench.CompilePool(os.cpu_count() or 1) if own_pool else compile_pool

    def prepare(configs):
        return pool.start(spec.kernel, spec.head_dim, dtype, spec.mask, configs, seqlens=seqlens,
                          device=device_name, varlen=spec.varlen)  # fmt: skip

    width = 2 * spec.head_dim if cpu else 2048
    tokens = 64 if cpu else spec.tokens
    measure = bench.make_measure(spec.kernel, spec.head_dim, dtype, spec.mask, seqlens=seqlens,
                                 device=device_name, tokens=tokens, width=width, varlen=spec.varlen)  # fmt: skip
    shape = (1, 2, 1, 70, 70, spec.head_dim) if cpu else (2, 8, 2, 1000, 1000, spec.head_dim)

    def verify(cfg):
        if spec.kernel == "fwd":
            r = selfcheck.check_forward(shape, dtype=dtype, causal=spec.mask, device=device_name, config=cfg,
                                        varlen=spec.varlen)  # fmt: skip
            return None if r.passed else f"relative error {r.rel_err:.1e}"
        key = "dkdv_config" if spec.kernel == "bwd_dkdv" else "dq_config"
        err = selfcheck.check_backward(shape, dtype=dtype, causal=spec.mask, device=device_name,
                                       varlen=spec.varlen, **{key: cfg})  # fmt: skip
        return None if err <= 2 * selfcheck.REL_TOLERANCE[dtype] else f"gradient relative error {err:.1e}"

    try:
        result = tuner.tune(
            device=info, kernel=spec.kernel, head_dim=spec.head_dim, dtype=dtype, causal=spec.causal,
            measure=measure, trials=spec.trials, timeout_s=spec.timeout_s, space=space, storage=_storage(spec.storage),
            verify=verify if finalize else None, remeasure_top=3 if finalize else 1, on_trial=on_trial,
            seed=spec.seed, variant=spec.variant, prepare=prepare if pool is not None else None,
            batch_size=BATCH if pool is not None else 1,
        )  # fmt: skip
    finally:
        if own_pool:
            pool.close()
    flops = 0.0 if cpu else sum(
        bench.attention_flops(max(1, tokens // n), max(1, width // spec.head_dim), n, n, spec.head_dim,
                              causal=spec.mask, mode="fwd" if spec.kernel == "fwd" else "bwd")
        for n in seqlens
    )  # fmt: skip
    tflops = lambda ms: round(flops / (ms * 1e-3) / 1e12, 1) if ms and flops else None
    _check_plausible(result, tflops, info)
    key = store.EntryKey(head_dim=spec.head_dim, dtype=spec.dtype, causal=spec.causal, kernel=spec.kernel,
                         window=spec.window is not None, varlen=spec.varlen)  # fmt: skip
    entry = store.Entry(
        key=key,
        config=result.best, ms=round(result.best_ms, 4), tflops=tflops(result.best_ms),
        baseline={"name": "planner-default", "config": result.default.to_dict(),
                  "ms": result.default_ms, "tflops": tflops(result.default_ms)},
        trials=result.measured, spread=measure.spread(result.best) if finalize else None,
        triton_version=_triton_version(), torch_version=str(torch.__version__),
        template_hash=codegen.code_hash(spec.kernel, causal=spec.causal, window=key.window, varlen=key.varlen,
                                        pipeline_qk=bool(result.best.pipeline_qk)),
        date=datetime.date.today().isoformat(),
    )  # fmt: skip
    return result, entry


def _check_plausible(result: tuner.TuneResult, tflops: Callable, info: DeviceInfo) -> None:
    """Refuses a result whose timing no GPU of this kind could produce, before it reaches a config file."""
    from .device import tflops_ceiling

    ceiling, best = tflops_ceiling(info), tflops(result.best_ms)
    if ceiling is not None and best is not None and best > ceiling:
        raise RuntimeError(
            f"{result.study_name}: the winner measured {best:,.0f} TFLOP/s, above the {ceiling:,.0f} that "
            f"{info.name}'s tensor cores can reach: the timing did not measure the kernel (were the events recorded "
            "on another GPU?). Nothing was written."
        )


def _triton_version() -> str:
    import triton

    return triton.__version__


def device_summary(info: DeviceInfo) -> dict:
    return {"name": info.name, "slug": info.slug, "capability": list(info.capability), "sm_count": info.sm_count,
            "smem_per_block": info.smem_per_block}  # fmt: skip


def write(entry: store.Entry, device_name: str, config_dir: Path) -> Path:
    info = selection.device_info(device_name)
    path = Path(config_dir) / f"{info.slug}.yaml"
    store.write_entries(path, device_summary(info), [entry])
    return path


def _worker(number: int, device_name: str, compile_workers: int, inbox, outbox) -> None:
    """A worker of run_parallel_many: runs the jobs it is sent until it is sent None. A job is ("trials", index,
    spec): time a share of a study; or ("finish", index, spec): re-time its best configs, verify, and send back the
    (result, entry). Every job is answered on outbox with ("done", index, worker number, problem or None, payload);
    each timed trial is told as ("progress", index, worker number, (timed, trials, best ms, elapsed s)).

    It lives for the whole tune, so its CUDA context and its compile pool start once, not once per study.
    """
    if device_name.startswith("cuda"):
        torch.cuda.set_device(torch.device(device_name))
    pool = None if _interpreted(device_name) else bench.CompilePool(compile_workers)
    try:
        while (job := inbox.get()) is not None:
            kind, index, spec = job

            def on_trial(*state, index=index):  # (timed, trials, best ms, elapsed s), for the progress line
                outbox.put(("progress", index, number, state))

            try:
                done = run_study(spec, device_name, finalize=kind == "finish", compile_pool=pool, on_trial=on_trial)
                outbox.put(("done", index, number, None, done if kind == "finish" else None))
            except Exception as exc:  # one study failing here is reported; the worker carries on with the next
                outbox.put(("done", index, number, bench.failure_reason(exc), None))
    finally:
        if pool is not None:
            pool.close()


def run_parallel(
    spec: StudySpec, device_names: list[str], *, report: Callable[[str], None] = print
) -> tuple[tuner.TuneResult, store.Entry, dict[str, int]]:
    """run_parallel_many for one study."""
    return run_parallel_many([spec], device_names, report=report)[0]


Progress = Callable[[int, int, tuple[int, int, float, float]], None]


def run_parallel_many(
    specs: list[StudySpec],
    device_names: list[str],
    *,
    report: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> list[tuple[tuner.TuneResult, store.Entry, dict[str, int]]]:
    """One worker process per device for the whole list of studies, each study shared by all workers through its
    storage. Two phases, neither with a barrier per study:

    1. Every worker is sent its share (spec.trials / devices) of every study at once, starting at a different study
       (worker i at study i·S/n) and taking the rest in turn. A worker's compile rounds and start-up then overlap
       the others' timing instead of holding them at a barrier; a worker coming to a study later builds on the
       trials already in it.
    2. Each study is finished (its best configs re-timed, its winner verified) by one worker, studies dealt
       round-robin over the devices, so finishing runs in parallel too.

    Returns per study: the result, its entry, and each worker's exit code (0 if alive at the end; non-zero if it
    died: its completed trials still count, and the others carry on). A study no worker could finish is finished
    in this process on the first device once the workers are done, so nothing else is timed meanwhile.
    progress(study index, worker number, (timed, trials, best ms, elapsed s)) is called for each trial a worker
    times.
    """
    if any(spec.storage is None for spec in specs):
        raise ValueError("run_parallel needs a shared storage (an Optuna URL or a journal file path)")
    context = mp.get_context("spawn")  # CUDA cannot be used in forked children
    count = len(device_names)
    compile_workers = max(1, (os.cpu_count() or 1) // count)  # the host's cores, shared by the workers
    outbox = context.Queue()
    workers = []
    for number, name in enumerate(device_names):
        inbox = context.Queue()
        process = context.Process(target=_worker, args=(number, name, compile_workers, inbox, outbox))
        process.start()
        workers.append((name, process, inbox))
    dead: dict[int, int] = {}
    finished: dict[int, tuple[tuner.TuneResult, store.Entry]] = {}
    waiting: set[tuple[int, int]] = set()  # (worker, study) jobs sent and not yet answered
    try:
        for i, (_, _, inbox) in enumerate(workers):
            first = i * len(specs) // count
            for index in [(first + j) % len(specs) for j in range(len(specs))]:
                share = max(1, -(-specs[index].trials // count))
                inbox.put(("trials", index, replace(specs[index], trials=share, seed=specs[index].seed + i)))
                waiting.add((i, index))
        while waiting:
            _collect(workers, outbox, waiting, dead, finished, report, progress)
        alive = [i for i in range(count) if i not in dead]
        for turn, index in enumerate(range(len(specs)) if alive else []):
            i = alive[turn % len(alive)]
            workers[i][2].put(("finish", index, replace(specs[index], trials=0)))
            waiting.add((i, index))
        while waiting:
            _collect(workers, outbox, waiting, dead, finished, report, progress)
    finally:
        for _, process, inbox in workers:
            if process.is_alive():
                inbox.put(None)
        for _, process, _ in workers:
            process.join(timeout=60)
    codes = {f"{i}:{name}": dead.get(i, 0) for i, (name, _, _) in enumerate(workers)}
    results = []
    for index, spec in enumerate(specs):
        if index not in finished:  # its worker died or failed: finish here (a study that cannot finish raises here)
            finished[index] = run_study(replace(spec, trials=0), device_names[0])
        results.append((*finished[index], dict(codes)))
    return results


def _collect(workers, outbox, waiting, dead, finished, report, progress) -> None:
    """Waits (at most a few seconds) for a worker to answer a job or to die; updates waiting, dead and finished."""
    import queue

    try:
        message = outbox.get(timeout=2.0)
        if message[0] == "progress":
            if progress is not None:
                progress(*message[1:])
            return
        _, index, i, problem, payload = message
        if (i, index) in waiting:
            waiting.discard((i, index))
            if problem:
                report(f"worker {i} on {workers[i][0]} failed study {index} ({problem}); the others carry on")
            elif payload is not None:
                finished[index] = payload
    except queue.Empty:
        pass
    for i, (name, process, _) in enumerate(workers):
        if i not in dead and not process.is_alive():
            dead[i] = process.exitcode if process.exitcode else 1
            report(f"worker {i} on {name} died (exit code {dead[i]}); the others carry on")
        if i in dead:
            waiting.difference_update({job for job in waiting if job[0] == i})
