"""One tuning job: for a device, plan → compile in parallel → Optuna study → verify → a store entry.

`run_study` does it on one device. `run_parallel` runs one worker process per device on one shared study (an
Optuna journal file by default), then finishes in this process: the best trials of all workers are timed again
on the first device, verified, and written. A worker that dies is reported and does not stop the others.
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
    own if None), then times them: a tune compiles what it times, not the whole search space.
    """
    info = selection.device_info(device_name)
    dtype = DTYPES_BY_NAME[spec.dtype]
    cpu = _interpreted(device_name)
    seqlens = tuple(min(n, 64) for n in spec.seqlens[:2]) if cpu else spec.seqlens
    if cpu:  # a few small tiles: the interpreter's time grows with the tile count
        space = [planner.INTERPRETER_CONFIG, *(planner.KernelConfig(m, n, 4, 1) for m in (16, 64) for n in (16, 64))]
    else:
        space = [c for c, _ in planner.plan(info, spec.head_dim, dtype, spec.kernel).accepted]
    own_pool = compile_pool is None and not cpu and spec.trials > 0
    pool = None if cpu else bench.CompilePool(os.cpu_count() or 1) if own_pool else compile_pool

    def prepare(configs):
        return pool.compile(spec.kernel, spec.head_dim, dtype, spec.mask, configs, seqlens=seqlens,
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

    result = tuner.tune(
        device=info, kernel=spec.kernel, head_dim=spec.head_dim, dtype=dtype, causal=spec.causal, measure=measure,
        trials=spec.trials, timeout_s=spec.timeout_s, space=space, storage=_storage(spec.storage),
        verify=verify if finalize else None, remeasure_top=3 if finalize else 1, on_trial=on_trial,
        seed=spec.seed, variant=spec.variant, prepare=prepare if pool is not None else None,
        batch_size=BATCH if pool is not None else 1,
    )  # fmt: skip
    if own_pool:
        pool.close()
    flops = 0.0 if cpu else sum(
        bench.attention_flops(max(1, tokens // n), max(1, width // spec.head_dim), n, n, spec.head_dim,
                              causal=spec.mask, mode="fwd" if spec.kernel == "fwd" else "bwd")
        for n in seqlens
    )  # fmt: skip
    tflops = lambda ms: round(flops / (ms * 1e-3) / 1e12, 1) if ms and flops else None
    entry = store.Entry(
        key=store.EntryKey(head_dim=spec.head_dim, dtype=spec.dtype, causal=spec.causal, kernel=spec.kernel,
                           window=spec.window is not None, varlen=spec.varlen),
        config=result.best, ms=round(result.best_ms, 4), tflops=tflops(result.best_ms),
        baseline={"name": "planner-default", "config": result.default.to_dict(),
                  "ms": result.default_ms, "tflops": tflops(result.default_ms)},
        trials=result.measured, spread=measure.spread(result.best) if finalize else None,
        triton_version=_triton_version(), torch_version=str(torch.__version__),
        template_hash=codegen.template_hash(), date=datetime.date.today().isoformat(),
    )  # fmt: skip
    return result, entry


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


def _worker(spec: StudySpec, device_name: str, compile_workers: int) -> None:
    if device_name.startswith("cuda"):
        torch.cuda.set_device(torch.device(device_name))
    if _interpreted(device_name):
        run_study(spec, device_name, finalize=False)
        return
    with bench.CompilePool(compile_workers) as pool:
        run_study(spec, device_name, finalize=False, compile_pool=pool)


def run_parallel(
    spec: StudySpec, device_names: list[str], *, report: Callable[[str], None] = print
) -> tuple[tuner.TuneResult, store.Entry, dict[str, int]]:
    """One worker process per device, each timing spec.trials / len(devices) configs of one shared study.

    Returns the finished result (re-timed and verified on the first device), its entry, and each worker's exit
    code (non-zero: that worker died; its completed trials still count).
    """
    if spec.storage is None:
        raise ValueError("run_parallel needs a shared storage (an Optuna URL or a journal file path)")
    share = max(1, -(-spec.trials // len(device_names)))
    context = mp.get_context("spawn")  # CUDA cannot be used in forked children
    compile_workers = max(1, (os.cpu_count() or 1) // len(device_names))  # the host's cores, shared by the workers
    workers = [(name, context.Process(target=_worker, args=(replace(spec, trials=share, seed=spec.seed + i), name,
                                                            compile_workers)))
               for i, name in enumerate(device_names)]  # fmt: skip
    for _, process in workers:
        process.start()
    codes = {}
    for i, (name, process) in enumerate(workers):
        process.join()
        codes[f"{i}:{name}"] = process.exitcode
        if process.exitcode != 0:
            report(f"worker {i} on {name} died (exit code {process.exitcode}); the others carry on")
    result, entry = run_study(replace(spec, trials=0), device_names[0])
    return result, entry, codes
