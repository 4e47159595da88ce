"""The `fa2tune` command: parse, call the library, print.

parser.py builds the command line; commands.py holds check, inspect, plan, codegen and show; tune_command.py the
tune; bench_command.py the benchmark; arguments.py the option values' checks; outputs.py where a tune writes;
common.py what they share, the command's messages (logging, to stderr) among them. Nothing here imports torch at
import time: `fa2tune tune` starts its helper processes before torch is imported (fa2tune.tune.processes).
"""

from __future__ import annotations

import sys

from ..config.types import DTYPE_CHOICES  # torch-free, as everything this package imports at its top
from .common import INTERRUPTED, USAGE_ERROR, configure_logging, end_progress_line
from .parser import build_parser, join_negative_values

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = join_negative_values(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    configure_logging(quiet=args.quiet)
    if args.command == "check":
        bad = [d for d in args.dtype.split(",") if d not in DTYPE_CHOICES]
        if bad:
            print(f"fa2tune: --dtype must be from {sorted(DTYPE_CHOICES)}, got {bad}", file=sys.stderr)
            return USAGE_ERROR
    try:
        return args.func(args)
    except BrokenPipeError:  # `fa2tune plan ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # Ctrl-C outside a tune's studies (`tune` says more of its own): no traceback
        end_progress_line()
        print("fa2tune: interrupted", file=sys.stderr)
        return INTERRUPTED
