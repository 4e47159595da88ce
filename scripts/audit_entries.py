#!/usr/bin/env python3
"""Time a tuned-config file's entries against what their calls would run without them, on this GPU, and say which
to re-tune.

An entry keeps the config that won under the templates of its tune. A template change that speeds up some forms
more than others — or a restamp (restamp_configs.py) after a change that did not keep every ranking — can leave an
entry slower than the planner's default for its key (or, for a length bucket's entry, than the "all" entry). Each
selected entry and its fallback are compiled at once, then timed in turn (the fastest of --rounds readings each) at
the lengths a tune of the key would time, as the tuner times them; an entry behind its fallback by more than
--threshold is marked "re-tune": `fa2tune tune --head-dim D --dtype T --kernel K --causal yes|no` (with
`--seqlen-bucket B` for a bucket's entry, `--varlen` for a packed-sequence one, `--heads H --kv-heads G` for a
grouped-query one, timed at the heads it records) rewrites it. Exit status 1 where an entry is behind or a config
failed.

    python scripts/audit_entries.py tuned_configs/nvidia-h200.yaml --kernel bwd_dkdv --dtype bf16
    python scripts/audit_entries.py tuned_configs/nvidia-h200.yaml --head-dim 80,96 --bucket all

Run it on the GPU the file is for, or one of the same chip (an H100 SXM reads the H200's entries) — except for the
short bucket's backward entries, which a tune times inside the whole training call, where the host's speed is part
of the time: audit those on the host that tuned them. Band-mask and decode entries are not timed, nor grouped-query
entries that record no heads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _ints(text: str) -> set[int]:
    return {int(part) for part in text.split(",")}


def _words(text: str) -> set[str]:
    return {part.strip() for part in text.split(",")}


def _choices() -> dict[str, tuple[str, ...]]:
    """The values each word filter takes."""
    from fa2tune.config.lengths import SEQLEN_BUCKETS
    from fa2tune.config.types import DTYPE_CHOICES, KERNELS

    return {"kernel": KERNELS, "dtype": DTYPE_CHOICES, "bucket": SEQLEN_BUCKETS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path, help="the tuned-config file (tuned_configs/<gpu>.yaml)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--kernel", type=_words, help="fwd, bwd_dkdv, bwd_dq (comma-separated; default all)")
    parser.add_argument("--head-dim", type=_ints, help="comma-separated head dims (default all)")
    parser.add_argument("--dtype", type=_words, help="bf16, fp16, fp32 (comma-separated; default all)")
    parser.add_argument("--bucket", type=_words, help="all, short, medium (comma-separated; default all three)")
    parser.add_argument("--rounds", type=int, default=2, help="readings of each config, taken in turn (default 2)")
    parser.add_argument("--threshold", type=float, default=0.03,
                        help="re-tune an entry slower than its fallback by more than this fraction (default 0.03)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (0: none)")
    args = parser.parse_args(argv)
    for name, allowed in _choices().items():
        unknown = sorted((getattr(args, name) or set()) - set(allowed))
        if unknown:
            parser.error(f"--{name}: each of {allowed}, got {', '.join(map(repr, unknown))}")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    if not args.file.is_file():
        parser.error(f"file: no such file {str(args.file)!r}")
    from fa2tune.config import store

    try:
        store.read_file(args.file)
    except (OSError, ValueError) as error:
        parser.error(f"file: {args.file} is not a tuned-config file: {error}")
    if not args.device.startswith("cuda"):
        parser.error(f"--device: a CUDA device (cuda or cuda:N), got {args.device!r}; timings on the CPU mean nothing")

    import torch

    if not torch.cuda.is_available():
        print("audit_entries.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from fa2tune.tune import audit

    def show(row):
        print(audit.report([row], args.threshold).splitlines()[1], flush=True)

    print(audit.report([], args.threshold), flush=True)
    rows = audit.audit(args.file, args.device, kernels=args.kernel, head_dims=args.head_dim, dtypes=args.dtype,
                       buckets=args.bucket, rounds=args.rounds, compile_workers=args.jobs, on_row=show)  # fmt: skip
    behind = [row for row in rows if row.behind(args.threshold)]
    failed = [row for row in rows if row.failed]
    print(f"{len(rows)} entries, {len(behind)} behind their fallback by more than {args.threshold:.0%}, "
          f"{len(failed)} failed", flush=True)  # fmt: skip
    return 1 if behind or failed else 0


if __name__ == "__main__":
    sys.exit(main())
