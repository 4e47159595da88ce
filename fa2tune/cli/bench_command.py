"""`fa2tune bench`: the shapes the flags or a preset ask for, measured for every provider (fa2tune.bench), then a
table (or JSON) on stdout, a CSV and plots where asked, and a line of progress per shape on stderr."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..bench import report
from ..bench.shapes import PRESETS, Shape, cpu_problem
from .common import fail, log, note_interpreter, resolve_device, to_json
from .outputs import write_problem

_CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True)}


def bench(args: argparse.Namespace) -> int:
    """Measures (or reads --from-csv) the rows, writes what was asked, prints the table or the JSON."""
    plots = _plots_folder(args.plots)
    _check_files(args)
    if args.from_csv:
        rows, environment, skipped = report.read_rows(args.from_csv), {}, {}
        title = Path(args.from_csv).stem.replace("-", " ").upper()
    else:
        shapes = _shapes(args)
        device = resolve_device(args.device)
        if device == "cpu" and (problem := cpu_problem(shapes)):
            fail(problem)
        from ..bench import measure, providers

        chosen, skipped = providers.select(list(args.providers) if args.providers else None, device)
        for name, why in skipped.items():
            log.info("note: %s skipped: %s", name, why)
        if not chosen:
            fail("none of the providers asked for can run here (" + "; ".join(f"{n}: {w}" for n, w in skipped.items())
                 + ")")  # fmt: skip
        note_interpreter(device)
        environment = measure.environment(device)
        log.info("%d shapes x %d providers on %s", len(shapes), len(chosen), environment["device"])
        if args.processes > 1:
            rows = _in_processes(args, [p.name for p in chosen], device)
        else:
            rows = measure.measure(shapes, chosen, device, rounds=args.rounds)
        title = f"{environment['device']} {shapes[0].dtype}"
    _write(args, rows, plots, title)
    if args.json:
        print(to_json({"environment": environment, "skipped": skipped, "rows": rows, "summary": report.summary(rows)}))
    else:
        _print_table(rows, environment)
    return 0


def _check_files(args: argparse.Namespace) -> None:
    """Exits 2 before any measurement where a file the bench reads or writes would fail or lose rows after it:
    --from-csv and an existing --merge-into must be benchmark CSVs, --csv and --merge-into writable files."""
    if args.from_csv and (problem := report.csv_problem(args.from_csv)):
        fail(f"--from-csv {args.from_csv}: {problem}")
    for flag, path in (("--csv", args.csv), ("--merge-into", args.merge_into)):
        if not path:
            continue
        if problem := write_problem(Path(path), []):  # the tune's check: tried, not guessed
            fail(f"{flag} {path}: {problem}")
        if flag == "--merge-into" and os.path.exists(path) and (problem := report.csv_problem(path)):
            fail(f"--merge-into {path}: {problem}; its rows would be lost")


def _shapes(args: argparse.Namespace) -> list[Shape]:
    """The preset's sweep (grid by default) with every shape flag given put in; exits 2 with the flag at fault."""
    sweep = PRESETS[args.preset or "grid"].override(
        batch=args.batch, heads=args.heads, heads_kv=args.kv_heads, seqlens=args.seqlen, head_dims=args.head_dim,
        causal=_CAUSAL.get(args.causal), modes=args.mode, dtype=args.dtype,
    )  # fmt: skip
    try:
        return sweep.shapes()
    except ValueError as exc:
        fail(str(exc))


def _plots_folder(folder: str | None) -> str | None:
    """--plots, or None with a note when matplotlib is not installed (checked before anything is measured)."""
    if folder and not report.can_plot():
        log.warning("--plots %s: matplotlib is not installed (pip install 'fa2tune[bench]'); no plots are written",
                    folder)  # fmt: skip
        return None
    return folder


def _write(args: argparse.Namespace, rows: list[dict], plots: str | None, title: str) -> None:
    if args.csv:
        report.write_rows(rows, args.csv)
        log.info("wrote %s", args.csv)
    if args.merge_into:
        base = report.read_rows(args.merge_into) if os.path.exists(args.merge_into) else []
        report.write_rows(report.merge_rows(base, rows), args.merge_into)
        log.info("merged %d rows into %s", len(rows), args.merge_into)
    if plots:
        from ..bench import plots as plotting

        for path in plotting.write_plots(rows, plots, title):
            log.info("wrote %s", path)


def _in_processes(args: argparse.Namespace, names: list[str], device: str) -> list[dict]:
    """The same shapes measured by args.processes fresh `fa2tune bench` processes in turn; each row's median."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.processes):
            path = os.path.join(folder, f"run{index}.csv")
            log.info("process %d of %d", index + 1, args.processes)
            command = [sys.executable, "-m", "fa2tune", *child_arguments(args, names, device), "--csv", path]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            runs.append(report.read_rows(path))
    log.info("each row: the median of %d processes", args.processes)
    return report.median_of_runs(runs)


# The flags that choose the shapes, by their argparse names: a fresh process gets those given, as given.
_SHAPE_FLAGS = {"preset": "--preset", "batch": "--batch", "heads": "--heads", "kv_heads": "--kv-heads",
                "seqlen": "--seqlen", "head_dim": "--head-dim", "causal": "--causal", "dtype": "--dtype",
                "mode": "--mode"}  # fmt: skip


def child_arguments(args: argparse.Namespace, names: list[str], device: str) -> list[str]:
    """The command line of one of --processes' fresh processes: this one's shapes, device and providers, and no
    output but the CSV its caller adds."""
    flags = [*(["--quiet"] if args.quiet else []), "bench", "--device", device, "--providers", ",".join(names),
             "--rounds", str(args.rounds)]
    for dest, flag in _SHAPE_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            flags += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return flags


def _print_table(rows: list[dict], environment: dict) -> None:
    """A line per shape, TFLOP/s per provider ('-': no number; the notes say why), then the geomean summary."""
    if environment:
        print("# " + "  ".join(f"{key} {value}" for key, value in environment.items()))
    names = list(dict.fromkeys(r["provider"] for r in rows))
    by_shape: dict[tuple, dict[str, dict]] = {}
    for row in map(report.complete, rows):
        by_shape.setdefault(report.shape_key(row), {})[row["provider"]] = row
    print(f"{'mode':>8} {'dtype':>5} {'B':>5} {'H':>7} {'N':>6} {'d':>4} {'causal':>6} "
          + " ".join(f"{name:>15}" for name in names))  # fmt: skip
    for shape, cells in by_shape.items():
        mode, dtype, batch, heads, heads_kv, seqlen, head_dim, causal = shape
        h = f"{heads}" if heads == heads_kv else f"{heads}/{heads_kv}"
        values = [cells.get(name, {}).get("tflops", float("nan")) for name in names]
        print(f"{mode:>8} {dtype:>5} {batch:>5} {h:>7} {seqlen:>6} {head_dim:>4} {causal!s:>6} "
              + " ".join(f"{v:>15g}" if v == v else f"{'-':>15}" for v in values))  # fmt: skip
    notes = [r for r in map(report.complete, rows) if r["note"]]
    if notes:
        print("\nno number:")
        for r in notes:
            print(f"  {r['provider']} {r['mode']} d={r['head_dim']} N={r['seqlen']} causal={r['causal']}: {r['note']}")
    summary = report.summary(rows)
    if summary:
        print("\n" + "\n".join(summary))
