#!/usr/bin/env python3
"""Prefixes each line of stdin with the seconds since it started, splitting at \\r as well as \\n (so each update of
a progress line gets its time), and prints the total at the end. Used by scripts/time-tune.sh."""

from __future__ import annotations

import sys
import time


def main() -> int:
    start, line = time.time(), b""

    def emit(text: bytes) -> None:
        if text.strip():
            print(f"[{time.time() - start:7.1f}] {text.decode(errors='replace')}", flush=True)

    while chunk := sys.stdin.buffer.read(1):
        if chunk in (b"\r", b"\n"):
            emit(line)
            line = b""
        else:
            line += chunk
    emit(line)
    print(f"[{time.time() - start:7.1f}] END", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
