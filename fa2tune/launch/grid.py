"""Launch arithmetic every launcher shares: grid shapes, and the constants kernel arguments are built with."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels run the softmax on exp2, so scores are scaled by scale·log2(e)
GRID_AXIS_MAX = 65535  # CUDA's cap on grid axes 1 and 2
# The forward computes pid_bh = axis2·B1 + axis1 and batch·heads in int32 (Triton's type for program ids): every
# program id of the grid must stay below 2^31. Only inputs of ~2^31 heads of a few elements come near it.
MAX_BATCH_HEADS = 2**31 - 1


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for positive b: the tiles of size b that cover a."""
    return -(-a // b)


# A dense call's backward statistics buffers (launch.backward's _Stats) hold a multiple of this many rows a (batch,
# head): the divisibility Triton's JIT specializes an int on, and the bound bwd_ws.py.jinja's loads round N_Q up to
STATS_ROWS = 16


def stats_rows(seqlen_q: int) -> int:
    """The rows a (batch, head) of a dense call's statistics buffers: seqlen_q rounded up to STATS_ROWS."""
    return cdiv(seqlen_q, STATS_ROWS) * STATS_ROWS


def fwd_grid(q_tiles: int, batch_heads: int) -> tuple[int, int, int]:
    """The forward's grid: (Q tiles, B1, B2) with B1·B2 >= batch_heads and B1, B2 <= GRID_AXIS_MAX.

    Programs with pid_bh = axis2·B1 + axis1 >= batch_heads return at once; there are fewer than B2 of them.
    """
    axis_max = GRID_AXIS_MAX
    b2 = cdiv(batch_heads, axis_max)
    if b2 > axis_max:
        raise ValueError(f"batch·heads = {batch_heads} exceeds what one launch can cover ({axis_max}²)")
    b1 = cdiv(batch_heads, b2)  # the smallest B1 for that B2: fewer than b2 idle programs per Q tile
    if b1 * b2 > MAX_BATCH_HEADS:
        raise ValueError(
            f"batch·heads = {batch_heads} is more than the forward kernel can number with 32-bit program ids "
            f"(at most {MAX_BATCH_HEADS}); split the batch into several calls"
        )
    return (q_tiles, b1, b2)


def input_precision(dtype: torch.dtype) -> str:
    """The kernels' INPUT_PRECISION: fp32 inputs get true fp32 products ("ieee"), as a user asking for fp32 expects;
    Triton would use tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"
