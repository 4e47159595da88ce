"""The decode path's decisions before any kernel exists (templates/decode.py.jinja): its template variant, its launch
config, how query rows are packed into tiles, and how many programs split each batch entry's keys.

A decode step has few query rows (1–16 tokens) per batch entry, so one program per (batch, query head) would read
each K/V tile once per query head and leave most SMs idle. The decode kernel instead gives one program the rows of
every query head that shares a K/V head (GQA packing: GROUP heads × q_len rows, one tile), so each K/V tile is read
once per K/V head, and splits the keys of an entry into chunks run by separate programs when batch × K/V heads
programs are too few to fill the GPU (flash-decoding). A second kernel merges the chunks' partial (O, logsumexp)
exactly (fa2tune.launch.decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import planner
from .types import DeviceInfo

MIN_BLOCK_M = 16  # tl.dot takes 16 rows at least: fewer packed rows are padded to it
MAX_SPLITS = 128  # splits one launch may take (num_splits above it is an error: its partials would outweigh K/V)
# The split rule (num_splits): a launch aims at this many programs per SM, so that each SM has K/V loads of more than
# one program in flight — one program's pipeline alone does not keep HBM busy
PROGRAMS_PER_SM = 2
# ... and a split reads at least this many keys: below it, a split's start and end and its partial's store and merge
# cost about what its K/V reads do
MIN_SPLIT_KEYS = 512


@dataclass(frozen=True)
class DecodeVariant:
    """Structural switches of templates/decode.py.jinja: each changes the code.

    Attributes:
        paged: the cache is paged, (num_pages, page_size, kv_heads, head_dim) found through a block table; else one
            (batch, capacity, kv_heads, head_dim) row of keys per batch entry.
        dot_fp32: upcast dot operands to fp32 (the Triton interpreter computes bf16 dots wrongly).
    """

    paged: bool
    dot_fp32: bool = False


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel.

    Attributes:
        block_n: keys a loop step reads (one page at most when the page size is a multiple of it: then a step looks
            up one page; otherwise each key's page is looked up).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loop.
        max_block_m: the most packed query rows a program takes; more rows are cut into tiles of this many (each
            tile reads the K/V head again).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    max_block_m: int = 64

    def __post_init__(self) -> None:
        for name, allowed in (("block_n", (16, 32, 64, 128, 256)), ("num_warps", (1, 2, 4, 8, 16)),
                              ("max_block_m", (16, 32, 64, 128))):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"DecodeConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"DecodeConfig.num_stages must be in 1..8, got {self.num_stages!r}")


# The untuned configs, tried in order: the first whose shared memory (sram_bytes) fits the device runs. 64 keys a step
# and three stages keep ~100 KB of K/V in flight per SM at d=128 with two programs an SM; larger head dims and
# smaller GPUs take fewer stages, shorter steps, fewer packed rows. The interpreter's takes 32 keys a step, so that
# short test caches span several steps and splits.
CANDIDATES = (
    DecodeConfig(block_n=64, num_warps=4, num_stages=3),
    DecodeConfig(block_n=64, num_warps=4, num_stages=2),
    DecodeConfig(block_n=32, num_warps=4, num_stages=2),
    DecodeConfig(block_n=32, num_warps=4, num_stages=2, max_block_m=32),
    DecodeConfig(block_n=16, num_warps=4, num_stages=2, max_block_m=16),
)
DEFAULT_CONFIG = CANDIDATES[0]
INTERPRETER_CONFIG = DecodeConfig(block_n=32, num_warps=4, num_stages=1)


def sram_bytes(config: DecodeConfig, head_dim: int, dtype: torch.dtype) -> int:
    """Shared memory the attention kernel takes at most, bytes: num_stages − 1 K/V steps in flight (one at least),
    and the tile of max_block_m rows' operands and layout conversions (Q, the fp32 accumulator, the scores) —
    an upper bound of what sm_90 compiles allocate (tests/test_decode.py compiles a few to check it)."""
    width, size = planner.head_dim_padded(head_dim), dtype.itemsize
    steps = max(1, config.num_stages - 1) * 2 * config.block_n * width * size
    rows = config.max_block_m
    return steps + rows * width * (4 + size) + rows * config.block_n * 4 + 1024


def default_config(device: DeviceInfo, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The config a decode call runs on `device` (fa2tune tune --decode will store tuned ones): the first of
    CANDIDATES whose shared memory fits one program on it, the last one else."""
    if device.source == "interpreter":
        return INTERPRETER_CONFIG
    fits = [c for c in CANDIDATES if sram_bytes(c, head_dim, dtype) <= device.smem_per_block]
    return fits[0] if fits else CANDIDATES[-1]


def row_tiles(group: int, seqlen_q: int, max_block_m: int) -> tuple[int, int]:
    """(block_m, tiles): the packed query rows of one K/V head — `group` query heads × seqlen_q tokens — as `tiles`
    tiles of block_m rows, block_m a power of two in MIN_BLOCK_M..max_block_m."""
    rows = group * seqlen_q
    block_m = min(max(MIN_BLOCK_M, 1 << (rows - 1).bit_length()), max_block_m)
    return block_m, -(-rows // block_m)


def num_splits(*, batch: int, kv_heads: int, tiles: int, max_keys: int, sm_count: int) -> int:
    """How many programs share the keys of one (batch entry, K/V head, row tile): the one rule of the decode path.

    The batch·kv_heads·tiles programs of an unsplit launch fill a GPU of `sm_count` SMs when there are at least as
    many as SMs (each SM then holds one or more, and the pipeline of each keeps its loads in flight): no split. Fewer,
    the keys are split so that the launch has PROGRAMS_PER_SM programs an SM, but never into chunks shorter than
    MIN_SPLIT_KEYS keys, nor into more than MAX_SPLITS. The lengths live on the device (cache_seqlens, read by no
    host code), so `max_keys` is the cache's capacity: a cache much larger than what it holds splits finer than its
    lengths need (each split then reads fewer keys; pass num_splits to choose).

    Args:
        batch, kv_heads: the call's batch entries and K/V heads.
        tiles: row tiles per K/V head (row_tiles).
        max_keys: the most keys an entry may hold (capacity of the cache).
        sm_count: the device's SMs.
    """
    programs = batch * kv_heads * tiles
    if programs >= sm_count or programs == 0:
        return 1
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    return max(1, min(wanted, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))
