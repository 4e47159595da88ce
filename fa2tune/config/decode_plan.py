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
from .decode_config import DecodeConfig
from .types import DeviceInfo

__all__ = ["CANDIDATES", "DEFAULT_CONFIG", "INTERPRETER_CONFIG", "MAX_SPLITS", "MERGE_ELEMENTS", "MERGE_WARPS",
           "MIN_BLOCK_M", "SHORT_QUERY_TOKENS", "DecodeConfig", "DecodeVariant", "check", "default_config",
           "launch_shape", "merge_blocks", "num_splits", "row_tiles", "sram_bytes"]  # fmt: skip

MIN_BLOCK_M = 16  # tl.dot takes 16 rows at least: fewer packed rows are padded to it
# attention()'s forward-only calls of at most this many query tokens run the decode kernels (launch.short_query): a
# decode step's range (GQA packing of 1–16 tokens, flash_attn_with_kvcache's), where a forward tile of 64–128 query
# rows holds at most a quarter of real ones
SHORT_QUERY_TOKENS = 16
MAX_SPLITS = 128  # splits one launch may take (num_splits above it is an error: its partials would outweigh K/V)
MERGE_WARPS = 4  # a merge program's warps
MERGE_ELEMENTS = 4096  # partial-output elements a merge program loads at once: 32 fp32 registers a thread


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


def check(config: DecodeConfig, device: DeviceInfo, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why `config` cannot run at this head dim and dtype on `device`, or None: the one constraint of the decode
    kernel, its shared memory (sram_bytes) against what one program may take."""
    need = sram_bytes(config, head_dim, dtype)
    if need > device.smem_per_block:
        return f"needs {need:,} B of shared memory, {device.name} gives a program {device.smem_per_block:,} B"
    return None


def default_config(device: DeviceInfo, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The untuned config a decode call runs on `device` (`fa2tune tune --kernel decode` stores tuned ones): the
    first of CANDIDATES that fits it (check), the last one else."""
    if device.source == "interpreter":
        return INTERPRETER_CONFIG
    fits = [c for c in CANDIDATES if check(c, device, head_dim, dtype) is None]
    return fits[0] if fits else CANDIDATES[-1]


def row_tiles(group: int, seqlen_q: int, max_block_m: int) -> tuple[int, int]:
    """(block_m, tiles): the packed query rows of one K/V head — `group` query heads × seqlen_q tokens — as `tiles`
    tiles of block_m rows, block_m a power of two in MIN_BLOCK_M..max_block_m."""
    rows = group * seqlen_q
    block_m = min(max(MIN_BLOCK_M, 1 << (rows - 1).bit_length()), max_block_m)
    return block_m, -(-rows // block_m)


def num_splits(*, batch: int, kv_heads: int, tiles: int, max_keys: int, sm_count: int, config: DecodeConfig) -> int:
    """How many programs share the keys of one (batch entry, K/V head, row tile): the one rule of the decode path.

    The batch·kv_heads·tiles programs of an unsplit launch fill a GPU of `sm_count` SMs when there are at least as
    many as SMs (each SM then holds one or more, and the pipeline of each keeps its loads in flight): no split. Fewer,
    the keys are split so that the launch has config.programs_per_sm programs an SM, but never into chunks shorter
    than config.min_split_keys keys, nor into more than MAX_SPLITS. The lengths live on the device (cache_seqlens,
    read by no host code), so `max_keys` is the cache's capacity: a cache much larger than what it holds splits finer
    than its lengths need (each split then reads fewer keys; pass num_splits to choose).

    Args:
        batch, kv_heads: the call's batch entries and K/V heads.
        tiles: row tiles per K/V head (row_tiles).
        max_keys: the most keys an entry may hold (capacity of the cache).
        sm_count: the device's SMs.
        config: the launch config, whose programs_per_sm and min_split_keys are the rule's two parameters.
    """
    programs = batch * kv_heads * tiles
    if programs >= sm_count or programs == 0:
        return 1
    wanted = -(-config.programs_per_sm * sm_count // programs)
    return max(1, min(wanted, max_keys // config.min_split_keys, MAX_SPLITS))


def launch_shape(config: DecodeConfig, *, batch: int, seqlen_q: int, heads_q: int, kv_heads: int, capacity: int,
                 sm_count: int) -> tuple[int, int, int]:  # fmt: skip
    """(block_m, tiles, splits) a call of these shapes launches with `config` and the split rule (num_splits): what
    the launcher works out and what the decode tuner tells configs apart by."""
    block_m, tiles = row_tiles(heads_q // kv_heads, seqlen_q, config.max_block_m)
    splits = num_splits(batch=batch, kv_heads=kv_heads, tiles=tiles, max_keys=capacity, sm_count=sm_count,
                        config=config)  # fmt: skip
    return block_m, tiles, splits


def merge_blocks(splits: int, head_dim: int) -> tuple[int, int]:
    """(SPLITS_PAD, SPLIT_BLOCK) of the merge kernel: the split count rounded up to a power of two, and how many
    splits' partial rows of `head_dim` columns (padded) a merge program loads at once (MERGE_ELEMENTS at most)."""
    splits_pad = 1 << (max(1, splits) - 1).bit_length()
    return splits_pad, max(1, min(splits_pad, MERGE_ELEMENTS // planner.head_dim_padded(head_dim)))
