"""The decode launcher: appends new keys to a KV cache and attends a few query tokens over it, split-KV, with the
kernels of templates/decode.py.jinja.

One call launches up to three kernels on the current stream, in order: _append_kv (only with new keys: it writes
them into the caches at each entry's length), _decode_fwd (grid: batch·kv_heads × splits × row tiles; with one split
it writes O and the logsumexp, else each split's partial), and _decode_merge (splits > 1: the partials' exact
combination). Nothing here reads a tensor's values on the host: the entries' lengths and pages stay on the device,
so a call can be captured in a CUDA graph; the kernels clamp every length and page index into the caches. What a
call works out from its shapes (config, splits, kernels, grids, scalar arguments) is kept per call signature, in
the launch plans that attention's calls keep theirs in (fa2tune.launch.plans).

A call that passes no config runs the one its caller's `resolve` gives (the API's: the tuned entry the store holds
for the device, head dim and dtype, else the default: fa2tune.api.selection.resolve_decode), asked when a call
signature is new, as the rest of a plan is worked out: the calls that repeat a signature ask nothing, and this module
reads no config file.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..config import decode_plan, planner
from ..config.decode_plan import DecodeConfig, DecodeVariant, default_config, launch_shape
from ..config.device import device_info
from ..config.inputs import interpreting
from ..config.kvcache_inputs import KVCache
from ..kernels import codegen
from . import fastlaunch, plans
from .grid import GRID_AXIS_MAX, LOG2E, cdiv, input_precision
from .layout import in_units, on_device, settled_strides

APPEND_ROWS = 16  # new keys an append program copies


Resolve = Callable[[torch.device, int, torch.dtype], DecodeConfig]  # (device, head_dim, dtype) -> config


def decode(q: torch.Tensor, cache: KVCache, *, scale: float, window: tuple[int, int], splits: int = 0,
           config: DecodeConfig | None = None,
           resolve: Resolve | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Appends cache.k_new/v_new (if any) and returns (O, logsumexp) of q over each entry's keys.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), unit last stride; heads_q a multiple of the cache's kv_heads.
        cache: the checked cache tensors (fa2tune.config.kvcache_inputs.check_call).
        scale: the softmax scale.
        window: (left, right) as the kernels take them (types.Mask.bounds: no side is negative; causal is right 0).
        splits: programs sharing an entry's keys; 0: decode_plan.num_splits, with the config's parameters.
        config: the launch config; None: resolve's for q's device, head dim and dtype.
        resolve: the config of a call that passes none, asked when its signature is new; None:
            decode_plan.default_config.

    Returns:
        O (batch, seqlen_q, heads_q, head_dim) contiguous in q's dtype, and the fp32 logsumexp (batch, heads_q,
        seqlen_q): 0 and -inf for a query that sees no key.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    # The kept plan first: a call of a seen signature works nothing out (the config, the split count and everything
    # else a plan holds follow from the signature, which has the requested splits and config, 0 and None for "choose",
    # and what a chosen config comes from: the resolver and the config directory the store reads first).
    key = ("decode", _signature(q, cache, scale, window, splits, config), resolve)
    plan = plans.lookup(key)
    if plan is None:
        config = config or (resolve or _default_config)(q.device, q.shape[-1], q.dtype)
        plan = plans.Plan(_plan(q, cache, scale, window, splits or _auto_splits(q, cache, config), config), tma=False)
        plans.keep(key, plan, downgraded=False, tma_tensors=())
    with on_device(q):
        plan.launch(q, cache, out, lse)
    return out, lse


def _default_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The untuned config: what a call without a config nor a resolver runs."""
    return default_config(device_info(device), head_dim, dtype)


def _auto_splits(q: torch.Tensor, cache: KVCache, config: DecodeConfig) -> int:
    """decode_plan.num_splits for this call's shapes and device."""
    batch, seqlen_q, heads_q, _ = q.shape
    return launch_shape(config, batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, kv_heads=cache.k_cache.shape[2],
                        capacity=cache.capacity, sm_count=device_info(q.device).sm_count)[2]  # fmt: skip


def _signature(q, cache: KVCache, scale, window, splits, config) -> tuple:
    """Everything a plan is worked out from: the tensors' shapes and strides, dtypes, device, whether lengths are a
    tensor (else their value), the scale, window, splits and config, the interpreter, and the config directory the
    store searches first (which may hold another tuned config)."""
    tensors = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.cache_seqlens, cache.k_new, cache.v_new)
    layout = tuple([None if t is None else (t.shape, t.stride(), t.dtype) for t in tensors])
    return (layout, q.device, cache.seqlen, scale, window, splits, config, interpreting(),
            os.environ.get("FA2TUNE_CONFIG_DIR"))  # fmt: skip


def _kernels(paged: bool):
    variant = DecodeVariant(paged=paged, dot_fp32=interpreting())
    return codegen.load("decode", variant)


def _plan(q, cache: KVCache, scale: float, window: tuple[int, int], splits: int, config: DecodeConfig):
    """launch(q, cache, out, lse) for calls of this signature: the append, the attention and the merge, every
    argument but the tensors worked out."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    k_cache, v_cache, table = cache.k_cache, cache.v_cache, cache.block_table
    kv_heads = k_cache.shape[2]
    group = heads_q // kv_heads
    block_m, tiles = decode_plan.row_tiles(group, seqlen_q, config.max_block_m)
    _check_grid(tiles, block_m, group, seqlen_q, cache.seqlen_new)
    module = _kernels(table is not None)
    head = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=planner.head_dim_padded(head_dim))
    num_pages = k_cache.shape[0] if table is not None else 1
    table_stride = table.stride(0) if table is not None else 0
    sizes = (cache.seqlen_new, cache.seqlen, cache.capacity, num_pages)
    append = None
    # every kernel takes its tensors' strides in the units it multiplies back (layout.in_units)
    if cache.seqlen_new:
        units, strides = in_units(KN=_strides(cache.k_new), VN=_strides(cache.v_new), K=_strides(k_cache),
                                  V=_strides(v_cache))  # fmt: skip
        append = fastlaunch.Launcher(
            module._append_kv, (batch * kv_heads, cdiv(cache.seqlen_new, APPEND_ROWS)),
            (*strides, table_stride, kv_heads, *sizes),
            dict(**head, BLOCK_R=APPEND_ROWS, PAGE_SIZE=cache.page_size, num_warps=4, **units),
        )  # fmt: skip
    o_strides = (seqlen_q * heads_q * head_dim, heads_q * head_dim, head_dim)  # out is contiguous
    lse_strides = (heads_q * seqlen_q, seqlen_q)
    units, strides = in_units(Q=_strides(q), K=_strides(k_cache), V=_strides(v_cache), O=o_strides)
    attend = fastlaunch.Launcher(
        module._decode_fwd, (batch * kv_heads, splits, tiles),
        (*strides, *lse_strides, table_stride, kv_heads, group, seqlen_q, *sizes, scale * LOG2E, *window),
        dict(**head, BLOCK_M=block_m, BLOCK_N=config.block_n, PAGE_SIZE=cache.page_size, PARTIAL=splits > 1,
             INPUT_PRECISION=input_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
             **units),
    )  # fmt: skip
    merge = None
    if splits > 1:
        rows = group * seqlen_q
        splits_pad, split_block = decode_plan.merge_blocks(splits, head_dim)
        merge_units, merge_strides = in_units(O=o_strides)
        merge = fastlaunch.Launcher(
            module._decode_merge, (batch * kv_heads * rows,),
            (*merge_strides, *lse_strides, kv_heads, group, rows, tiles * block_m, splits),
            dict(**head, SPLITS_PAD=splits_pad, SPLIT_BLOCK=split_block, **merge_units,
                 num_warps=decode_plan.MERGE_WARPS),
        )  # fmt: skip
    part_shape = (splits, batch * kv_heads, tiles * block_m)

    def launch(q, cache: KVCache, out, lse):
        k, v, table, seqlens = cache.k_cache, cache.v_cache, cache.block_table, cache.cache_seqlens
        if append is not None:
            append(cache.k_new, cache.v_new, k, v, seqlens, table)
        if merge is None:
            attend(q, k, v, out, lse, None, None, seqlens, table)
            return
        part_o = q.new_empty((*part_shape, head["HEAD_DIM_PAD"]), dtype=torch.float32)
        part_lse = q.new_empty(part_shape, dtype=torch.float32)
        attend(q, k, v, out, lse, part_o, part_lse, seqlens, table)
        merge(part_o, part_lse, out, lse)

    return launch


def _check_grid(tiles: int, block_m: int, group: int, seqlen_q: int, seqlen_new: int) -> None:
    """The attention's row tiles and the append's row blocks are grid axes that CUDA caps at GRID_AXIS_MAX: a call
    past them is refused by name rather than failing to launch."""
    if tiles > GRID_AXIS_MAX:
        raise ValueError(
            f"q has {seqlen_q} tokens of {group} query heads a K/V head: {group * seqlen_q} packed rows, more than the "
            f"decode kernel's {GRID_AXIS_MAX} tiles of {block_m} take; flash_attn_with_kvcache is for decode steps "
            "and chunks of a prompt — attend a longer one with fa2tune.attention"
        )
    if cdiv(seqlen_new, APPEND_ROWS) > GRID_AXIS_MAX:
        raise ValueError(
            f"k/v to append have {seqlen_new} tokens, more than one append takes ({GRID_AXIS_MAX * APPEND_ROWS}); "
            "append them in parts"
        )


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(entry or page, key, head) strides of a (batch or pages, keys, heads, head_dim) tensor, a size-1 dim's settled
    (layout.settled_strides): it addresses nothing, so an odd one (a one-token q sliced out of a wider buffer) must
    not narrow the tensor's unit. A plan's strides are its signature's, so settling them here costs a call nothing."""
    return settled_strides(t).stride()[:3]
