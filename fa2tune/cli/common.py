"""What every command shares: exit codes, the one-line failure, and the device a command runs on."""

from __future__ import annotations

import os
import sys

USAGE_ERROR = 2  # a bad argument, or a device or directory the command cannot use: nothing was done
INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT


def fail(message: str):
    """Ends the command with a one-line reason on stderr and the usage-error exit code."""
    print(f"fa2tune: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def resolve_device(name: str) -> str:
    """Returns a usable device string or exits with code 2 and a one-line reason."""
    import torch

    if name == "cpu":
        # Triton reads TRITON_INTERPRET when it builds each @jit function, its own library's included, so the
        # choice must come before triton is imported; fa2tune itself imports triton only when a kernel runs.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
            fail("--device cpu needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        return "cpu"
    if not torch.cuda.is_available():
        fail(f"no CUDA device is visible (asked for {name}); use --device cpu to run through Triton's interpreter")
    count = torch.cuda.device_count()
    if int(name.partition(":")[2] or 0) >= count:
        fail(f"--device {name} does not exist: {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})")
    return name


def note_interpreter(device: str) -> None:
    if device == "cpu":
        print("note: --device cpu runs the kernels through Triton's interpreter: right answers, no speed.",
              file=sys.stderr)  # fmt: skip


def device_info(args):
    """The DeviceInfo for --gpu NAME (the known-GPU table) or --device cuda:N (the card); exits 2 without one."""
    from ..config import device

    if getattr(args, "gpu", None):
        try:
            return device.known_gpu(args.gpu)
        except ValueError as exc:
            print(f"fa2tune: {exc}", file=sys.stderr)
            sys.exit(USAGE_ERROR)
    try:
        return device.inspect(args.device)
    except (RuntimeError, ValueError) as exc:
        print(
            f"fa2tune: {exc}; use --gpu NAME to plan for a known GPU ({', '.join(sorted(device.KNOWN_GPUS))})",
            file=sys.stderr,
        )
        sys.exit(USAGE_ERROR)
