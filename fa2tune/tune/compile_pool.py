"""Processes that compile kernel configs into Triton's disk cache while the tuning process times others.

Compiling is CPU work and most of a tune's time; the timing process then only loads binaries. A CompilePool starts
once and takes every batch — the attention kernels' configs through `start`, any other calls that build kernels (the
decode tuner's) through `start_calls`; `precompile` is one batch in a pool of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

import torch

from ..config import group_split
from .records import failure_reason
from .workload import kernel_inputs, run_kernel


def _run_attention(kernel, head_dim, dtype, causal, cfg, seqlen, device, varlen, group) -> None:
    # batch and K/V heads of 2, not 1: Triton compiles an int argument equal to 1 as a constant, so a binary built
    # with H_Q = 1 would not be the one a real launch (H_Q = 16) loads from the cache. The query heads make the
    # group the timed calls have: 1 compiles as a constant, others (GQA) as a run-time value.
    x = kernel_inputs(kernel, causal, 2, 2 * group, seqlen, head_dim, dtype=dtype, device=device, varlen=varlen,
                      heads_kv=2)
    with _split_as_timed(kernel, cfg, causal, group):
        run_kernel(kernel, cfg, x, causal)
        if x.q.is_cuda:
            torch.cuda.synchronize()  # a launch error surfaces here, as this config's failure


@contextlib.contextmanager
def _split_as_timed(kernel, cfg, causal, group):
    """The dK/dV kernel's group split (config.group_split) of the timed calls, forced on the example's small grid,
    whose tail would split it otherwise — the kernel's group and split are compiled as constants where they are 1.
    The timed calls' grids are full (batch·N of thousands of tokens): there the fused rule alone splits. A dQ
    study's dK/dV partner leaves dQ to it (workload.dq_partner)."""
    saved = os.environ.get(group_split.DKDV_HEADS_ENV)
    if group == 1 or kernel == "fwd" or saved is not None:  # nothing to split, or the caller's override rules
        yield
        return
    fused = kernel == "bwd_dkdv" and cfg.fused_dq
    os.environ[group_split.DKDV_HEADS_ENV] = str(group_split.many_waves_heads(group, causal=_causal(causal),
                                                                              fused_dq=fused))  # fmt: skip
    try:
        yield
    finally:
        del os.environ[group_split.DKDV_HEADS_ENV]


def _causal(mask) -> bool:
    """A study's mask (a bool or a types.Mask) as the split rule reads it (launch.backward's _GroupSplit): causal,
    a band splitting as no mask does."""
    return mask if isinstance(mask, bool) else mask.causal and not mask.banded


def _call_one(job) -> str | None:
    """Runs function(*arguments) of job = (function, arguments), a call that builds kernels; its failure's reason,
    or None."""
    function, arguments = job
    if _released is not None and _released.is_set():  # the tune times nothing more: skip it (CompilePool.release)
        return None
    try:
        function(*arguments)
        return None
    except Exception as exc:  # failures are data
        return failure_reason(exc)


_released = None  # in a compile process: its pool's release event (CompilePool.release)


def _start_compiler(environment: dict[str, str], released=None) -> None:
    """A compile process's start: the caller's environment, its pool's release event, and a lower priority.

    It does not create its CUDA context here: a pool's processes all doing so at once make the tuning process's
    own context wait behind theirs (4.3 s instead of 0.5 s on the H200 host). Each creates it with its first
    compile, after the tuning process has its own.
    """
    from . import processes

    global _released
    processes.adopt(environment)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the tuning process's: it lets the pool go
    _released = released
    try:
        # Compiles run while the tuning process times kernels: a timing process waiting for a core would launch
        # late and read slow.
        os.nice(10)
    except OSError:  # not allowed here: compile at normal priority
        pass


class CompilePool:
    """Spawned processes that compile kernel configs (CPU work, most of a tune's time) into Triton's disk cache, so
    the timing process then only loads binaries. Start it once and hand it every batch: each process pays its
    start-up once. Use as a context manager, or call close().

    context: where the processes come from (fa2tune.tune.processes): by default forked from the fork server, which
    imported torch and fa2tune once for all of them; a process that has not initialized CUDA may pass
    processes.fork_context() to fork them from itself.
    """

    def __init__(self, workers: int = 16, context=None):
        from . import processes

        self.workers = workers
        context = context or processes.context()
        self._released = context.Event()
        self._pool = context.Pool(workers, initializer=_start_compiler, initargs=(dict(os.environ), self._released))

    def compile(self, kernel, head_dim, dtype, causal, configs, *, seqlens, device="cuda:0", varlen=False,
                group=1) -> dict:  # fmt: skip
        """Compiles every config; returns {config: failure reason} for those that failed.

        Each length N is compiled at 256 + N mod 256, a short length with the same divisibility by every block
        size, hence the same Jinja variant (even or ragged tails) as N itself; `group` query heads a K/V head, as
        the timed calls have them.
        """
        wait = self.start(kernel, head_dim, dtype, causal, configs, seqlens=seqlens, device=device, varlen=varlen,
                          group=group)  # fmt: skip
        return {cfg: reason for cfg in configs if (reason := wait(cfg))}

    def start(self, kernel, head_dim, dtype, causal, configs, *, seqlens, device="cuda:0", varlen=False, group=1):
        """compile() in the background: returns at once with wait(config) -> its failure reason or None.

        wait blocks for that config's compile only (a config not in `configs` returns None at once), so a tuner
        can time the first config of a batch as soon as it is built, not after the slowest of the batch;
        wait.ready(config) says whether it would block. The processes take configs up in the order given, and
        batches in the order started.
        """
        lengths = sorted({256 + n % 256 for n in seqlens})
        arguments = lambda cfg, n: (kernel, head_dim, dtype, causal, cfg, n, device, varlen, group)
        return self.start_calls({cfg: [(_run_attention, arguments(cfg, n)) for n in lengths]
                                 for cfg in dict.fromkeys(configs)})  # fmt: skip

    def start_calls(self, calls: dict) -> Callable:
        """Runs calls that build kernels into Triton's disk cache in the background: `calls` maps a key (a config)
        to its (function, arguments) pairs, the functions module-level and the arguments picklable; the processes
        take them up in the order given. Returns wait(key) -> the first failure reason of its calls, or None (also
        for a key not given), which blocks for that key's calls only, and wait.ready(key), whether it would block."""
        pending = {key: [self._pool.apply_async(_call_one, (call,)) for call in key_calls]
                   for key, key_calls in calls.items()}  # fmt: skip

        def wait(key) -> str | None:
            return next((reason for result in pending.get(key, ()) if (reason := result.get())), None)

        def ready(key) -> bool:
            """Whether wait(key) would return at once."""
            return all(result.ready() for result in pending.get(key, ()))

        wait.ready = ready
        return wait

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def release(self) -> None:
        """For a tune that will time nothing more: the compiles not started yet are skipped (their wait says
        None, as for a config never started), and the processes exit once their current compile is done — while
        the caller goes on (the study's finish), not at close(). Waiting at the end for the queued batches and
        compiles-ahead nobody would load, and for 16 processes to tear down their CUDA contexts, costs 3-4 s at
        the end of a tune on the 2×H200 host. (Not Pool.terminate: it can hang, python/cpython#78178; on the H200
        host it does not return within 200 s, cause unknown.) Nothing can be started after this."""
        self._released.set()
        self._pool.close()

    def close(self) -> None:
        """Waits for every compile started (none not yet begun, after release()), then for the processes' exit."""
        self._pool.close()
        self._pool.join()

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def precompile(kernel, head_dim, dtype, causal, configs, *, seqlens, device="cuda:0", workers=16, varlen=False,
               group=1) -> dict:  # fmt: skip
    """CompilePool.compile in a pool of its own. Returns {config: failure reason}."""
    with CompilePool(workers) as pool:
        return pool.compile(kernel, head_dim, dtype, causal, configs, seqlens=seqlens, device=device, varlen=varlen,
                            group=group)  # fmt: skip
