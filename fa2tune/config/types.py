"""Records passed between fa2tune's stages: frozen dataclasses, no logic beyond validation of their own fields."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields

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
PERSISTENT_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")  # the kernels they run
MAX_HEAD_DIM = 256  # the largest head dimension the templates take
# The short names of the dtypes the kernels take, as YAML and the CLI spell them (torch-free, for the CLI's parser;
# inputs.DTYPES_BY_NAME maps them to torch dtypes).
DTYPE_CHOICES = ("bf16", "fp16", "fp32")


def integer(value: object) -> int | None:
    """`value` as a Python int if it is an integer — an int or a NumPy integer (numbers.Integral), as PyTorch takes
    them —, else None: not a bool, whose True would pass as 1, nor a float, whose fraction would be dropped."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel: tile sizes, warps per program and software-pipelining depth.

    Attributes:
        block_m: B_r, rows of Q (forward) owned by one program.
        block_n: B_c, rows of K/V streamed per inner step.
        num_warps: warps per program (4 warps = one Hopper warpgroup).
        num_stages: pipelining depth of the K/V loop (shared-memory buffers in flight).
        pipeline_qk: forward only, 0 or 1: issue the next tile's QKᵀ before this tile's softmax (templates'
            `pipeline_qk` switch), so the tensor cores and the softmax overlap within one warpgroup.
        warpspec: 0 runs the Triton template (fwd.py.jinja, bwd.py.jinja); 1 a warp-specialized Gluon template
            (Hopper only): in the forward (fwd_ws.py.jinja) a TMA producer warp and block_m / 64 consumer
            warpgroups (block_m 64, 128 or 192; num_warps is then the first consumer's 4); 2 the same with the two
            consumers of a block_m = 128 tile taking turns at the tensor cores (ping-pong). In bwd_dkdv
            (bwd_ws.py.jinja) 1: block_n / 64 consumer warpgroups own the K/V rows, block_m = 64 Q rows a step; 2:
            the same kernel also adds each step's dQ share into an fp32 dQ by TMA reductions, and no dQ kernel runs
            (FlashAttention-2/3's five matmuls instead of seven; the bwd_dq config is then unused);
            in bwd_dq (bwd_dq_ws.py.jinja) 1 only: block_m / 64 consumer warpgroups own the query rows, block_n K/V
            rows a step.
        persistent: the warpspec kernels (PERSISTENT_KERNELS: forward, dK/dV and dQ), 0 or 1: one program per SM
            walks the tiles, and the producer loads the next tile's operands while the consumers finish this one
            (the `persistent` switch of fwd_ws, bwd_ws and bwd_dq_ws.py.jinja); causal tiles are dealt in pairs, a
            head's j-th longest with its j-th shortest, so every program gets the same work; 0: one program per tile.
            2 (one-consumer configs of each of the three: two_an_sm_shape): persistent with two programs an SM,
            each compiled for half the register file (planner.WS_TWO_AN_SM_REGISTERS) and in half the shared
            memory, so one runs under the other's tile prologue and epilogue — what a one-consumer program lacks at
            N <= 1k, where its loads and stores are a large share of a tile (docs/PERF.md v19, v21, v22).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    pipeline_qk: int = 0
    warpspec: int = 0
    persistent: int = 0

    def label(self) -> str:
        """A short human name, as logs print it: "128x128 w4 s2 ws2 persistent"."""
        persistent = "persistent" + " x2" * (self.persistent == 2)
        switches = [name for name, on in (("qk", self.pipeline_qk), (f"ws{self.warpspec}", self.warpspec),
                                          (persistent, self.persistent)) if on]  # fmt: skip
        return " ".join([f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}", *switches])

    def __post_init__(self) -> None:
        for field in fields(self):  # ints, as the kernels' compile-time constants and the custom op's int list take
            value = getattr(self, field.name)
            if type(value) is int:  # the common case first: the op path builds a config every call
                continue
            if integer(value) is None:
                raise TypeError(f"KernelConfig.{field.name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, field.name, integer(value))  # a NumPy integer becomes a Python int
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
        if self.warpspec not in (0, 1, 2):
            raise ValueError(f"warpspec must be 0, 1 or 2, got {self.warpspec!r}")
        if self.persistent not in (0, 1, 2):
            raise ValueError(f"persistent must be 0, 1 or 2, got {self.persistent!r}")

    def combination_error(self, kernel: str = "fwd") -> str | None:
        """Why these fields do not make one config of `kernel` ("fwd", "bwd_dkdv", "bwd_dq") together, or None.
        Separate from __post_init__ so that a tuner sampling each field on its own can build any combination and
        have planner.check reject it."""
        if self.persistent and (not self.warpspec or kernel not in PERSISTENT_KERNELS):
            return (
                f"persistent is a switch of the warpspec kernels {', '.join(PERSISTENT_KERNELS)}, got "
                f"warpspec={self.warpspec} for {kernel}"
            )
        if self.persistent == 2 and not self.two_an_sm_shape(kernel):
            return (
                f"persistent=2 (two programs an SM) is a switch of one-consumer warpspec configs: the forward's and "
                f"the dQ kernel's (warpspec=1, block_m=64) and the dK/dV kernel's (block_n=64), got "
                f"warpspec={self.warpspec}, block_m={self.block_m}, block_n={self.block_n} for {kernel}"
            )
        if not self.warpspec:
            if self.block_m not in _BLOCK_SIZES:
                return (
                    f"block_m={self.block_m} needs warpspec (three consumer warpgroups); the Triton template "
                    f"takes {_BLOCK_SIZES}"
                )
            return None
        if self.num_warps != 4 or self.pipeline_qk:
            return (
                "warpspec configs have num_warps=4 (one warpgroup per consumer) and pipeline_qk=0, "
                f"got num_warps={self.num_warps}, pipeline_qk={self.pipeline_qk}"
            )
        if kernel in WS_BACKWARD_TILES:
            owned, owned_sizes, rows, streamed, streamed_sizes = WS_BACKWARD_TILES[kernel]
            got = (self.warpspec, getattr(self, owned), getattr(self, streamed))
            modes = (1, 2) if kernel == "bwd_dkdv" else (1,)  # bwd_dkdv's 2: dQ fused in (Variant.fused_dq)
            if got[0] not in modes or got[1] not in owned_sizes or got[2] not in streamed_sizes:
                return (
                    f"{kernel}'s warpspec takes warpspec in {modes}, {owned} in {owned_sizes} (64 {rows} rows per "
                    f"consumer warpgroup) and {streamed} in {streamed_sizes}, got {', '.join(map(str, got))}"
                )
            return None
        if self.block_m not in WS_BLOCK_M:
            return f"warpspec takes block_m in {WS_BLOCK_M} (64 query rows per consumer warpgroup), got {self.block_m}"
        if self.warpspec == 2 and self.block_m != 128:
            return f"warpspec=2 (ping-pong of two consumers) needs block_m=128, got {self.block_m}"
        return None

    def two_an_sm_shape(self, kernel: str = "fwd") -> bool:
        """Whether persistent=2 may run this config of `kernel`: a one-consumer program — of the forward or the
        dQ kernel (warpspec 1, block_m 64: 64 query rows) or of the dK/dV kernel (block_n 64, dQ fused in or not) —
        measured faster two an SM at N <= 1k (docs/PERF.md v21, v22); programs of more consumers hold most of an
        SM already."""
        if kernel in ("fwd", "bwd_dq"):
            return self.warpspec == 1 and self.block_m == WS_BLOCK_M[0]
        return kernel == "bwd_dkdv" and self.warpspec in (1, 2) and self.block_n == WS_DKDV_BLOCK_N[0]

    def consumers(self, kernel: str = "fwd") -> int:
        """Consumer warpgroups of a warpspec program of `kernel`, 64 rows each (of Q in the forward and bwd_dq, of
        K/V in bwd_dkdv); 0 for the Triton template."""
        if not self.warpspec:
            return 0
        return getattr(self, WS_BACKWARD_TILES[kernel][0] if kernel in WS_BACKWARD_TILES else "block_m") // 64

    def to_dict(self) -> dict[str, int]:
        """The fields as a mapping; switches at their default (off) are left out, so entries written before a switch
        existed and entries that do not use it read the same."""
        data = asdict(self)
        for switch in (f.name for f in fields(self) if f.default == 0):  # the switches: every field defaulting to off
            if not data[switch]:
                del data[switch]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        """Builds a config from a mapping (a YAML entry); unknown keys are an error, not silently dropped."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown KernelConfig keys {sorted(unknown)}")
        return cls(**{k: int(v) for k, v in data.items()})


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
        pingpong: fwd_ws only: the two consumer warpgroups take turns at the tensor cores (KernelConfig.warpspec 2).
        persistent: fwd_ws only: one program per SM walks the tiles (KernelConfig.persistent).
        fused_dq: bwd_ws only: the dK/dV kernel also adds each step's dQ share, scale·dS·K, into an fp32 dQ by TMA
            reductions, and no dQ kernel runs (KernelConfig.warpspec 2 of bwd_dkdv).
        causal_tail: the warpspec templates, causal and persistent: the launch's last heads' tiles may be dealt out
            one at a time (fa2tune.launch.causal_tail); off, the code is the pairs' alone. Not an entry's switch: a
            launch's, by FA2TUNE_CAUSAL_TAIL.
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
    causal_tail: bool = False

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
        persistent: int | bool = False,
        fused_dq: bool = False,
        causal_tail: bool = False,
    ) -> Variant:
        """The variant `template` (codegen.TEMPLATES) renders for a call: the rules the launcher, codegen.code_hash
        and the probe must agree on, or a stored entry's hash would not name the code it runs. A band mask carries
        causality itself; packed sequences have no even tails; pipeline_qk exists in the forward template only.
        The warpspec templates have causal, persistent and causal_tail (with both), fwd_ws pingpong, bwd_ws fused_dq:
        TMA bounds every tile, so tails need no code of their own, and they take neither band masks nor packed
        sequences (the launcher routes those to the Triton templates)."""
        if template.endswith("_ws"):
            forward = template == "fwd_ws"
            persistent = bool(persistent) and template in PERSISTENT_TEMPLATES
            return cls(causal=causal, even_m=False, even_n=False, pingpong=pingpong and forward,
                       persistent=persistent, fused_dq=fused_dq and template == "bwd_ws",
                       causal_tail=causal_tail and causal and persistent)  # fmt: skip
        return cls(
            causal=causal and not banded, even_m=even_m and not varlen, even_n=even_n and not varlen,
            dot_fp32=dot_fp32, banded=banded, varlen=varlen, pipeline_qk=bool(pipeline_qk) and template == "fwd",
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
