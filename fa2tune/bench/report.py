"""Benchmark rows → the numbers and pictures people read: the CSV, geomean ratios against each baseline, TFLOP/s
plots, and the rows of several runs or files combined.

A row is a dict with the columns of COLUMNS (measure.py makes them). A CSV of the grid's older form (provider,
head_dim, seqlen, causal, mode, tflops and perhaps gqa) is read as the grid's rows: bf16, batch·N and heads·d of
shapes.GRID_TOKENS and shapes.GRID_WIDTH.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

from .shapes import GRID_TOKENS, GRID_WIDTH

COLUMNS = ("provider", "mode", "dtype", "batch", "heads", "heads_kv", "seqlen", "head_dim", "causal", "ms", "tflops",
           "rel_err", "note")  # fmt: skip
_INTS = ("batch", "heads", "heads_kv", "seqlen", "head_dim")
_FLOATS = ("ms", "tflops", "rel_err")
_READINGS = ("ms", "tflops")
# What makes two rows the same measurement (merge, median), and the same shape (ratios between providers).
_SHAPE = ("mode", "dtype", "batch", "heads", "heads_kv", "seqlen", "head_dim", "causal")


def rounded(value: float) -> float:
    """A row's number as written: one decimal from 10 up (TFLOP/s and milliseconds of a GPU), three significant
    digits below (errors, the interpreter's TFLOP/s)."""
    if math.isnan(value):
        return value
    return round(value, 1) if abs(value) >= 10 else float(f"{value:.3g}")


def complete(row: dict) -> dict:
    """row with the columns that the grid's older rows leave out filled in by the grid's rule; typed fields. A value
    that does not parse, or a length, head dim or head count below 1, raises ValueError naming the column."""
    row = dict(row)
    row["head_dim"], row["seqlen"] = _count(row, "head_dim"), _count(row, "seqlen")
    row.setdefault("dtype", "bf16")
    row.setdefault("batch", max(1, GRID_TOKENS // row["seqlen"]))
    row.setdefault("heads", max(1, GRID_WIDTH // row["head_dim"]))
    if "heads_kv" not in row:  # the grid's older rows: query heads over K/V heads as a ratio
        heads, gqa = _count(row, "heads"), _count(row, "gqa", default=1)
        if gqa > heads:
            raise ValueError(f"column gqa: expected at most the row's {heads} heads, got {gqa}")
        row["heads_kv"] = heads // gqa
    row.pop("gqa", None)
    for name in _INTS:
        row[name] = _count(row, name)
    row["causal"] = _flag(row.get("causal"), "causal")
    for name in _FLOATS:
        value = row.get(name, math.nan)
        try:
            number = float(value) if value not in ("", "nan", None) else math.nan
        except (TypeError, ValueError):
            raise ValueError(f"column {name}: expected a number, got {value!r}") from None
        # a timing that is not a finite number is no reading (an error may be inf: a provider's broken output)
        row[name] = math.nan if name in _READINGS and not math.isfinite(number) else number
    row.setdefault("note", "")
    return row


# How a CSV spells a row's mask (measure.py writes True / False; spreadsheets TRUE / FALSE)
_FLAG_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _flag(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if value is None:
        raise ValueError(f"column {name}: missing (a short row)")
    word = _FLAG_WORDS.get(str(value).strip().lower())
    if word is None:
        raise ValueError(f"column {name}: expected True or False, got {value!r}")
    return word


def _count(row: dict, name: str, default: int | None = None) -> int:
    """row[name] as an int of at least 1 (default where the column is absent or empty, if given)."""
    value = row.get(name)
    if value in (None, "") and default is not None:
        return default
    if value is None and name in row:  # csv.DictReader fills a short row's missing columns with None
        raise ValueError(f"column {name}: missing (a short row)")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"column {name}: expected a whole number, got {value!r}") from None
    if number < 1:
        raise ValueError(f"column {name}: expected at least 1, got {number}")
    return number


# The columns a benchmark CSV cannot do without (complete fills in the grid's others)
REQUIRED_COLUMNS = ("provider", "mode", "seqlen", "head_dim", "causal")


def csv_problem(path: str | Path) -> str | None:
    """Why `path` is not a benchmark CSV that read_rows reads, or None."""
    path = Path(path)
    if not path.is_file():
        return "no such file" if not path.exists() else "not a file"
    try:
        with open(path, newline="") as handle:
            header = next(csv.reader(handle), [])
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read ({exc})"
    missing = [name for name in REQUIRED_COLUMNS if name not in header]
    if missing:
        return f"not a benchmark CSV (no {', '.join(missing)} column)"
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        for row in reader:
            try:
                complete(row)
            except ValueError as exc:
                return f"line {reader.line_num}: {exc}"  # the row's last line, where a quoted note spans several
    return None


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a benchmark CSV, completed and typed (complete)."""
    with open(path) as handle:
        return [complete(row) for row in csv.DictReader(handle)]


def write_rows(rows: Iterable[dict], path: str | Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(complete(row) for row in rows)


def shape_key(row: dict) -> tuple:
    """The shape a row measured: (mode, dtype, batch, heads, heads_kv, seqlen, head_dim, causal)."""
    row = complete(row)
    return tuple(row[name] for name in _SHAPE)


def _key(row: dict) -> tuple:
    return (row["provider"], *shape_key(row))


def median_of_runs(runs: list[list[dict]]) -> list[dict]:
    """One row per measurement of several runs of the same shapes, its tflops and ms the medians of the runs'
    numbers (NaN readings left out; NaN if every run had one), in the first run's order.

    Why: a training call at N <= 512 waits for its host, and its readings differ between processes by up to 35 %;
    one process's reading is a draw, the median of several is the row."""
    readings: dict[tuple, list[dict]] = {}
    first: dict[tuple, dict] = {}
    for run in runs:
        for row in map(complete, run):
            first.setdefault(_key(row), row)
            if not math.isnan(row["tflops"]):
                readings.setdefault(_key(row), []).append(row)
    out = []
    for key, row in first.items():
        got = readings.get(key, [])
        middle = {name: rounded(statistics.median(r[name] for r in got)) if got else math.nan
                  for name in ("tflops", "ms")}  # fmt: skip
        out.append({**row, **middle, **({"note": ""} if got else {})})
    return out


def merge_rows(base: list[dict], new: list[dict]) -> list[dict]:
    """base with every row that new also has replaced by new's (the same provider and shape), in base's order;
    new's other rows after them. How a re-measured part of the grid goes into docs/bench/<gpu>.csv."""
    by_key = {_key(row): row for row in new}
    merged = [by_key.pop(_key(row), row) for row in base]
    return merged + [row for row in new if _key(row) in by_key]


def ratios(rows: list[dict], provider: str, baseline: str, mode: str) -> dict[tuple, float]:
    """provider / baseline TFLOP/s for every shape of `mode` where both have a number, by shape (the _SHAPE
    fields without mode)."""
    table = {_key(r): r["tflops"] for r in map(complete, rows) if r["mode"] == mode}
    out = {}
    for (name, *shape), value in table.items():
        base = table.get((baseline, *shape))
        if name == provider and base and not math.isnan(value) and not math.isnan(base):
            out[tuple(shape[1:])] = value / base
    return out


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def shape_words(shape: tuple) -> str:
    """A ratios() key in words: d, N, the mask, and the dtype, batch and heads where they are not the grid's."""
    dtype, batch, heads, heads_kv, seqlen, head_dim, causal = shape
    words = f"d={head_dim} N={seqlen} causal={causal}"
    if (dtype, batch, heads, heads_kv) != ("bf16", max(1, GRID_TOKENS // seqlen), max(1, GRID_WIDTH // head_dim),
                                           max(1, GRID_WIDTH // head_dim)):  # fmt: skip
        words += f" {dtype} B={batch} H={heads}" + (f"/{heads_kv}" if heads_kv != heads else "")
    return words


def summary(rows: list[dict], provider: str = "fa2tune") -> list[str]:
    """One line per (mode, baseline): geomean ratio, worst shape, and how many shapes are below 1."""
    lines = []
    rows = [complete(r) for r in rows]
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
                f"worst {r[worst]:.2f}x at {shape_words(worst)}; below 1x: {below}"
            )
    return lines


def can_plot() -> bool:
    """Whether matplotlib is installed (the `bench` extra): the plots need it, nothing else does."""
    return importlib.util.find_spec("matplotlib") is not None
