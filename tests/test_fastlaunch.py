"""Direct launches of compiled kernels: the key they are looked up by, and when they fall back to the JIT.

The direct path itself needs a GPU (tests/test_gpu.py compares it with Triton's launch path); here a stand-in
kernel records how it is called.
"""

from __future__ import annotations

import pytest
import torch

from fa2tune.launch import fastlaunch

from .conftest import ON_DIRECT_LAUNCH_TRITON


class _Compiled:
    packed_metadata = "meta"
    function = "fn-handle"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """A stand-in @triton.jit function: parameters T (a tensor), a, b, x (scalars) and BLOCK, MODE (constexpr)."""

    arg_names = ("T", "a", "b", "x", "BLOCK", "MODE")

    def __init__(self):
        self.jit_calls = []
        self.compiled = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]

        return run


class _CudaTensor:
    """What launch() reads of a tensor: where it lives, its dtype and its address."""

    is_cuda = True

    def __init__(self, address, dtype=torch.bfloat16):
        self.address, self.dtype = address, dtype

    def data_ptr(self):
        return self.address


@pytest.fixture
def fake_cuda(monkeypatch):
    fastlaunch.clear()
    monkeypatch.setattr(fastlaunch, "_enabled", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: False)
    yield
    fastlaunch.clear()


def test_the_key_is_finer_than_triton_s_specialization():
    key = lambda address, dtype=torch.bfloat16, scalars=(32, 5, 0.5): fastlaunch._key(
        (_CudaTensor(address, dtype), None), scalars)  # fmt: skip
    assert key(4096) == key(8192)  # both 16-byte aligned: the same binary
    assert key(4096) != key(4098)  # 2 bytes off: Triton drops the alignment hint
    assert key(4096) != key(4096, torch.float16)
    assert key(4096) != key(4096, scalars=(33, 5, 0.5))  # every scalar by value (here: no longer % 16)
    assert key(4096) != key(4096, scalars=(32, 1, 0.5))  # (here: == 1, which Triton makes a constant)


def test_first_call_of_a_key_goes_through_the_jit_then_runs_directly(fake_cuda):
    kernel = _Kernel()
    fastlaunch.launch(kernel, (4,), (_CudaTensor(4096),), (32, 5, 0.5), BLOCK=64, MODE="tf32", num_warps=4)
    assert len(kernel.jit_calls) == 1
    tensor = _CudaTensor(8192)  # another tensor at another aligned address: the same key
    fastlaunch.launch(kernel, (4,), (tensor,), (32, 5, 0.5), BLOCK=64, MODE="tf32", num_warps=4)
    assert len(kernel.jit_calls) == 1 and fastlaunch.direct_launches > 0
    (run,) = kernel.compiled[0].runs
    # grid padded to 3 axes, the current stream, the binary, no launch hooks, then every parameter in signature
    # order: tensors, scalars, then the constexprs (num_warps is an option, not a parameter).
    assert run == (4, 1, 1, 1234, "fn-handle", "meta", None, None, None, tensor, 32, 5, 0.5, 64, "tf32")


@pytest.mark.parametrize(
    "tensor, scalars, kwargs",
    [
        (4098, (32, 5, 0.5), dict(BLOCK=64, MODE="tf32", num_warps=4)),  # misaligned
        (4096, (33, 5, 0.5), dict(BLOCK=64, MODE="tf32", num_warps=4)),  # another scalar
        (4096, (32, 5, 0.5), dict(BLOCK=128, MODE="tf32", num_warps=4)),  # another constexpr
        (4096, (32, 5, 0.5), dict(BLOCK=64, MODE="tf32", num_warps=8)),  # another launch option
    ],
)
def test_another_key_goes_through_the_jit_again(fake_cuda, tensor, scalars, kwargs):
    kernel = _Kernel()
    fastlaunch.launch(kernel, (4,), (_CudaTensor(4096),), (32, 5, 0.5), BLOCK=64, MODE="tf32", num_warps=4)
    fastlaunch.launch(kernel, (4,), (_CudaTensor(tensor),), scalars, **kwargs)
    assert len(kernel.jit_calls) == 2 and kernel.compiled[0].runs == []


def test_falls_back_to_the_jit_when_it_cannot_launch_directly(fake_cuda, monkeypatch):
    kernel = _Kernel()
    args = ((_CudaTensor(4096),), (32, 5, 0.5))
    fastlaunch.launch(kernel, (2, 3), *args, BLOCK=64, MODE="x")
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: True)  # a profiler's launch hooks: the JIT runs them
    fastlaunch.launch(kernel, (2, 3), *args, BLOCK=64, MODE="x")
    assert len(kernel.jit_calls) == 2
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: False)
    kernel.compiled[0].run = None  # a Triton whose compiled kernels launch differently
    with pytest.warns(RuntimeWarning, match="launching compiled kernels directly failed"):
        fastlaunch.launch(kernel, (2, 3), *args, BLOCK=64, MODE="x")
    assert len(kernel.jit_calls) == 3 and not fastlaunch._enabled  # relaunched through the JIT, and from now on
    fastlaunch.launch(kernel, (2, 3), *args, BLOCK=64, MODE="x")
    assert len(kernel.jit_calls) == 4


def test_cpu_tensors_and_a_jit_without_binaries_always_use_the_jit(fake_cuda):
    kernel = _Kernel()
    for _ in range(2):  # the interpreter: CPU tensors
        fastlaunch.launch(kernel, (1,), (torch.zeros(2),), (32, 5, 0.5), BLOCK=64, MODE="x")
    assert len(kernel.jit_calls) == 2 and not fastlaunch._compiled
    kernel.__class__ = type("NoBinary", (_Kernel,), {"__getitem__": lambda self, grid: (
        lambda *a, **k: self.jit_calls.append(a))})  # fmt: skip
    for _ in range(3):
        fastlaunch.launch(kernel, (1,), (_CudaTensor(4096),), (32, 5, 0.5), BLOCK=64, MODE="x")
    assert len(kernel.jit_calls) == 5


@pytest.fixture
def fake_device(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)


def test_a_launcher_launches_as_launch_would_and_keeps_a_binary_per_alignment(fake_device):
    kernel = _Kernel()
    launch = fastlaunch.Launcher(kernel, (4,), (32, 5, 0.5), dict(BLOCK=64, MODE="tf32", num_warps=4))
    launch(_CudaTensor(4096))  # the JIT's
    start = fastlaunch.direct_launches
    tensor = _CudaTensor(8192)
    launch(tensor)
    assert len(kernel.jit_calls) == 1 and fastlaunch.direct_launches == start + 1
    assert kernel.compiled[0].runs == [(4, 1, 1, 1234, "fn-handle", "meta", None, None, None, tensor, 32, 5, 0.5, 64,
                                        "tf32")]  # fmt: skip
    launch(_CudaTensor(4098))  # misaligned: another binary, through the JIT once, then kept too
    launch(_CudaTensor(4098 + 64))
    assert len(kernel.jit_calls) == 2 and len(kernel.compiled[1].runs) == 1


def test_a_launcher_takes_the_jit_path_for_hooks_cpu_tensors_and_when_switched_off(fake_device, monkeypatch):
    kernel = _Kernel()
    launch = fastlaunch.Launcher(kernel, (1,), (32, 5, 0.5), dict(BLOCK=64, MODE="x"))
    for _ in range(2):
        launch(torch.zeros(2))  # the interpreter
    assert len(kernel.jit_calls) == 2
    launch(_CudaTensor(4096))
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: True)
    launch(_CudaTensor(4096))
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(fastlaunch, "_enabled", False)
    launch(_CudaTensor(4096))
    assert len(kernel.jit_calls) == 5 and kernel.compiled[2].runs == []
    monkeypatch.setattr(fastlaunch, "_enabled", True)
    kernel.compiled[2].run = None  # a Triton whose compiled kernels launch differently
    with pytest.warns(RuntimeWarning, match="launching compiled kernels directly failed"):
        launch(_CudaTensor(4096))
    assert len(kernel.jit_calls) == 6 and not fastlaunch._enabled


def test_the_kept_binaries_are_bounded(fake_cuda, monkeypatch):
    monkeypatch.setattr(fastlaunch, "_MAX_KEPT", 3)
    kernel = _Kernel()
    for seqlen in range(1, 8):  # every new length is a new key
        fastlaunch.launch(kernel, (1,), (_CudaTensor(4096),), (seqlen, 5, 0.5), BLOCK=64, MODE="x")
    assert len(fastlaunch._compiled) <= 3


def test_triton_s_empty_hook_chains_count_as_no_hooks():
    # Triton 3.6 keeps launch hooks in HookChains that are never None: an empty chain must not force the JIT path.
    from triton import knobs

    assert not fastlaunch._hooks_installed()
    hook = lambda metadata: None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert fastlaunch._hooks_installed()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not fastlaunch._hooks_installed()


def test_direct_launches_are_on_for_the_tested_triton_unless_turned_off(monkeypatch):
    import importlib
    import importlib.metadata

    monkeypatch.delenv("FA2TUNE_DIRECT_LAUNCH", raising=False)
    try:
        for triton_version, enabled in (("3.6.0", True), ("3.6.1", True), ("3.7.0", False), ("4.0.0", False)):
            monkeypatch.setattr(importlib.metadata, "version", lambda name, v=triton_version: v)
            assert importlib.reload(fastlaunch)._enabled is enabled, triton_version
        for value, enabled in (("", False), ("0", False), ("1", True)):  # the variable wins, either way
            monkeypatch.setenv("FA2TUNE_DIRECT_LAUNCH", value)
            assert importlib.reload(fastlaunch)._enabled is enabled
    finally:
        monkeypatch.undo()
        importlib.reload(fastlaunch)


# ---- launch_tma: kernels whose leading parameters are TMA descriptors ------------------------------------------


class _TmaTensor(_CudaTensor):
    """What launch_tma reads of a tensor it describes: _CudaTensor's fields plus shape and strides."""

    def __init__(self, address, shape=(1, 2, 64, 128)):
        super().__init__(address)
        self.shape = shape

    def stride(self):
        return (2 * 64 * 128, 64 * 128, 128, 1)


def _describe(t, block):
    from fa2tune.launch import warpspec

    return warpspec._descriptor(t, block, checked=False)  # the unchecked form warpspec passes with fastlaunch on


class _TmaCompiled:
    """A compiled kernel with Triton 3.6's launch form: run.launch is its driver's descriptor-expanding wrapper
    (the real function, wrap_handle_tensordesc) around the C launcher, here a recorder."""

    packed_metadata = "meta"
    function = "fn-handle"

    def __init__(self, descriptors: int, scratch: int = 0):
        from types import SimpleNamespace

        from triton.backends.nvidia import driver

        self.launches = []
        signature = {f"D{i}": "tensordesc<bf16[64,128]>" for i in range(descriptors)} | {"P": "*fp32", "n": "i32"}
        launcher = lambda *args: self.launches.append(args)
        self.run = SimpleNamespace(launch=driver.wrap_handle_tensordesc(launcher, signature, []),
                                   global_scratch_size=scratch, profile_scratch_size=0,
                                   launch_cooperative_grid=False, launch_pdl=True)  # fmt: skip


class _TmaKernel(_Kernel):
    """A stand-in Gluon kernel: descriptors D0, D1, a pointer P, a scalar n, a constexpr BLOCK."""

    arg_names = ("D0", "D1", "P", "n", "BLOCK")

    def __init__(self, scratch: int = 0):
        super().__init__()
        self.scratch = scratch

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            self.compiled.append(_TmaCompiled(2, self.scratch))
            return self.compiled[-1]

        return run


def _launch_tma(kernel, q, k, pointer, n=64, grid=(132,)):
    tma = [(q, (1, 1, 64, 128)), (k, (1, 1, 128, 128))]
    fastlaunch.launch_tma(kernel, grid, tma, _describe, (pointer,), (n,), BLOCK=64, num_warps=4)


@ON_DIRECT_LAUNCH_TRITON
def test_launch_tma_calls_the_launcher_as_triton_s_wrapper_would(fake_cuda):
    kernel, q, k, lse = _TmaKernel(), _TmaTensor(4096), _TmaTensor(1 << 20), _CudaTensor(1 << 24, torch.float32)
    _launch_tma(kernel, q, k, lse)  # first call: the JIT
    _launch_tma(kernel, q, k, lse)
    assert len(kernel.jit_calls) == 1 and fastlaunch.direct_launches > 0
    compiled = kernel.compiled[0]
    (direct,) = compiled.launches
    # What CompiledKernel.run hands Triton's wrapper for the same call: it expands each descriptor itself.
    compiled.run.launch(132, 1, 1, 1234, "fn-handle", False, True, None, None, "meta", None, None, None,
                        _describe(q, (1, 1, 64, 128)), _describe(k, (1, 1, 128, 128)), lse, 64, 64)  # fmt: skip
    assert direct == compiled.launches[1]
    assert direct[13] is q and direct[13 + 1 : 13 + 5] == q.shape  # the expansion really happened (no TMA meta)


@ON_DIRECT_LAUNCH_TRITON
def test_launch_tma_encodes_a_descriptor_once_per_address(fake_cuda, monkeypatch):
    kernel, q, k, lse = _TmaKernel(), _TmaTensor(4096), _TmaTensor(1 << 20), _CudaTensor(1 << 24, torch.float32)
    _launch_tma(kernel, q, k, lse)
    (plan,) = fastlaunch._tma_plans.values()
    encoded = []
    real = plan.encode
    plan.encode = lambda desc, meta: encoded.append(desc.base) or real(desc, meta)
    for _ in range(3):
        _launch_tma(kernel, q, k, lse)
    assert encoded == [q, k]
    moved = _TmaTensor(8192)  # another q at another (aligned) address: the same binary, a new encoding for it only
    _launch_tma(kernel, moved, k, lse)
    reshaped = _TmaTensor(4096, shape=(1, 2, 32, 128))  # q's address, another shape: encoded anew
    _launch_tma(kernel, reshaped, k, lse)
    assert encoded == [q, k, moved, reshaped] and len(kernel.jit_calls) == 1
    launches = kernel.compiled[0].launches
    assert launches[-2][13] is moved and launches[-1][13 + 1 : 13 + 5] == (1, 2, 32, 128)
    monkeypatch.setattr(fastlaunch, "_MAX_ENCODED", 2)
    _launch_tma(kernel, _TmaTensor(12288), k, lse)
    assert len(plan.encoded) <= 2


@ON_DIRECT_LAUNCH_TRITON
def test_a_tma_launcher_launches_as_launch_tma_would_and_encodes_once_per_addresses(fake_device, monkeypatch):
    kernel, q, k, lse = _TmaKernel(), _TmaTensor(4096), _TmaTensor(1 << 20), _CudaTensor(1 << 24, torch.float32)
    blocks = ((1, 1, 64, 128), (1, 1, 128, 128))
    launch = fastlaunch.TmaLauncher(kernel, (132,), blocks, _describe, (64,), dict(BLOCK=64, num_warps=4))
    launch(q, k, lse)  # the JIT's
    plan = next(iter(fastlaunch._tma_plans.values()))
    encoded = []
    real = plan.encode
    plan.encode = lambda desc, meta: encoded.append(desc.base) or real(desc, meta)
    for _ in range(3):
        launch(q, k, lse)
    assert len(kernel.jit_calls) == 1 and encoded == [q, k]  # encoded once for these addresses, launched 3 times
    compiled = kernel.compiled[0]
    assert len(compiled.launches) == 3
    _launch_tma(kernel, q, k, lse)  # launch_tma's own direct path (its plan) gives the same arguments
    assert compiled.launches[-1] == compiled.launches[0]
    moved = _TmaTensor(8192)
    launch(moved, k, lse)
    assert encoded[-2:] == [moved, k] and compiled.launches[-1][13] is moved
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: True)
    launch(q, k, lse)
    assert len(kernel.jit_calls) == 2


@ON_DIRECT_LAUNCH_TRITON
def test_launch_tma_keeps_the_jit_path_for_a_launch_form_it_does_not_know(fake_cuda, monkeypatch):
    kernel, q, k, lse = _TmaKernel(scratch=256), _TmaTensor(4096), _TmaTensor(1 << 20), _CudaTensor(1 << 24)
    for _ in range(3):  # scratch memory to allocate per launch: CompiledKernel.run's job, not the plan's
        _launch_tma(kernel, q, k, lse)
    assert len(kernel.jit_calls) == 3 and list(fastlaunch._tma_plans.values()) == [None]
    fastlaunch.clear()
    kernel = _TmaKernel()
    _launch_tma(kernel, q, k, lse)
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: True)
    _launch_tma(kernel, q, k, lse)
    assert len(kernel.jit_calls) == 2 and kernel.compiled[0].launches == []
    monkeypatch.setattr(fastlaunch, "_hooks_installed", lambda: False)
    _launch_tma(kernel, q, k, lse, n=65)  # another scalar: another key, the JIT again
    assert len(kernel.jit_calls) == 3
    (plan, _) = fastlaunch._tma_plans.values()
    plan.launcher = None  # a Triton whose launcher changed under us
    with pytest.warns(RuntimeWarning, match="launching compiled kernels directly failed"):
        _launch_tma(kernel, q, k, lse)
    assert len(kernel.jit_calls) == 4 and not fastlaunch._enabled and not fastlaunch._tma_plans


def test_launch_tma_keeps_the_jit_path_for_compiled_kernels_without_triton_3_6_s_fields(fake_cuda):
    kernel, q, k, lse = _TmaKernel(), _TmaTensor(4096), _TmaTensor(1 << 20), _CudaTensor(1 << 24)
    real = kernel.__getitem__

    def older_triton(grid):  # its compiled kernels' launchers have no scratch-size fields
        def run(*args, **kwargs):
            compiled = real(grid)(*args, **kwargs)
            del compiled.run.global_scratch_size
            return compiled

        return run

    kernel.__class__ = type("OlderTriton", (_TmaKernel,), {"__getitem__": lambda self, grid: older_triton(grid)})
    for _ in range(3):  # no error for the call that looked, and the JIT from then on
        _launch_tma(kernel, q, k, lse)
    assert len(kernel.jit_calls) == 3 and list(fastlaunch._tma_plans.values()) == [None]


def test_launch_tma_on_the_interpreter_or_switched_off_uses_the_jit(fake_cuda, monkeypatch):
    kernel = _TmaKernel()
    cpu = torch.zeros(1, 2, 64, 128)
    for _ in range(2):
        _launch_tma(kernel, cpu, cpu, torch.zeros(2))
    monkeypatch.setattr(fastlaunch, "_enabled", False)
    for _ in range(2):
        _launch_tma(kernel, _TmaTensor(4096), _TmaTensor(8192), _CudaTensor(1 << 24))
    assert len(kernel.jit_calls) == 4 and not fastlaunch._tma_plans
    assert kernel.jit_calls[0][1][0].base is cpu  # the JIT gets descriptors of the tensors
