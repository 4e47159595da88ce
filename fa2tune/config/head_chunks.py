"""How the warp-specialized kernels cover a head dim: as column chunks of power-of-two widths.

Gluon, like Triton, takes only power-of-two tensor shapes, and a wgmma's reduction step is 16 columns of 16-bit
inputs; a head dim of 96 padded to 128 does a third more work than it needs (d=96 ran at 0.7x of cuDNN so). The
kernels instead split the head dim into chunks — 96 = 64 + 32, 192 = 128 + 64, 80 = 64 + 16 — each its own TMA
block, shared-memory buffer and accumulator: QKᵀ sums the chunks' products into one S (wgmmas chained on one
accumulator), P·V writes one O accumulator a chunk. The head dim is rounded up to a multiple of CHUNK_MIN only; TMA
reads the columns past the tensor's end as zeros and never writes them.

One rule for the templates (rendered per chunk list: fa2tune.config.types.Variant), the launcher (a descriptor a
chunk) and the planner's shared-memory and register model (the padded width).
"""

from __future__ import annotations

import functools

CHUNK_MIN = 16  # wgmma's K step for 16-bit inputs: the narrowest chunk
CHUNK_MAX = 256  # wgmma's largest N: one chunk covers a head dim of 256
ALIGN = 8  # head dims whose rows are whole 16-byte TMA units in 16-bit types (the stride TMA needs)


def supported(head_dim: int) -> bool:
    """Whether the warp-specialized kernels take this head dim: a multiple of ALIGN, CHUNK_MIN … CHUNK_MAX."""
    return head_dim % ALIGN == 0 and CHUNK_MIN <= head_dim <= CHUNK_MAX


@functools.cache
def chunks(head_dim: int) -> tuple[int, ...]:
    """The chunk widths of `head_dim`, largest first: the binary digits of head_dim rounded up to CHUNK_MIN."""
    if not 1 <= head_dim <= CHUNK_MAX:
        raise ValueError(f"head_dim must be in 1..{CHUNK_MAX}, got {head_dim}")
    width = -(-head_dim // CHUNK_MIN) * CHUNK_MIN
    return tuple(bit for bit in (256, 128, 64, 32, 16) if width & bit)


def padded(head_dim: int) -> int:
    """The columns the kernels compute on: head_dim rounded up to CHUNK_MIN."""
    return sum(chunks(head_dim))


def fused_dq_error(head_dim: int, head_dim_v: int | None = None) -> str | None:
    """Why the warp-specialized dK/dV kernel cannot add dQ in (KernelConfig.fused_dq) at these head dims, or None:
    its dQ partials take a head dim of one chunk (a power of two), and V's the same as Q's and K's (bwd_ws.py.jinja's
    fused dQ is written and measured for one head dim)."""
    if len(chunks(head_dim)) > 1:
        widths = " + ".join(map(str, chunks(head_dim)))
        return f"fused_dq takes a head dim of one chunk (a power of two), got {head_dim} = {widths}"
    if head_dim_v is not None and head_dim_v != head_dim:
        return f"fused_dq takes V's head dim equal to Q's and K's, got {head_dim_v} and {head_dim}"
    return None


def offsets(widths: tuple[int, ...]) -> tuple[int, ...]:
    """The first column of each chunk."""
    return tuple(sum(widths[:i]) for i in range(len(widths)))
