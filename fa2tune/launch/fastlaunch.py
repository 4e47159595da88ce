"""Kernel launches without Triton's per-call argument binding — on by default with the Triton versions it was
checked against on a GPU (TESTED_TRITON); FA2TUNE_DIRECT_LAUNCH=0 turns it off, =1 on with any version.

`kernel[grid](*args, **constexprs)` goes through JITFunction.run on every call: it binds the ~40 arguments, works
out their specialization (pointer alignment, ints equal to 1 or divisible by 16), renders the options into a cache
key and only then calls the compiled binary's launcher. At N <= 1k a fwd+bwd call's kernels take about as long as
the host takes to launch them, so the GPU waits for the host (docs/PERF.md, "Host time per call").

launch() lets Triton's JIT handle the first call of each argument key (it compiles, or loads from its cache) and
keeps the CompiledKernel it returns; later calls with the same key call that kernel's launcher directly. The key
(_key) is finer than Triton's specialization — every tensor by dtype and address modulo 16, every scalar by value
— so a binary is reused only for arguments the JIT would have compiled the same way. The interpreter and launch
hooks (a profiler such as proton adds them) take the JIT path.

Measured on the H200 (docs/PERF.md, "Launch plans and direct launches"): a fwd+bwd call's host time 807 → 677 µs;
fwd+bwd 1.16-1.41× faster at N = 256 and at N = 512 causal, d = 128, where the GPU waited for the host; the same speed
(±1 %) from N = 1k on. tests/test_gpu.py checks the direct path's results against the JIT's bit for bit.

This reads three attributes of Triton's CompiledKernel (run, function, packed_metadata) that are not public API:
hence on only for the versions checked (a new Triton gets the JIT path until tests/test_gpu.py has run with it
and TESTED_TRITON names it); if a Triton version changes them, the first direct launch fails with a TypeError
or AttributeError, launch() warns once and uses the JIT path from then on.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

# (id(kernel), device, argument key) -> (kernel, compiled, names of the parameters passed by keyword, in signature
# order). The kernel is kept in the value so that its id cannot be reused by another object. None as compiled:
# this key always takes the JIT path (the JIT returned no compiled kernel).
_compiled: dict[tuple, tuple[Any, Any, tuple[str, ...]] | None] = {}
_MAX_KEPT = 4096  # distinct scalar values each add a key (say, every sequence length served): bound the dict
TESTED_TRITON = ("3.6.",)  # version prefixes whose launcher tests/test_gpu.py checked the direct path against


def _enabled_by_default() -> bool:
    """FA2TUNE_DIRECT_LAUNCH if set (0 or empty: off), else whether the installed Triton is one of TESTED_TRITON."""
    asked = os.environ.get("FA2TUNE_DIRECT_LAUNCH")
    if asked is not None:
        return asked not in ("", "0")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton").startswith(TESTED_TRITON)
    except PackageNotFoundError:
        return False


_enabled = _enabled_by_default()
direct_launches = 0  # how many launches took the direct path (tests check that it was taken)


def enabled() -> bool:
    """Whether launches take the direct path (the installed Triton is one it was checked against, or forced on)."""
    return _enabled


def _tensor_key(t: Any) -> tuple | None:
    if t is None:
        return None
    if hasattr(t, "block_shape"):  # a TMA descriptor: the JIT specializes on its dtype, block shape and layout
        return (t.base.dtype, tuple(t.block_shape), t.layout)
    return (t.dtype, t.data_ptr() & 15)


def _key(tensors: tuple, scalars: tuple) -> tuple:
    """What a kept binary is looked up by: each tensor's dtype and address modulo 16 (Triton specializes on 16-byte
    alignment) — a TMA descriptor's dtype, block shape and shared-memory layout —, and the scalars' values
    themselves — finer than Triton's classes (== 1, % 16, int32 range), so a binary is reused only where the JIT
    would pick the same one, and cheap: one C-level tuple for ~30 ints."""
    return tuple([_tensor_key(t) for t in tensors]), scalars


def _on_cuda(t: Any) -> bool:
    return (t.base if hasattr(t, "block_shape") else t).is_cuda


_runtime_knobs: Any = None  # triton.knobs.runtime, imported on the first launch (importing fa2tune imports no Triton)


def _hooks_installed() -> bool:
    """True when a launch hook is registered. Triton 3.6's hooks are HookChains, empty rather than None when unused;
    older versions use None or a callable. Asked on every launch, hence no import statement and no generator here
    (they cost ~13 µs of a launch's host time on the H200's host, cProfiled)."""
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    enter, leave = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return bool(getattr(enter, "calls", enter is not None)) or bool(getattr(leave, "calls", leave is not None))


def _launch_key(kernel: Any, tensors: tuple, scalars: tuple, kwargs: dict) -> tuple:
    """What launch() keeps a binary by: the kernel, the current device, _key's classes of tensors and scalars, the
    options. One definition for launch() and Launcher, which looks up what launch() kept."""
    return (id(kernel), torch.cuda.current_device(), _key(tensors, scalars), tuple(kwargs.items()))


def _run(compiled: Any, xyz: tuple, device: int, tensors: tuple, scalars: tuple, constexprs) -> None:
    """Calls a compiled kernel's launcher as Triton 3.6's CompiledKernel.run does for kernel[grid](...): the grid,
    the device's current stream, the binary, no launch hooks, then every parameter in signature order."""
    x, y, z = xyz
    compiled.run(x, y, z, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *tensors, *scalars, *constexprs)  # fmt: skip


def launch(kernel: Any, grid: tuple[int, ...], tensors: tuple, scalars: tuple, **kwargs: Any) -> None:
    """Launches `kernel[grid](*tensors, *scalars, **kwargs)` on the current CUDA device and stream, directly when
    it can.

    tensors: the kernel's leading tensor (or None) parameters, or TMA descriptors of tensors (a Gluon kernel's);
    scalars: the int/float parameters after them; kwargs: its constexpr parameters plus Triton's launch options
    (num_warps, num_stages, maxnreg).
    """
    global direct_launches
    if not _enabled or not _on_cuda(tensors[0]):  # off, or the interpreter
        kernel[grid](*tensors, *scalars, **kwargs)
        return
    key = _launch_key(kernel, tensors, scalars, kwargs)
    hit = _compiled.get(key, False)
    if hit is False:  # first call with this key: the JIT compiles or loads the binary, and launches it
        compiled = kernel[grid](*tensors, *scalars, **kwargs)
        usable = compiled is not None and hasattr(compiled, "packed_metadata")
        names = tuple(getattr(kernel, "arg_names", ())[len(tensors) + len(scalars) :])
        if len(_compiled) >= _MAX_KEPT:
            _compiled.clear()
        _compiled[key] = (kernel, compiled, names) if usable and all(n in kwargs for n in names) else None
        return
    if hit is None or _hooks_installed():
        kernel[grid](*tensors, *scalars, **kwargs)
        return
    _, compiled, names = hit
    try:
        _run(compiled, (*grid, 1, 1)[:3], key[1], tensors, scalars, [kwargs[n] for n in names])
        direct_launches += 1
    except (TypeError, AttributeError) as exc:  # Triton's launcher changed: never try again in this process
        _turn_off(exc)
        kernel[grid](*tensors, *scalars, **kwargs)


def _turn_off(exc: Exception) -> None:
    """A direct launch failed (Triton's launcher changed under us): every launch takes the JIT path from now on in
    this process, with one warning."""
    global _enabled
    _enabled = False
    clear()
    warnings.warn(f"fa2tune: launching compiled kernels directly failed ({exc}); using Triton's launch path",
                  RuntimeWarning, stacklevel=3)  # fmt: skip


class Launcher:
    """launch(kernel, grid, tensors, scalars, **kwargs) for one call signature — kernel, grid, scalars and options
    fixed, the tensors' dtypes too —, called with the tensors alone: Launcher(kernel, grid, scalars, kwargs)(*tensors).

    launch() works out a key of ~40 values for every call (each tensor, each scalar, each option) and looks the
    binary up by it; a launch plan (fa2tune.launch.plans) has fixed all but the tensors' addresses, so this keeps the
    binary by the one thing a call can still change — which tensors are 16-byte aligned — and calls it directly.
    The first call of each alignment goes through launch() (JIT, compile or cache), which also decides whether a
    direct launch is possible at all; hooks, the interpreter and a switched-off fastlaunch take launch()'s path."""

    __slots__ = ("_binaries", "grid", "kernel", "kwargs", "scalars", "xyz")

    def __init__(self, kernel: Any, grid: tuple[int, ...], scalars: tuple, kwargs: dict[str, Any]):
        self.kernel, self.grid, self.scalars, self.kwargs = kernel, grid, scalars, kwargs
        self.xyz = (*grid, 1, 1)[:3]
        self._binaries: dict[tuple, tuple[Any, tuple]] = {}  # alignments -> (compiled, constexpr values)

    def __call__(self, *tensors: Any) -> None:
        global direct_launches
        alignments = tuple([None if t is None else t.data_ptr() & 15 for t in tensors])
        hit = self._binaries.get(alignments)
        if hit is not None and _enabled and not _hooks_installed():
            compiled, constexprs = hit
            try:
                _run(compiled, self.xyz, torch._C._cuda_getDevice(), tensors, self.scalars, constexprs)
                direct_launches += 1
                return
            except (TypeError, AttributeError) as exc:  # Triton's launcher changed: launch() from now on
                _turn_off(exc)
        launch(self.kernel, self.grid, tensors, self.scalars, **self.kwargs)
        if _enabled and _on_cuda(tensors[0]) and hit is None:
            kept = _compiled.get(_launch_key(self.kernel, tensors, self.scalars, self.kwargs))
            if kept:  # launch() kept a binary it can call directly: so can we, for this alignment
                _, compiled, names = kept
                self._binaries[alignments] = (compiled, tuple(self.kwargs[n] for n in names))


# ---- kernels whose leading parameters are TMA descriptors (the Gluon kernels of fa2tune.launch.warpspec) -------
# Through launch(), such a launch builds a descriptor object per tensor, keys each, and Triton's CompiledKernel.run then
# encodes every descriptor (a 128-byte CUtensorMap) before calling the binary's launcher: ~34 µs of host time a launch
# on the H200 host, where the launcher itself takes 5.5 (docs/PERF.md, "Host time per call"; `bench_host_overhead.py
# --split`). A warpspec fwd+bwd call makes three such launches, and at N <= 1k the GPU waits for the host.

# launch_tma's plans: (id(kernel), device, descriptor dtypes and blocks, pointer keys, scalars, options) ->
# _TmaPlan, or None where the JIT path is always taken. Bounded like _compiled.
_tma_plans: dict[tuple, Any] = {}
_MAX_ENCODED = 1024  # encoded descriptors a plan keeps (tensor addresses seen); cleared when full
_BASE_ARGS = 13  # Triton 3.6's launcher arguments before the kernel's: checked against its driver in _TmaPlan.make


class _TmaPlan:
    """How to launch one compiled kernel without its Python wrapper: the launcher Triton compiled for it (a C
    function taking every argument flat), the launch metadata, each descriptor's TMA metadata, and the descriptors
    already encoded, by tensor address, shape and strides — the only inputs of the encoding besides the plan's own
    block shape, dtype and swizzle, so a kept encoding is the one Triton would make again. Training loops and
    benchmarks pass the same few addresses over and over (the caching allocator hands them back)."""

    __slots__ = ("constexprs", "encode", "encoded", "function", "launcher", "metas", "options", "packed")

    @classmethod
    def make(cls, compiled, descriptors: int, constexprs: tuple) -> _TmaPlan | None:
        """The plan for `compiled`, or None where its launch does not have the form this was written for (then
        launch_tma keeps taking the JIT path for this key)."""
        from triton.backends.nvidia import driver

        run = compiled.run
        wrapper = getattr(run, "launch", None)
        closure = getattr(wrapper, "__closure__", None)
        if closure is None or run.global_scratch_size or run.profile_scratch_size:
            return None  # no descriptor wrapper to look through, or scratch memory to allocate per launch
        cells = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in closure), strict=True))
        if (
            getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != _BASE_ARGS
            or cells.get("tensordesc_indices") != set(range(descriptors))
            or not callable(cells.get("launcher"))
        ):
            return None
        plan = cls()
        plan.launcher, plan.function, plan.packed = cells["launcher"], compiled.function, compiled.packed_metadata
        plan.options = (run.launch_cooperative_grid, run.launch_pdl)
        plan.metas = list(cells.get("tensordesc_meta") or [None] * descriptors)
        plan.constexprs, plan.encoded, plan.encode = constexprs, {}, driver.make_tensordesc_arg
        return plan

    def launch(self, grid: tuple[int, ...], stream: int, tma, describe, pointers: tuple, scalars: tuple) -> None:
        flat = []
        for index, (t, block) in enumerate(tma):
            key = (index, t.data_ptr(), t.shape, t.stride())
            encoded = self.encoded.get(key)
            if encoded is None:
                if len(self.encoded) >= _MAX_ENCODED:
                    self.encoded.clear()
                encoded = self.encoded[key] = self.encode(describe(t, block), self.metas[index])
            flat += encoded
        self.launch_encoded((*grid, 1, 1)[:3], stream, flat, pointers, scalars)

    def encode_all(self, tma, describe) -> list:
        """The flat launcher arguments of every descriptor of `tma` ((tensor, block) pairs), encoded now."""
        flat = []
        for index, (t, block) in enumerate(tma):
            flat += self.encode(describe(t, block), self.metas[index])
        return flat

    def launch_encoded(self, xyz: tuple, stream: int, flat: list, pointers: tuple, scalars: tuple) -> None:
        x, y, z = xyz
        self.launcher(x, y, z, stream, self.function, *self.options, None, None, self.packed, None, None, None,
                      *flat, *pointers, *scalars, *self.constexprs)  # fmt: skip


def _tma_key(kernel: Any, tma, pointers: tuple, scalars: tuple, kwargs: dict) -> tuple:
    """What launch_tma keeps a plan by: launch()'s key with each descriptor's dtype and block shape for its tensors.
    One definition for launch_tma and TmaLauncher, which looks up what launch_tma kept."""
    return (id(kernel), torch.cuda.current_device(), tuple([(t.dtype, block) for t, block in tma]),
            tuple([_tensor_key(t) for t in pointers]), scalars, tuple(kwargs.items()))  # fmt: skip


def launch_tma(kernel: Any, grid: tuple[int, ...], tma, describe, pointers: tuple, scalars: tuple, **kwargs) -> None:
    """launch() for a kernel whose leading parameters are TMA descriptors: `kernel[grid](*descriptors, *pointers,
    *scalars, **kwargs)` with descriptors = [describe(t, block) for t, block in tma].

    The first call of a key goes through the JIT, as in launch(); later ones call the compiled launcher with the
    descriptors encoded once per tensor address (_TmaPlan). The key adds each descriptor's dtype and block shape
    (what the JIT specializes a descriptor on, with the layout the block and dtype decide) to launch()'s.
    """
    global direct_launches
    if not _enabled or not tma[0][0].is_cuda:
        kernel[grid](*[describe(t, block) for t, block in tma], *pointers, *scalars, **kwargs)
        return
    key = _tma_key(kernel, tma, pointers, scalars, kwargs)
    plan = _tma_plans.get(key, False)
    if plan is False:
        compiled = kernel[grid](*[describe(t, block) for t, block in tma], *pointers, *scalars, **kwargs)
        names = tuple(getattr(kernel, "arg_names", ())[len(tma) + len(pointers) + len(scalars) :])
        usable = compiled is not None and hasattr(compiled, "packed_metadata") and all(n in kwargs for n in names)
        if len(_tma_plans) >= _MAX_KEPT:
            _tma_plans.clear()
        try:
            plan = _TmaPlan.make(compiled, len(tma), tuple(kwargs[n] for n in names)) if usable else None
        except (AttributeError, TypeError, ValueError):  # a Triton whose compiled kernels look otherwise: the JIT
            plan = None
        _tma_plans[key] = plan
        return
    if plan is None or _hooks_installed():
        kernel[grid](*[describe(t, block) for t, block in tma], *pointers, *scalars, **kwargs)
        return
    try:
        plan.launch(grid, torch._C._cuda_getCurrentRawStream(key[1]), tma, describe, pointers, scalars)
        direct_launches += 1
    except (TypeError, AttributeError) as exc:  # Triton's launcher changed: never try again in this process
        _turn_off(exc)
        kernel[grid](*[describe(t, block) for t, block in tma], *pointers, *scalars, **kwargs)


class TmaLauncher:
    """launch_tma for one call signature, called with the tensors alone: `TmaLauncher(kernel, grid, blocks, describe,
    scalars, kwargs)(*tensors)` launches `kernel[grid](*descriptors, *pointers, *scalars, **kwargs)`, descriptors =
    [describe(t, block) for t, block in zip(tensors, blocks)], pointers the tensors after those.

    The contract that makes it cheap: every call passes tensors of the shapes, strides and dtypes of the first (a
    launch plan's signature fixes them; fa2tune.launch.plans keeps one per signature). So an encoding is kept by the
    descriptors' addresses alone (one dict lookup a launch, not a key of address, shape and strides per descriptor),
    and the launcher plan by the pointers' alignment (launch_tma's key of ~40 values is worked out once). The first
    call of each alignment goes through launch_tma, which decides whether a direct launch is possible at all."""

    __slots__ = ("_encoded", "_plans", "blocks", "describe", "grid", "kernel", "kwargs", "scalars", "xyz")

    def __init__(self, kernel: Any, grid: tuple[int, ...], blocks: tuple, describe, scalars: tuple, kwargs: dict):
        self.kernel, self.grid, self.blocks, self.describe = kernel, grid, blocks, describe
        self.scalars, self.kwargs = scalars, kwargs
        self.xyz = (*grid, 1, 1)[:3]
        self._plans: dict[tuple, _TmaPlan] = {}  # the pointers' alignments -> launch_tma's plan
        self._encoded: dict[tuple, list] = {}  # the descriptors' addresses -> their encodings, flat

    def __call__(self, *tensors: Any) -> None:
        global direct_launches
        count = len(self.blocks)
        pointers = tensors[count:]
        alignments = tuple([None if t is None else t.data_ptr() & 15 for t in pointers])
        plan = self._plans.get(alignments)
        if plan is not None and _enabled and not _hooks_installed():
            addresses = tuple([t.data_ptr() for t in tensors[:count]])
            try:
                flat = self._encoded.get(addresses)
                if flat is None:
                    if len(self._encoded) >= _MAX_ENCODED:
                        self._encoded.clear()
                    flat = self._encoded[addresses] = plan.encode_all(
                        zip(tensors[:count], self.blocks, strict=True), self.describe
                    )
                plan.launch_encoded(self.xyz, torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()), flat,
                                    pointers, self.scalars)  # fmt: skip
                direct_launches += 1
                return
            except (TypeError, AttributeError) as exc:  # Triton's launcher changed: launch_tma from now on
                _turn_off(exc)
        tma = list(zip(tensors[:count], self.blocks, strict=True))
        launch_tma(self.kernel, self.grid, tma, self.describe, pointers, self.scalars, **self.kwargs)
        if _enabled and tensors[0].is_cuda and plan is None:
            kept = _tma_plans.get(_tma_key(self.kernel, tma, pointers, self.scalars, self.kwargs))
            if kept:
                self._plans[alignments] = kept


def clear() -> None:
    """Forgets every kept kernel (tests; after Triton's cache was cleared)."""
    _compiled.clear()
    _tma_plans.clear()
