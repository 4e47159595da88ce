"""The config a kernel runs before any tuning: the H200's measured best where it fits the device, else the
warp-specialized shapes the planner's model admits, else the largest moderate Triton tile that fits. What fits is
planner.check's to say; this module only orders the candidates.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import head_chunks, lengths, planner
from .device import INTERPRETER, inspect_cached, known_gpu
from .schedule import PERSISTENT
from .types import DeviceInfo, KernelConfig

# Fastest configs measured on the H200 (bf16; docs/PERF.md, docs/bench/nvidia-h200-sweep-*.csv, and the shipped
# file's tuned entries for all lengths), tried first on any GPU; a GPU with less shared memory falls through to the
# largest tile that fits. Warp-specialized configs first: on GPUs without wgmma check() rejects them and the Triton
# ones follow.
_WS = dict(warp_specialized=True)
_PREFERRED: dict[tuple[str, int, bool], list[KernelConfig]] = {
    ("fwd", 64, False): [KernelConfig(192, 128, 4, 2, **_WS, schedule=PERSISTENT), KernelConfig(128, 64, 8, 3)],
    ("fwd", 64, True): [KernelConfig(192, 128, 4, 3, **_WS, schedule=PERSISTENT), KernelConfig(128, 64, 8, 3)],
    ("fwd", 128, False): [KernelConfig(128, 128, 4, 2, **_WS, schedule=PERSISTENT), KernelConfig(256, 64, 8, 4)],
    ("fwd", 128, True): [KernelConfig(128, 128, 4, 2, **_WS, pingpong=True, schedule=PERSISTENT),
                         KernelConfig(128, 128, 8, 3)],
    ("bwd_dkdv", 64, False): [KernelConfig(64, 128, 4, 3, **_WS, fused_dq=True, schedule=PERSISTENT),
                              KernelConfig(32, 128, 4, 3)],
    ("bwd_dkdv", 128, False): [KernelConfig(64, 128, 4, 2, **_WS, fused_dq=True), KernelConfig(32, 64, 4, 3)],
    ("bwd_dq", 64, False): [KernelConfig(128, 64, 4, 3)],
    ("bwd_dq", 128, False): [KernelConfig(128, 64, 4, 3, **_WS, schedule=PERSISTENT), KernelConfig(128, 64, 8, 3)],
}  # fmt: skip
# At a head dim without a measurement, the warp-specialized shapes tried first: the first that check() lets fit
# (shared memory, registers) is the default, so a head dim's default follows from the model and not from a table of
# head dims. Each list leads with the forms the tunes at d = 64-256 picked wherever the model admits them (the
# shipped file's entries had beaten the earlier defaults by 1-18 % a kernel where they differed; with these, the
# untuned forward + backward at d = 64, 96, 128, 192 runs within 1.2 % of the tuned entries: docs/PERF.md, "The
# untuned defaults"):
# - the forward: most rows a program first, persistent; causal: ping-pong persistent (the two consumers' softmaxes
#   under each other's wgmmas), after the three-consumer tile that fits at d <= 64 only;
# - dK/dV: dQ fused in (five matmuls a step instead of the dQ kernel's extra two) at every head dim up to 128:
#   below 65 the consumers take turns forming dQ_i, 5-26 % faster than unfused without a mask; causal at d = 33-48,
#   where they do not, fused and unfused read within 3.3 % either way (docs/PERF.md, "The untuned defaults"),
#   persistent where the staging fits, three stages where the model allows them (d <= 64); past the head dims where
#   one warpgroup holds both dK and dV (d <= 128), the two consumers split the roles;
# - dQ: three stages, persistent. At d >= 224 it fits one consumer only: per tile it spills 56-144 B (sm_90),
#   persistent 0-56 (causal).
_PINGPONG = KernelConfig(128, 128, 4, 2, **_WS, pingpong=True, schedule=PERSISTENT)
_WS_ORDER: dict[tuple[str, bool], list[KernelConfig]] = {
    ("fwd", False): [
        KernelConfig(192, 128, 4, 2, **_WS, schedule=PERSISTENT),
        KernelConfig(128, 128, 4, 2, **_WS, schedule=PERSISTENT),
        KernelConfig(128, 128, 4, 2, **_WS),
        KernelConfig(128, 64, 4, 2, **_WS, schedule=PERSISTENT),
        KernelConfig(128, 64, 4, 2, **_WS),
        KernelConfig(64, 128, 4, 2, **_WS),
        KernelConfig(64, 64, 4, 2, **_WS),
    ],
    ("fwd", True): [
        KernelConfig(192, 128, 4, 3, **_WS, schedule=PERSISTENT),
        _PINGPONG,
        KernelConfig(128, 128, 4, 2, **_WS, pingpong=True),
        KernelConfig(128, 64, 4, 2, **_WS, pingpong=True, schedule=PERSISTENT),
        KernelConfig(128, 64, 4, 2, **_WS, pingpong=True),
        KernelConfig(64, 128, 4, 2, **_WS),
        KernelConfig(64, 64, 4, 2, **_WS),
    ],
    ("bwd_dkdv", False): [
        KernelConfig(64, 128, 4, 3, **_WS, fused_dq=True, schedule=PERSISTENT),
        KernelConfig(64, 128, 4, 2, **_WS, fused_dq=True, schedule=PERSISTENT),
        KernelConfig(64, 128, 4, 2, **_WS, fused_dq=True),
        KernelConfig(64, 128, 4, 2, **_WS),  # without dQ: where no fused form fits
        KernelConfig(64, 64, 4, 2, **_WS),
        KernelConfig(64, 64, 4, 2, **_WS, split_roles=True),
    ],
    ("bwd_dq", False): [
        KernelConfig(128, 64, 4, 3, **_WS, schedule=PERSISTENT),
        KernelConfig(128, 64, 4, 3, **_WS),
        KernelConfig(64, 64, 4, 3, **_WS, schedule=PERSISTENT),
        KernelConfig(64, 64, 4, 2, **_WS, schedule=PERSISTENT),
        KernelConfig(64, 64, 4, 2, **_WS),
    ],
}
# Calls of a length bucket (lengths.BUCKET_RANGES) at a head dim without an entry of their own try that bucket's
# forms first, then the lists above. Measured on an H100 SXM (bf16, batch·N = 16k, heads·d = 2048; docs/PERF.md,
# "Short and odd lengths"); the head dims between those measured follow the same forms where the model lets them fit.
# - short (N <= 1k), causal forward: 128 × 64 persistent, no ping-pong, three stages. A short causal tile visits a
#   few K/V tiles, most of them on the diagonal, where 64-key steps waste less and the consumers' turns hide little.
#   Against the long order's first fit at N=512: d = 40 and 64 1.74-1.95× (the three-consumer 192 × 128), d = 96 and
#   128 +11 % (ping-pong); ping-pong is 18-25 % slower at d = 40-64 too. At N=1k 1.36-1.54× over 192 × 128
#   (d = 32-64) but 2-9 % behind ping-pong at every head dim measured (d = 32-128). The d=128 short tunes chose this
#   form; d=64's chose two programs an SM (64 × 128), within 2 % of it at N=512. Two stages where three do not fit
#   (d = 192-224, where either form reads the same).
# - short, causal dK/dV: dQ by its own kernel, persistent. With few Q tiles a K/V tile, the fused form's dQ
#   reductions and zeroing weigh more than the two matmuls it saves: the whole backward at N=512 +2.6 % (d=40),
#   +7 % (d=72), +24 % (d=112, against its padded fused default); d=128's short tunes chose it too (at N=1k the
#   unfused pair read 317 TFLOP/s against fused 293: docs/PERF.md, "The backward's dK/dV kernel and fused dQ"). Past
#   d=128 it does not fit and split roles follow. Without the mask the fused default stays (within 2.4 % of the
#   best at d = 40-112). At N=2k fused is ahead again at d=72 (+10 %), so the medium bucket keeps it.
# - short, forward without a mask: 128 × 128 persistent, two stages — the long order's choice past d=64 — at every
#   head dim: at d = 32-64 the three-consumer tile computes rows past a short sequence's end (three tiles of 192 rows
#   for N=512: 12.5 % more rows than the sequence; at 8k 0.8 %); 128 × 128 is 2-6 % faster at N=512 and 1-5.5 % at 1k
#   (d = 32, 48, 64), three stages within 2 % of two.
# - medium (1k < N <= 4k), causal forward: 128 × 128 ping-pong, persistent, the long order's choice past d=64, at
#   every head dim: at d = 32-64 it is 12-33 % ahead of the three-consumer tile at N=2k and 4 % at 4k (d = 40,
#   48; d=64 within 0.6 %); at 8k the three consumers lead at d = 48 and 64 (4-5 %), d=40 within 1 %.
_WS_ORDER_BY_BUCKET: dict[str, dict[tuple[str, bool], list[KernelConfig]]] = {
    "short": {
        ("fwd", False): [KernelConfig(128, 128, 4, 2, **_WS, schedule=PERSISTENT)],
        ("fwd", True): [KernelConfig(128, 64, 4, stages, **_WS, schedule=PERSISTENT) for stages in (3, 2)],
        ("bwd_dkdv", True): [KernelConfig(64, 128, 4, stages, **_WS, schedule=PERSISTENT) for stages in (3, 2)],
    },
    "medium": {("fwd", True): [_PINGPONG]},
}
# Without a measurement: moderate tiles first (they ran within 10 % of the best in every H200 sweep), then smaller.
_FALLBACK = {
    "fwd": [
        KernelConfig(128, 64, 8, 3),
        KernelConfig(128, 64, 4, 2),
        KernelConfig(64, 64, 4, 2),
        KernelConfig(64, 32, 4, 2),
        KernelConfig(32, 32, 4, 2),
        KernelConfig(16, 16, 4, 1),
    ],
    "bwd_dkdv": [
        KernelConfig(32, 64, 4, 3),
        KernelConfig(32, 64, 4, 2),
        KernelConfig(32, 32, 4, 2),
        KernelConfig(16, 32, 4, 2),
        KernelConfig(16, 16, 4, 1),
    ],
    "bwd_dq": [
        KernelConfig(128, 64, 8, 3),
        KernelConfig(64, 64, 4, 2),
        KernelConfig(64, 32, 4, 2),
        KernelConfig(32, 32, 4, 2),
        KernelConfig(16, 16, 4, 1),
    ],
}
INTERPRETER_CONFIG = KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)


def pads_by_default(kernel: str, config: KernelConfig) -> bool:
    """Whether an untuned default of `kernel` in `config`'s form computes a head dim padded to fewer chunks where a
    pad changes them (KernelConfig.pad_head_dim; head_chunks.fewer_chunks: d=112 as one chunk of 128). Measured at
    d=112 on the H200 (N=8k, the whole backward or the forward): the dK/dV kernel with dQ fused in +3.3 % without a
    mask and +12 % causal, where its dQ reductions and staging come a chunk at a time; the forward +1.7 % and -1.9 %
    causal, the dQ kernel -2.6 % and +0.2 %, within what a config's place in a sweep moves it (docs/PERF.md, "Every
    head dim"). So only that form pads. Past d = 128 (H100, N=8k, d = 176, 224, 240) padding gained nothing in the
    split-roles dK/dV form, which has no dQ in it (−3.8 … +2.0 %), the forward (−4.3 … +0.3 %) or the dQ kernel
    (−6.2 … 0 %), so they keep the exact chunks. The tuner searches the switch for every kernel."""
    return kernel == "bwd_dkdv" and config.fused_dq


def default_config(
    head_dim: int,
    dtype: torch.dtype,
    *,
    causal: bool = False,
    kernel: str = "fwd",
    device: DeviceInfo | None = None,
    warp_specialized: bool = True,
    pad: bool | None = None,
    seqlen_bucket: str = "all",
) -> KernelConfig:
    """The config used before any tuning: the H200's measured best where it fits the device, else the largest
    moderate tile that does.

    Args:
        head_dim: per-head dimension d (1..256).
        dtype: element type of q/k/v.
        causal: causal masking (the best d=128 forward tile differs with it).
        kernel: "fwd", "bwd_dkdv" (one program per K/V tile: block_n rows owned, block_m Q rows streamed) or
            "bwd_dq" (one program per Q tile: block_m rows owned, block_n K/V rows streamed).
        device: the GPU to fit; default: the current CUDA device, else the H200 table entry. For
            device.INTERPRETER, small tiles that keep the CPU interpreter quick and let tests cross many tile
            boundaries at small sequence lengths.
        warp_specialized: False: a Triton-template config only (for inputs the warp-specialized kernels do not
            take).
        pad: at a head dim a pad changes (head_chunks.pads), try the warp-specialized shapes with the head dim padded
            to fewer chunks (KernelConfig.pad_head_dim) before any without (a length bucket's own forms, unpadded,
            still lead); None: for the shapes pads_by_default says.
        seqlen_bucket: the length bucket of the call (lengths.bucket_of): "short" and "medium" try the forms
            measured best at those lengths first (_WS_ORDER_BY_BUCKET), ahead of the padded ones (measured
            against them: d=112's short causal dK/dV).
    """
    planner.check_kernel(kernel)
    if seqlen_bucket not in lengths.SEQLEN_BUCKETS:
        raise ValueError(f"seqlen_bucket must be one of {lengths.SEQLEN_BUCKETS}, got {seqlen_bucket!r}")
    if device is INTERPRETER:
        return INTERPRETER_CONFIG
    if device is None:
        device = inspect_cached(torch.cuda.current_device()) if torch.cuda.is_available() else known_gpu("h200")
    masked = causal if kernel == "fwd" else False
    measured = _PREFERRED.get((kernel, head_dim, masked))
    if measured is None:  # the warp-specialized shapes by the model, then the Triton tiles of the power of two
        like = _PREFERRED.get((kernel, planner.head_dim_padded(head_dim), masked), [])
        measured = _WS_ORDER[kernel, masked] + [cfg for cfg in like if not cfg.warp_specialized]
    elif measured[0].warp_specialized:  # measured warp-specialized best; where it does not fit, the model's shapes
        ws = [cfg for cfg in measured if cfg.warp_specialized]
        measured = ws + _WS_ORDER[kernel, masked] + [cfg for cfg in measured if not cfg.warp_specialized]
    preferred = []
    if dtype != torch.float32:
        preferred = measured
        if head_chunks.pads(head_dim):
            padded = [cfg for cfg in preferred if cfg.warp_specialized and (pads_by_default(kernel, cfg)
                                                                              if pad is None else pad)]  # fmt: skip
            preferred = [replace(cfg, pad_head_dim=True) for cfg in padded] + preferred
        preferred = _WS_ORDER_BY_BUCKET.get(seqlen_bucket, {}).get((kernel, causal), []) + preferred
    for cfg in preferred + _FALLBACK[kernel]:
        if cfg.warp_specialized and not warp_specialized:
            continue
        if planner.check(cfg, device, head_dim, dtype, kernel) is None:
            return cfg
    raise ValueError(
        f"no {kernel} config fits {device.name} ({device.smem_per_block:,} B shared memory per block) "
        f"for head_dim {head_dim} {dtype}"
    )
