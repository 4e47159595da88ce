"""What a benchmark compares: fa2tune, each SDPA backend, FlexAttention, and flash_attn / flash_attn.cute where
installed. A provider builds, for one shape, a call on q, k, v in its own layout that returns the output.

Optional packages are imported only when asked for and only here: one that is missing or fails to import makes
its provider unavailable, with the reason, never the benchmark fail.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import PROVIDER_NAMES
from .shapes import Shape

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The math backend stores the N×N scores (and, training, their gradient) in fp32: past this many bytes of them a
# shape is skipped rather than run out of memory or run for minutes.
MATH_SCORES_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class Provider:
    """One implementation. build(shape) gives the call; missing(device) says why it cannot run here at all (None:
    it can); skip(shape) why it does not take a shape. seq_major: q, k, v as (batch, seqlen, heads, d), flash_attn's
    layout, instead of SDPA's (batch, heads, seqlen, d)."""

    name: str
    about: str
    build: Callable[[Shape], Run]
    missing: Callable[[str], str | None]
    skip: Callable[[Shape], str | None] = lambda shape: None
    seq_major: bool = False


def _fa2tune(shape: Shape) -> Run:
    import fa2tune

    return lambda q, k, v: fa2tune.attention(q, k, v, causal=shape.causal)


def _sdpa(backend_name: str) -> Callable[[Shape], Run]:
    def build(shape: Shape) -> Run:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        gqa = shape.heads != shape.heads_kv

        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)

        return run

    return build


def _flex(shape: Shape) -> Run:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    gqa = shape.heads != shape.heads_kv
    masks = {}

    def run(q, k, v):
        if not shape.causal:
            return compiled(q, k, v, enable_gqa=gqa)
        if "causal" not in masks:  # built on the first call, which the timing's warm-up absorbs
            n = q.shape[-2]
            masks["causal"] = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n, device=q.device)
        return compiled(q, k, v, block_mask=masks["causal"], enable_gqa=gqa)

    return run


def _flash_attn(module: str) -> Callable[[Shape], Run]:
    def build(shape: Shape) -> Run:
        func = importlib.import_module(module).flash_attn_func

        def run(q, k, v):
            out = func(q, k, v, causal=shape.causal)
            return out[0] if isinstance(out, tuple) else out  # flash_attn.cute returns (out, lse)

        return run

    return build


def _needs_cuda(device: str) -> str | None:
    return "needs a CUDA device" if device == "cpu" else None


def _importable(module: str, package: str) -> Callable[[str], str | None]:
    def missing(device: str) -> str | None:
        try:
            importlib.import_module(module).flash_attn_func  # noqa: B018  (a namespace package may lack it)
        except Exception as exc:  # not installed, or built for another torch or CUDA: either way not here
            return f"{module}.flash_attn_func is not importable ({type(exc).__name__}: {exc}; pip install {package})"
        return _needs_cuda(device)

    return missing


def _math_skip(shape: Shape) -> str | None:
    scores = shape.batch * shape.heads * shape.seqlen**2 * 4 * (2 if shape.mode != "fwd" else 1)
    if scores > MATH_SCORES_MAX_BYTES:
        return f"the math backend would store {scores / 2**30:.0f} GiB of scores (limit {MATH_SCORES_MAX_BYTES >> 30})"
    return None


PROVIDERS = {
    p.name: p
    for p in (
        Provider("fa2tune", "fa2tune.attention", _fa2tune, lambda device: None),
        Provider("sdpa_flash", "SDPA, flash backend", _sdpa("FLASH_ATTENTION"), lambda device: None),
        Provider("sdpa_cudnn", "SDPA, cuDNN backend", _sdpa("CUDNN_ATTENTION"), _needs_cuda),
        Provider("sdpa_efficient", "SDPA, memory-efficient backend", _sdpa("EFFICIENT_ATTENTION"), _needs_cuda),
        Provider("sdpa_math", "SDPA, math backend (N×N scores in memory)", _sdpa("MATH"), lambda device: None,
                 skip=_math_skip),
        Provider("flex", "torch.nn.attention.flex_attention, compiled", _flex, _needs_cuda),
        Provider("flash_attn", "flash_attn.flash_attn_func (FlashAttention-2)", _flash_attn("flash_attn"),
                 _importable("flash_attn", "flash-attn"), seq_major=True),
        Provider("flash_attn_cute", "flash_attn.cute.flash_attn_func (FlashAttention-4, CuTe DSL)",
                 _flash_attn("flash_attn.cute"), _importable("flash_attn.cute", "flash-attn-4"), seq_major=True),
    )
}  # fmt: skip
assert tuple(PROVIDERS) == PROVIDER_NAMES


def select(names: list[str] | None, device: str) -> tuple[list[Provider], dict[str, str]]:
    """(the providers asked for that can run on `device`, {name: why not} for the others); None asks for all.
    ValueError for a name that is no provider."""
    unknown = [name for name in names or [] if name not in PROVIDERS]
    if unknown:
        raise ValueError(f"--providers takes names from {', '.join(PROVIDERS)}; got {', '.join(unknown)}")
    chosen, skipped = [], {}
    for name in names or list(PROVIDERS):
        why = PROVIDERS[name].missing(device)
        if why is None:
            chosen.append(PROVIDERS[name])
        else:
            skipped[name] = why
    return chosen, skipped
