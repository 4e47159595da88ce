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


# The most a padded form (KernelConfig.pad_head_dim) computes beyond the exact chunks, as a fraction of their width.
# Each chunk costs its own TMA load, buffer, wgmmas and (in the backward) dQ reductions: in one run of the untuned
# defaults on the H200 (forward + backward, N=8k; docs/PERF.md, "The untuned defaults"), d=112 = 64 + 32 + 16 ran at
# 459 TFLOP/s and d=128 at 562, so 112 columns took 7 % longer than 128 would; where the count stays, the pad is
# only extra work (d=160 = 128 + 32 at 490 against d=192 = 128 + 64 at 472). A quarter admits 112 → 128,
# 176 → 192, 208 → 256, 224 → 256, 240 → 256 and rules out 48 → 64, 80 → 128, 144 → 256.
MAX_PAD = 0.25


def _digits(width: int) -> tuple[int, ...]:
    """The power-of-two chunks of a multiple of CHUNK_MIN, largest first."""
    return tuple(bit for bit in (256, 128, 64, 32, 16) if width & bit)


@functools.cache
def chunks(head_dim: int, pad: bool = False) -> tuple[int, ...]:
    """The chunk widths of `head_dim`, largest first: the binary digits of head_dim rounded up to CHUNK_MIN; pad:
    those of fewer_chunks(head_dim) (KernelConfig.pad_head_dim)."""
    if not 1 <= head_dim <= CHUNK_MAX:
        raise ValueError(f"head_dim must be in 1..{CHUNK_MAX}, got {head_dim}")
    width = -(-head_dim // CHUNK_MIN) * CHUNK_MIN
    if pad:
        bound = min(CHUNK_MAX, int(width * (1 + MAX_PAD)))
        count = len(_digits(width))
        width = next((w for w in range(width, bound + 1, CHUNK_MIN) if len(_digits(w)) < count), width)
    return _digits(width)


def padded(head_dim: int, pad: bool = False) -> int:
    """The columns the kernels compute on: head_dim rounded up to CHUNK_MIN; pad: to fewer_chunks(head_dim)."""
    return sum(chunks(head_dim, pad))


def fewer_chunks(head_dim: int) -> int:
    """The columns a padded form computes on: the narrowest multiple of CHUNK_MIN, at most MAX_PAD wider than
    padded(head_dim), that takes fewer chunks than it (d=112: 128, one chunk instead of 64 + 32 + 16); padded(head_dim)
    itself where none does."""
    return padded(head_dim, pad=True)


def pads(head_dim: int) -> bool:
    """Whether a padded form of head_dim computes on other chunks than the exact one (fewer_chunks differs)."""
    return fewer_chunks(head_dim) != padded(head_dim)


DQ_BLOCK_MAX = 64  # columns of one fused-dQ partial: 64 × 64 fp32 is 32 registers a thread of a warpgroup


def dq_width(chunk_width: int) -> int:
    """The width of the dQ blocks of a chunk `chunk_width` wide: its TMA descriptor's block columns (a chunk's
    blocks are as wide)."""
    return min(chunk_width, DQ_BLOCK_MAX)


@functools.cache
def dq_blocks(head_dim: int) -> tuple[tuple[int, int, int], ...]:
    """The blocks a fused-dQ dK/dV kernel (KernelConfig.fused_dq) forms and reduces dQ in: (chunk, first column in the
    chunk, width), each chunk cut into blocks of dq_width columns (a wgmma's B operand is a column slice of one
    chunk's K buffer; a TMA reduction a block, with its chunk's descriptor)."""
    return tuple((index, start, dq_width(width))
                 for index, width in enumerate(chunks(head_dim))
                 for start in range(0, width, dq_width(width)))  # fmt: skip


def widest_dq_block(head_dim: int) -> int:
    """The widest dQ block's columns: the first chunk's (chunks run widest first), what a consumer's fp32 staging
    buffer and its dQ partial's registers hold."""
    return dq_width(chunks(head_dim)[0])


@functools.cache
def dq_widths(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(width, the first chunk whose blocks are that wide) of each distinct dQ block width, widest first: the
    staging buffers a fused-dQ consumer views its one buffer as, in that chunk's TMA layout."""
    first: dict[int, int] = {}
    for index, _, width in dq_blocks(head_dim):
        first.setdefault(width, index)
    return tuple(first.items())


@functools.cache
def dq_shares(head_dim: int, consumers: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """dq_blocks dealt to `consumers` warpgroups, one tuple each: block by block, in column order, to the one with the
    fewest columns so far, ties to the first. Widths are powers of two, largest first, so the shares differ by at
    most one block."""
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(consumers)]
    for block in dq_blocks(head_dim):
        taker = min(range(consumers), key=lambda wg: sum(width for _, _, width in shares[wg]))
        shares[taker].append(block)
    return tuple(tuple(share) for share in shares)


def offsets(widths: tuple[int, ...]) -> tuple[int, ...]:
    """The first column of each chunk."""
    return tuple(sum(widths[:i]) for i in range(len(widths)))
