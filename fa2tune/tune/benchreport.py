"""Benchmark rows → the numbers and pictures people read: geomean ratios against a baseline, and TFLOP/s plots.

A row is a dict with the columns of docs/bench/<gpu>.csv: provider, head_dim, seqlen, causal, mode, tflops.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

COLUMNS = ("provider", "head_dim", "seqlen", "causal", "mode", "tflops")


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a benchmark CSV with typed fields (extra columns are kept as strings)."""
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        row["head_dim"], row["seqlen"] = int(row["head_dim"]), int(row["seqlen"])
        row["causal"] = row["causal"] in ("True", "true", "1", "yes")
        row["tflops"] = float(row["tflops"]) if row["tflops"] not in ("", "nan") else math.nan
    return rows


def write_rows(rows: Iterable[dict], path: str | Path) -> None:
    """COLUMNS, and a gqa column (query heads per K/V head) when the rows measured grouped-query attention."""
    rows = list(rows)
    columns = COLUMNS + (("gqa",) if any("gqa" in row for row in rows) else ())
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _key(row: dict) -> tuple:
    return row["provider"], row["head_dim"], row["seqlen"], row["causal"], row["mode"]


def median_of_runs(runs: list[list[dict]]) -> list[dict]:
    """One row per (provider, head_dim, seqlen, causal, mode) of several runs of the same grid, its tflops the median
    of the runs' numbers (NaN readings left out; NaN if every run had one), in the first run's order.

    Why: a training call at N <= 512 waits for its host, and its readings differ between processes by up to 35 %;
    one process's reading is a draw, the median of several is the row."""
    readings: dict[tuple, list[float]] = {}
    first: dict[tuple, dict] = {}
    for run in runs:
        for row in run:
            first.setdefault(_key(row), row)
            if not math.isnan(row["tflops"]):
                readings.setdefault(_key(row), []).append(row["tflops"])
    return [{**row, "tflops": round(statistics.median(readings[key]), 1) if key in readings else math.nan}
            for key, row in first.items()]  # fmt: skip


def merge_rows(base: list[dict], new: list[dict]) -> list[dict]:
    """base with every row that new also has replaced by new's (same provider, head_dim, seqlen, causal, mode), in
    base's order; new's other rows after them. How a re-measured part of the grid goes into docs/bench/<gpu>.csv."""
    by_key = {_key(row): row for row in new}
    merged = [by_key.pop(_key(row), row) for row in base]
    return merged + [row for row in new if _key(row) in by_key]


def ratios(rows: list[dict], provider: str, baseline: str, mode: str) -> dict[tuple[int, int, bool], float]:
    """provider / baseline TFLOP/s for every (head_dim, seqlen, causal) of `mode` where both have a number."""
    table = {(r["provider"], r["head_dim"], r["seqlen"], r["causal"]): r["tflops"] for r in rows if r["mode"] == mode}
    out = {}
    for (name, head_dim, seqlen, causal), value in table.items():
        base = table.get((baseline, head_dim, seqlen, causal))
        if name == provider and base and not math.isnan(value) and not math.isnan(base):
            out[(head_dim, seqlen, causal)] = value / base
    return out


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(rows: list[dict], provider: str = "fa2tune") -> list[str]:
    """One line per (mode, baseline): geomean ratio, worst shape, and how many shapes are below 1."""
    lines = []
    baselines = sorted({r["provider"] for r in rows} - {provider})
    for mode in sorted({r["mode"] for r in rows}):
        for baseline in baselines:
            r = ratios(rows, provider, baseline, mode)
            if not r:
                continue
            worst = min(r, key=r.get)
            below = sum(v < 1 for v in r.values())
            lines.append(
                f"{mode:>8} vs {baseline:<15} geomean {geomean(r.values()):.2f}x over {len(r)} shapes; "
                f"worst {r[worst]:.2f}x at d={worst[0]} N={worst[1]} causal={worst[2]}; below 1x: {below}"
            )
    return lines


def write_plots(rows: list[dict], outdir: str | Path, title: str = "") -> list[Path]:
    """One PNG per (head_dim, mode): TFLOP/s against N, a line per provider (dashed: causal)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for head_dim in sorted({r["head_dim"] for r in rows}):
        for mode in sorted({r["mode"] for r in rows}):
            group = [r for r in rows if r["head_dim"] == head_dim and r["mode"] == mode]
            if not group:
                continue
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for i, provider in enumerate(sorted({r["provider"] for r in group})):
                for causal in (False, True):
                    points = sorted((r["seqlen"], r["tflops"]) for r in group
                                    if r["provider"] == provider and r["causal"] == causal)  # fmt: skip
                    if points:
                        xs, ys = zip(*points, strict=True)
                        ax.plot(xs, ys, marker="o", color=f"C{i}", linestyle="--" if causal else "-",
                                label=f"{provider}{' causal' if causal else ''}")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length N (batch·N = 16k tokens)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{title} d={head_dim} {mode}".strip())
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            path = outdir / f"d{head_dim}-{mode.replace('+', '_')}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written
