"""The warp-specialized kernels (KernelConfig.warp_specialized): the forward (templates/fwd_ws.py.jinja) and the
backward's dK/dV and dQ kernels (templates/bwd_ws.py.jinja, bwd_dq_ws.py.jinja) — which calls they take, and their
launches.

They are Gluon kernels: TMA descriptors of the tensors replace pointer arithmetic, so they take what TMA takes —
16-byte-aligned base addresses and strides, a unit last stride — on a Hopper GPU (wgmma), in 16-bit floats, with
the plain or causal mask. Every other call runs the Triton templates: the launcher asks `unsupported` first.
They are written out a head-dim chunk at a time (fa2tune.config.head_chunks): they take a TMA descriptor a chunk
of each tensor, every one over the whole tensor, in blocks of the chunk's width — Q's and K's chunks for Q, K, dQ, dK,
V's for V, O, dO, dV, whose head dim may be its own.
"""

from __future__ import annotations

import functools

import torch

from ..config import head_chunks, planner
from ..config.device import device_info
from ..config.inputs import interpreting
from ..config.types import KernelConfig, Mask, Variant
from ..kernels import codegen
from . import fastlaunch, split_tail

# GRID_AXIS_MAX caps grid axis 1, which numbers batch·heads here
from .grid import GRID_AXIS_MAX, LOG2E, STATS_ROWS, stats_rows

ROWS_PER_CONSUMER = 64  # the template's ROWS_PER_CONSUMER: one warpgroup's wgmma rows
TMA_ALIGN = 16  # bytes: TMA's alignment of a tensor's base address and of every stride but the last


def unsupported(kernel: str, mask: Mask, packed: bool, **tensors: torch.Tensor) -> str | None:
    """Why the warp-specialized kernel of `kernel` cannot run this call (then the Triton template does), or None.
    tensors: every tensor it reads or writes through TMA, by the name an error should give; q, k and v among them."""
    q, k = tensors["q"], tensors["k"]
    if interpreting() or not q.is_cuda:
        return "warpspec runs on a CUDA GPU only, not Triton's interpreter"
    reason = planner.warpspec_unsupported(q.shape[-1], q.dtype, _capability(q.device.index), planner.triton_version(),
                                          tensors["v"].shape[-1])  # fmt: skip
    if reason is not None:
        return reason
    if mask.banded or packed:
        return "warpspec takes the plain and causal masks of dense (batch, heads, seqlen, head_dim) tensors"
    if k.shape[-2] == 0:
        return "warpspec needs at least one key"
    if q.shape[0] * q.shape[1] > GRID_AXIS_MAX:
        return f"warpspec numbers batch·heads on one grid axis (at most {GRID_AXIS_MAX}), got {q.shape[0] * q.shape[1]}"
    # Every call asks (seven tensors a backward): OR-ing the addresses and byte strides into one int and testing it
    # once takes half the host time of a test per stride (4.8 vs 9.4 µs for five tensors on the development
    # machine); the loop below only names the culprit.
    size, bits = q.element_size(), 0
    for t in tensors.values():
        bits |= t.data_ptr()
        for stride in t.stride()[:-1]:
            bits |= stride * size
    if bits % TMA_ALIGN == 0:
        return None
    for name, t in tensors.items():
        if t.data_ptr() % TMA_ALIGN or any(s * t.element_size() % TMA_ALIGN for s in t.stride()[:-1]):
            return f"warpspec needs {name}'s address and strides in multiples of {TMA_ALIGN} bytes (TMA)"
    return None


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # a driver query: once per device, not per call


@functools.cache
def _sm_count(index: int | None) -> int:
    # the card's reading (config.device), which the backward's group split counts its slots by too
    return device_info(torch.device("cuda", index) if index is not None else "cuda").sm_count


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def dq_partial_blocks(q_blocks: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """TMA blocks of the fp32 dQ that a fused-dQ dK/dV kernel (KernelConfig.fused_dq) adds its partials into, one a
    head-dim chunk: the chunk's query-side block, as wide as its dQ blocks (head_chunks.dq_width)."""
    return tuple((*block[:-1], head_chunks.dq_width(block[-1])) for block in q_blocks)


@functools.cache
def _descriptor_type():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor


def _descriptor(t: torch.Tensor, block: tuple[int, ...], checked: bool = True):
    """Gluon's TMA descriptor of `t` in blocks of `block`. checked=False skips the dataclass's own validation and
    __init__ (1.7 µs a descriptor instead of 10 µs checked, measured on a CPU machine; a warpspec backward builds
    eleven, in the host time a short call waits for), for inputs `unsupported` already passed and with the Triton
    version fastlaunch checked these fields against."""
    layout = _shared_layout(block, t.dtype)
    if checked:
        return _descriptor_type()(t, list(t.shape), list(t.stride()), list(block), layout)
    desc = object.__new__(_descriptor_type())
    desc.__dict__ = {"base": t, "shape": list(t.shape), "strides": list(t.stride()), "block_shape": list(block),
                     "layout": layout, "padding": "zero"}  # fmt: skip
    return desc


def _module(kernel: str, config: KernelConfig, causal: bool, head_dim: int, head_dim_v: int | None = None):
    """The rendered template module of a warpspec config of `kernel` at `head_dim` (V's head_dim_v; None: the same)
    (codegen keeps it per process)."""
    template = codegen.template_for(kernel, config.warp_specialized)
    variant = Variant.for_template(template, causal=causal, banded=False, varlen=False, even_m=False, even_n=False,
                                   head_dim=head_dim, head_dim_v=head_dim_v,
                                   **config.template_switches(kernel))  # fmt: skip
    return codegen.load(template, variant)


@functools.lru_cache(maxsize=256)
def compiled_form(kernel: str, config: KernelConfig, head_dim: int, causal: bool, head_dim_v: int | None = None):
    """(Gluon kernel, TMA blocks by side, keyword arguments) that a warpspec config of `kernel` ("fwd", "bwd_dkdv",
    "bwd_dq") runs. Sides: on the query side "q" (Q, dQ) and "o" (O, dO), on the key side "k" (K, dK) and "v" (V,
    dV), each a tuple of blocks, a descriptor a head-dim chunk (head_chunks) of head_dim ("q", "k") or of V's
    head_dim_v ("o", "v"; None: head_dim). The keywords are its constexprs and launch options (a shared dict: read
    it, do not change it). One definition for the launches below and for probe.compile_config; cached, as every
    launch asks (7 µs uncached)."""
    module = _module(kernel, config, causal, head_dim, head_dim_v)
    if kernel == "fwd":  # consumers own query rows; K/V stream in block_n rows
        fn, q_rows, kv_rows = module._attn_fwd_ws, ROWS_PER_CONSUMER, config.block_n
    elif kernel == "bwd_dq":  # likewise
        fn, q_rows, kv_rows = module._attn_bwd_dq_ws, ROWS_PER_CONSUMER, config.block_n
    else:  # consumers own K/V rows; Q and dO stream in block_m rows
        fn, q_rows, kv_rows = module._attn_bwd_dkdv_ws, config.block_m, ROWS_PER_CONSUMER
    consumers = config.consumers(kernel)
    maxnreg, consumer_regs, producer_regs = planner.ws_registers(config, kernel)
    kwargs = dict(CONSUMERS=consumers, STAGES=config.num_stages, PRODUCER_REGS=producer_regs,
                  CONSUMER_REGS=consumer_regs, num_warps=4)  # fmt: skip
    if maxnreg is not None:
        kwargs["maxnreg"] = maxnreg
    pad = config.pad_head_dim
    widths, v_widths = head_chunks.chunks(head_dim, pad), head_chunks.chunks(head_dim_v or head_dim, pad)
    blocks = {side: tuple((1, 1, rows, w) for w in chunks)
              for side, rows, chunks in (("q", q_rows, widths), ("o", q_rows, v_widths), ("k", kv_rows, widths),
                                         ("v", kv_rows, v_widths))}  # fmt: skip
    return fn, blocks, kwargs


def _grid(config: KernelConfig, row_tiles: int, batch_heads: int, device_index: int | None):
    """(grid, tiles): one program per tile of rows, (row_tiles, batch·heads); or, persistent, one per SM (a program
    of these configs takes most of an SM's shared memory: planner.sram_bytes) — two with Schedule.programs_per_sm
    = 2, which planner.check lets only configs fitting twice have —, each walking tiles first, first + programs, ...
    of the row_tiles · batch·heads."""
    tiles = row_tiles * batch_heads
    if not config.schedule.persistent:
        return (row_tiles, batch_heads), tiles
    return (min(tiles, config.schedule.programs_an_sm * _sm_count(device_index)),), tiles


def _launcher(
    kernel: str,
    config: KernelConfig,
    causal: bool,
    head_dims: tuple[int, int],
    grid: tuple[int, ...],
    sides: tuple[str, ...],
    scalars: tuple,
):
    """A function of the call's tensors that launches a warpspec config of `kernel` on `grid`: its arguments are the
    tensors the kernel reads through TMA descriptors, in the kernel's order — sides names each one's blocks, "q",
    "o", "k" and "v" (compiled_form), "dq_partial" a fused-dQ partial's (dq_partial_blocks) —,
    then its pointer parameters; scalars are the rest. A tensor of several blocks (the forward's head-dim chunks) is
    passed once and described once a block.
    Everything but the tensors is worked out here, once per call signature (launcher's plans keep the function).
    head_dims: (Q's and K's, V's)."""
    head_dim, head_dim_v = head_dims
    fn, blocks, kwargs = compiled_form(kernel, config, head_dim, causal, None if head_dim_v == head_dim else head_dim_v)
    by_side = dict(blocks, dq_partial=dq_partial_blocks(blocks["q"]))
    flat = tuple(block for side in sides for block in by_side[side])
    launcher = fastlaunch.TmaLauncher(fn, grid, flat, _describe, scalars, kwargs)
    if len(flat) == len(sides):
        return launcher
    repeats = tuple(len(by_side[side]) for side in sides)
    count = len(sides)

    def launch_chunked(*tensors):
        described = [t for t, times in zip(tensors[:count], repeats, strict=True) for _ in range(times)]
        launcher(*described, *tensors[count:])

    return launch_chunked


def _describe(t: torch.Tensor, block: tuple[int, ...]):
    """The descriptor fastlaunch.launch_tma passes the JIT or encodes: unchecked where fastlaunch is on (its
    Triton versions were checked against these fields), checked by the dataclass otherwise."""
    return _descriptor(t, block, checked=not fastlaunch.enabled())


def _sizes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    batch, heads_q, seqlen_q, head_dim = q.shape
    return batch, heads_q, k.shape[1], seqlen_q, k.shape[2], head_dim


def forward_launcher(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float,
                     config: KernelConfig, head_dim_v: int | None = None):  # fmt: skip
    """launch(q, k, v, o, lse): writes O and the logsumexp (batch, heads_q, seqlen_q) of attention(q, k, v) with a
    warpspec config, for calls of these shapes and strides and V's head dim head_dim_v (None: q's); the call must
    have passed `unsupported`. A persistent forward without a mask whose last round would be part empty cuts that
    round's tiles into pieces where its schedule says so (Schedule.splits_tail; fa2tune.launch.split_tail), and runs
    a merge launch after the kernel."""
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim = _sizes(q, k)
    head_dims = (head_dim, head_dim_v or head_dim)
    row_tiles = -(-seqlen_q // config.block_m)
    grid, tiles = _grid(config, row_tiles, batch * heads_q, q.device.index)
    main, split = tiles, 1
    if config.schedule.splits_tail("fwd", causal):
        main, split = split_tail.plan(tiles, grid[0], -(-seqlen_k // config.block_n))
    launch = _launcher(
        "fwd", config, causal, head_dims, grid, ("q", "k", "v", "o"),
        (lse.stride(0), lse.stride(1), seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, scale * LOG2E, tiles, main,
         split),
    )  # fmt: skip
    if split == 1:
        return lambda q, k, v, o, lse: launch(q, k, v, o, lse, lse, lse)  # no pieces: lse stands in for PART_O/LSE

    o_width = planner.computed_width(config, head_dims[1])  # O's columns computed: V's head-dim chunks
    merge = split_tail.Merge(_module("fwd", config, causal, head_dim, head_dim_v)._merge_pieces, tiles=tiles,
                             main=main, split=split, n_m=row_tiles, heads_q=heads_q, seqlen_q=seqlen_q,
                             tile_m=config.block_m, width=o_width, head_dim=head_dims[1])  # fmt: skip

    def launch_split(q, k, v, o, lse):
        part_o, part_lse = split_tail.workspace(tiles, main, split, config.block_m, o_width, q.device)  # pieces' O
        launch(q, k, v, o, lse, part_o, part_lse)
        merge(part_o, part_lse, o, lse)

    return launch_split


def _check_stats_strides(stats_strides: tuple[int, int], heads_q: int, seqlen_q: int) -> None:
    """The backward kernels read a (batch, head)'s logsumexp and δ unmasked up to seqlen_q rounded up to STATS_ROWS
    (launch.backward's padded buffers): strides that leave fewer rows a head would read the next head's, or past the
    buffer's end. Checked once, where a launch plan builds its launcher."""
    stride_lb, stride_lh = stats_strides
    rows = stats_rows(seqlen_q)
    if stride_lh < rows or stride_lb < heads_q * stride_lh:
        raise ValueError(
            f"the backward's statistics need {rows} rows a head (seqlen_q={seqlen_q} rounded up to a multiple of "
            f"{STATS_ROWS}) at a head stride of at least that and a batch stride of at least {heads_q} heads; got "
            f"strides {stats_strides}"
        )


def backward_dkdv_launcher(q: torch.Tensor, k: torch.Tensor, stats_strides: tuple[int, int], *, causal: bool,
                           scale: float, config: KernelConfig, head_dim_v: int | None = None,
                           group_split: int = 1):  # fmt: skip
    """launch(q, k, v, do, dk, dv, lse, delta): writes dK and dV (batch, heads_kv, seqlen_k, head_dim; dV V's
    head_dim_v, None: q's) — summed over each K/V head's query heads — with a warpspec bwd_dkdv config; δ (delta) as
    the Triton template's preprocess kernel leaves it (less dlse). The call must have passed `unsupported`.
    lse and delta: the statistics buffers of fa2tune.launch.backward (_Stats), rows padded to a multiple of 16 with
    lse = +inf past seqlen_q, as the kernel's loads assume (bwd_ws.py.jinja's _row_stats), at (batch, head) strides
    stats_strides.

    With config.fused_dq (dQ fused in) it is launch(q, k, v, do, dk, dv, dq_acc, lse, delta), and also adds dQ into
    dq_acc, a zeroed fp32 tensor of q's shape. group_split > 1 (fa2tune.config.group_split): each group's query heads
    go to that many programs a K/V tile, and dk and dv are partials of heads_kv · group_split heads, group_split a
    K/V head in a row (launch.backward sums them)."""
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim = _sizes(q, k)
    _check_stats_strides(stats_strides, heads_q, seqlen_q)
    n_kv = -(-seqlen_k // config.block_n)
    heads_kv *= group_split  # the partials' heads: the kernel's H_KV
    grid, tiles = _grid(config, n_kv, batch * heads_kv, q.device.index)
    sides = ("q", "k", "v", "o", "k", "v") + (("dq_partial",) if config.fused_dq else ())
    return _launcher(
        "bwd_dkdv", config, causal, (head_dim, head_dim_v or head_dim), grid, sides,
        (*stats_strides, seqlen_q, seqlen_k, heads_kv, heads_q // heads_kv, group_split, scale * LOG2E, scale,
         tiles),
    )  # fmt: skip


def backward_dq_launcher(q: torch.Tensor, k: torch.Tensor, stats_strides: tuple[int, int], *, causal: bool,
                         scale: float, config: KernelConfig, head_dim_v: int | None = None):  # fmt: skip
    """launch(q, k, v, do, dq, lse, delta): writes dQ (batch, heads_q, seqlen_q, head_dim) with a warpspec bwd_dq
    config, V's head dim head_dim_v (None: q's); lse, δ and stats_strides as for backward_dkdv_launcher. The call
    must have passed `unsupported`."""
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim = _sizes(q, k)
    _check_stats_strides(stats_strides, heads_q, seqlen_q)
    row_tiles = -(-seqlen_q // config.block_m)
    grid, tiles = _grid(config, row_tiles, batch * heads_q, q.device.index)
    return _launcher(
        "bwd_dq", config, causal, (head_dim, head_dim_v or head_dim), grid, ("q", "k", "v", "o", "q"),
        (*stats_strides, seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, scale * LOG2E, scale,
         tiles),
    )  # fmt: skip


def forward(q, k, v, o, lse, *, causal: bool, scale: float, config: KernelConfig) -> None:
    """forward_launcher's launch, once (a one-off call: scripts, tests)."""
    forward_launcher(q, k, lse, causal=causal, scale=scale, config=config, head_dim_v=v.shape[-1])(q, k, v, o, lse)
