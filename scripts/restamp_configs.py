#!/usr/bin/env python3
"""Restamp a tuned-config file's entries with the code hash of the current templates — after a template change
that a developer has checked leaves each entry's config the right one (configs are kept, not re-timed).

An entry records `template_hash`, the code hash of the rendered kernel it was tuned on (codegen.entry_code_hash);
when a template change alters that code the entry is stale and attention() skips it with a warning. A change that
keeps the winners (a comment-level rewrite of the code, an instruction removed from every config's step) would stale
the whole shipped file; this brings the hashes up to date instead of re-tuning everything. It rewrites only the
`template_hash:` lines (the rest of the file, its comments and order, is kept) and says which entries it touched:
the commit message and docs/PERF.md should say why their configs still hold. Without --write it only lists them.

    python scripts/restamp_configs.py tuned_configs/nvidia-h200.yaml            # which entries are stale
    python scripts/restamp_configs.py tuned_configs/nvidia-h200.yaml --write    # restamp them
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # rendering the templates needs no GPU

import yaml

from fa2tune.config import store
from fa2tune.kernels import codegen

_HASH_LINE = re.compile(r"^(\s*template_hash:\s*)(\S+)(\s*)$")


def restamp(path: Path, write: bool) -> list[str]:
    """Labels of the entries of `path` whose template_hash is not the current code's; rewritten if `write`."""
    _, entries = store.read_file(path)
    lines = path.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if _HASH_LINE.match(line)]
    if len(at) != len(entries):
        raise ValueError(f"{path}: {len(at)} template_hash lines for {len(entries)} entries; restamp by re-tuning")
    stale = []
    for i, entry in zip(at, entries, strict=True):
        current = codegen.entry_code_hash(entry.key, entry.config)
        if entry.template_hash != current:
            k = entry.key
            variants = "".join(f" {name}" for name in ("window", "varlen", "gqa") if getattr(k, name))
            stale.append(f"{k.kernel} d={k.head_dim} {k.dtype} causal={k.causal} {k.seqlen_bucket}{variants}: "
                         f"{entry.config.label()}")  # fmt: skip
            scalar = yaml.safe_dump(current).splitlines()[0]  # quoted where YAML would read a number
            prefix, _, suffix = _HASH_LINE.match(lines[i]).groups()
            lines[i] = prefix + scalar + suffix
    if write and stale:
        path.write_text("".join(lines))
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--write", action="store_true", help="rewrite the stale entries' template_hash lines")
    args = parser.parse_args(argv)
    stale = restamp(args.path, args.write)
    for label in stale:
        print(("restamped " if args.write else "stale ") + label)
    print(f"{len(stale)} of the file's entries {'restamped' if args.write else 'stale'}")
    if args.write and stale:
        # a restamp keeps configs that won under the old code; a change that moved some forms more than others can
        # leave them behind the untuned default (d=80's dK/dV entries were, by 4-11 %: docs/PERF.md)
        print(f"their configs are kept, not re-timed: check them against what calls would run without them on a GPU, "
              f"python scripts/audit_entries.py {args.path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
