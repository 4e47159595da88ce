#!/usr/bin/env python3
"""Where a tune's time went, read back from its Optuna storage: every timed trial of every study, in the order
they completed, with the process that timed it, how long it waited for the compile processes, how long its
measurement took (including building the config itself when the pool had not: built_here), and the gap since
that process's previous trial. A multi-GPU tune's journal is `<config-dir>/.studies/tune.journal`.

    python scripts/tune_timeline.py ~/.cache/fa2tune/configs/.studies/tune.journal
    python scripts/tune_timeline.py sqlite:///tune.db --study nvidia-h200/fwd/d128/bfloat16/causal

The per-process summary at the end (trials, seconds waiting, building, measuring, and idle between trials) says
whether a GPU sat waiting for compiles, built configs itself, or had nothing to do (docs/TUNING.md).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict


def _storage(url: str):
    import optuna

    if "://" in url:
        return url
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))


def timeline(study) -> list[tuple]:
    """(completed at, pid, number, wait s, measure s, built here, value, started at) of the study's timed trials,
    in order; started at (when the process turned to the trial: its wait began) is None in older records."""
    import optuna

    rows = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        timing = t.user_attrs.get("timing")
        if timing and t.datetime_complete is not None:
            rows.append((t.datetime_complete, timing["pid"], t.number, timing["wait_s"], timing["measure_s"],
                         timing["built_here"], t.value, timing.get("start")))  # fmt: skip
    return sorted(rows)


def gaps(rows: list[tuple]) -> dict[tuple[int, int, float], float]:
    """{(pid, trial number, started at): seconds from the process's previous timed trial's end, in any study, to
    this one's start} — asking Optuna, a finish, moving to another study, or nothing to do. A process's first
    trial, and records without a start, have none."""
    found, last_end = {}, {}
    for _, pid, number, wait_s, measure_s, _, _, started in sorted((r for r in rows if r[7] is not None),
                                                                  key=lambda r: r[7]):  # fmt: skip
        if pid in last_end:
            found[pid, number, started] = started - last_end[pid]
        last_end[pid] = started + wait_s + measure_s
    return found


def main(argv: list[str] | None = None) -> int:
    import optuna

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("storage", help="a journal file path or an Optuna storage URL")
    parser.add_argument("--study", default=None, help="one study's name (default: every study)")
    args = parser.parse_args(argv)
    storage = _storage(args.storage)
    names = [args.study] if args.study else [s.study_name for s in optuna.get_all_study_summaries(storage)]
    totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    studies = {name: rows for name in names if (rows := timeline(optuna.load_study(study_name=name, storage=storage)))}
    every = [row for rows in studies.values() for row in rows]
    first = min((row[0] for row in every), default=None)
    since_previous = gaps(every)
    for name, rows in studies.items():
        print(f"\n{name}: {len(rows)} timed trials")
        print(f"{'done at s':>9} {'pid':>7} {'trial':>5} {'wait s':>6} {'measure s':>9} {'built here':>10} {'ms':>8} "
              f"{'gap s':>6}")  # fmt: skip
        for done, pid, number, wait_s, measure_s, built_here, value, started in rows:
            at = (done - first).total_seconds()
            gap = since_previous.get((pid, number, started))
            print(f"{at:9.1f} {pid:7d} {number:5d} {wait_s:6.2f} {measure_s:9.2f} {'yes' if built_here else '':>10} "
                  f"{value:8.3f} {'' if gap is None else f'{gap:6.2f}':>6}")  # fmt: skip
            t = totals[pid]
            t["trials"] += 1
            t["wait_s"] += wait_s
            t["measure_s"] += measure_s
            t["built_here"] += built_here
            t["first"] = min(t.get("first", at - wait_s - measure_s), at - wait_s - measure_s)
            t["last"] = max(t.get("last", at), at)
    if not totals:
        print("no timed trials with timings in this storage (tuned before they were recorded?)", file=sys.stderr)
        return 1
    print(f"\n{'pid':>7} {'trials':>6} {'built here':>10} {'wait s':>7} {'measure s':>9} {'span s':>7} {'other s':>7}")
    for pid, t in sorted(totals.items()):
        span = t["last"] - t["first"]
        other = span - t["wait_s"] - t["measure_s"]  # asking Optuna, telling it, a finish, or nothing to do
        print(f"{pid:7d} {t['trials']:6.0f} {t['built_here']:10.0f} {t['wait_s']:7.1f} {t['measure_s']:9.1f} "
              f"{span:7.1f} {other:7.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
