"""`fa2tune tune --kernel decode`: the decode kernel's study on one device (fa2tune.tune.decode_tuner), its winner
written to the GPU's config file, and a report.

Imported with the parser, before torch (as tune_command is): everything heavy is imported inside the functions.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from . import arguments
from .common import end_progress_line, fail, log, note_interpreter, progress, to_json
from .outputs import check_writable, config_destination, interrupted

DEFAULT_HEADS = (32, 8)  # query and K/V heads of the timed steps: issue 45's GQA group of 4 (Llama 3 8B's)
# The tune flags of the attention kernels' studies, with their defaults: a decode tune takes none of them
_NOT_FOR_DECODE = {"causal": "both", "window": None, "varlen": False, "seqlens": None, "seqlen_bucket": "all",
                   "tokens": 16384, "storage": None}  # fmt: skip


def tune_decode(args: argparse.Namespace, devices: list[str]) -> int:
    """`fa2tune tune --kernel decode`: one study on one device, its winner merged into <config dir>/<gpu>.yaml."""
    heads, kv_heads = _check(args, devices)
    from ..api import selection
    from ..launch import plans
    from ..tune import compile_pool, decode_tuner, job

    device = devices[0]
    config_dir, source = config_destination(args.config_dir)
    target = job.config_path(device, config_dir)
    check_writable(config_dir, target, None, source)
    spec = decode_tuner.DecodeSpec(head_dim=args.head_dim, dtype=args.dtype, heads=heads, kv_heads=kv_heads,
                                   trials=args.trials,
                                   timeout_s=arguments.study_timeout(args.timeout, 1),
                                   timeout_counts_builds=args.timeout is None)  # fmt: skip
    spec = job.with_incumbent(spec, target, selection.device_info(device))  # timed beside the rest
    note_interpreter(device)
    if device == "cpu":
        log.info("note: CPU timings (Triton's interpreter) say nothing about GPU speed; this run only exercises the "
                 "pipeline on tiny shapes.")  # fmt: skip
    pool = compile_pool.CompilePool(args.jobs or os.cpu_count() or 1) if device != "cpu" else None

    def on_trial(done, total, best_ms, elapsed):
        progress(f"  decode: config {done}/{total}  best {best_ms:.4f} ms  {elapsed:.0f} s")

    try:
        result, entry = decode_tuner.run(spec, device, on_trial=on_trial, compile_pool=pool)
    except KeyboardInterrupt:
        return interrupted(0, None, None, set())
    finally:
        if pool is not None:
            pool.release()  # after Ctrl-C too (decode_tuner.run releases it before the finish otherwise)
            pool.close()
    end_progress_line()
    path = job.write(entry, device, config_dir)
    plans.clear_plans()  # a decode call of a signature seen before looks its config up again
    if args.json:
        print(to_json(_as_json(result, path)))
    else:
        _report(result, path)
    return 0


def _check(args: argparse.Namespace, devices: list[str]) -> tuple[int, int]:
    """(heads, kv_heads) of the decode steps; exits 2 on a flag a decode tune does not take, several devices, or
    heads that do not group."""
    given = [name for name, default in _NOT_FOR_DECODE.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        fail(f"{flags}: not for --kernel decode (one decode entry per head dim and dtype serves every mask and "
             "length); leave them out")  # fmt: skip
    if len(devices) > 1:
        fail(f"--device {','.join(devices)}: a decode tune runs on one GPU (its study takes a few minutes)")
    heads, kv_heads = args.heads or DEFAULT_HEADS[0], args.kv_heads or DEFAULT_HEADS[1]
    if heads % kv_heads:
        fail(f"--kv-heads must divide --heads (query heads share K/V heads in groups), got {heads} and {kv_heads}")
    return heads, kv_heads


def _report(result, path: Path) -> None:
    """The file written, the winner beside the default, and what was timed, fastest first."""
    print(f"\nwrote {path}")
    rate = lambda gbps: "" if gbps is None else f"  {gbps:,.0f} GB/s"  # none under the interpreter
    print(f"{result.study_name}: {result.best.label()}  {result.best_ms:.4f} ms{rate(result.gbps)}  (default "
          f"{result.default.label()}: {result.default_ms:.4f} ms{rate(result.default_gbps)})")  # fmt: skip
    print(f"  {result.measured} configs timed, {result.failed} failed, {result.pruned} proposals pruned, "
          f"{result.wall_s:.0f} s")  # fmt: skip
    timed = sorted((r for r in result.history if r.ms is not None), key=lambda r: r.ms)
    print("  timed: " + ", ".join(f"{r.config.label()} {r.ms:.4f}" for r in timed))
    failed = [r for r in result.history if r.ms is None]
    for r in failed:
        print(f"  failed: {r.config.label()}: {r.reason}")
    if result.incumbent_note is not None:
        print(f"  {result.incumbent_note}")


def _as_json(result, path: Path) -> dict:
    """What _report prints, as data."""
    return {"config_file": str(path), "study": result.study_name, "winner": result.best.to_dict(),
            "winner_label": result.best.label(), "ms": result.best_ms, "gbps": result.gbps,
            "default": result.default.to_dict(), "default_ms": result.default_ms, "default_gbps": result.default_gbps,
            "steps_ms": [t.median_ms for t in result.readings], "timed": result.measured, "failed": result.failed,
            "pruned": result.pruned, "wall_s": result.wall_s, "incumbent_note": result.incumbent_note,
            "trials": [{"config": r.config.to_dict(), "ms": r.ms, "reason": r.reason} for r in result.history]}
