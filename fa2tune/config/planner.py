"""Which kernel configs fit a GPU, and which one to use before tuning. Constraints live here and nowhere else.

The SRAM model. The seed's rule budgets one Q tile, one K tile and the score tile in SRAM:
    B_r·d + B_c·d + B_r·B_c ≲ SRAM   (elements).
What Triton actually places in shared memory (checked against the compiler: docs/PLANNER.md) differs:
  * the K/V loop is software-pipelined: Hopper's wgmma path keeps S = num_stages buffers of K_j *and* of V_j in
    flight (the mma.sync path of older GPUs, and of Hopper dots under 64 rows, keeps S − 1); with num_stages = 1
    one buffer serves K_j then V_j. Stages multiply the K/V term — the term that decides fit;
  * S_ij and P_ij stay in registers on the wgmma path; on the mma.sync path P is re-laid out through shared
    memory before P·V, so there the seed's B_r·B_c term (+ scores below) is real.
So, in bytes (e = bytes per element, d = head dim padded to a power of two ≥ 16; for the warp-specialized kernels
below, to a multiple of 16: their head-dim chunks, fa2tune.config.head_chunks):
    fwd       e·d·(B_r + kv·B_c) + scores                kv = 2·S (num_stages ≥ 2; + 1 with pipeline_qk) or 1
    bwd_dkdv  e·d·(2·B_c + 2·S·B_r) + 8·S·B_r + scores   K_j, V_j owned; Q_i, dO_i, lse, δ streamed; scores ×2
    bwd_dq    e·d·(2·B_r + 2·S·B_c) + scores             Q_i, dO_i owned; K_j, V_j streamed
and a config fits when that is ≤ the device's opt-in shared memory per block (Triton's OutOfResources test).
A warp-specialized kernel (KernelConfig.warp_specialized: the Gluon templates fwd_ws, bwd_ws, bwd_dq_ws) allocates its
buffers itself: its Q tiles, S buffers of K_j and of V_j, and mbarriers (checked against compiles: ~300–400 B beyond
the tiles):
    fwd_ws    e·d·(B_r + 2·S·B_c) + 512       (+ e·d·B_r persistent: O is staged apart from the next tile's Q)
    dkdv_ws   e·d·(2·B_c + 2·S·B_r) + 512         K, V owned (B_c = 64 per consumer); Q_i, dO_i streamed
                                                  (+ 2·e·d·B_c persistent: dK, dV staged apart from K, V)
              split_roles: B_c = 64 for both consumers, + 2·2·64·B_r + 64: Pᵀ (fp16) handed from the dV side to the
                                                  dK side, double-buffered, and its two mbarrier pairs
              fused_dq: + 2·e·B_c·B_r + consumers·B_r·w·4 + 256: dSᵀ double-buffered, an fp32 dQ staging buffer
                                                  a consumer (w = the widest dQ block, ≤ 64 columns), mbarriers
              + 2·4·S·B_r where the producer stages the statistics (KernelConfig.stages_statistics): each stage's
                                                  logsumexp and δ, fp32
    dq_ws     e·d·(2·B_r + 2·S·B_c) + 512         Q, dO owned (B_r = 64 per consumer); K_j, V_j streamed
                                                  (+ e·d·B_r persistent: dQ staged apart from Q)

On the wgmma path the seed's B_r·B_c term lives in the register file, with the other fp32 accumulators:
    fwd       B_r·(d + B_c)          Õ_i and S_ij (and S_i,j+1 with pipeline_qk)
    fwd_ws    64·(d + B_c)           per consumer warpgroup (128 threads), which owns 64 rows
    dkdv_ws   64·(2·d + 3·B_r)       per consumer: dK, dV, Sᵀ, dPᵀ, and Pᵀ, dSᵀ (16-bit, half a register each);
              + 64·d at d <= 64      K and V as 16-bit operands (kv_in_registers; counted for both masks)
              + 32·d at 64 < d <= 96 V alone (v_in_registers; counted for both masks)
              64·(d + 2.5·B_r)       split_roles, the dK side (the dV side holds less): dK, dPᵀ, the Pᵀ it reads,
                                     dSᵀ (16-bit)
    dq_ws     64·(d + 2.5·B_c)       per consumer: dQ, S (then P), dP, and the in-flight wgmma's dS_j-1 (16-bit)
    bwd_dkdv  B_c·(2·d + 2·B_r)      dK_j, dV_j, P_ijᵀ and dP_ijᵀ
    bwd_dq    B_r·(d + 2·B_c)        dQ_i, P_ij and dP_ij
spread over 32·num_warps threads. A thread has at most 255 registers; at 256 accumulator values per thread or
more every H200 sweep collapsed (2–4× slower: spills to local memory), so check() rejects those too — they
compile, but are never worth timing.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch

from . import head_chunks
from .schedule import PER_TILE, PERSISTENT, TWO_AN_SM
from .types import KERNELS, MAX_HEAD_DIM, WS_BACKWARD_TILES, WS_BLOCK_M, DeviceInfo, KernelConfig

BLOCK_SIZES = (16, 32, 64, 128, 256)
NUM_WARPS = (4, 8)
NUM_STAGES = (1, 2, 3, 4, 5)
# The warp-specialized kernels (fwd_ws, bwd_ws, bwd_dq_ws .py.jinja): Hopper's wgmma and TMA, 16-bit inputs, every
# head dim head_chunks.supported admits (written out a power-of-two chunk at a time).
WS_DTYPES = (torch.float16, torch.bfloat16)
# Gluon, the dialect they are written in, is experimental and its API moves between Triton releases (3.9 renamed the
# TMA copies: fa2tune.kernels.gluon_ext names them for both): they run on the Tritons they compile and pass the offline
# sm_90 checks under (tests/test_warpspec.py; measured on a GPU under 3.6), and elsewhere every call takes the Triton
# template.
WS_TRITONS = ("3.6.", "3.9.")
WS_BLOCK_N = (64, 128)
WS_STAGES = (2, 3, 4)
_WS_SMEM_OVERHEAD = 512  # mbarriers and alignment; compiles measured 284–392 B
# The forward's buffers a head-dim chunk past the first align apart: compiled for sm_90 at every head dim 16…256 step 8,
# 2 chunks took 520–604 B beyond the tiles, 3 chunks 712, 4 chunks 744.
_WS_CHUNK_OVERHEAD = 128
# (maxnreg of the kernel, registers of each worker consumer, of the producer warp) by consumer count. A program is
# 4·(consumers + 1) warps (the producer's warp rounds up to a warpgroup) on one SM of 64k registers; setmaxnreg
# gives the producer the minimum (24) and the consumers the rest (one consumer: the compiler's 255).
WS_REGISTERS = {1: (None, 255, 24), 2: (None, 240, 24), 3: (128, 160, 24)}
# Two one-consumer programs an SM (Schedule.programs_per_sm = 2): each compiled at maxnreg 128 — half the register file
# for its two warpgroups — of which setmaxnreg gives the consumer 232 (sm_90, no spill: the forward's d=64 (64, 128)
# and d=128 (64, 64), the fused dK/dV kernel's d=64 (64, 64), the dQ kernel's d=128 (64, 64);
# tests/test_warpspec.py).
WS_TWO_AN_SM_REGISTERS = (128, 232, 24)
# The widest head dim at which the dK/dV kernel takes dQ fused in (check: past it the compiled kernel spills more
# than the model counts); the split-roles form takes over past d = 128 anyway.
FUSED_DQ_MAX_HEAD_DIM = 128
# A consumer spills once its fp32 accumulators (64·(d + B_c) / 128) pass its registers less this: compiled for
# sm_90, (d, B_r, B_c) = (256, 64, 128) with 192 of 255, (256, 128, 128) 192 of 240 and (128, 192, 128) 128 of
# 160 spill (cuobjdump STACK 40, 96, 248 B); 160 of 255, 160 of 240 and 96 of 160 do not (tests/test_warpspec.py).
_WS_REGISTERS_BESIDE_ACCUMULATORS = {"fwd": 64, "bwd_dkdv": 16, "bwd_dq": 24}
# What another Triton's code needs beyond that, by (kernel, consumers, B_c), from sm_90 compiles (the score tile's
# registers weigh more there than the model's count of them). Triton 3.9's forward consumers at B_c = 128: three (160
# registers each) spill 24–120 B from d=32 on (3.6: none), and not at d=16's 72 accumulator values; two (240 each)
# hold (d, B_r) = (144, 128)'s 136 without a spill and spill (160, 128)'s 144 (56 B; persistent 128 B; 3.6: none):
# their budgets are 24 and 40 registers less. At B_c = 64 neither spills ((128, 192) 96 values, (256, 128) 160).
_TRITON_REGISTERS_BESIDE_EXTRA = {"3.9.": {("fwd", 3, 128): 24, ("fwd", 2, 128): 40}}
# dK/dV: (d, B_r, B_c) = (128, 64, 128) holds 224 of 240 and keeps a 32 B stack, measured 17 % faster than the Triton
# template's dK/dV all the same; (64, 128, 128) holds 256 and spills 264 B. dQ: (d, B_r, B_c) =
# (128, 64, 128) holds 224 of 255 and does not spill; (128, 128, 128), 224 of 240, spills 48 B (causal 72).


def warpspec_unsupported(
    head_dim: int, dtype: torch.dtype, capability: tuple[int, int], triton: str = "", head_dim_v: int | None = None
) -> str | None:
    """Why the warp-specialized kernels (forward, dK/dV, dQ) cannot run this head dim / dtype / GPU, or None.
    triton: the version of the Triton that would compile them ("": not known — a known-GPU table's model of a card).
    head_dim_v: V's head dim (None: head_dim's), which the kernels take in chunks of its own."""
    if capability[0] != 9:
        major, minor = capability
        return f"warpspec needs a Hopper GPU (compute capability 9.x: wgmma), this one is {major}.{minor}"
    if dtype not in WS_DTYPES:
        return f"warpspec takes float16/bfloat16 inputs, got {dtype}"
    for dim in dict.fromkeys((head_dim, head_dim_v or head_dim)):  # Q's and K's, then V's if it differs
        if not head_chunks.supported(dim):
            low, high, step = head_chunks.CHUNK_MIN, head_chunks.CHUNK_MAX, head_chunks.ALIGN
            return f"warpspec takes head_dim a multiple of {step} in {low}..{high}, got {dim}"
    if triton and not triton.startswith(WS_TRITONS):
        written = " and ".join(f"{prefix}x" for prefix in WS_TRITONS)
        return f"warpspec's Gluon kernels are written for Triton {written}; this is Triton {triton}"
    return None


@functools.cache
def triton_version() -> str:
    """The version of the Triton this process compiles with."""
    import triton

    return triton.__version__


def head_dim_padded(head_dim: int) -> int:
    """Head dim rounded up to the power of two >= 16 that the Triton templates compute on (tl.dot needs K >= 16)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def config_head_dim(head_dim: int, head_dim_v: int) -> int:
    """The head dim whose configs a call runs when V's head dim (head_dim_v) is not Q's and K's (head_dim): the
    larger. The store and the tuner key configs by one head dim, and a config's tiles and accumulators at max(d, dv)
    are at least as wide as each of the call's (Q, K at d; V, O, dO, dV at dv), so its shared memory and registers
    bound the call's: a config that fits there fits here. The planner's model stays that of one head dim, the larger
    — conservative. The one rule for resolving (fa2tune.api.selection), the Triton default a warpspec config gives
    way to (fa2tune.launch.fallback) and check()."""
    return max(head_dim, head_dim_v)


def computed_width(cfg: KernelConfig, head_dim: int) -> int:
    """The head-dim columns `cfg`'s kernel computes on: the warp-specialized kernels' chunks (head_chunks.padded, to
    fewer chunks with KernelConfig.pad_head_dim), the Triton templates' power of two (head_dim_padded)."""
    return head_chunks.padded(head_dim, cfg.pad_head_dim) if cfg.warp_specialized else head_dim_padded(head_dim)


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def seed_rule_bytes(cfg: KernelConfig, head_dim: int, dtype: torch.dtype) -> int:
    """The seed's budget, (B_r·d + B_c·d + B_r·B_c) elements, in bytes: no stages, no V tile."""
    e, d = dtype.itemsize, head_dim_padded(head_dim)
    return e * (cfg.block_m * d + cfg.block_n * d + cfg.block_m * cfg.block_n)


def _uses_wgmma(dot_rows: int, capability: tuple[int, int]) -> bool:
    """Hopper's wgmma takes a dot of >= 64 rows (one warpgroup's minimum); older GPUs and smaller dots use mma.sync."""
    return capability[0] == 9 and dot_rows >= 64


def sram_bytes(
    cfg: KernelConfig, head_dim: int, dtype: torch.dtype, kernel: str = "fwd", capability: tuple[int, int] = (9, 0)
) -> int:
    """Predicted shared memory of one program of `kernel` with `cfg`, in bytes (see the module docstring)."""
    check_kernel(kernel)
    e, d, m, n = dtype.itemsize, computed_width(cfg, head_dim), cfg.block_m, cfg.block_n
    persistent = cfg.schedule.persistent
    if cfg.warp_specialized and kernel == "bwd_dkdv":
        staging = 2 * n if persistent else 0  # dK, dV staged apart from the next tile's K, V; else in K's, V's
        exchange = 0  # what consumers pass each other through shared memory
        if cfg.fused_dq:  # dSᵀ (n × m, 16-bit) twice, and an fp32 staging buffer of its dQ blocks a consumer
            dq_staging = m * head_chunks.widest_dq_block(d) * 4
            exchange = 2 * e * n * m + cfg.consumers(kernel) * dq_staging + 256  # + 4 mbarriers
        if cfg.split_roles:  # Pᵀ, fp16, 64 × m, double-buffered, and its ready / free mbarrier pairs
            exchange = 2 * 2 * n * m + 64
        # each stage's logsumexp and δ, fp32, beside its Q_i and dO_i, where the producer stages them
        stats = 2 * 4 * cfg.num_stages * m if cfg.stages_statistics(kernel) else 0
        return e * d * (2 * n + staging + 2 * cfg.num_stages * m) + stats + exchange + _ws_overhead(d)
    if cfg.warp_specialized and kernel == "bwd_dq":
        staging = m if persistent else 0  # dQ staged apart from the next tile's Q; else in Q's buffer
        return e * d * (2 * m + staging + 2 * cfg.num_stages * n) + _ws_overhead(d)  # S buffers of K_j, V_j
    if cfg.warp_specialized:
        o_staging = m if persistent else 0  # else O is staged in Q's buffer
        return e * d * (m + o_staging + 2 * cfg.num_stages * n) + _ws_overhead(d)
    wgmma = _uses_wgmma(n if kernel == "bwd_dkdv" else m, capability)
    # wgmma pipelines keep num_stages buffers of each streamed tile in flight, mma.sync pipelines one fewer.
    s = max(1, cfg.num_stages if wgmma else cfg.num_stages - 1)
    # On the mma.sync path P (and in dK/dV also dSᵀ) is re-laid out through shared memory before the second dot:
    # the seed's B_r·B_c term. wgmma reads them from registers.
    scores = 0 if wgmma else e * m * n * (2 if kernel == "bwd_dkdv" else 1)
    if kernel == "fwd":
        kv_buffers = 2 * s if cfg.num_stages >= 2 else 1  # one stage: a single buffer serves K_j, then V_j
        if cfg.pipeline_qk and wgmma and cfg.num_stages >= 2:
            kv_buffers += 1  # the K tile of the QKᵀ issued ahead holds a buffer of its own (measured: docs/PLANNER.md)
        return e * d * (m + kv_buffers * n) + scores
    if kernel == "bwd_dkdv":
        return e * d * (2 * n + 2 * s * m) + 8 * s * m + scores
    return e * d * (2 * m + 2 * s * n) + scores


def _registers_beside(kernel: str, consumers: int, block_n: int, triton: str) -> int:
    """Registers a warp-specialized consumer of `kernel` keeps beside its accumulators when `triton` (the card's
    reading; "" for a table entry: the installed Triton) compiles it."""
    triton = triton or triton_version()
    extra = next((table for prefix, table in _TRITON_REGISTERS_BESIDE_EXTRA.items() if triton.startswith(prefix)), {})
    return _WS_REGISTERS_BESIDE_ACCUMULATORS[kernel] + extra.get((kernel, consumers, block_n), 0)


def _ws_overhead(width: int) -> int:
    """Shared memory a warp-specialized program holds beyond its tiles: mbarriers, and alignment a chunk of the
    `width` columns it computes on (computed_width)."""
    return _WS_SMEM_OVERHEAD + _WS_CHUNK_OVERHEAD * (len(head_chunks.chunks(width)) - 1)


def kv_in_registers(head_dim: int, causal: bool = False) -> bool:
    """Whether the warp-specialized dK/dV kernel holds its K and V rows in registers as the Sᵀ and dPᵀ wgmmas' A
    operands (bwd_ws.py.jinja's KV_IN_REGS), rather than reading them from shared memory every step: at d <= 64,
    where 2·64·d/128 16-bit values a thread fit beside the accumulators, and without a causal mask: with the mask
    under a branch the compile reused K's and V's registers for Pᵀ and dSᵀ (wrong dK), and a mask without a branch
    cost more than the registers save. The register model (accumulators_per_thread) has no mask, so it counts
    them for both: a causal compile holds fewer than it says."""
    return head_chunks.padded(head_dim) <= 64 and not causal


def v_in_registers(head_dim: int, causal: bool = False, cfg: KernelConfig | None = None) -> bool:
    """Whether the warp-specialized dK/dV kernel holds its V rows in registers as the dPᵀ wgmma's A operand
    (bwd_ws.py.jinja's V_IN_REGS): up to d = 96 without a causal mask, K too at d <= 64 (kv_in_registers). With the
    mask, past d = 64 for a `cfg` whose causal step loop runs the masked steps apart from the others, with no branch
    on the mask for a register operand to be miscompiled under (the template's CAUSAL_SPLIT): dQ fused in, the
    statistics staged (one program an SM), not split roles. head_dim: the wider of Q's and V's, as the register
    model takes it; with V's own head dim the template also needs Q's past 64."""
    padded = head_chunks.padded(head_dim)
    if not causal:
        return padded <= 96
    split = cfg is not None and cfg.fused_dq and cfg.stages_statistics("bwd_dkdv") and not cfg.split_roles
    return 64 < padded <= 96 and split


MAX_ACCUMULATORS_PER_THREAD = 255


def accumulators_per_thread(cfg: KernelConfig, head_dim: int, kernel: str = "fwd") -> float:
    """fp32 accumulator values each thread holds (see the module docstring)."""
    check_kernel(kernel)
    d, m, n = computed_width(cfg, head_dim), cfg.block_m, cfg.block_n
    # K and V as 16-bit register operands (half a register a value) of the dK/dV kernel's Sᵀ and dPᵀ at d <= 64, V
    # alone up to d = 96; counted for both masks, as the model has none
    kv_operands = 0.0
    if kernel == "bwd_dkdv" and cfg.warp_specialized and v_in_registers(d):
        kv_operands = 64 * d / 128 if kv_in_registers(d) else 64 * d / 256
    if cfg.split_roles:
        # the dK side, the fuller of the two: dK (64 × d), dPᵀ and the Pᵀ it reads (64 × B_r each), dSᵀ 16-bit
        return 64 * (d + 2.5 * m) / 128
    if cfg.fused_dq and kernel == "bwd_dkdv":
        # dQ fused in: dSᵀ goes to shared memory for dQ and, without a mask nor the drain, stays in registers
        # (16-bit) as dK's A operand, formed as dPᵀ (fp32) dies (counted for both, as the model has no mask); the dQ
        # partial (64 × at most 64 fp32) is live beside Pᵀ's and dSᵀ's 16-bit copies once Sᵀ and dPᵀ are dead:
        # B_r + w ≤ 2·B_r, under the step's peak of Sᵀ, dPᵀ and Pᵀ (2.5·B_r), which is what counts. Compiled for
        # sm_90 without a mask, d=128 (64, 128) keeps 40 B of stack, d=96 32 B
        return 64 * (2 * d + max(2.5 * m, head_chunks.widest_dq_block(d))) / 128 + kv_operands
    if cfg.warp_specialized and kernel == "bwd_dkdv":
        # each consumer warpgroup: its 64 rows of dK and dV, Sᵀ and dPᵀ (64 × B_r), and Pᵀ, dSᵀ as 16-bit operands
        return 64 * (2 * d + 2 * m + m) / 128 + kv_operands
    if cfg.warp_specialized and kernel == "bwd_dq":
        # each consumer warpgroup: its 64 rows of dQ, S (then P) and dP (64 × B_c), the in-flight dS_j-1 (16-bit)
        return 64 * (d + 2.5 * n) / 128
    if cfg.warp_specialized:
        return 64 * (d + n) / 128  # each consumer warpgroup: its 64 rows of Õ and S
    values = {"fwd": m * (d + n * (1 + cfg.pipeline_qk)), "bwd_dkdv": n * (2 * d + 2 * m), "bwd_dq": m * (d + 2 * n)}[
        kernel
    ]
    return values / (32 * cfg.num_warps)


def ws_registers(cfg: KernelConfig, kernel: str = "fwd") -> tuple[int | None, int, int]:
    """(maxnreg, registers of each consumer thread, of the producer's) a warpspec config of `kernel` compiles with."""
    return WS_TWO_AN_SM_REGISTERS if cfg.schedule.programs_an_sm == 2 else WS_REGISTERS[cfg.consumers(kernel)]


def check(cfg: KernelConfig, device: DeviceInfo, head_dim: int, dtype: torch.dtype, kernel: str = "fwd",
          head_dim_v: int | None = None) -> str | None:  # fmt: skip
    """Returns why `cfg` should not run `kernel` on `device` (does not fit, or would spill), or None.
    head_dim_v: V's head dim where it is not Q's and K's (None: the same): warpspec must take both, and the model is
    that of config_head_dim."""
    check_kernel(kernel)
    for name, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if dim is not None and not 1 <= dim <= MAX_HEAD_DIM:
            return f"{name} must be in 1..{MAX_HEAD_DIM}, got {dim}"
    narrower = head_dim  # warpspec must take both head dims: the larger is checked below
    if head_dim_v is not None:
        narrower, head_dim = min(head_dim, head_dim_v), config_head_dim(head_dim, head_dim_v)
    combination = cfg.combination_error(kernel)
    if combination is not None:
        return combination
    if cfg.pipeline_qk and kernel != "fwd":
        return f"pipeline_qk is a forward switch; {kernel} has no QKᵀ loop to pipeline that way"
    if cfg.warp_specialized:
        reason = warpspec_unsupported(narrower, dtype, device.capability, device.triton_version, head_dim)
        if reason is not None:
            return reason
        if cfg.pad_head_dim and not any(head_chunks.pads(dim) for dim in (narrower, head_dim)):
            return (
                f"pad_head_dim changes no chunk at head_dim {head_dim} ({head_chunks.chunks(head_dim)}): the same "
                f"kernel as without it; it pads only where fewer chunks cost at most {head_chunks.MAX_PAD:.0%} more "
                "columns (head_chunks.fewer_chunks)"
            )
        consumer_registers = ws_registers(cfg, kernel)[1]
        budget = consumer_registers - _registers_beside(kernel, cfg.consumers(kernel), cfg.block_n,
                                                        device.triton_version)
        regs = accumulators_per_thread(cfg, head_dim, kernel)
        if regs > budget:
            return (
                f"registers: {regs:.0f} fp32 accumulator values per consumer thread, more than the {budget} its "
                f"{consumer_registers} registers leave beside them: would spill"
            )
        if kernel == "bwd_dkdv" and cfg.fused_dq and computed_width(cfg, head_dim) > FUSED_DQ_MAX_HEAD_DIM:
            # measured, not modelled: compiled for sm_90, (64, 128) at d=144 spills 216 B (causal 352), where d=128
            # keeps 40 B (causal 128); the model's count for it, 224, is within the budget
            return (
                f"registers: dK/dV with dQ fused in spills past head_dim {FUSED_DQ_MAX_HEAD_DIM} (sm_90: 216-352 B "
                f"of stack at d=144), got head_dim={head_dim}"
            )
        if kernel == "bwd_dkdv" and cfg.fused_dq and head_dim > 64 and cfg.num_stages > 2:
            # measured, not modelled: (64, 128) 3 stages at d=128 compiles with 232 B of stack (2 stages: 40 B) and
            # ran 25-30 % slower; timed first by the tuner, it hid the 2-stage config
            return (
                f"registers: dK/dV with dQ fused in at head_dim > 64 spills past 2 stages (sm_90: 232 B of stack at "
                f"d=128, 3 stages), got num_stages={cfg.num_stages}"
            )
    need = sram_bytes(cfg, head_dim, dtype, kernel, device.capability)
    if need > device.smem_per_block:
        return (
            f"shared memory: needs {need:,} B (model: {_model_terms(cfg, kernel)}), "
            f"{device.name} allows {device.smem_per_block:,} B per block"
        )
    shared = cfg.schedule.programs_an_sm
    if shared > 1:
        # each program also leaves the SM's reserve (smem_per_sm - smem_per_block: 1 KiB on Hopper) to the system
        each = device.smem_per_sm // shared - (device.smem_per_sm - device.smem_per_block)
        if need > each:
            return (
                f"shared memory: needs {need:,} B (model: {_model_terms(cfg, kernel)}); {shared} programs an SM "
                f"(programs_per_sm={cfg.schedule.programs_per_sm}) leave each {each:,} B on {device.name}"
            )
    regs = accumulators_per_thread(cfg, head_dim, kernel)
    if regs > MAX_ACCUMULATORS_PER_THREAD:
        return (
            f"registers: {regs:.0f} fp32 accumulator values per thread over {32 * cfg.num_warps} threads "
            f"(limit {MAX_ACCUMULATORS_PER_THREAD}): would spill"
        )
    return None


def _model_terms(cfg: KernelConfig, kernel: str) -> str:
    s, persistent = cfg.num_stages, cfg.schedule.persistent
    if kernel == "fwd":
        kv = f"{2 * s}×K/V" if s >= 2 else "1×K/V"
        o_staging = f" + O {cfg.block_m}×d" if persistent else ""
        return f"Q {cfg.block_m}×d{o_staging} + {kv} {cfg.block_n}×d"
    if kernel == "bwd_dkdv":
        staging = f" + dK,dV {cfg.block_n}×d" if persistent else ""
        handoff = f" + 2×Pᵀ {cfg.block_n}×{cfg.block_m} fp16" if cfg.split_roles else ""
        if cfg.fused_dq:
            handoff += f" + 2×dSᵀ {cfg.block_n}×{cfg.block_m} + {cfg.consumers(kernel)}×dQ staging fp32"
        return f"K,V {cfg.block_n}×d{staging} + {s}×(Q,dO) {cfg.block_m}×d{handoff}"
    staging = f" + dQ {cfg.block_m}×d" if persistent else ""
    return f"Q,dO {cfg.block_m}×d{staging} + {s}×(K,V) {cfg.block_n}×d"


# The schedules the search space offers a warp-specialized config: one program a tile, persistent, and two
# programs an SM where the config has one consumer (KernelConfig.two_an_sm_shape); the split tail at its default.
WS_SCHEDULES = (PER_TILE, PERSISTENT, TWO_AN_SM)


def candidates(kernel: str = "fwd", head_dim: int | None = None) -> list[KernelConfig]:
    """The search space of `kernel`: block_m, block_n in {16..256}, num_warps in {4, 8}, num_stages in {1..5};
    the forward also pipeline_qk in {0, 1}, and the warp-specialized template: block_m in {64, 128, 192}, block_n
    in {64, 128}, num_stages in {2, 3, 4}, each of WS_SCHEDULES, with ping-pong too at block_m = 128; bwd_dkdv and
    bwd_dq their warp-specialized templates, each of WS_SCHEDULES: bwd_dkdv at block_m 64, block_n in {64, 128},
    with dQ fused in (drained before it or not: drain_before_dq) or not, and at block_n 64 with split_roles (not
    two an SM, no fused dQ), bwd_dq at block_m and block_n in {64, 128}, num_stages in {2, 3, 4} (check() drops
    them off Hopper); each warp-specialized config also with its head dim padded to fewer chunks (pad_head_dim),
    except at a head_dim given that no pad changes (head_chunks.pads), where the twin would be the same kernel."""
    check_kernel(kernel)
    pad_twins = head_dim is None or head_chunks.pads(head_dim)
    switches = (0, 1) if kernel == "fwd" else (0,)
    grid = itertools.product(BLOCK_SIZES, BLOCK_SIZES, NUM_WARPS, NUM_STAGES, switches)
    configs = [KernelConfig(m, n, w, s, p) for m, n, w, s, p in grid]
    if kernel == "fwd":
        for m, n, s, schedule in itertools.product(WS_BLOCK_M, WS_BLOCK_N, WS_STAGES, WS_SCHEDULES):
            shapes = [KernelConfig(m, n, 4, s, warp_specialized=True, pingpong=pingpong, schedule=schedule)
                      for pingpong in ((False, True) if m == 128 else (False,))]  # fmt: skip
            # two an SM: one consumer only (combination_error)
            configs += _with_pad_twins((c for c in shapes if c.combination_error(kernel) is None), pad_twins)
    if kernel in WS_BACKWARD_TILES:
        owned, owned_sizes, _, _, streamed_sizes = WS_BACKWARD_TILES[kernel]
        for a, b, s, schedule in itertools.product(owned_sizes, streamed_sizes, WS_STAGES, WS_SCHEDULES):
            m, n = (b, a) if owned == "block_n" else (a, b)
            # bwd_dkdv: dQ fused in or not, and fused with the step drained before its dQ share or not
            fused = ((False, False), (True, False), (True, True)) if kernel == "bwd_dkdv" else ((False, False),)
            shapes = [KernelConfig(m, n, 4, s, warp_specialized=True, fused_dq=f, drain_before_dq=drain,
                                   schedule=schedule) for f, drain in fused]  # fmt: skip
            if kernel == "bwd_dkdv":
                shapes.append(KernelConfig(m, n, 4, s, warp_specialized=True, split_roles=True, schedule=schedule))
            configs += _with_pad_twins((c for c in shapes if c.combination_error(kernel) is None), pad_twins)
    return configs


def _with_pad_twins(configs, twins: bool) -> list[KernelConfig]:
    """Each warp-specialized config, then (twins) its twin on the head dim padded to fewer chunks (pad_head_dim),
    which check() passes only at head dims it changes (head_chunks.pads)."""
    out = []
    for cfg in configs:
        out += [cfg, replace(cfg, pad_head_dim=True)] if twins else [cfg]
    return out


@dataclass(frozen=True)
class Plan:
    """Every candidate of one kernel on one device: those that fit (with their predicted bytes), and the rest."""

    device: DeviceInfo
    kernel: str
    head_dim: int
    dtype: torch.dtype
    accepted: tuple[tuple[KernelConfig, int], ...]
    rejected: tuple[tuple[KernelConfig, int, str], ...]


def plan(device: DeviceInfo, head_dim: int, dtype: torch.dtype, kernel: str = "fwd") -> Plan:
    """Splits candidates() into accepted and rejected (with reasons) for one kernel on one device."""
    accepted, rejected = [], []
    for cfg in candidates(kernel, head_dim):
        reason = check(cfg, device, head_dim, dtype, kernel)
        need = sram_bytes(cfg, head_dim, dtype, kernel, device.capability)
        if reason is None:
            accepted.append((cfg, need))
        else:
            rejected.append((cfg, need, reason))
    return Plan(device, kernel, head_dim, dtype, tuple(accepted), tuple(rejected))
