"""What the GPU has: read from the card (inspect), or from a table of known GPUs for planning without one."""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

from .types import DeviceInfo

if TYPE_CHECKING:  # torch is imported where a card is read: the CLI parser lists KNOWN_GPUS before any import
    import torch

_KIB = 1024
_MIB = 1024 * 1024


def slugify(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'; 'NVIDIA A100-SXM4-80GB' -> 'nvidia-a100-sxm4-80gb'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _known(name: str, cc: tuple[int, int], sms: int, smem_block_kib: int, smem_sm_kib: int, l2_mib: float, doc: str):
    return DeviceInfo(
        name=name,
        slug=slugify(name),
        capability=cc,
        sm_count=sms,
        smem_per_block=smem_block_kib * _KIB,
        smem_per_sm=smem_sm_kib * _KIB,
        regs_per_sm=65536,
        l2_bytes=int(l2_mib * _MIB),
        source=doc,
    )


# Figures from NVIDIA's CUDA C++ Programming Guide (shared memory per SM / per block opt-in by compute capability:
# 8.0: 164/163 KiB, 8.6 and 8.9: 100/99 KiB, 9.0: 228/227 KiB; 64K registers per SM) and each product's
# datasheet or architecture whitepaper (SM count, L2). The H200 row's SM count and limits were also read off the
# card here (docs/PERF.md).
_GUIDE = "CUDA C++ Programming Guide (compute capabilities) + product datasheet"
KNOWN_GPUS: dict[str, DeviceInfo] = {
    "a100-40gb": _known("NVIDIA A100-SXM4-40GB", (8, 0), 108, 163, 164, 40, _GUIDE),
    "a100-80gb": _known("NVIDIA A100-SXM4-80GB", (8, 0), 108, 163, 164, 40, _GUIDE),
    "h100-sxm": _known("NVIDIA H100 80GB HBM3", (9, 0), 132, 227, 228, 50, _GUIDE),
    "h100-pcie": _known("NVIDIA H100 PCIe", (9, 0), 114, 227, 228, 50, _GUIDE),
    "h200": _known("NVIDIA H200", (9, 0), 132, 227, 228, 60, _GUIDE + "; read off the card"),
    "l4": _known("NVIDIA L4", (8, 9), 58, 99, 100, 48, _GUIDE),
    "l40s": _known("NVIDIA L40S", (8, 9), 142, 99, 100, 96, _GUIDE),
    "a10g": _known("NVIDIA A10G", (8, 6), 80, 99, 100, 6, _GUIDE),
    "rtx-3090": _known("NVIDIA GeForce RTX 3090", (8, 6), 82, 99, 100, 6, _GUIDE),
    "rtx-4090": _known("NVIDIA GeForce RTX 4090", (8, 9), 128, 99, 100, 72, _GUIDE),
}


# The Triton interpreter as a pseudo-device, so the tune → store → run pipeline also works on a CPU (for tests).
INTERPRETER = DeviceInfo(
    name="Triton interpreter (CPU)", slug="cpu-interpreter", capability=(0, 0), sm_count=1,
    smem_per_block=1 << 30, smem_per_sm=1 << 30, regs_per_sm=1 << 30, l2_bytes=0, source="interpreter",
)  # fmt: skip


def known_gpu(name: str) -> DeviceInfo:
    """Looks up the table by key ('h200') or slug ('nvidia-h200'); unknown names list the choices."""
    key = name.lower()
    if key in KNOWN_GPUS:
        return KNOWN_GPUS[key]
    for info in KNOWN_GPUS.values():
        if info.slug == key:
            return info
    raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(KNOWN_GPUS))}")


def inspect(device: str | torch.device = "cuda:0") -> DeviceInfo:
    """Reads a CUDA device's properties.

    Raises:
        RuntimeError: no CUDA device is visible, or the index does not exist.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device such as 'cuda:0', got {str(device)!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"device cuda:{index} does not exist; {torch.cuda.device_count()} CUDA device(s) visible")
    props = torch.cuda.get_device_properties(index)
    import triton  # only here: importing fa2tune must not import triton (see launcher)

    return DeviceInfo(
        name=props.name,
        slug=slugify(props.name),
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        smem_per_block=int(getattr(props, "shared_memory_per_block_optin", 0)),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0)),
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536)),
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
        source="card",
        triton_version=triton.__version__,
        torch_version=str(torch.__version__),
    )


@functools.cache
def inspect_cached(index: int) -> DeviceInfo:
    """inspect(f"cuda:{index}"), read once per process: the card does not change under a running program."""
    return inspect(f"cuda:{index}")


def device_info(device: torch.device | str) -> DeviceInfo:
    """The DeviceInfo for a tensor's device: the card's reading (cached), or the interpreter pseudo-device."""
    import torch

    from .inputs import interpreting

    device = torch.device(device)
    if device.type == "cpu" or interpreting():
        return INTERPRETER
    return inspect_cached(device.index if device.index is not None else torch.cuda.current_device())


# Dense bf16/fp16 tensor-core FLOP per clock per SM, by compute capability, from NVIDIA's whitepapers (A100 312
# TFLOP/s = 108 SMs × 1.41 GHz × 2048; H100 SXM 989 = 132 × 1.83 GHz × 4096; Ada and GA10x: 1024 at most).
_TENSOR_FLOP_PER_CLOCK_PER_SM = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096}
_CLOCK_CEILING_HZ = 2.6e9  # above any boost clock of these parts: the bound must never reject a real timing


def tflops_ceiling(info: DeviceInfo) -> float | None:
    """TFLOP/s no attention kernel can exceed on this GPU (its tensor cores at an impossible clock), or None for
    an unknown architecture. A timing above it measured something other than the kernel — e.g. events recorded on
    another GPU than the one that ran it."""
    per_clock = _TENSOR_FLOP_PER_CLOCK_PER_SM.get(tuple(info.capability))
    return None if per_clock is None else info.sm_count * per_clock * _CLOCK_CEILING_HZ / 1e12
