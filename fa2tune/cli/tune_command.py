"""`fa2tune tune`: the tuning lengths and studies the arguments ask for, run on one GPU or several, each winner
written to the GPU's config file, and a report of what each study found (`--kernel decode`: decode_tune_command).

This module is imported with the parser, before torch: `tune` starts the fork server that imports torch for its
helper processes first (fa2tune.tune.processes), so everything heavy is imported inside the functions.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..bench.shapes import GRID_WIDTH
from ..config.decode_config import DECODE_KERNEL
from . import arguments
from .common import end_progress_line, fail, log, note_interpreter, progress, resolve_device, to_json
from .decode_tune_command import tune_decode
from .outputs import check_writable, config_destination, interrupted


def tune(args: argparse.Namespace) -> int:
    """`fa2tune tune`: one study per kernel and mask asked, on one GPU or shared by several, each winner written
    to <config dir>/<gpu>.yaml; then a table of what each study found."""
    if args.device[0] != "cpu":
        # Before this process imports torch: the fork server that starts the workers and compile processes imports
        # torch, triton and fa2tune meanwhile (fa2tune.tune.processes), not after.
        from ..tune import processes

        processes.start_early()
    # Every argument is checked before anything is timed: a bad one ends the command with one line, exit code 2.
    seqlens = _tuning_lengths(args.seqlens, args.seqlen_bucket)
    devices = args.device if args.device != ["all"] else _all_cuda_devices()
    devices = [resolve_device(d) for d in devices]
    if args.kernel == DECODE_KERNEL:
        return tune_decode(args, devices)
    heads = _heads(args)
    from ..api import attention_kernel
    from ..tune import compile_pool

    config_dir, storage, target = _destination(args, devices)
    note_interpreter(devices[0])
    if devices[0] == "cpu":
        log.info("note: CPU timings (Triton's interpreter) say nothing about GPU speed; this run only exercises the "
                 "pipeline on tiny shapes.")  # fmt: skip
    written, names = _Written(), set()
    # One pool of compile processes for every study of a single-GPU tune (multi-GPU workers start their own).
    jobs = args.jobs or os.cpu_count() or 1
    pool = compile_pool.CompilePool(jobs) if devices[0] != "cpu" and len(devices) == 1 else None
    try:
        specs = _specs(args, seqlens, storage, target, devices[0], heads)
        names = _study_names(specs, devices[0])
        if len(devices) > 1:
            _tune_on_several(specs, devices, config_dir, storage, written)
        else:
            _tune_one_by_one(specs, devices[0], config_dir, pool, written)
    except KeyboardInterrupt:
        if pool is not None:
            pool.release()  # compiles not begun are skipped: closing waits only for those under way
            pool.close()
            pool = None
        _end_children()
        return interrupted(len(written.rows), written.path, storage, names)
    finally:
        if pool is not None:
            pool.close()
    attention_kernel.clear_cache()
    if args.json:
        print(to_json(_as_json(written)))
    else:
        _report(written, heads)
    return 0


@dataclass
class _Written:
    """What a tune has written so far: (kernel, causal, result) per study, and the file."""

    rows: list = field(default_factory=list)
    path: Path | None = None


def _destination(args: argparse.Namespace, devices: list[str]) -> tuple[Path, str | None, Path]:
    """(config dir, storage, the file the tune writes), checked writable; exits 2 where the tune could not write
    (or the devices cannot share a study)."""
    from ..api import selection
    from ..tune import job

    if len({selection.device_info(d).slug for d in devices}) > 1:
        fail(f"--device {','.join(devices)}: GPUs of different kinds cannot share a study; tune each kind alone")
    config_dir, source = config_destination(args.config_dir)
    storage = args.storage
    if storage is None and len(devices) > 1:  # workers share one study through a journal file
        storage = str(config_dir / ".studies" / "tune.journal")
    target = job.config_path(devices[0], config_dir)  # what the file holds now is timed beside the rest
    check_writable(config_dir, target, storage, source)
    return config_dir, storage, target


def _heads(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(query heads, K/V heads) of the timed calls where --heads or --kv-heads is given, the other the grid's
    (GRID_WIDTH // d query heads; as many K/V heads); (None, None): the grid's. Fewer K/V heads make grouped-query
    entries (EntryKey.gqa). Exits 2 on K/V heads that do not divide the query heads, or more heads than an entry
    records."""
    from ..config.entries import MAX_HEADS

    if args.heads is None and args.kv_heads is None:
        return None, None
    heads = args.heads or max(1, GRID_WIDTH // args.head_dim)
    kv_heads = args.kv_heads or heads
    if max(heads, kv_heads) > MAX_HEADS:  # what an entry records: refused now, not after the study
        fail(f"--heads and --kv-heads take at most {MAX_HEADS} heads, got --heads {heads} and --kv-heads {kv_heads}")
    if heads % kv_heads:
        implied = "" if args.heads else f" (--heads defaults to {GRID_WIDTH} // d)"
        fail(f"--kv-heads must divide --heads (query heads share K/V heads in groups), got --heads {heads} and "
             f"--kv-heads {kv_heads}{implied}")  # fmt: skip
    return heads, kv_heads


def _specs(args: argparse.Namespace, seqlens: tuple[int, ...], storage: str | None, target: Path, device: str,
           heads: tuple[int | None, int | None]) -> list:  # fmt: skip
    """One StudySpec per kernel and mask asked, each with the incumbent the file holds for its key (job.incumbent);
    heads: _heads'."""
    from ..api import selection
    from ..config import planner
    from ..tune import job

    kernels = {"bwd": ["bwd_dkdv", "bwd_dq"], "all": list(planner.KERNELS)}.get(args.kernel, [args.kernel])
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    timeout_s = arguments.study_timeout(args.timeout, len(kernels) * len(causals))
    if args.timeout is None:
        log.info(f"note: each study times configs for {timeout_s:g} s at most ({arguments.RUN_BUDGET_S:g} s shared "
                 f"by {len(kernels) * len(causals)}), then finishes with what it timed; --timeout S gives each S s")
    specs = [
        job.StudySpec(kernel=kernel, head_dim=args.head_dim, dtype=args.dtype, causal=causal,
                          seqlens=seqlens, tokens=args.tokens, trials=args.trials, timeout_s=timeout_s,
                          timeout_counts_builds=args.timeout is None, storage=storage, window=args.window,
                          varlen=args.varlen, seqlen_bucket=args.seqlen_bucket, heads=heads[0], kv_heads=heads[1])
        for kernel in kernels for causal in causals
    ]  # fmt: skip
    info = selection.device_info(device)  # a same-chip GPU's entry, which calls read until the tune, is an incumbent
    specs = [job.with_incumbent(spec, target, info) for spec in specs]
    if args.seqlens is None:  # an "all" entry beside bucket entries is tuned at the lengths it serves
        specs = [_at_served_lengths(spec, target, info) for spec in specs]
    return specs


def _study_names(specs: list, device: str) -> set[str]:
    from ..api import selection

    info = selection.device_info(device)
    return {spec.study_name(info) for spec in specs}


def _tune_on_several(specs: list, devices: list[str], config_dir: Path, storage: str, written: _Written) -> None:
    from ..tune import job, workers

    log.info("%d studies shared by %d workers (%s)", len(specs), len(devices), storage)
    done = workers.run_parallel_many(specs, devices, progress=_worker_progress(specs, devices))
    end_progress_line()
    for spec, (result, entry, _) in zip(specs, done, strict=True):
        written.path = job.write(entry, devices[0], config_dir)
        written.rows.append((spec.kernel, spec.causal, result))


def _tune_one_by_one(specs: list, device: str, config_dir: Path, pool, written: _Written) -> None:
    from ..tune import job

    for number, spec in enumerate(specs):

        def on_trial(done, total, best_ms, elapsed, spec=spec):
            progress(f"  {spec.kernel} causal={spec.causal}: trial {done}/{total}  best {best_ms:.3f} ms  "
                     f"{elapsed:.0f} s")  # fmt: skip

        then = specs[number + 1] if number + 1 < len(specs) else None  # its first configs compile meanwhile
        result, entry = job.run_study(
            spec, device, on_trial=on_trial, compile_pool=pool, then=then, release_pool=then is None
        )
        end_progress_line()
        written.path = job.write(entry, device, config_dir)
        written.rows.append((spec.kernel, spec.causal, result))


def _report(written: _Written, heads: tuple[int | None, int | None] = (None, None)) -> None:
    """The file written (and, for grouped-query studies, which calls read their entries), a table of what each study
    found, the configs each timed and what became of the incumbent."""
    print(f"\nwrote {written.path}")
    if heads[0] is not None and heads[1] < heads[0]:
        print(f"grouped-query entries, timed at {heads[0]} query heads over {heads[1]} K/V heads: calls with fewer K/V "
              "heads than query heads read them before the plain entry of the same length bucket, MHA calls "
              "never")  # fmt: skip
    # "before ms": the config the file held for the key (tuner's incumbent), timed in this run; "-" if none
    print(f"{'kernel':>9} {'causal':>6} {'winner':>30} {'ms':>8} {'default ms':>10} {'before ms':>9} {'median ms':>9} "
          f"{'timed':>5} {'2% at':>5} {'wall s':>6}")  # fmt: skip
    for kernel, causal, r in written.rows:
        before = f"{r.incumbent_ms:.3f}" if r.incumbent_ms is not None else "-"
        default = r.default_ms or float("nan")
        print(f"{kernel:>9} {causal!s:>6} {r.best.label():>30} {r.best_ms:>8.3f} {default:>10.3f} {before:>9} "
              f"{r.median_ms:>9.3f} {r.measured:>5} {r.within_2pct_at or '-':>5} {r.wall_s:>6.0f}")  # fmt: skip
    # What each study timed, fastest first: which configs a winner was chosen among; without it nothing says that a
    # study which kept its config timed, say, only spilling fused configs beside it
    for kernel, causal, r in written.rows:
        print(f"  {kernel} causal={causal} timed: " + ", ".join(f"{cfg.label()} {ms:.3f}" for cfg, ms in r.timed))
    for kernel, causal, r in written.rows:  # the config the file held for the key, kept or replaced, and why
        if r.incumbent_note is not None:
            print(f"  {kernel} causal={causal}: {r.incumbent_note}")


def _as_json(written: _Written) -> dict:
    """What _report prints, as data: the file written and, per study, the winner, the timings and what was timed."""
    studies = []
    for kernel, causal, r in written.rows:
        studies.append({"kernel": kernel, "causal": causal, "study": r.study_name, "winner": r.best.to_dict(),
                        "winner_label": r.best.label(), "ms": r.best_ms, "default_ms": r.default_ms,
                        "incumbent_ms": r.incumbent_ms, "median_ms": r.median_ms, "timed": r.measured,
                        "within_2pct_at": r.within_2pct_at, "wall_s": r.wall_s, "incumbent_note": r.incumbent_note,
                        "trials": [{"config": cfg.to_dict(), "ms": ms} for cfg, ms in r.timed]})  # fmt: skip
    return {"config_file": str(written.path), "studies": studies}


def _tuning_lengths(text: str | None, bucket: str) -> tuple[int, ...]:
    """--seqlens, or the bucket's default; a bucket tuned at a length it never serves would be wrong."""
    from ..config.lengths import BUCKET_RANGES, TUNING_LENGTHS, bucket_of

    text = text or ",".join(map(str, TUNING_LENGTHS[bucket]))
    try:
        seqlens = tuple(int(n) for n in text.split(","))
    except ValueError:
        seqlens = ()
    problem = None
    if not seqlens or min(seqlens) < 1:
        problem = f"--seqlens must be comma-separated ints >= 1, got {text!r}"
    elif bucket != "all" and not all(bucket_of(n) == bucket for n in seqlens):
        low, high = BUCKET_RANGES[bucket]
        problem = f"--seqlen-bucket {bucket} serves lengths in ({low}, {high}]; --seqlens {text} goes outside it"
    if problem:
        fail(problem)
    return seqlens


def _at_served_lengths(spec, target, info):
    """spec, tuned at the lengths that the bucket entries its calls read (in `target`, the GPU's own files or a
    same-chip GPU's: info) leave to it (job.unserved_lengths), and says so."""
    from ..tune import job

    lengths = job.unserved_lengths(spec, target, info)
    if lengths != spec.seqlens:
        log.info(f"note: {spec.kernel} causal={spec.causal}: there are length-bucket entries for this key (this "
                 f"GPU's or a GPU's of the same chip), so its \"all\" entry serves longer calls and is tuned at "
                 f"{','.join(map(str, lengths))} (--seqlens chooses)")  # fmt: skip
    return replace(spec, seqlens=lengths)


def _worker_progress(specs, devices):
    """A one-line progress display for a multi-GPU tune: each worker's study, trials timed, best ms so far."""
    states: dict[int, str] = {}

    def show(index, worker, state):
        timed, trials, best_ms, elapsed = state
        spec = specs[index]
        states[worker] = (f"{devices[worker]} {spec.kernel} causal={spec.causal}: {timed}/{trials} "
                          f"best {best_ms:.3f} ms {elapsed:.0f} s")  # fmt: skip
        progress("  " + " | ".join(states[w] for w in sorted(states)))

    return show


def _end_children() -> None:
    """Ends this process's helper processes still running (a tune interrupted before its workers were told to
    stop): multiprocessing would otherwise join them at exit, and a worker waiting for its next job never ends."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=10)


def _all_cuda_devices() -> list[str]:
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        fail("--device all found no CUDA device")
    return [f"cuda:{i}" for i in range(count)]
