#!/usr/bin/env python3
"""Host (CPU) time fa2tune spends per call: the Python path of attention() and its backward, and the launches.

For a short sequence this decides the speed: a GPU that finishes before the host has launched the next kernel
waits. Without a flag the kernel launches are replaced by no-ops, so the figure is fa2tune's own overhead (argument
checks, config lookup, autograd), not Triton's launcher or the GPU; no GPU needed. The other modes need a CUDA GPU.

    python scripts/bench_host_overhead.py            # the eager path attention() takes, launches as no-ops
    python scripts/bench_host_overhead.py --op       # the custom op torch.compile sees, called directly
    python scripts/bench_host_overhead.py --gpu      # real launches: Triton's path vs direct, SDPA, autograd's floor
    python scripts/bench_host_overhead.py --split    # where one warp-specialized forward launch's host time goes
    python scripts/bench_host_overhead.py --autograd-split   # a fwd+bwd call: forward, into the backward, its body, out
    python scripts/bench_host_overhead.py --threads  # fwd+bwd with the backward on autograd's thread, pinned, or not
    python scripts/bench_host_overhead.py --waits    # real shapes: does a training call wait for the GPU?

--gpu launches the kernels for real on a shape so small (1×2×64×128) that the GPU is never the limit, through
Triton's launch path and through fa2tune.launch.fastlaunch's direct one (the default; FA2TUNE_DIRECT_LAUNCH=0 turns
it off), in alternating rounds, beside SDPA's flash backend.

--split replays one launch of the shipped d=128 causal forward piece by piece: fa2tune's wrapper, the TMA
descriptors, fastlaunch.launch_tma and its plan (the compiled launcher called with descriptors encoded once per
address), fastlaunch.launch of descriptor objects (Triton's CompiledKernel.run then encodes a CUtensorMap per
descriptor per call), and the TmaLauncher a launch plan calls (launch_tma's key and the per-descriptor lookups
worked out once per call signature) — beside the Triton template's forward, whose launch costs less host time.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

if not {"--gpu", "--split", "--autograd-split", "--threads", "--waits"} & set(sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU needed: nothing is launched

import torch

import fa2tune
from fa2tune.api import ops
from fa2tune.config.types import KernelConfig, Mask
from fa2tune.launch import autograd, layout


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _median(xs: list[float]) -> float:
    """The middle reading (the upper middle of an even count)."""
    return sorted(xs)[len(xs) // 2]


def _time_us(fn, repeats: int = 2000) -> float:
    for _ in range(50):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - start  # host time only: no synchronisation inside the timed loop
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed / repeats * 1e6


def _cases(attend, q, k, v, do):
    detached = [t.detach() for t in (q, k, v)]
    return {
        "forward, no grad": lambda: attend(*detached),
        "forward, grad": lambda: attend(q, k, v),
        "forward + backward": lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), do),
    }


class _KernelLess(torch.autograd.Function):
    """attention()'s autograd.Function with no kernels (outputs allocated, inputs and outputs saved): the host
    time autograd itself takes for a call of that shape, the floor under fa2tune's own."""

    @staticmethod
    def forward(ctx, q, k, v):
        o, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _gpu(rounds: int) -> int:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa2tune.launch import fastlaunch

    if not torch.cuda.is_available():
        print("--gpu needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    ours = _cases(lambda *t: fa2tune.attention(*t, causal=True), q, k, v, do)
    # The tuned forward at d=128 on Hopper is the warp-specialized (Gluon) one; the Triton template's beside it
    triton_fwd = _cases(lambda *t: fa2tune.attention(*t, causal=True, config=KernelConfig(64, 64, 4, 2)), q, k, v, do)
    sdpa = _cases(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v, do)
    kernel_less = _cases(_KernelLess.apply, q, k, v, do)
    # fa2tune's launchers alone, on tensors without grad: what the forward and the backward cost outside autograd
    qd, kd, vd = (t.detach() for t in (q, k, v))
    o, lse = ops.forward(qd, kd, vd, causal=True, scale=0.088)
    launchers = {
        "ops.forward": lambda: ops.forward(qd, kd, vd, causal=True, scale=0.088),
        "ops.backward": lambda: ops.backward(do, qd, kd, vd, o, lse, causal=True, scale=0.088),
    }
    readings: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for label, direct, cases in (("Triton's launch path", False, ours), ("direct launches", True, ours),
                                     ("direct, Triton forward", True, triton_fwd), ("launchers alone", True, launchers),
                                     ("no kernels (autograd)", True, kernel_less)):  # fmt: skip
            fastlaunch._enabled = direct
            for name, fn in cases.items():
                readings.setdefault(label, {}).setdefault(name, []).append(_time_us(fn))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for name, fn in sdpa.items():
                readings.setdefault("SDPA flash", {}).setdefault(name, []).append(_time_us(fn))
    from fa2tune.api import selection

    resolved = selection.resolve("fwd", 128, torch.bfloat16, True, "cuda", seqlen=64)[0]
    print(f"# host µs per call, {torch.cuda.get_device_name()}, 1x2x64x128 bf16 causal, median of {rounds} rounds "
          f"(direct launches taken: {fastlaunch.direct_launches}); forward config {resolved}")  # fmt: skip
    print(f"{'':>22}" + "".join(f"{name:>20}" for name in ours))
    for label, rows in readings.items():
        if label != "launchers alone":
            print(f"{label:>22}" + "".join(f"{_median(xs):20.0f}" for xs in rows.values()))
    print("  launchers alone, no autograd: " + ", ".join(
        f"{name} {_median(xs):.0f}" for name, xs in readings["launchers alone"].items()))  # fmt: skip
    return 0


def _captured(call, name: str = "launch") -> tuple:
    """The arguments of the one fastlaunch.<name> call that call() makes (the last if more): (positional, kwargs)."""
    from fa2tune.launch import fastlaunch

    seen = []
    real = getattr(fastlaunch, name)
    setattr(fastlaunch, name, lambda *args, **kwargs: seen.append((args, kwargs)))
    try:
        call()
    finally:
        setattr(fastlaunch, name, real)
    return seen[-1]


def _split(repeats: int) -> int:
    from triton.backends.nvidia import driver

    from fa2tune.api import selection
    from fa2tune.launch import fastlaunch, warpspec

    if not torch.cuda.is_available():
        print("--split needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(1, 2, 64, device="cuda", dtype=torch.float32)
    config = selection.resolve("fwd", 128, torch.bfloat16, True, "cuda", seqlen=64)[0]
    if not config.warp_specialized:
        config = KernelConfig(128, 128, 4, 2, warp_specialized=True, pingpong=True)  # a shipped kind of d=128 config
    ws_forward = lambda: warpspec.forward(q, k, v, o, lse, causal=True, scale=0.088, config=config)
    (kernel, grid, tma, describe, pointers, scalars), kwargs = _captured(ws_forward, "launch_tma")
    fastlaunch.launch_tma(kernel, grid, tma, describe, pointers, scalars, **kwargs)  # the JIT's call: compiles
    plan = next((p for key, p in fastlaunch._tma_plans.items() if key[0] == id(kernel)), None)
    descriptors = [describe(t, block) for t, block in tma]
    tensors = (*descriptors, *pointers)
    fastlaunch.launch(kernel, grid, tensors, scalars, **kwargs)  # descriptor objects through Triton's run()
    hit = next((h for key, h in fastlaunch._compiled.items() if key[0] == id(kernel) and h), None)
    if hit is None or plan is None:
        print("fastlaunch kept no binary or plan for the warpspec forward (off, or Triton changed)", file=sys.stderr)
        return 1
    _, compiled, names = hit
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    x, y, z = (*grid, 1, 1)[:3]
    launch_args = (compiled.packed_metadata, None, None, None, *tensors, *scalars, *(kwargs[n] for n in names))
    metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descriptors)
    pieces = {
        "attention(), no grad": lambda: fa2tune.attention(q, k, v, causal=True),
        "attention(), config given": lambda: fa2tune.attention(q, k, v, causal=True, config=config),
        "warpspec.forward": ws_forward,
        "launch_tma": lambda: fastlaunch.launch_tma(kernel, grid, tma, describe, pointers, scalars, **kwargs),
        "its plan, encodings kept": lambda: plan.launch(grid, stream, tma, describe, pointers, scalars),
        "descriptors, unchecked": lambda: [warpspec._descriptor(t, block, False) for t, block in tma],
        "launch() of descriptors": lambda: fastlaunch.launch(kernel, grid, tensors, scalars, **kwargs),
        "compiled.run (Triton)": lambda: compiled.run(x, y, z, stream, compiled.function, *launch_args),
        "TMA expansion alone": lambda: [
            driver.make_tensordesc_arg(d, m) for d, m in zip(descriptors, metas, strict=True)
        ],
    }
    tma_launcher = warpspec.forward_launcher(q, k, lse, causal=True, scale=0.088, config=config)
    tma_launcher(q, k, v, o, lse)  # through launch_tma once: it finds the plan and keeps it
    pieces["TmaLauncher (a plan's)"] = lambda: tma_launcher(q, k, v, o, lse)
    triton_config = KernelConfig(64, 64, 4, 2)
    pieces["attention(), Triton fwd"] = lambda: fa2tune.attention(q, k, v, causal=True, config=triton_config)
    (tk, tgrid, ttensors, tscalars), tkwargs = _captured(pieces["attention(), Triton fwd"])
    pieces["fastlaunch.launch, Triton"] = lambda: fastlaunch.launch(tk, tgrid, ttensors, tscalars, **tkwargs)
    readings = {name: sorted(_time_us(fn, repeats) for _ in range(5))[2] for name, fn in pieces.items()}
    print(f"# host µs per call (median of 5 loops of {repeats}), {torch.cuda.get_device_name()}, 1x2x64x128 bf16 "
          f"causal; warpspec config {config.label()}, {len(descriptors)} TMA descriptors")  # fmt: skip
    for name, us in readings.items():
        print(f"{name:>30} {us:8.1f}")
    return 0


def _autograd_split(repeats: int) -> int:
    """A fwd+bwd call's host time in four stretches, from timestamps taken inside it: the forward (attention()),
    torch.autograd.grad until fa2tune's backward begins (the engine's start, and on a GPU its hand-over to the
    device's backward thread), the backward's body (autograd.backward, inside the autograd.Function's backward), and
    from its end until grad() returns: a call's pieces timed alone do not add up to the whole call, and these
    stamps say where the rest goes. On a machine without a GPU the launches are no-ops (CPU tensors, no thread
    hand-over)."""
    on_gpu = torch.cuda.is_available()
    kernel_lookup = layout.kernel
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launchers would refuse CPU tensors
        layout.kernel = lambda *a, **k: _NoLaunch()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    q, k, v = (torch.randn(1, 2, 64, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    stamps: dict[str, float] = {}
    function_backward, body = autograd.EagerAttention.backward, autograd.backward

    def timed_function_backward(ctx, *grads):
        stamps["in"] = time.perf_counter()
        result = function_backward(ctx, *grads)
        stamps["out"] = time.perf_counter()
        return result

    def timed_body(*args, **kwargs):
        stamps["body"] = time.perf_counter()
        result = body(*args, **kwargs)
        stamps["body end"] = time.perf_counter()
        return result

    autograd.EagerAttention.backward, autograd.backward = staticmethod(timed_function_backward), timed_body
    spans: dict[str, list[float]] = {}
    try:
        for i in range(repeats + 50):
            start = time.perf_counter()
            out = fa2tune.attention(q, k, v, causal=True)
            forward_end = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), do)
            end = time.perf_counter()
            if i < 50:  # warm-up: compiles, caches
                continue
            for name, (a, b) in {
                "forward (attention())": (start, forward_end),
                "grad() until the Function's backward": (forward_end, stamps["in"]),
                "  the Function's backward until the body": (stamps["in"], stamps["body"]),
                "  the body (autograd.backward)": (stamps["body"], stamps["body end"]),
                "  the body's end until the Function's return": (stamps["body end"], stamps["out"]),
                "the Function's return until grad() returns": (stamps["out"], end),
                "whole call": (start, end),
            }.items():
                spans.setdefault(name, []).append((b - a) * 1e6)
    finally:
        autograd.EagerAttention.backward, autograd.backward = staticmethod(function_backward), body
        layout.kernel = kernel_lookup
        if on_gpu:
            torch.cuda.synchronize()
    where = torch.cuda.get_device_name() if on_gpu else "CPU, launches as no-ops"
    print(f"# host µs of a fwd+bwd call, {where}, 1x2x64x128 causal, medians of {repeats} calls without synchronising")
    for name, xs in spans.items():
        print(f"{name:>46} {_median(xs):8.1f}")
    return 0


_SLEEP_CYCLES_PER_MS = 1_980_000  # torch.cuda._sleep counts GPU clock cycles: ~1 ms at the H200's 1.98 GHz


def _host_us(call, calls: int, rounds: int, busy_ms: float = 0) -> float:
    """Median over `rounds` of the host µs a call takes in a burst of `calls`, timed without synchronising inside it;
    busy_ms: that much GPU work (a sleep kernel) queued first, so nothing the calls launch can run yet."""
    readings = []
    for _ in range(rounds):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if busy_ms:
            torch.cuda._sleep(int(busy_ms * _SLEEP_CYCLES_PER_MS))
        start = time.perf_counter()
        for _ in range(calls):
            call()
        readings.append((time.perf_counter() - start) / calls * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return _median(readings)


def _gpu_us(call, calls: int = 20) -> float:
    """GPU µs a call: events around `calls` calls queued behind a sleep kernel, so the host is ahead of the GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(20 * _SLEEP_CYCLES_PER_MS)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def _training_call(attend, q, k, v, causal: bool, do):
    return torch.autograd.grad(attend(q, k, v, causal), (q, k, v), do)


def _waits(calls: int = 10, rounds: int = 5) -> int:
    """Real shapes (bf16, batch·N = 16k tokens, heads·d = 2048): host µs of a fwd+bwd call with an idle GPU and with
    ~60 ms of GPU work queued ahead of the burst — if anything in the call waited for the GPU, the second would read
    milliseconds a call —, with the backward on autograd's device thread and on the calling thread, fa2tune beside
    SDPA's cuDNN backend, and each call's GPU µs. On the H200 nothing waits, and on autograd's device thread a short
    call's host time can exceed its GPU time where on the calling thread it does not."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa2tune.tune.workload import random_qkv

    if not torch.cuda.is_available():
        print("--waits needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2

    def cudnn(q, k, v, causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    providers = {"fa2tune": lambda q, k, v, causal: fa2tune.attention(q, k, v, causal=causal), "SDPA cuDNN": cudnn}
    print(f"# host µs per fwd+bwd call (median of {rounds} bursts of {calls}), {torch.cuda.get_device_name()}: "
          "idle GPU / ~60 ms of GPU work queued first")  # fmt: skip
    print(f"{'shape':>22} {'provider':>11} {'GPU µs':>7} {'device thread':>15} {'calling thread':>15}")
    for head_dim, seqlen, causal in ((64, 512, True), (64, 512, False), (128, 512, True), (64, 1024, True)):
        q, k, v = random_qkv(16384 // seqlen, 2048 // head_dim, seqlen, head_dim, requires_grad=True)
        do = torch.randn_like(q)
        for name, attend in providers.items():
            call = functools.partial(_training_call, attend, q, k, v, causal, do)
            for _ in range(5):
                call()
            cells = []
            for threaded in (True, False):
                with torch.autograd.set_multithreading_enabled(threaded):
                    cells.append(" / ".join(f"{_host_us(call, calls, rounds, busy):.0f}" for busy in (0, 60)))
            shape = f"d={head_dim} N={seqlen}{' causal' if causal else ''}"
            print(f"{shape:>22} {name:>11} {_gpu_us(call):7.0f} {cells[0]:>15} {cells[1]:>15}")
    return 0


def _threads(rounds: int, repeats: int = 1000) -> int:
    """Host µs of fwd+bwd calls (fa2tune, SDPA flash, a kernel-less autograd.Function) and of fa2tune's launchers,
    with the backward where PyTorch puts it (autograd's thread for the GPU, on whichever core), with that thread and
    the calling one pinned to one core or to two, and on the calling thread (torch.autograd.
    set_multithreading_enabled(False)); "launchers fwd; bwd on a thread" hands autograd.backward to a plain Python
    thread, which isolates the hand-over from autograd. The thread, not autograd, is where a short fwd+bwd call's
    unexplained host time goes: the backward's objects are cache misses on another core."""
    import queue
    import threading

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("--threads needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    o, lse = ops.forward(qd, kd, vd, causal=True, scale=0.088)
    every_core = os.sched_getaffinity(0)
    first, second = sorted(every_core)[:2]
    # the cores asked for the thread that runs the backward, and what each thread was given, by thread: with
    # autograd's threads off the backward runs on the calling thread, and autograd's thread must keep its own record
    # (one record for both would leave autograd's thread pinned in the next round's "default")
    pin: dict = {"want": None}
    applied: dict[int, object] = {}

    def pinned(backward):
        def run(ctx, *grads):
            thread = threading.get_ident()
            if applied.get(thread) != pin["want"]:  # pins the thread this runs on only (Linux)
                os.sched_setaffinity(0, pin["want"] or every_core)
                applied[thread] = pin["want"]
            return backward(ctx, *grads)

        return staticmethod(run)

    class Identity(torch.autograd.Function):  # puts a pinning backward in SDPA's graph too
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        backward = pinned(lambda ctx, g: g)

    jobs: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def worker():
        while True:
            job = jobs.get()
            job()
            done.put(None)

    threading.Thread(target=worker, daemon=True).start()
    on_worker = lambda fn: (jobs.put(fn), done.get())
    forward = lambda: ops.forward(qd, kd, vd, causal=True, scale=0.088)
    backward = lambda: ops.backward(do, qd, kd, vd, o, lse, causal=True, scale=0.088)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(Identity.apply(q), k, v, is_causal=True)
            return torch.autograd.grad(out, (q, k, v), do)

    cases = {
        "fa2tune fwd+bwd": lambda: torch.autograd.grad(fa2tune.attention(q, k, v, causal=True), (q, k, v), do),
        "SDPA flash fwd+bwd": sdpa,
        "kernel-less fwd+bwd": lambda: torch.autograd.grad(_KernelLess.apply(q, k, v), (q, k, v), do),
        "fa2tune fwd (grad)": lambda: fa2tune.attention(q, k, v, causal=True),
        "launchers fwd;bwd": lambda: (forward(), backward()),
        "launchers fwd; bwd on a thread": lambda: (forward(), on_worker(backward)),
        "thread round trip": lambda: on_worker(lambda: None),
    }
    modes = {"default": (every_core, None), "same core": ({first}, {first}), "two cores": ({first}, {second}),
             "no autograd threads": (every_core, None)}  # fmt: skip
    real = autograd.EagerAttention.backward
    autograd.EagerAttention.backward = pinned(real)
    readings: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(rounds):
            for mode, (main_cores, backward_cores) in modes.items():
                os.sched_setaffinity(0, main_cores)
                pin["want"] = backward_cores
                on_worker(lambda cores=backward_cores: os.sched_setaffinity(0, cores or every_core))
                for name, fn in cases.items():
                    with torch.autograd.set_multithreading_enabled(mode != "no autograd threads"):
                        readings.setdefault(name, {}).setdefault(mode, []).append(_time_us(fn, repeats))
    finally:
        autograd.EagerAttention.backward = staticmethod(real)
        os.sched_setaffinity(0, every_core)
    print(f"# host µs per call, {torch.cuda.get_device_name()}, 1x2x64x128 bf16 causal, median of {rounds} rounds")
    print(f"{'':>34}" + "".join(f"{mode:>22}" for mode in modes))
    for name, row in readings.items():
        print(f"{name:>34}" + "".join(f"{_median(xs):22.0f}" for xs in row.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="store_true", help="call the custom op (the torch.compile path) instead")
    parser.add_argument("--gpu", action="store_true", help="launch for real on a CUDA GPU (see above)")
    parser.add_argument("--rounds", type=int, default=5, help="--gpu: alternating rounds")
    parser.add_argument("--split", action="store_true", help="one warpspec launch's host time, piece by piece (GPU)")
    parser.add_argument("--autograd-split", action="store_true", help="a fwd+bwd call's host time in stretches")
    parser.add_argument("--threads", action="store_true", help="fwd+bwd host time by where the backward runs (GPU)")
    parser.add_argument("--waits", action="store_true", help="real shapes: host time with an idle and a busy GPU")
    args = parser.parse_args(argv)
    if args.waits:
        return _waits()
    if args.threads:
        return _threads(3)
    if args.autograd_split:
        return _autograd_split(2000)
    if args.split:
        return _split(1000)
    if args.gpu:
        return _gpu(args.rounds)
    layout.kernel = lambda *a, **k: _NoLaunch()
    q, k, v = (torch.randn(1, 2, 64, 128, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    if args.op:
        attend = lambda *t: ops.apply_op(*t, Mask(causal=True), 0.1, None)[0]
    else:
        attend = lambda *t: fa2tune.attention(*t, causal=True)
    print(f"# host µs per call, {'custom op' if args.op else 'attention()'}, kernels not launched")
    for name, fn in _cases(attend, q, k, v, do).items():
        print(f"{name:>20} {_time_us(fn):8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
