"""Records passed between fa2tune's stages: frozen dataclasses, no logic beyond validation of their own fields."""

from __future__ import annotations

import functools
import numbers
from dataclasses import MISSING, asdict, dataclass, fields, replace

from . import head_chunks
from .schedule import PER_TILE, RETIRED_FIELDS, SCHEDULE_WORDS, Schedule

_BLOCK_SIZES = (16, 32, 64, 128, 256)
WS_BLOCK_M = (64, 128, 192)  # warpspec forward programs: 1, 2 or 3 consumer warpgroups of 64 query rows
WS_DKDV_BLOCK_N = (64, 128)  # warpspec dK/dV programs: 1 or 2 consumer warpgroups of 64 K/V rows
WS_DKDV_BLOCK_M = (64,)  # the Q rows a dK/dV step streams (128 spills: 264 B of stack at d=64, 720 at d=128)
WS_DQ_BLOCK_M = (64, 128)  # warpspec dQ programs: 1 or 2 consumer warpgroups of 64 query rows
WS_DQ_BLOCK_N = (64, 128)  # the K/V rows a dQ step streams
# The warpspec backward kernels' tiles: (field of the rows consumers own, its sizes, whose rows, field of the rows a
# step streams, its sizes) — one place for their config rules (KernelConfig), consumer counts and candidates (planner)
WS_BACKWARD_TILES = {
    "bwd_dkdv": ("block_n", WS_DKDV_BLOCK_N, "K/V", "block_m", WS_DKDV_BLOCK_M),
    "bwd_dq": ("block_m", WS_DQ_BLOCK_M, "query", "block_n", WS_DQ_BLOCK_N),
}
PERSISTENT_TEMPLATES = ("fwd_ws", "bwd_ws", "bwd_dq_ws")  # the warpspec templates with a `persistent` switch
# The templates whose code each of Variant's template switches changes: Variant.for_template drops a switch given for
# another template, and `fa2tune codegen` refuses it there (cli/commands.py) rather than print other code than asked.
SWITCH_TEMPLATES: dict[str, tuple[str, ...]] = {
    "pipeline_qk": ("fwd",),
    "pingpong": ("fwd_ws",),
    "persistent": PERSISTENT_TEMPLATES,
    "fused_dq": ("bwd_ws",),
    "split_roles": ("bwd_ws",),
    "stage_stats": ("bwd_ws",),
}
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")  # the kernels a config is for: the forward, the backward's dK/dV and dQ
MAX_HEAD_DIM = 256  # the largest head dimension the templates take
# The short names of the dtypes the kernels take, as YAML and the CLI spell them (torch-free, for the CLI's parser;
# inputs.DTYPE_NAMES maps torch dtypes to them).
DTYPE_CHOICES = ("bf16", "fp16", "fp32")


def integer(value: object) -> int | None:
    """`value` as a Python int if it is an integer — an int or a NumPy integer (numbers.Integral), as PyTorch takes
    them —, else None: not a bool, whose True would pass as 1, nor a float, whose fraction would be dropped."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


_NUMBERS = ("block_m", "block_n", "num_warps", "num_stages", "pipeline_qk")  # KernelConfig's int fields
_FLAGS = ("warp_specialized", "pingpong", "fused_dq", "split_roles", "drain_before_dq", "pad_head_dim")  # bool fields
_SCHEDULE_FIELDS = tuple(f.name for f in fields(Schedule))
_SWITCH_WORDS = {"qk": "pipeline_qk", "ws": "warp_specialized", "pingpong": "pingpong", "fused-dq": "fused_dq",
                 "split-roles": "split_roles", "drain-before-dq": "drain_before_dq", "pad-head-dim": "pad_head_dim"}


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel: tile sizes, warps per program, software-pipelining depth, the template and
    its switches, and the schedule of its programs.

    Attributes:
        block_m: B_r, rows of Q (forward) owned by one program.
        block_n: B_c, rows of K/V streamed per inner step.
        num_warps: warps per program (4 warps = one Hopper warpgroup).
        num_stages: pipelining depth of the K/V loop (shared-memory buffers in flight).
        pipeline_qk: forward only, 0 or 1: issue the next tile's QKᵀ before this tile's softmax (templates'
            `pipeline_qk` switch), so the tensor cores and the softmax overlap within one warpgroup.
        warp_specialized: run the kernel's warp-specialized Gluon template (Hopper only) instead of the Triton one
            (fwd.py.jinja, bwd.py.jinja): a TMA producer warp and consumer warpgroups of 64 rows each (num_warps is
            then the first consumer's 4). The forward (fwd_ws.py.jinja) and the dQ kernel (bwd_dq_ws.py.jinja):
            block_m / 64 consumers own the query rows, block_n K/V rows a step; the dK/dV kernel (bwd_ws.py.jinja):
            block_n / 64 consumers own the K/V rows, block_m = 64 Q rows a step.
        pingpong: forward only, warp-specialized, block_m = 128: its two consumers take turns at the tensor cores.
        fused_dq: bwd_dkdv only, warp-specialized: the dK/dV kernel also adds each step's dQ share into an fp32 dQ
            by TMA reductions, and no dQ kernel runs (FlashAttention-2/3's five matmuls instead of seven; the bwd_dq
            config is then unused).
        split_roles: bwd_dkdv only, warp-specialized, block_n = 64: the two consumer warpgroups share the program's
            64 K/V rows and split the work by role — one forms Sᵀ, Pᵀ and dV, the other dPᵀ, dSᵀ (from that Pᵀ,
            handed over in shared memory) and dK — so each holds one 64 × d accumulator instead of two: the dK/dV
            kernel for head dims whose dK and dV do not fit one warpgroup's registers together (d > 128). Not with
            fused_dq (_switch_error says why).
        drain_before_dq: bwd_dkdv only, with fused_dq: each step's dV and dK wgmmas retire, and its Q_i, dO_i buffer
            goes back to the producer, before the step's first dQ wgmma is issued (dK then reads dSᵀ from shared
            memory with or without the causal mask). Off, that wgmma queues behind them and, without the mask, runs
            between dV and dK (FlashAttention-3's order). Which is faster depends on the head dim and the mask
            (the whole backward on an H100: drained 3.2 % faster at d=128 causal, 4.4 % slower at d=96 causal;
            docs/PERF.md), so the tuner times both.
        pad_head_dim: warp-specialized only: compute on the head dim padded to fewer chunks (head_chunks.fewer_chunks:
            d=112 as one chunk of 128 instead of 64 + 32 + 16; TMA reads the columns past the tensor's end as zeros
            and writes none of them). A config of a head dim that no pad changes (head_chunks.pads) is the same
            kernel either way; the planner offers the switch only where it changes the chunks.
        schedule: how the warp-specialized kernel's programs walk the tiles (Schedule: persistent or one program a
            tile, programs an SM, the split tail); one program a tile for the Triton templates.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    pipeline_qk: int = 0
    warp_specialized: bool = False
    pingpong: bool = False
    fused_dq: bool = False
    split_roles: bool = False
    drain_before_dq: bool = False
    pad_head_dim: bool = False
    schedule: Schedule = PER_TILE

    def label(self) -> str:
        """A short human name, as logs print it: "128x128 w4 s2 ws pingpong persistent" (the switch words:
        _SWITCH_WORDS, then the schedule's, Schedule.label)."""
        switches = [word for word, name in _SWITCH_WORDS.items() if getattr(self, name)]
        schedule = self.schedule.label()
        return " ".join([f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}", *switches,
                         *([schedule] if schedule else [])])  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """A config from the short spelling scripts take on their command lines: block_m, block_n, num_warps,
        num_stages, then label()'s switch words, comma-separated ("128,128,4,2,ws,pingpong,persistent")."""
        parts = [part.strip() for part in text.split(",")]
        words = set(parts[4:])
        unknown = words - set(_SWITCH_WORDS) - set(SCHEDULE_WORDS)
        if len(parts) < 4 or not all(part.isdigit() for part in parts[:4]) or unknown:
            raise ValueError(
                f"a config is block_m,block_n,num_warps,num_stages[,word...] with words from "
                f"{[*_SWITCH_WORDS, *SCHEDULE_WORDS]}, got {text!r}"
            )
        switches = {name: word in words for word, name in _SWITCH_WORDS.items()}
        switches["pipeline_qk"] = int(switches["pipeline_qk"])
        return cls(*map(int, parts[:4]), **switches, schedule=Schedule.from_words(words))

    def __post_init__(self) -> None:
        for name in _NUMBERS:  # ints, as the kernels' compile-time constants and the custom op's int list take
            value = getattr(self, name)
            if type(value) is int:  # the common case first: the op path builds a config every call
                continue
            if integer(value) is None:
                raise TypeError(f"KernelConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, integer(value))  # a NumPy integer becomes a Python int
        for name in _FLAGS:
            if type(getattr(self, name)) is not bool:
                value = getattr(self, name)
                raise TypeError(f"KernelConfig.{name} must be a bool, got {type(value).__name__} {value!r}")
        if type(self.schedule) is not Schedule:
            value = self.schedule
            raise TypeError(f"KernelConfig.schedule must be a Schedule, got {type(value).__name__} {value!r}")
        for name, allowed in (("block_m", _BLOCK_SIZES + WS_BLOCK_M[2:]), ("block_n", _BLOCK_SIZES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of (1, 2, 4, 8, 16), got {self.num_warps!r}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages!r}")
        if self.pipeline_qk not in (0, 1):
            raise ValueError(f"pipeline_qk must be 0 or 1, got {self.pipeline_qk!r}")

    def combination_error(self, kernel: str = "fwd") -> str | None:
        """Why these fields do not make one config of `kernel` (KERNELS) together, or None. Separate from
        __post_init__ so that a tuner sampling each field on its own can build any combination and have
        planner.check reject it."""
        problem = self._schedule_error(kernel) or self._switch_error(kernel)
        if problem is not None or not self.warp_specialized:
            return problem
        if self.num_warps != 4 or self.pipeline_qk:
            return (
                "warpspec configs have num_warps=4 (one warpgroup per consumer) and pipeline_qk=0, "
                f"got num_warps={self.num_warps}, pipeline_qk={self.pipeline_qk}"
            )
        if kernel in WS_BACKWARD_TILES:
            owned, owned_sizes, rows, streamed, streamed_sizes = WS_BACKWARD_TILES[kernel]
            got = (getattr(self, owned), getattr(self, streamed))
            if got[0] not in owned_sizes or got[1] not in streamed_sizes:
                return (
                    f"{kernel}'s warpspec takes {owned} in {owned_sizes} (64 {rows} rows per consumer warpgroup) "
                    f"and {streamed} in {streamed_sizes}, got {', '.join(map(str, got))}"
                )
            return None
        if self.block_m not in WS_BLOCK_M:
            return f"warpspec takes block_m in {WS_BLOCK_M} (64 query rows per consumer warpgroup), got {self.block_m}"
        if self.pingpong and self.block_m != 128:
            return f"warpspec's pingpong (ping-pong of two consumers) needs block_m=128, got {self.block_m}"
        return None

    def _schedule_error(self, kernel: str) -> str | None:
        """combination_error's rules of the schedule."""
        schedule = self.schedule
        if schedule.persistent and not self.warp_specialized:
            return (
                f"persistent is a switch of the warpspec kernels {', '.join(KERNELS)}, got warp_specialized=False "
                f"for {kernel}"
            )
        problem = schedule.error()
        if problem is not None:
            return problem
        if schedule.programs_per_sm == 2 and not self.two_an_sm_shape(kernel):
            return (
                f"warpspec's programs_per_sm=2 (two programs an SM) is a switch of one-consumer configs: the "
                f"forward's and the dQ kernel's (block_m=64, no ping-pong) and the dK/dV kernel's (block_n=64), got "
                f"warp_specialized={self.warp_specialized}, pingpong={self.pingpong}, block_m={self.block_m}, "
                f"block_n={self.block_n} for {kernel}"
            )
        if not schedule.split_tail and (kernel != "fwd" or schedule.programs_per_sm != 1):
            return (
                f"warpspec's split_tail is a switch of the forward's persistent schedule of one program an SM, the "
                f"one with a split tail; got split_tail=False for {kernel}, programs_per_sm={schedule.programs_per_sm}"
            )
        return None

    def _switch_error(self, kernel: str) -> str | None:
        """combination_error's rules of the template switches outside the schedule."""
        if self.pingpong and (kernel != "fwd" or not self.warp_specialized):
            return (
                f"warpspec's pingpong (ping-pong of two consumers) is a switch of warp-specialized forward configs, "
                f"got warp_specialized={self.warp_specialized} for {kernel}"
            )
        if self.split_roles and (kernel != "bwd_dkdv" or not self.warp_specialized
                                 or self.block_n != WS_DKDV_BLOCK_N[0]):
            return (
                f"warpspec's split_roles (two consumers on one 64-row K/V block) is a switch of warp-specialized "
                f"bwd_dkdv configs with block_n={WS_DKDV_BLOCK_N[0]}, got warp_specialized="
                f"{self.warp_specialized}, block_n={self.block_n} for {kernel}"
            )
        if self.split_roles and self.fused_dq:
            # A program of split roles owns 64 K/V rows, so each Q tile's fp32 dQ is reduced N_K / 64 times, twice as
            # often as with two 64-row blocks: on the H200 at d=192 N=8k that traffic made the fused kernel 6.5 ms
            # against 5.25 ms for split roles and a dQ kernel (docs/PERF.md, "The backward's dK/dV kernel")
            return (
                "warpspec's split_roles does not take fused_dq: its 64 K/V rows a program would reduce each dQ tile "
                "twice as often as two 64-row blocks do (slower than its dQ kernel); drop one of the two"
            )
        if self.drain_before_dq and not self.fused_dq:
            return (
                "warpspec's drain_before_dq (the step's dV and dK retired before its dQ share) is a switch of "
                f"configs with fused_dq, got fused_dq=False for {kernel}"
            )
        if self.pad_head_dim and not self.warp_specialized:
            return (
                "pad_head_dim (the head dim computed in fewer, wider chunks) is a switch of the warpspec kernels, "
                f"got warp_specialized=False for {kernel}"
            )
        if self.fused_dq and (kernel != "bwd_dkdv" or not self.warp_specialized):
            return (
                f"warpspec's fused_dq (dQ added by the dK/dV kernel) is a switch of warp-specialized bwd_dkdv "
                f"configs, got warp_specialized={self.warp_specialized} for {kernel}"
            )
        if not self.warp_specialized and self.block_m not in _BLOCK_SIZES:
            return (
                f"block_m={self.block_m} needs warpspec (three consumer warpgroups); the Triton template "
                f"takes {_BLOCK_SIZES}"
            )
        return None

    def without_fused_dq(self) -> KernelConfig:
        """This dK/dV config's twin that leaves dQ to the dQ kernel (same tiles, less shared memory): fused_dq off,
        and the switches that exist only with it (drain_before_dq). Where a backward must not fuse dQ in
        (deterministic mode, V's own head dim) and where a dQ study times beside the unfused form."""
        return replace(self, fused_dq=False, drain_before_dq=False)

    def two_an_sm_shape(self, kernel: str = "fwd") -> bool:
        """Whether two programs an SM (Schedule.programs_per_sm = 2) may run this config of `kernel`: a one-consumer
        program — of the forward or the dQ kernel (64 query rows, no ping-pong) or of the dK/dV kernel (64 K/V rows,
        dQ fused in or not) —, measured faster two an SM at N <= 1k; programs of more consumers hold most of an SM
        already."""
        if not self.warp_specialized:
            return False
        if kernel in ("fwd", "bwd_dq"):
            return not self.pingpong and self.block_m == WS_BLOCK_M[0]
        return kernel == "bwd_dkdv" and self.block_n == WS_DKDV_BLOCK_N[0] and not self.split_roles

    def stages_statistics(self, kernel: str) -> bool:
        """Whether a warpspec dK/dV program's producer stages each step's logsumexp and δ in shared memory beside
        Q_i and dO_i (2·4·block_m bytes a stage), for the consumers to read when they need them: the two-block form,
        one program an SM (part of the change that made the backward 1–10 % faster but d=128 causal with fused dQ
        1.9 % slower on an H100: docs/PERF.md, "Measured and shipped"). Otherwise each consumer loads them from global
        memory a step ahead, into registers: two programs an SM have no room for the buffers (d=64's three fused
        stages fill half the SM to 256 B), and split roles read 1.8 % slower staged (d=192, both masks)."""
        return (self.warp_specialized and kernel == "bwd_dkdv" and self.schedule.programs_per_sm == 1
                and not self.split_roles)  # fmt: skip

    def template_switches(self, kernel: str) -> dict[str, bool]:
        """The switches of this config of `kernel` that select other template code, as Variant.for_template and
        codegen.code_hash take them: the one mapping the launcher's module and a stored entry's code hash share, so
        the hash names the code that runs."""
        return {"pipeline_qk": bool(self.pipeline_qk), "pingpong": self.pingpong,
                "persistent": self.schedule.persistent, "fused_dq": self.fused_dq, "split_roles": self.split_roles,
                "stage_stats": self.stages_statistics(kernel), "drain_before_dq": self.drain_before_dq,
                "pad_head_dim": self.pad_head_dim}  # fmt: skip

    def consumers(self, kernel: str = "fwd") -> int:
        """Consumer warpgroups of a warpspec program of `kernel`, 64 rows each (of Q in the forward and bwd_dq, of
        K/V in bwd_dkdv); 0 for the Triton template."""
        if not self.warp_specialized:
            return 0
        if self.split_roles:
            return 2  # the dV side and the dK side of one 64-row K/V block
        return getattr(self, WS_BACKWARD_TILES[kernel][0] if kernel in WS_BACKWARD_TILES else "block_m") // 64

    def to_dict(self) -> dict:
        """The fields as YAML stores them (store schema 2); switches off (pipeline_qk 0, flags False, one program a
        tile) are left out, so entries that do not use a switch read as they did before it existed."""
        data = {name: getattr(self, name) for name in ("block_m", "block_n", "num_warps", "num_stages")}
        data.update({name: getattr(self, name) for name in ("pipeline_qk", *_FLAGS) if getattr(self, name)})
        if self.schedule != PER_TILE:
            data["schedule"] = self.schedule.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        """Builds a config from a mapping (to_dict's, a YAML entry's); unknown keys are an error, not silently
        dropped."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown KernelConfig keys {sorted(unknown)}")
        values = {k: int(v) if k in _NUMBERS else v for k, v in data.items()}
        if "schedule" in values:
            values["schedule"] = Schedule.from_dict(values["schedule"])
        return cls(**values)

    def params(self) -> dict[str, int | bool]:
        """Every field as one flat mapping of plain values, the schedule's beside the others (PARAM_NAMES): a
        tuner's search dimensions."""
        flat = {name: getattr(self, name) for name in (*_NUMBERS, *_FLAGS)}
        return {**flat, **{name: getattr(self.schedule, name) for name in _SCHEDULE_FIELDS}}

    @classmethod
    def from_params(cls, params: dict) -> KernelConfig:
        """The config of a flat mapping (params'; fields left out take their defaults). A schedule's retired fields
        (schedule.RETIRED_FIELDS), which the trials of a study begun before their removal hold, are left out."""
        schedule = Schedule(**{name: params[name] for name in _SCHEDULE_FIELDS if name in params})
        return cls(**{k: v for k, v in params.items() if k not in _SCHEDULE_FIELDS and k not in RETIRED_FIELDS},
                   schedule=schedule)  # fmt: skip

    def to_ints(self) -> list[int]:
        """Every field as an int, in PARAM_NAMES' order: what a custom op's schema carries (it takes no
        dataclasses); from_ints reads it back."""
        return [int(value) for value in self.params().values()]

    @classmethod
    def from_ints(cls, ints: list[int]) -> KernelConfig:
        """The config of to_ints' list. Positional, and the schedule looked up (_schedule_of_ints): the custom op's
        path builds a config every call. A list one shorter is the layout before pad_head_dim (a graph that
        torch.compile cached or torch.export saved then still runs): the switch off."""
        if len(ints) == len(PARAM_NAMES) - 1:
            at = PARAM_NAMES.index("pad_head_dim")
            ints = [*ints[:at], 0, *ints[at:]]
        if len(ints) != len(PARAM_NAMES):
            raise ValueError(f"a config as ints has {len(PARAM_NAMES)} ({', '.join(PARAM_NAMES)}), got {len(ints)}")
        m, n, warps, stages, qk, ws, pingpong, fused_dq, split_roles, drain, pad, *schedule = ints
        return cls(m, n, warps, stages, qk, bool(ws), bool(pingpong), bool(fused_dq), bool(split_roles), bool(drain),
                   bool(pad), _schedule_of_ints(*schedule))


@functools.lru_cache(maxsize=64)
def _schedule_of_ints(persistent: int, programs_per_sm: int, split_tail: int) -> Schedule:
    return Schedule(bool(persistent), programs_per_sm, bool(split_tail))


PARAM_NAMES = (*_NUMBERS, *_FLAGS, *_SCHEDULE_FIELDS)  # KernelConfig.params' keys, in order
REQUIRED_PARAMS = tuple(f.name for f in fields(KernelConfig) if f.default is MISSING)  # the rest have defaults


@dataclass(frozen=True)
class Variant:
    """Structural switches of the templates (fwd.py.jinja, bwd.py.jinja): each one changes the code.

    Attributes:
        causal: emit the diagonal loops with the causal mask (bottom-right aligned).
        even_m: q_len is a multiple of the kernel's block_m, so Q-side loads and stores need no row mask.
        even_n: k_len is a multiple of the kernel's block_n, so no K/V tile is ragged.
        dot_fp32: upcast dot operands to fp32 (the Triton interpreter computes bf16 dots wrongly).
        banded: the general mask of `Mask` (sliding window and/or prefix) with run-time bounds; `causal` is then
            False, as causality is the window's right bound of 0.
        varlen: packed sequences (total_tokens, heads, head_dim) split by cumulative lengths; even_m/even_n are
            then False, as every sequence has its own length.
        pipeline_qk: the forward's unmasked loop issues the next QKᵀ before this softmax (KernelConfig.pipeline_qk).
        pingpong: fwd_ws only: the two consumer warpgroups take turns at the tensor cores (KernelConfig.pingpong).
        persistent: the warpspec templates: programs walk the tiles (KernelConfig.schedule.persistent).
        fused_dq: bwd_ws only: the dK/dV kernel also adds each step's dQ share, scale·dS·K, into an fp32 dQ by TMA
            reductions, and no dQ kernel runs (KernelConfig.fused_dq).
        split_roles: bwd_ws only: the two consumers share one 64-row K/V block, one on the dV side, one on the dK
            side (KernelConfig.split_roles).
        stage_stats: bwd_ws only: the producer stages each step's logsumexp and δ in shared memory
            (KernelConfig.stages_statistics).
        drain_before_dq: bwd_ws with fused_dq only: the step's dV and dK wgmmas retire before its first dQ wgmma
            (KernelConfig.drain_before_dq).
        qk_chunks, v_chunks: the warpspec templates: the head-dim chunks of Q/K (and dQ, dK) and of V/O (and dO, dV)
            (fa2tune.config.head_chunks), whose loads, buffers, wgmmas and accumulators the template writes out one a
            chunk; () for the Triton templates.
        distinct_v: the Triton templates: V's head dim is not Q's and K's, so V, O, dO and dV take constexprs of
            their own (HEAD_DIM_V, HEAD_DIM_V_PAD); off, the code reads HEAD_DIM for all, as it always has.
    """

    causal: bool
    even_m: bool
    even_n: bool
    dot_fp32: bool = False
    banded: bool = False
    varlen: bool = False
    pipeline_qk: bool = False
    pingpong: bool = False
    persistent: bool = False
    fused_dq: bool = False
    split_roles: bool = False
    stage_stats: bool = False
    drain_before_dq: bool = False
    qk_chunks: tuple[int, ...] = ()
    v_chunks: tuple[int, ...] = ()
    distinct_v: bool = False

    @classmethod
    def for_template(
        cls,
        template: str,
        *,
        causal: bool,
        banded: bool,
        varlen: bool,
        even_m: bool,
        even_n: bool,
        pipeline_qk: int | bool = False,
        dot_fp32: bool = False,
        pingpong: bool = False,
        persistent: bool = False,
        fused_dq: bool = False,
        split_roles: bool = False,
        stage_stats: bool = False,
        drain_before_dq: bool = False,
        pad_head_dim: bool = False,
        head_dim: int | None = None,
        head_dim_v: int | None = None,
    ) -> Variant:
        """The variant `template` (codegen.TEMPLATES) renders for a call: the rules the launcher, codegen.code_hash
        and the probe must agree on, or a stored entry's hash would not name the code it runs. A band mask carries
        causality itself; packed sequences have no even tails; pipeline_qk exists in the forward template only.
        The warpspec templates have causal, persistent, fwd_ws pingpong, bwd_ws fused_dq, split_roles, stage_stats and
        (with fused_dq) drain_before_dq, and pad_head_dim, which picks their chunks:
        TMA bounds every tile, so tails need no code of their own, and they take neither band masks nor packed
        sequences (the launcher routes those to the Triton templates). They are written out a head-dim chunk at a
        time: they need head_dim (and head_dim_v, V's, where it differs). The Triton templates take any head dims as
        constexprs; a head_dim_v other than head_dim gives them V's own (distinct_v)."""
        takes = lambda switch: template in SWITCH_TEMPLATES[switch]
        if template.endswith("_ws"):
            if head_dim is None:
                raise ValueError(f"{template} is rendered for a head dim: pass head_dim")
            qk_chunks = head_chunks.chunks(head_dim, pad_head_dim)
            v_chunks = head_chunks.chunks(head_dim if head_dim_v is None else head_dim_v, pad_head_dim)
            fused_dq = fused_dq and takes("fused_dq")
            split_roles = split_roles and takes("split_roles")
            return cls(causal=causal, even_m=False, even_n=False, pingpong=pingpong and takes("pingpong"),
                       persistent=bool(persistent) and takes("persistent"), fused_dq=fused_dq,
                       split_roles=split_roles, stage_stats=stage_stats and takes("stage_stats") and not split_roles,
                       drain_before_dq=drain_before_dq and fused_dq, qk_chunks=qk_chunks,
                       v_chunks=v_chunks)  # fmt: skip
        return cls(
            causal=causal and not banded, even_m=even_m and not varlen, even_n=even_n and not varlen,
            dot_fp32=dot_fp32, banded=banded, varlen=varlen, pipeline_qk=bool(pipeline_qk) and takes("pipeline_qk"),
            distinct_v=head_dim_v is not None and head_dim_v != head_dim,
        )  # fmt: skip


@dataclass(frozen=True)
class Mask:
    """Which keys a query sees. Positions are aligned bottom-right, as FlashAttention-2 does: query i sits at key
    position i + seqlen_k - seqlen_q (its own sequence's lengths, for packed sequences).

    Query i sees key j when j < prefix_len, or when i' - left <= j <= i' + right (i' = the aligned position), with
    (left, right) = window, -1 meaning unbounded on that side. causal=True is a right bound of 0.

    Attributes:
        causal: no key after the query's own position.
        window: (left, right) as FlashAttention-2's window_size; (-1, -1) is no window.
        prefix_len: keys [0, prefix_len) are visible to every query (prefix-LM); implies causal after them.
    """

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    prefix_len: int = 0

    @property
    def banded(self) -> bool:
        """True when the kernels need the general (window/prefix) variant rather than plain or causal."""
        return self.window != (-1, -1) or self.prefix_len > 0

    def bounds(self, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
        """(left, right, prefix_len) as the kernels take them: -1 becomes a bound no position reaches, and so does
        any side past it (the kernels add a side to 32-bit positions: a side near 2^31 would wrap around)."""
        unbounded = seqlen_q + seqlen_k + 1
        left, right = (unbounded if side < 0 else min(side, unbounded) for side in self.window)
        if self.causal or self.prefix_len > 0:
            right = min(right, 0)
        return left, right, min(self.prefix_len, seqlen_k)


@dataclass(frozen=True)
class DeviceInfo:
    """What a GPU offers the kernels, read from the card (device.inspect) or the known-GPU table.

    Attributes:
        name: marketing name, e.g. "NVIDIA H200".
        slug: file-name-safe key for tuned configs, e.g. "nvidia-h200".
        capability: CUDA compute capability (major, minor).
        sm_count: streaming multiprocessors.
        smem_per_block: largest shared memory one program may opt in to, bytes (Triton's OutOfResources limit).
        smem_per_sm: shared memory per SM, bytes (how many programs fit side by side).
        regs_per_sm: 32-bit registers per SM.
        l2_bytes: L2 cache size, bytes.
        source: "card" when read from the device, else where the figures came from.
        triton_version, torch_version: the software the reading was made with ("" for table entries).
    """

    name: str
    slug: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int
    smem_per_sm: int
    regs_per_sm: int
    l2_bytes: int
    source: str = "card"
    triton_version: str = ""
    torch_version: str = ""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["capability"] = list(self.capability)
        return data
