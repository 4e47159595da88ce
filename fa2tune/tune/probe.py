"""Compiles one kernel config ahead of time for a target GPU and reports what Triton allocated.

Triton compiles for a named target without the card being present (its ptxas ships with it), so the shared
memory a config needs — `CompiledKernel.metadata.shared` — can be read on any machine. Triton raises
OutOfResources only when it loads a kernel whose `shared` exceeds the card's opt-in limit; `fits` applies that
same test against a DeviceInfo. This is how planner.sram_bytes is checked (scripts/check_planner.py).

Arguments are specialised as Triton's JIT would for a typical call (16-byte-aligned pointers and strides that
are multiples of 16 get `tt.divisibility=16`; an int equal to 1 becomes a constant), so the compile matches what
a real launch builds.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from ..config import planner
from ..config.inputs import DTYPE_NAMES
from ..config.types import KernelConfig, Variant
from ..kernels import codegen
from ..launch.layout import head_dim_options, in_units, stride_unit

_TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
_FP32_TENSORS = {"LSE", "DELTA"}
_FLOATS = {"qk_scale", "scale"}
_V_SIDE = {"v", "o", "do", "dv"}  # the tensors of V's head dim (head_dim_v), by their strides' names
_STRIDE_AXES = {"b": 0, "h": 1, "m": 2, "n": 2}  # a stride parameter's last letter: batch, head, row (query or key)


@dataclass(frozen=True)
class CompileReport:
    """What the compiler said about one config: the shared memory it allocated (bytes), or why it failed."""

    shared_bytes: int | None
    error: str | None = None
    cubin: bytes | None = None  # the binary, for cuobjdump() (registers, spills, SASS)


def cuobjdump(cubin: bytes, *options: str) -> str:
    """What Triton's bundled cuobjdump prints for a compiled binary: `-res-usage` (registers, stack: spills),
    `-sass` (the machine code, scripts/sass_wgmma_operands.py)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, *options, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


EXAMPLE_SEQLEN = 8192  # the example call's lengths: a multiple of 16, as every tuning length is
_EXAMPLE_BATCH = 2
EXAMPLE_HEADS = 16  # the example call's query heads


def _example_ints(head_dim_pad: int, heads: int, group: int, seqlen: int = EXAMPLE_SEQLEN,
                  padded_stats: bool = False) -> dict[str, int]:  # fmt: skip
    """The int arguments of an example call: a (2, heads, seqlen, head_dim_pad) contiguous layout (the Triton
    kernels' callers pass the head dim itself, whose strides they take in units: compile_config), and lengths that
    are multiples of 16 where seqlen is. The logsumexp's strides: the
    forward's (batch, heads, seqlen) tensor; padded_stats, the backward kernels' statistics buffers, whose rows a
    (batch, head) fa2tune.launch.backward pads to a multiple of 16 (_Stats) for a dense call."""
    from ..launch.grid import stats_rows as padded_rows

    stats_rows = padded_rows(seqlen) if padded_stats else seqlen
    return {
        "stride_b": heads * seqlen * head_dim_pad,
        "stride_h": seqlen * head_dim_pad,
        "stride_m": head_dim_pad,
        "H_Q": heads,
        "H_KV": heads // group,
        "GROUP": group,
        "KV_SPLIT": 1,  # the dK/dV kernels' group split (config.group_split): unsplit, as the tuner's shapes run
        "stride_lb": heads * stats_rows,  # the fp32 logsumexp (batch, heads, stats_rows)
        "stride_lh": stats_rows,
        "N_Q": seqlen,
        "N_K": seqlen,
        # a persistent launch's work units: (batch, head) pairs times tiles, so as divisible as batch·heads
        "TILES": _EXAMPLE_BATCH * heads * max(1, seqlen // 128),
    }


def _int_specialization(value: int) -> tuple[str, object]:
    """How Triton's JIT passes an int argument of this value (not in do_not_specialize): ("constexpr", 1) for 1;
    else (its type, attrs): i64 from 2**31 on, i32 below, attrs marking it divisible by 16 where it is (which lets
    the compiler vectorize loads it bounds or offsets), None where not."""
    if value == 1:
        return "constexpr", 1
    kind = "i32" if -(2**31) <= value < 2**31 else "i64"
    return kind, [["tt.divisibility", 16]] if value % 16 == 0 else None


def compile_config(
    kernel: str,
    config: KernelConfig,
    head_dim: int,
    dtype: torch.dtype,
    *,
    causal: bool = False,
    capability: tuple[int, int] = (9, 0),
    banded: bool = False,
    varlen: bool = False,
    head_dim_v: int | None = None,
    seqlen: int = EXAMPLE_SEQLEN,
    group: int = 1,
) -> CompileReport:
    """Compiles `kernel` ("fwd", "bwd_dkdv", "bwd_dq") with `config` for a CUDA target of this capability.

    banded / varlen: the window/prefix and packed-sequence variants (ragged tails, as they always are).
    head_dim_v: V's head dim (and O's, dO's, dV's), where it is not Q's and K's head_dim; None: the same.
    seqlen: the example call's query and key length. The JIT compiles a length that is not a multiple of 16 (and the
    forward's logsumexp head stride, which is the length) without their divisibility, which is other code in the
    kernels that bound or address loads by them (docs/PERF.md, "Lengths that are not a multiple of a tile"); the
    backward's statistics keep theirs (_example_ints). The default is a multiple of 16.
    group: query heads a K/V head of the example call (of 16): 1 compiles what an MHA call runs (the JIT specializes
    the group 1 as a constant), more what a GQA call runs (the group a run-time value)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_config needs Triton's compiler: unset TRITON_INTERPRET in this process")
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"seqlen must be an int >= 1 (the example call's length), got {seqlen!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or EXAMPLE_HEADS % group:
        raise ValueError(f"group must be an int dividing the example call's {EXAMPLE_HEADS} query heads, got {group!r}")
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    if config.warp_specialized:
        return _compile_warpspec(kernel, config, head_dim, dtype, causal, target, head_dim_v, seqlen, group)
    template, name = codegen.TEMPLATE_OF[kernel], f"_attn_{kernel}"  # the template's kernel of that name
    variant = Variant.for_template(
        template, causal=causal, banded=banded, varlen=varlen, even_m=seqlen % config.block_m == 0,
        even_n=seqlen % config.block_n == 0, pipeline_qk=config.pipeline_qk, head_dim=head_dim, head_dim_v=head_dim_v,
    )  # fmt: skip
    fn = getattr(codegen.load(template, variant), name)
    # the backward's statistics are padded for dense calls; packed ones keep the logsumexp's layout. The tensors'
    # strides are a contiguous call's, of their own head dim (V, O, dO, dV: head_dim_v), each tensor's in the unit
    # its launcher passes them in (layout.in_units)
    ints = _example_ints(head_dim, heads=EXAMPLE_HEADS, group=group, seqlen=seqlen,
                         padded_stats=kernel != "fwd" and not varlen)
    ints_v = _example_ints(head_dim_v or head_dim, heads=EXAMPLE_HEADS, group=1, seqlen=seqlen)
    tensors = [arg[len("UNIT_"):] for arg in fn.arg_names if arg.startswith("UNIT_")]  # Q, K, ..., DV
    example = {tensor: ints_v if tensor.lower() in _V_SIDE else ints for tensor in tensors}
    units, divided = in_units(**{tensor: (side["stride_b"], side["stride_h"], side["stride_m"])
                                 for tensor, side in example.items()})  # fmt: skip
    strides_of = {tensor.lower(): divided[3 * i : 3 * i + 3] for i, tensor in enumerate(tensors)}
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {
        **head_dim_options(head_dim, head_dim_v or head_dim),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }
    constexprs |= units
    attrs: dict[tuple[int, ...], list] = {}
    for index, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        if arg in _TENSORS or arg in _FP32_TENSORS:
            # Triton spells the dtypes as fa2tune's short names do.
            signature[arg] = "*" + ("fp32" if arg in _FP32_TENSORS else DTYPE_NAMES[dtype])
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif arg in _FLOATS:
            signature[arg] = "fp32"
        elif arg in ("CU_Q", "CU_K") and varlen:
            signature[arg] = "*i32"
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif arg in ("CU_Q", "CU_K"):
            signature[arg] = "constexpr"  # a dense launch passes None for the packed-sequence offsets
            constexprs[arg] = None
        elif arg in ("BATCH", "N_Q", "N_K", "window_left", "window_right", "prefix_len", "TOTAL_Q", "TOTAL_K"):
            signature[arg] = "i32"  # do_not_specialize in the templates
        else:
            # stride_qm / stride_kn / ... are row strides; stride_*b and stride_*h batch and head strides, of the
            # tensor named between (q, do, dk, ...), as its launcher passes them
            if arg in ints:
                value = ints[arg]
            else:
                value = strides_of[arg[len("stride_"):-1]][_STRIDE_AXES[arg[-1]]]
            signature[arg], spec = _int_specialization(value)
            if signature[arg] == "constexpr":
                constexprs[arg] = spec
            elif spec is not None:
                attrs[(index,)] = spec
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return _compile(source, target, {"num_warps": config.num_warps, "num_stages": config.num_stages})


def _compile(source, target, options: dict) -> CompileReport:
    import triton

    try:
        compiled = triton.compile(source, target=target, options=options)
    except Exception as exc:  # failures are data: keep the reason
        return CompileReport(None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
    return CompileReport(int(compiled.metadata.shared), cubin=compiled.asm.get("cubin"))


def _compile_warpspec(
    kernel: str,
    config: KernelConfig,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    target,
    head_dim_v: int | None = None,
    seqlen: int = EXAMPLE_SEQLEN,
    group: int = 1,
) -> CompileReport:
    """A Gluon kernel (fwd_ws, bwd_ws for bwd_dkdv, bwd_dq_ws for bwd_dq) as warpspec.compiled_form launches it: its
    TMA descriptors' types come from CPU tensors of a (2, 16, seqlen, head_dim) layout (V's side: head_dim_v), which
    carry the shapes, strides and block layouts a real launch specializes on, and its int arguments are those of
    that call (_example_ints: lengths, logsumexp strides, heads, one query head a K/V head) as the JIT specializes
    them."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from ..launch import warpspec

    head_dim_v = None if head_dim_v == head_dim else head_dim_v  # as the launcher asks for it
    fn, blocks, kwargs = warpspec.compiled_form(kernel, config, head_dim, causal, head_dim_v)
    x = torch.empty(_EXAMPLE_BATCH, EXAMPLE_HEADS, seqlen, head_dim, dtype=dtype)
    x_v = torch.empty(_EXAMPLE_BATCH, EXAMPLE_HEADS, seqlen, head_dim_v or head_dim, dtype=dtype)  # V, O, dO, dV
    ints = _example_ints(planner.head_dim_padded(head_dim), heads=EXAMPLE_HEADS, group=group, seqlen=seqlen,
                         padded_stats=kernel != "fwd")  # the backward's statistics buffers (warpspec: dense only)
    sides = {"q": "q", "o": "o", "do": "o", "dq": "q", "k": "k", "v": "v", "dk": "k", "dv": "v"}
    descriptors = {}
    for arg in fn.arg_names:  # q_desc, or q_desc0, q_desc1, … a head-dim chunk each
        name, _, chunk = arg.partition("_desc")
        if name in sides:
            side = sides[name]
            descriptors[arg] = warpspec._descriptor(x_v if side in ("o", "v") else x, blocks[side][int(chunk or 0)])
    if "dqacc_desc0" in fn.arg_names:  # bwd_dkdv with dQ fused in: the fp32 dQ its partials are added into
        dq_acc = torch.empty_like(x, dtype=torch.float32)
        for index, block in enumerate(warpspec.dq_partial_blocks(blocks["q"])):
            descriptors[f"dqacc_desc{index}"] = warpspec._descriptor(dq_acc, block)
    scalars = {"LSE": "*fp32", "DELTA": "*fp32", "PART_O": "*fp32", "PART_LSE": "*fp32", "qk_scale": "fp32",
               "scale": "fp32"}  # fmt: skip
    signature, constexprs, attrs = {}, {}, {}
    for index, (arg, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        if param.is_constexpr:
            signature[arg] = "constexpr"
            constexprs[(index,)] = kwargs[arg]
        elif arg in descriptors or arg in scalars:
            signature[arg] = mangle_type(descriptors[arg]) if arg in descriptors else scalars[arg]
            if signature[arg].startswith("*"):
                attrs[(index,)] = [["tt.divisibility", 16]]  # as the JIT specializes a 16-byte-aligned tensor
        elif param.do_not_specialize or arg not in ints:  # the split tail's counts: one binary for every value
            signature[arg] = "i32"
        else:
            signature[arg], spec = _int_specialization(ints[arg])
            if signature[arg] == "constexpr":
                constexprs[(index,)] = spec
            elif spec is not None:
                attrs[(index,)] = spec
    options = {name: kwargs[name] for name in ("num_warps", "maxnreg") if name in kwargs}
    return _compile(GluonASTSource(fn, signature, constexprs, attrs), target, options)


_DECODE_POINTERS = {"Q": None, "K": None, "V": None, "O": None, "K_NEW": None, "V_NEW": None, "LSE": "fp32",
                    "PART_O": "fp32", "PART_LSE": "fp32", "SEQLENS": "i32", "TABLE": "i32"}  # fmt: skip
# Strides of any value in real use: the logsumexp's head stride is seqlen_q (often 1), a block table's row its width.
# The others reach the kernels divided by their tensor's unit (8 at a head dim that is a multiple of 8) and are taken as
# multiples of 16 after it, as the JIT sees them at d = 128; at other head dims it sees less divisibility, but every
# row start 16-byte aligned all the same, which is what the loads' vector width follows.
_DECODE_ANY_STRIDES = {"stride_lh", "stride_tb"}


def compile_decode(kernel: str, config, head_dim: int, dtype: torch.dtype, *, paged: bool, page_size: int = 16,
                   block_m: int = 16, splits: int = 64,
                   capability: tuple[int, int] = (9, 0)) -> CompileReport:  # fmt: skip
    """Compiles a decode kernel of templates/decode.py.jinja ("_decode_fwd" with split partials, "_decode_merge",
    "_append_kv") with a DecodeConfig for a CUDA target, as fa2tune.launch.decode launches it on typical tensors:
    every pointer 16-byte aligned, the strides in their tensors' units multiples of 16 (but _DECODE_ANY_STRIDES),
    lengths plain i32, paged
    or not; block_m packed query rows a tile (decode_plan.row_tiles), `splits` splits merged (the merge's blocks,
    decode_plan.merge_blocks)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..config import decode_plan
    from ..config.decode_plan import DecodeVariant

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_decode needs Triton's compiler: unset TRITON_INTERPRET in this process")
    fn = getattr(codegen.load("decode", DecodeVariant(paged=paged)), kernel)
    splits_pad, split_block = decode_plan.merge_blocks(splits, head_dim)
    constexprs: dict[str, object] = {
        "SPLITS_PAD": splits_pad, "SPLIT_BLOCK": split_block,
        **head_dim_options(head_dim, head_dim), "BLOCK_M": block_m, "BLOCK_N": config.block_n, "BLOCK_R": 16,
        "PAGE_SIZE": page_size if paged else 0, "PARTIAL": True,
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }  # fmt: skip
    constexprs |= {arg: stride_unit((head_dim,)) for arg in fn.arg_names if arg.startswith("UNIT_")}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for index, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg == "TABLE" and not paged:
            signature[arg], constexprs[arg] = "constexpr", None
        elif arg in _DECODE_POINTERS:
            signature[arg] = "*" + (_DECODE_POINTERS[arg] or DTYPE_NAMES[dtype])
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg == "qk_scale" else "i32"
            if arg.startswith("stride_") and arg not in _DECODE_ANY_STRIDES:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs={k: v for k, v in constexprs.items() if k in signature}, attrs=attrs)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    warps = decode_plan.MERGE_WARPS if kernel == "_decode_merge" else config.num_warps  # as the launcher takes them
    return _compile(source, target, {"num_warps": warps, "num_stages": config.num_stages})
