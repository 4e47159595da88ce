"""Direct launches of compiled kernels: the key they are looked up by, and when they fall back to the JIT.

The direct path itself needs a GPU (tests/test_gpu.py compares it with Triton's launch path); here a stand-in
kernel records how it is called.
"""

from __future__ import annotations

import pytest
import torch

from fa2tune import fastlaunch


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
