"""Measuring: every provider on one shape, each checked against a reference and then timed, and a list of shapes
measured one after another with a line of progress each (the "fa2tune.bench" logger).

A row is a flat dict, the columns of report.COLUMNS: the shape, the provider, its median milliseconds and TFLOP/s,
its relative error against the reference, and a note where it has no number (why not).

With rounds > 1 a shape's providers are timed that many times, each round in the other direction (first to last,
then last to first: tune.timing.final_readings, the tuner's finish rule), and each row's milliseconds are the mean
of its rounds' medians: a GPU's readings drift within a run (on an H100 a config re-timed last in a tune's finish
read 11 % above its earlier reading), and one pass in a fixed order charges that drift to the providers timed last.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable

import torch

from ..config.inputs import DTYPES_BY_NAME
from ..tune.timing import Timing, final_readings, time_cuda
from ..tune.workload import random_qkv
from .providers import Provider
from .report import rounded
from .shapes import Shape

log = logging.getLogger("fa2tune.bench")
# ‖out − ref‖ / ‖ref‖ (outputs and, training, the three gradients): a provider past this computes something else
# and gets no speed number. bf16 implementations land near 5e-3 of each other.
MAX_REL_ERR = 2e-2
HOST_REPS = 3  # timed runs of a call on the CPU (the interpreter: seconds each)


def measure(shapes: list[Shape], providers: list[Provider], device: str, rounds: int = 1) -> list[dict]:
    """The rows of every shape, provider by provider, in order; one progress line per shape."""
    rows = []
    for number, shape in enumerate(shapes, 1):
        got = measure_shape(shape, providers, device, rounds)
        said = ", ".join(f"{r['provider']} {r['tflops']:g}" if not math.isnan(r["tflops"]) else f"{r['provider']} -"
                         for r in got)  # fmt: skip
        log.info("[%d/%d] %s: %s TFLOP/s", number, len(shapes), shape.label(), said)
        rows += got
    return rows


def measure_shape(shape: Shape, providers: list[Provider], device: str, rounds: int = 1) -> list[dict]:
    """One row per provider for `shape` (a provider named twice has two rows), all on the same fresh random inputs,
    each checked against the reference right before its first timing and timed `rounds` times in alternating order
    (the module's text): with one round, provider by provider, each checked then timed."""
    training = shape.mode != "fwd"
    q, k, v = random_qkv(shape.batch, shape.heads, shape.seqlen, shape.head_dim, dtype=DTYPES_BY_NAME[shape.dtype],
                         device=device, heads_kv=shape.heads_kv, requires_grad=training)  # fmt: skip
    do = torch.randn_like(q) if training else None
    try:
        ref, failed = _flat(_call(_reference(shape), (q, k, v), do)()), ""
    except Exception as exc:  # no reference (out of memory, say): no provider can be checked, so none is timed
        ref, failed = None, f"the reference failed: {_first_line(exc)}"
    checked, notes = {}, {}  # by the provider's place in `providers`: (relative error, call, note); a timing's failure

    def read(index: int) -> float:
        if index not in checked:  # its first round: checked against the reference first
            checked[index] = (math.nan, None, failed) if failed else _checked(providers[index], shape, (q, k, v), do,
                                                                                 ref)  # fmt: skip
        call = checked[index][1]
        if call is None:
            raise _NotTimed
        try:
            return (time_cuda(call, device=device) if device != "cpu" else _time_host(call)).median_ms
        except Exception as exc:  # a provider that fails to run costs its row, not the benchmark
            _free_memory(q)
            notes[index] = _first_line(exc)
            raise

    readings = final_readings(list(range(len(providers))), read, rounds=rounds)
    rows = []
    for index, provider in enumerate(providers):
        err, _, note = checked[index]
        ms = statistics.fmean(readings[index]) if index in readings else math.nan
        rows.append(_row(shape, provider.name, ms, err if index not in notes else math.nan, notes.get(index, note)))
    return rows


class _NotTimed(Exception):
    """A provider that is not to be timed (skipped, failed, wrong: its note says why), out of the rounds."""


def _row(shape: Shape, provider: str, ms: float, rel_err: float, note: str) -> dict:
    tflops = shape.flops() / (ms * 1e-3) / 1e12 if not math.isnan(ms) else math.nan
    return dict(provider=provider, mode=shape.mode, dtype=shape.dtype, batch=shape.batch, heads=shape.heads,
                heads_kv=shape.heads_kv, seqlen=shape.seqlen, head_dim=shape.head_dim, causal=shape.causal,
                ms=rounded(ms), tflops=rounded(tflops), rel_err=rounded(rel_err), note=note)  # fmt: skip


def _checked(provider: Provider, shape: Shape, qkv, do, ref) -> tuple[float, Callable | None, str]:
    """(relative error, the call to time, note) of one provider on one shape: the call run once and checked against
    the reference; no call (None), and the reason in the note, where it is not to be timed."""
    why = provider.skip(shape)
    if why:
        return math.nan, None, why
    inputs, grad_out = _in_layout(provider, qkv, do)
    try:
        call = _call(provider.build(shape), inputs, grad_out)
        err = _rel_err(_flat(_from_layout(provider, call())), ref)
    except Exception as exc:  # a provider that does not take the shape (or fails) costs its row, not the benchmark
        _free_memory(qkv[0])
        return math.nan, None, _first_line(exc)
    if not err <= MAX_REL_ERR:  # NaN too: a provider that computes something else gets no speed number
        return err, None, f"relative error {err:.1e} against the reference: not timed"
    return err, call, ""


def _free_memory(on: torch.Tensor) -> None:
    """After a provider's failure (out of memory, say) on a GPU, the memory it held goes back for the next one."""
    if on.is_cuda:
        torch.cuda.empty_cache()


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _reference(shape: Shape):
    """SDPA with PyTorch's own backend choice, on K/V repeated for grouped-query attention (so it needs no
    backend's GQA support; autograd sums the repeated heads' gradients back)."""
    group = shape.heads // shape.heads_kv

    def run(q, k, v):
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

    return run


def _call(fn, inputs, do) -> Callable[[], tuple[torch.Tensor, ...]]:
    """The timed call: the forward, or the forward and all three gradients (autograd.grad: nothing accumulates)."""
    if do is None:
        return lambda: (fn(*inputs),)

    def train():
        out = fn(*inputs)
        return (out, *torch.autograd.grad(out, inputs, do))

    return train


def _in_layout(provider: Provider, qkv, do):
    """q, k, v (and dO) in the provider's layout, copied once outside the timed call."""
    if not provider.seq_major:
        return qkv, do
    moved = tuple(t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad) for t in qkv)
    return moved, None if do is None else do.transpose(1, 2).contiguous()


def _from_layout(provider: Provider, tensors):
    return tuple(t.transpose(1, 2) for t in tensors) if provider.seq_major else tensors


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for t in tensors])


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def _time_host(call) -> Timing:
    """Wall-clock milliseconds of HOST_REPS runs (the CPU has no CUDA events); the interpreter's, not a GPU's."""
    readings = []
    for _ in range(HOST_REPS):
        start = time.perf_counter()
        call()
        readings.append((time.perf_counter() - start) * 1e3)
    return Timing(median_ms=statistics.median(readings), p20_ms=min(readings), p80_ms=max(readings))


def environment(device: str) -> dict:
    """What a benchmark ran on: the device and the versions that decide its numbers."""
    import triton

    import fa2tune

    name = torch.cuda.get_device_name(device) if device != "cpu" else "CPU (Triton's interpreter; no speed)"
    versions = {"fa2tune": fa2tune.__version__, "torch": torch.__version__, "triton": triton.__version__}
    return {"device": name, **versions, **({"cuda": torch.version.cuda} if device != "cpu" else {})}
