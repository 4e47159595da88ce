"""The shapes a benchmark measures: a Sweep (the axes, from flags or a preset) expanded into one Shape per call.

Torch-free, so the command line can check its flags before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config.types import DTYPE_CHOICES, MAX_HEAD_DIM

# The grid of the FlashAttention-2 and -3 papers, which docs/bench/<gpu>.csv holds: batch·N = 16k tokens and
# heads·d = 2048 at every length and head dim, so each row does the same work per token.
GRID_TOKENS = 16384
GRID_WIDTH = 2048
MODES = ("fwd", "fwd+bwd")
# The interpreter runs a kernel's every program in Python: at these sizes a shape takes seconds on the CPU, beyond
# them minutes to hours; `--device cpu` is for checking the pipeline, not for speed.
CPU_MAX_SEQLEN = 256
CPU_MAX_HEADS = 4
CPU_MAX_BATCH = 2


@dataclass(frozen=True)
class Shape:
    """One benchmarked call: q (batch, heads, seqlen, head_dim), k and v with heads_kv heads, in SDPA's layout."""

    batch: int
    heads: int
    heads_kv: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: str  # one of DTYPE_CHOICES
    mode: str  # one of MODES

    def flops(self) -> float:
        """The standard count, 4·B·H·N²·d (causal: the visible pairs, about half; fwd+bwd: × 3.5)."""
        from ..tune.timing import attention_flops

        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, causal=self.causal,
                               mode=self.mode)  # fmt: skip

    def label(self) -> str:
        heads = f"{self.heads}" if self.heads == self.heads_kv else f"{self.heads}/{self.heads_kv}"
        return (f"{self.mode} {self.dtype} B={self.batch} H={heads} N={self.seqlen} d={self.head_dim}"
                f"{' causal' if self.causal else ''}")  # fmt: skip


@dataclass(frozen=True)
class Sweep:
    """The axes of a benchmark. batch None: GRID_TOKENS // N (at least 1); heads None: GRID_WIDTH // d; heads_kv
    None: heads (multi-head attention). Shapes run mode by mode, then head dim, length and mask."""

    seqlens: tuple[int, ...]
    head_dims: tuple[int, ...]
    batch: int | None = None
    heads: int | None = None
    heads_kv: int | None = None
    causal: tuple[bool, ...] = (False, True)
    modes: tuple[str, ...] = MODES
    dtype: str = "bf16"

    def override(self, **fields) -> Sweep:
        """This sweep with the fields given that are not None (a flag the user set beats the preset's value)."""
        return replace(self, **{name: value for name, value in fields.items() if value is not None})

    def shapes(self) -> list[Shape]:
        """Every shape of the sweep; ValueError naming the flag when an axis cannot make one."""
        self._check()
        out = []
        for mode in self.modes:
            for head_dim in self.head_dims:
                heads = self.heads or max(1, GRID_WIDTH // head_dim)
                heads_kv = self.heads_kv or heads
                if heads % heads_kv:
                    raise ValueError(f"--kv-heads must divide the query heads, {heads} at d={head_dim}; "
                                     f"got {heads_kv}")  # fmt: skip
                for seqlen in self.seqlens:
                    batch = self.batch or max(1, GRID_TOKENS // seqlen)
                    out += [Shape(batch, heads, heads_kv, seqlen, head_dim, causal, self.dtype, mode)
                            for causal in self.causal]  # fmt: skip
        return out

    def _check(self) -> None:
        problems = [
            (not self.seqlens or min(self.seqlens) < 1, f"--seqlen takes lengths >= 1, got {list(self.seqlens)}"),
            (not self.head_dims or not all(1 <= d <= MAX_HEAD_DIM for d in self.head_dims),
             f"--head-dim takes head dims in 1..{MAX_HEAD_DIM}, got {list(self.head_dims)}"),
            (any(m not in MODES for m in self.modes) or not self.modes,
             f"--mode takes {' or '.join(MODES)}, got {list(self.modes)}"),
            (self.dtype not in DTYPE_CHOICES, f"--dtype takes one of {list(DTYPE_CHOICES)}, got {self.dtype!r}"),
        ]  # fmt: skip
        for flag, value in (("--batch", self.batch), ("--heads", self.heads), ("--kv-heads", self.heads_kv)):
            problems.append((value is not None and value < 1, f"{flag} takes an integer >= 1, got {value}"))
        for bad, message in problems:
            if bad:
                raise ValueError(message)


# --preset: grid, the project's benchmark grid (docs/bench/<gpu>.csv); llama, grouped-query attention as in
# Llama 3 8B (32 query heads over 8 K/V heads of d=128); headdims, every head dim the kernels are tuned for at the
# grid's width, the odd ones (80, 96) included.
PRESETS = {
    "grid": Sweep(seqlens=(512, 1024, 2048, 4096, 8192, 16384), head_dims=(64, 128)),
    "llama": Sweep(seqlens=(1024, 2048, 4096, 8192, 16384), head_dims=(128,), heads=32, heads_kv=8),
    "headdims": Sweep(seqlens=(1024, 4096), head_dims=(64, 80, 96, 128, 192, 256)),
}
PRESET_HELP = {
    "grid": f"the project's grid: d 64,128, N 512..16384, batch·N = {GRID_TOKENS}, heads·d = {GRID_WIDTH}",
    "llama": "GQA as in Llama 3 8B: 32 query heads over 8 K/V heads, d=128, N 1024..16384",
    "headdims": "d 64, 80, 96, 128, 192, 256 at N 1024 and 4096",
}
assert set(PRESETS) == set(PRESET_HELP)


def cpu_problem(shapes: list[Shape]) -> str | None:
    """Why these shapes are too large for Triton's interpreter (--device cpu), or None."""
    limits = (("seqlen", CPU_MAX_SEQLEN, "--seqlen"), ("heads", CPU_MAX_HEADS, "--heads"),
              ("batch", CPU_MAX_BATCH, "--batch"))  # fmt: skip
    for field, limit, flag in limits:
        largest = max(getattr(shape, field) for shape in shapes)
        if largest > limit:
            return (f"--device cpu runs the kernels through Triton's interpreter, which takes minutes to hours past "
                    f"{flag} {limit} (got {largest}); give small shapes, e.g. --batch 1 --heads 2 --seqlen 64 "
                    f"--head-dim 32")  # fmt: skip
    return None
