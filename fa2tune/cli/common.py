"""What every command shares: exit codes, the one-line failure, its messages, and the device a command runs on.

A command's result (a table, JSON) goes to stdout; its notes and progress go through logging, to the "fa2tune"
logger, which `configure_logging` sends to stderr (`--quiet`: warnings only). A program that calls the library sees
those loggers' records only if it configures logging itself.
"""

from __future__ import annotations

import logging
import os
import re
import sys

# Triton release -> the first numpy release its interpreter fails on (Triton 3.6: "only 0-dimensional arrays can be
# converted to Python scalars" under numpy 2.4). The `cpu` and `test` extras of pyproject.toml pin numpy below it.
INTERPRETER_NUMPY_LIMITS = {(3, 6): (2, 4)}
USAGE_ERROR = 2  # a bad argument, or a device or directory the command cannot use: nothing was done
INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT
log = logging.getLogger("fa2tune.cli")


class _Messages(logging.Handler):
    """The command's messages on stderr, looked up per message (a redirected or captured stderr gets them). A
    progress record (`progress`) on a terminal rewrites one line; the next message ends it. Elsewhere (a log
    file) each progress record is a line of its own."""

    line_open = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message, stream = self.format(record), sys.stderr
            if getattr(record, "progress", False) and stream.isatty():
                stream.write(f"\r{message}\x1b[K")  # \x1b[K: clear what a longer earlier line left
                _Messages.line_open = True
            else:
                end_progress_line()
                stream.write(message + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        return message if record.levelno < logging.WARNING else f"fa2tune: {record.levelname.lower()}: {message}"


def to_json(data) -> str:
    """JSON text of data, NaN and infinities written as null (JSON has no NaN; Python's json would write it)."""
    import json
    import math

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [clean(item) for item in value]
        return value

    return json.dumps(clean(data), indent=2, allow_nan=False)


def configure_logging(quiet: bool = False) -> None:
    """The "fa2tune" logger's records to stderr, INFO and up (quiet: WARNING and up); once, however often called."""
    logger = logging.getLogger("fa2tune")
    for handler in [h for h in logger.handlers if isinstance(h, _Messages)]:
        logger.removeHandler(handler)
    handler = _Messages()
    handler.setFormatter(_Format())
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def progress(message: str) -> None:
    """A progress line: rewritten in place on a terminal, one line each in a log."""
    log.info(message, extra={"progress": True})


def end_progress_line() -> None:
    """Ends a progress line left open on the terminal, so that what comes next starts on a line of its own."""
    if _Messages.line_open:
        sys.stderr.write("\n")
        _Messages.line_open = False


def fail(message: str):
    """Ends the command with a one-line reason on stderr and the usage-error exit code."""
    end_progress_line()
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
        if problem := interpreter_problem():
            fail(problem)
        os.environ["TRITON_INTERPRET"] = "1"
        return "cpu"
    if not torch.cuda.is_available():
        fail(f"no CUDA device is visible (asked for {name}); use --device cpu to run through Triton's interpreter")
    count = torch.cuda.device_count()
    if int(name.partition(":")[2] or 0) >= count:
        fail(f"--device {name} does not exist: {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})")
    return name


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run with the installed numpy (INTERPRETER_NUMPY_LIMITS), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton, numpy = version("triton"), version("numpy")
    except PackageNotFoundError:
        return None  # no numpy: the interpreter says so itself when it imports it
    limit = INTERPRETER_NUMPY_LIMITS.get(_release(triton))
    if limit is None or _release(numpy) < limit:
        return None
    below = ".".join(map(str, limit))
    return (f"--device cpu runs Triton's interpreter, which in Triton {triton} fails on numpy {numpy}; install "
            f"numpy<{below} (pip install 'numpy<{below}', or the cpu extra: pip install 'fa2tune[cpu]')")


def _release(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string: '3.6.0' -> (3, 6), '2.4.0rc1' -> (2, 4)."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def note_interpreter(device: str) -> None:
    if device == "cpu":
        log.info("note: --device cpu runs the kernels through Triton's interpreter: right answers, no speed.")


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
