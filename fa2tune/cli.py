"""The `fa2tune` command: parse, call the library, print."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# torch-free: `fa2tune tune` starts its helper processes before importing torch
from .config.lengths import BUCKET_RANGES, SEQLEN_BUCKETS, TUNING_LENGTHS, bucket_of
from .config.types import DTYPE_CHOICES, KERNELS

USAGE_ERROR = 2  # a bad argument, or a device or directory the command cannot use: nothing was done
INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT
# The shortest --timeout a study can use: its first config takes seconds to build and time on a GPU (~2 s to
# compile, 1-2 s to time at the default lengths), so below this a study would time nothing but its default.
MIN_TIMEOUT_S = 10.0
# --storage: an Optuna database URL of one of these SQLAlchemy dialects (dialect+driver allowed), or a journal
# file named by one of these suffixes. A bare word is neither: `--storage foo` silently made a journal file ./foo.
STORAGE_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
JOURNAL_SUFFIXES = (".journal", ".log")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit code 2: argparse's default prints the whole usage above the error, seven
    lines for `tune`, and the one that matters comes last."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _fail(message: str):
    """Ends the command with a one-line reason on stderr and the usage-error exit code."""
    print(f"fa2tune: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def _device_name(text: str) -> str:
    """--device of check and show: cpu, cuda or cuda:N (whether it exists is _resolve_device's to say)."""
    name = text.strip()
    if not _DEVICE.fullmatch(name):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return name


def _device_names(text: str) -> list[str]:
    """--device of tune: 'all', or one device or several, comma-separated. Several are one worker each on one
    study: the same GPU twice would time two configs at once on it (each reading slowed by the other), and cpu
    beside a GPU would share one study between the interpreter's timings and the GPU's."""
    if text.strip() == "all":
        return ["all"]
    names = [_device_name(part) for part in text.split(",")]
    gpus = [int(name.partition(":")[2] or 0) for name in names if name != "cpu"]
    if gpus and len(gpus) != len(names):
        raise argparse.ArgumentTypeError(f"cpu and CUDA devices cannot share a tune, got {text!r}")
    if len(set(gpus)) != len(gpus):
        why = "two workers on one GPU slow each other's timings"
        raise argparse.ArgumentTypeError(f"each GPU at most once ({why}), got {text!r}")
    return names


def _resolve_device(name: str) -> str:
    """Returns a usable device string or exits with code 2 and a one-line reason."""
    import torch

    if name == "cpu":
        # Triton reads TRITON_INTERPRET when it builds each @jit function, its own library's included, so the
        # choice must come before triton is imported; fa2tune itself imports triton only when a kernel runs.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
            _fail("--device cpu needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        return "cpu"
    if not torch.cuda.is_available():
        _fail(f"no CUDA device is visible (asked for {name}); use --device cpu to run through Triton's interpreter")
    count = torch.cuda.device_count()
    if int(name.partition(":")[2] or 0) >= count:
        _fail(f"--device {name} does not exist: {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})")
    return name


def _note_interpreter(device: str) -> None:
    if device == "cpu":
        print("note: --device cpu runs the kernels through Triton's interpreter: right answers, no speed.",
              file=sys.stderr)  # fmt: skip


def _cmd_check(args: argparse.Namespace) -> int:
    device = _resolve_device(args.device)
    _note_interpreter(device)

    from .config.inputs import DTYPES_BY_NAME
    from .config.types import Mask
    from .tune import verification

    dtypes = [DTYPES_BY_NAME[d] for d in args.dtype.split(",")]
    print(f"{'batch,hq,hkv,nq,nk,d':>24} {'dtype':>9} {'mask':>14} {'rel err O':>10} {'rel err lse':>11}  result")
    failed = 0
    for shape in verification.default_shapes(on_gpu=device != "cpu"):
        left = max(8, shape[4] // 4)  # a window that leaves whole K tiles out at the larger lengths
        masks = [("full", Mask(), False), ("causal", Mask(causal=True), False),
                 (f"window {left},0", Mask(causal=True, window=(left, -1)), False),
                 ("causal varlen", Mask(causal=True), True)]  # fmt: skip
        for dtype in dtypes:
            for name, mask, varlen in masks:
                r = verification.check_forward(shape, dtype=dtype, causal=mask, device=device, varlen=varlen)
                failed += not r.passed
                print(
                    f"{','.join(map(str, r.shape)):>24} {str(dtype).replace('torch.', ''):>9} {name:>14} "
                    f"{r.rel_err:>10.1e} {r.lse_rel_err:>11.1e}  {'ok' if r.passed else 'FAIL'}"
                )
    print("all checks passed" if not failed else f"{failed} checks FAILED")
    return 1 if failed else 0


def _device_info(args: argparse.Namespace):
    """The DeviceInfo for --gpu NAME (the known-GPU table) or --device cuda:N (the card); exits 2 without one."""
    from .config import device

    if getattr(args, "gpu", None):
        try:
            return device.known_gpu(args.gpu)
        except ValueError as exc:
            print(f"fa2tune: {exc}", file=sys.stderr)
            sys.exit(2)
    try:
        return device.inspect(args.device)
    except (RuntimeError, ValueError) as exc:
        print(
            f"fa2tune: {exc}; use --gpu NAME to plan for a known GPU ({', '.join(sorted(device.KNOWN_GPUS))})",
            file=sys.stderr,
        )
        sys.exit(2)


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = _device_info(args)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    for key, value in info.to_dict().items():
        print(f"{key:>16}  {value}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:

    from .config import planner
    from .config.inputs import DTYPES_BY_NAME

    info = _device_info(args)
    dtype = DTYPES_BY_NAME[args.dtype]
    kernels = ["bwd_dkdv", "bwd_dq"] if args.kernel == "bwd" else [args.kernel]
    plans = [planner.plan(info, args.head_dim, dtype, kernel) for kernel in kernels]
    if args.json:
        out = [
            {
                "device": {**info.to_dict(), "smem_per_block": info.smem_per_block},
                "kernel": p.kernel,
                "head_dim": p.head_dim,
                "dtype": args.dtype,
                # params, not to_dict: every row of a table has every column, switches off included
                "accepted": [{**cfg.params(), "sram_bytes": need} for cfg, need in p.accepted],
                "rejected": [{**cfg.params(), "sram_bytes": need, "reason": why} for cfg, need, why in p.rejected],
            }
            for p in plans
        ]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return 0
    for p in plans:
        print(
            f"{p.kernel} on {info.name} ({info.smem_per_block:,} B shared memory per block), "
            f"head_dim {p.head_dim}, {args.dtype}: {len(p.accepted)} accepted, {len(p.rejected)} rejected"
        )
        print(f"  {'block_m':>7} {'block_n':>7} {'warps':>5} {'stages':>6} {'SRAM (B)':>10}  switches")
        for cfg, need in sorted(p.accepted, key=lambda a: -a[1]):
            print(f"  {cfg.block_m:>7} {cfg.block_n:>7} {cfg.num_warps:>5} {cfg.num_stages:>6} {need:>10,}  "
                  f"{_switches(cfg)}")  # fmt: skip
        print("  rejected:")
        for cfg, _need, why in p.rejected:
            print(f"  {cfg.block_m:>7} {cfg.block_n:>7} {cfg.num_warps:>5} {cfg.num_stages:>6}  {_switches(cfg)} {why}")
    return 0


def _switches(cfg) -> str:
    """The config's template switches and schedule in words ("" for the plain Triton template)."""
    schedule = cfg.schedule
    words = [("pipeline_qk", cfg.pipeline_qk), ("warpspec", cfg.warp_specialized), ("ping-pong", cfg.pingpong),
             ("fused dQ", cfg.fused_dq), ("persistent", schedule.persistent),
             (", two programs an SM", schedule.programs_an_sm == 2), (", no split tail", not schedule.split_tail),
             (", causal tail", schedule.causal_tail)]  # fmt: skip
    return " ".join(word for word, on in words if on).replace(" ,", ",")


def _cmd_codegen(args: argparse.Namespace) -> int:
    from .config.types import Variant
    from .kernels import codegen

    variant = Variant.for_template(
        args.template, causal=args.causal, banded=False, varlen=False, even_m=not args.ragged,
        even_n=not args.ragged, dot_fp32=args.interpret, pingpong=args.pingpong, persistent=args.persistent,
        fused_dq=args.fused_dq,
    )  # fmt: skip
    print(codegen.render(args.template, variant), end="")
    return 0


def _window(text: str) -> tuple[int, int]:
    from .config.inputs import check_window

    try:
        return check_window(tuple(int(x) for x in text.split(",")))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT with ints >= -1, got {text!r} ({exc})") from None


def _tuning_lengths(text: str | None, bucket: str) -> tuple[int, ...]:
    """--seqlens, or the bucket's default; a bucket tuned at a length it never serves would be wrong."""
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
        print(f"fa2tune: {problem}", file=sys.stderr)
        sys.exit(2)
    return seqlens


def _at_served_lengths(spec, target):
    """spec, tuned at the lengths that the file's bucket entries leave to it (job.unserved_lengths), and says so."""
    from .tune import job

    lengths = job.unserved_lengths(spec, target)
    if lengths != spec.seqlens:
        print(f"note: {spec.kernel} causal={spec.causal}: {target.name} has length-bucket entries for this key, so "
              f"its \"all\" entry serves longer calls and is tuned at {','.join(map(str, lengths))} "
              f"(--seqlens chooses)")  # fmt: skip
    return replace(spec, seqlens=lengths)


def _worker_progress(specs, devices):
    """A one-line progress display for a multi-GPU tune: each worker's study, trials timed, best ms so far."""
    states: dict[int, str] = {}

    def show(index, worker, state):
        timed, trials, best_ms, elapsed = state
        spec = specs[index]
        states[worker] = (f"{devices[worker]} {spec.kernel} causal={spec.causal}: {timed}/{trials} "
                          f"best {best_ms:.3f} ms {elapsed:.0f} s")  # fmt: skip
        print("\r  " + " | ".join(states[w] for w in sorted(states)), end="", flush=True)

    return show


def _positive_int(text: str) -> int:
    """--trials, --tokens, --jobs: a count, at least one."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _timeout(text: str) -> float:
    """--timeout: seconds per study, finite and at least MIN_TIMEOUT_S."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < MIN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"expected seconds >= {MIN_TIMEOUT_S:g} (a study's first config takes seconds to build and time), "
            f"got {text!r}"
        )
    return value


def _storage(text: str) -> str:
    """--storage: a database URL (STORAGE_DIALECTS) or a journal file path (JOURNAL_SUFFIXES), nothing else."""
    expected = (f"expected a database URL (sqlite:///PATH, postgresql://..., mysql://..., ...) or a journal file "
                f"path ending in {' or '.join(JOURNAL_SUFFIXES)}, got {text!r}")  # fmt: skip
    scheme, url, _ = text.partition("://")
    if url:
        if scheme.split("+")[0].lower() not in STORAGE_DIALECTS:
            raise argparse.ArgumentTypeError(f"{expected}: unknown scheme {scheme!r}")
        if scheme.startswith("sqlite") and _sqlite_path(text) is None:
            raise argparse.ArgumentTypeError(f"{text!r} is an in-memory database, which keeps nothing: name a file")
        return text
    if re.match(r"[A-Za-z][\w+.-]+:", text):  # sqlite:/t.db: a URL without its "//" (a drive letter C: is a path)
        raise argparse.ArgumentTypeError(f"{expected}: a URL needs '://'")
    if not text.endswith(JOURNAL_SUFFIXES):
        raise argparse.ArgumentTypeError(expected)
    return text


def _sqlite_path(url: str) -> Path | None:
    """The file of a sqlite:///PATH URL (sqlite:////abs for an absolute one); None for an in-memory database."""
    path = url.partition("://")[2][1:].partition("?")[0]
    return Path(path) if path and path != ":memory:" else None


def _write_problem(path: Path, created: list[Path]) -> str | None:
    """Why the file at `path` cannot be written, or None; its directory is created if missing (each directory
    made appended to `created`). Tried, not guessed: a directory under a file, a read-only or virtual file system
    (/proc) or missing permissions show only when written to."""
    directory = path.parent
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    if missing and missing[-1].parent.exists() and not missing[-1].parent.is_dir():
        return f"{missing[-1].parent} is a file, not a directory"
    if not missing and not directory.is_dir():
        return f"{directory} is a file, not a directory"
    try:
        for made in reversed(missing):
            made.mkdir()
            created.append(made)
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".fa2tune-write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot create or write in {directory} ({exc.strerror or exc})"
    if path.exists() and not path.is_file():
        return f"{path} is a {'directory' if path.is_dir() else 'special file'}, not a file"
    try:
        path.open("rb").close() if path.exists() else None
    except OSError as exc:  # a tune merges its entries into the file: one it cannot read would lose the others
        return f"cannot read {path} ({exc.strerror or exc})"
    return None


def _check_writable(config_dir: Path, target: Path, storage: str | None) -> None:
    """Exits with a one-line reason, before any timing, if the tune could not write its entries or its trials;
    the directories the check made are removed then (nothing is left of a command that did nothing)."""
    created: list[Path] = []
    problem = _write_problem(target, created)
    said = f"--config-dir {config_dir}: {problem}" if problem else None
    local = _storage_file(storage) if storage is not None and not said else None
    if local is not None and (problem := _write_problem(local, created)):
        said = f"--storage {storage}: {problem}"
    if said:
        for made in reversed(created):
            with contextlib.suppress(OSError):  # something else wrote in it meanwhile: it stays
                made.rmdir()
        _fail(said)


def _storage_file(storage: str) -> Path | None:
    """The local file a --storage value names (a journal file, a SQLite database), or None (a database server)."""
    if "://" not in storage:
        return Path(storage)
    return _sqlite_path(storage) if storage.startswith("sqlite") else None


def _trials_kept(storage: str | None, names: set[str]) -> int | None:
    """How many timed trials of the studies `names` the storage holds; None if it cannot say."""
    if storage is None or ((local := _storage_file(storage)) is not None and not local.exists()):
        return 0  # opening a file that is not there would create it: nothing was kept
    import optuna

    from .tune import job

    try:
        opened = job._storage(storage)
        complete = (optuna.trial.TrialState.COMPLETE,)
        return sum(
            len(optuna.load_study(study_name=s.study_name, storage=opened).get_trials(deepcopy=False, states=complete))
            for s in optuna.get_all_study_summaries(opened, include_best_trial=False)
            if s.study_name in names
        )
    except Exception:  # interrupted while it was written, a server gone: say less rather than fail here
        return None


def _interrupted(entries: int, path: Path | None, storage: str | None, names: set[str]) -> int:
    """The one line Ctrl-C ends a tune with: what was written, and what its storage keeps."""
    said = [f"{entries} entr{'y' if entries == 1 else 'ies'} written to {path}" if entries else "nothing written"]
    kept = _trials_kept(storage, names)
    if storage is not None and kept != 0:
        trials = f"{kept} timed trial{'' if kept == 1 else 's'}" if kept is not None else "the trials timed so far"
        said.append(f"{trials} kept in {storage} (the same command reuses them)")
    lead = "\n" if sys.stdout.isatty() else ""  # after a progress line left open with \r
    print(f"{lead}fa2tune: interrupted; {'; '.join(said)}", file=sys.stderr)
    return INTERRUPTED


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.device[0] != "cpu":
        # Before this process imports torch: the fork server that starts the workers and compile processes imports
        # torch, triton and fa2tune meanwhile (fa2tune.tune.processes), not after.
        from .tune import processes

        processes.start_early()
    # Every argument is checked before anything is timed: a bad one ends the command with one line, exit code 2.
    seqlens = _tuning_lengths(args.seqlens, args.seqlen_bucket)
    devices = args.device if args.device != ["all"] else _all_cuda_devices()
    devices = [_resolve_device(d) for d in devices]
    from .api import attention_kernel, selection
    from .config import planner, store
    from .config.inputs import DTYPES_BY_NAME
    from .tune import job, timing, tuner

    if len({selection.device_info(d).slug for d in devices}) > 1:
        _fail(f"--device {','.join(devices)}: GPUs of different kinds cannot share a study; tune each kind alone")
    config_dir = Path(args.config_dir) if args.config_dir else store.user_config_dir()
    storage = args.storage
    if storage is None and len(devices) > 1:  # workers share one study through a journal file
        storage = str(config_dir / ".studies" / "tune.journal")
    target = job.config_path(devices[0], config_dir)  # what the file holds now is timed beside the rest
    _check_writable(config_dir, target, storage)

    _note_interpreter(devices[0])
    if devices[0] == "cpu":
        print("note: CPU timings (Triton's interpreter) say nothing about GPU speed; this run only exercises the "
              "pipeline on tiny shapes.")  # fmt: skip
    kernels = {"bwd": ["bwd_dkdv", "bwd_dq"], "all": list(planner.KERNELS)}.get(args.kernel, [args.kernel])
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows, path, names = [], None, set()
    # One pool of compile processes for every study of a single-GPU tune (multi-GPU workers start their own).
    jobs = args.jobs or os.cpu_count() or 1
    pool = timing.CompilePool(jobs) if devices[0] != "cpu" and len(devices) == 1 else None
    try:
        specs = [
            job.StudySpec(kernel=kernel, head_dim=args.head_dim, dtype=args.dtype, causal=causal,
                              seqlens=seqlens, tokens=args.tokens, trials=args.trials, timeout_s=args.timeout,
                              storage=storage, window=args.window, varlen=args.varlen,
                              seqlen_bucket=args.seqlen_bucket)
            for kernel in kernels for causal in causals
        ]  # fmt: skip
        specs = [replace(spec, incumbent=job.incumbent(spec, target)) for spec in specs]
        if args.seqlens is None:  # an "all" entry beside bucket entries is tuned at the lengths it serves
            specs = [_at_served_lengths(spec, target) for spec in specs]
        info = selection.device_info(devices[0])
        names = {tuner.study_name(info, spec.kernel, spec.head_dim, DTYPES_BY_NAME[spec.dtype], spec.causal,
                                  spec.variant) for spec in specs}  # fmt: skip
        if len(devices) > 1:
            print(f"{len(specs)} studies shared by {len(devices)} workers ({storage})", flush=True)
            done = job.run_parallel_many(specs, devices, progress=_worker_progress(specs, devices))
            print()
            for spec, (result, entry, _) in zip(specs, done, strict=True):
                path = job.write(entry, devices[0], config_dir)
                rows.append((spec.kernel, spec.causal, result))
        for number, spec in enumerate(specs if len(devices) == 1 else []):

            def progress(done, total, best_ms, elapsed, spec=spec):
                print(f"\r  {spec.kernel} causal={spec.causal}: trial {done}/{total}  best {best_ms:.3f} ms  "
                      f"{elapsed:.0f} s", end="", flush=True)  # fmt: skip

            then = specs[number + 1] if number + 1 < len(specs) else None  # its first configs compile meanwhile
            result, entry = job.run_study(
                spec, devices[0], on_trial=progress, compile_pool=pool, then=then, release_pool=then is None
            )
            print()
            path = job.write(entry, devices[0], config_dir)
            rows.append((spec.kernel, spec.causal, result))
    except KeyboardInterrupt:
        if pool is not None:
            pool.release()  # compiles not begun are skipped: closing waits only for those under way
            pool.close()
            pool = None
        _end_children()
        return _interrupted(len(rows), path, storage, names)
    finally:
        if pool is not None:
            pool.close()
    attention_kernel.clear_cache()
    print(f"\nwrote {path}")
    # "before ms": the config the file held for the key (tuner's incumbent), timed in this run; "-" if none
    print(f"{'kernel':>9} {'causal':>6} {'winner':>30} {'ms':>8} {'default ms':>10} {'before ms':>9} {'median ms':>9} "
          f"{'timed':>5} {'2% at':>5} {'wall s':>6}")  # fmt: skip
    for kernel, causal, r in rows:
        before = f"{r.incumbent_ms:.3f}" if r.incumbent_ms is not None else "-"
        default = r.default_ms or float("nan")
        print(f"{kernel:>9} {causal!s:>6} {r.best.label():>30} {r.best_ms:>8.3f} {default:>10.3f} {before:>9} "
              f"{r.median_ms:>9.3f} {r.measured:>5} {r.within_2pct_at or '-':>5} {r.wall_s:>6.0f}")  # fmt: skip
    # What each study timed, fastest first: which configs a winner was chosen among (docs/PERF.md v18: a d=128 tune
    # kept the dQ kernel, and without this list nothing said it had timed only a spilling fused config)
    for kernel, causal, r in rows:
        timed = sorted({t.config: t.ms for t in r.history if t.ms is not None}.items(), key=lambda item: item[1])
        print(f"  {kernel} causal={causal} timed: " + ", ".join(f"{cfg.label()} {ms:.3f}" for cfg, ms in timed))
    for kernel, causal, r in rows:  # the config the file held for the key, kept or replaced, and why
        if r.incumbent_note is not None:
            print(f"  {kernel} causal={causal}: {r.incumbent_note}")
    return 0


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
        print("fa2tune: --device all found no CUDA device", file=sys.stderr)
        sys.exit(2)
    return [f"cuda:{i}" for i in range(count)]


def _cmd_show(args: argparse.Namespace) -> int:
    import torch

    from .api import attention_kernel, selection
    from .config import store

    if args.gpu:
        info = _device_info(args)
        slug = info.slug
    else:
        device_name = _resolve_device(args.device)
        _note_interpreter(device_name)
        slug = selection.device_info(device_name).slug
    rows = []
    seen = set()
    for directory in store.config_dirs():
        path = directory / f"{slug}.yaml"
        if not path.is_file():
            continue
        try:
            _, entries = store.read_file(path)
        except Exception as exc:  # show says why a file is ignored instead of failing
            rows.append({"file": str(path), "error": str(exc)})
            continue
        for e in entries:
            shadowed = e.key in seen
            seen.add(e.key)
            rows.append(
                {
                    "file": str(path),
                    **{k: v for k, v in e.key.__dict__.items()},
                    "config": e.config.to_dict(),
                    "tflops": e.tflops,
                    "used": not shadowed,
                }
            )
    if not args.gpu:  # what the attention_kernel resolves now, including planner defaults
        for head_dim in sorted({r["head_dim"] for r in rows if "head_dim" in r} | {64, 128}):
            for causal in (False, True):
                k = attention_kernel.get_kernel(head_dim, device=device_name, dtype=torch.bfloat16, causal=causal)
                rows.append(
                    {
                        "resolved": True,
                        "head_dim": head_dim,
                        "dtype": "bf16",
                        "causal": causal,
                        "fwd": k.config.to_dict(),
                        "source": k.source,
                        "bwd_dkdv": k.bwd_dkdv_config.to_dict(),
                        "bwd_dq": k.bwd_dq_config.to_dict(),
                        "bwd_source": k.bwd_source,
                    }
                )
                if (k.short_config, k.short_source) != (k.config, k.source):  # a "short" entry for N <= 1024
                    rows[-1].update(fwd_short=k.short_config.to_dict(), short_source=k.short_source)
                if (k.medium_config, k.medium_source) != (k.config, k.source):  # a "medium" entry, 1024 < N <= 4096
                    rows[-1].update(fwd_medium=k.medium_config.to_dict(), medium_source=k.medium_source)
    if args.json:
        print(json.dumps({"slug": slug, "search_path": [str(d) for d in store.config_dirs()], "rows": rows}, indent=2))
        return 0
    print(f"tuned configs for {slug}; search path: " + " -> ".join(str(d) for d in store.config_dirs()))
    for r in rows:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fa2tune", description="Exact FlashAttention-2 in Triton, tuned per GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run the kernels against a float64 reference on random odd shapes")
    check.add_argument("--device", type=_device_name, default="cuda:0", help="cuda[:N], or cpu (Triton's interpreter)")
    check.add_argument("--dtype", default="bf16,fp16", help=f"comma-separated, from {sorted(DTYPE_CHOICES)}")
    check.set_defaults(func=_cmd_check)

    inspect = sub.add_parser("inspect", help="what the GPU offers: SMs, shared memory, registers, L2")
    inspect.add_argument("--device", default="cuda:0")
    inspect.add_argument("--gpu", default=None, help="a known GPU instead of the card (see `fa2tune plan --help`)")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=_cmd_inspect)

    plan = sub.add_parser("plan", help="which block configs fit the GPU's shared memory and registers, and why not")
    plan.add_argument("--head-dim", type=_head_dim, required=True)
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--device", default="cuda:0")
    where.add_argument("--gpu", default=None, help="plan without the card: one of " + ", ".join(_known_gpus()))
    plan.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_CHOICES))
    plan.add_argument("--kernel", default="fwd", choices=[*KERNELS, "bwd"])
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_cmd_plan)

    tune = sub.add_parser("tune", help="time candidate configs with Optuna and store the fastest as YAML")
    tune.add_argument(
        "--device",
        type=_device_names,
        default="cuda:0",
        help="cuda[:N]; several (cuda:0,cuda:1; each GPU once, all of one kind) or 'all' run one worker per GPU "
        "on one study; cpu exercises the pipeline (no speed)",
    )
    tune.add_argument("--head-dim", type=_head_dim, required=True)
    tune.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_CHOICES))
    tune.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    tune.add_argument(
        "--kernel",
        default="fwd",
        choices=[*KERNELS, "bwd", "all"],
        help="bwd: both backward kernels; bwd_dkdv / bwd_dq one of them (after a change to its template)",
    )
    tune.add_argument(
        "--window",
        type=_window,
        default=None,
        help="LEFT,RIGHT: tune the band-mask variant at this window, e.g. 1024,0 or -1,0 (-1: unbounded)",
    )
    tune.add_argument("--varlen", action="store_true", help="tune the packed-sequence (attention_varlen) variant")
    tune.add_argument("--jobs", type=_positive_int, default=None, help="compile processes (default: one per CPU core)")
    lengths = {bucket: ",".join(map(str, TUNING_LENGTHS[bucket])) for bucket in SEQLEN_BUCKETS}
    (_, short), (low, medium) = BUCKET_RANGES["short"], BUCKET_RANGES["medium"]
    tune.add_argument("--seqlens", default=None,
                      help=f"tuning lengths, at batch·N = --tokens (default {lengths['all']} — less those the "
                           "file's short and medium entries for the key serve, 8192 added where fewer than two "
                           f"remain —; {lengths['short']} for --seqlen-bucket short; {lengths['medium']} for "
                           "medium)")  # fmt: skip
    tune.add_argument("--seqlen-bucket", default="all", choices=SEQLEN_BUCKETS,
                      help=f"short: an entry used only by calls with max(seqlen_q, seqlen_k) <= {short}, tuned at "
                           "such lengths (a backward kernel timed inside the whole training call, where the host can "
                           f"be the bound); medium: the same for {low} < max(seqlen_q, seqlen_k) <= {medium}; all: "
                           "the entry for every other length")  # fmt: skip
    tune.add_argument("--tokens", type=_positive_int, default=16384, help="batch·N of each tuning length")
    tune.add_argument("--trials", type=_positive_int, default=40,
                      help="configs timed per study (>= 1; the config the file holds for the key is timed beside "
                           "them, whatever the budget)")  # fmt: skip
    tune.add_argument("--timeout", type=_timeout, default=None,
                      help=f"seconds per study (>= {MIN_TIMEOUT_S:g}): no new trial starts after it")  # fmt: skip
    tune.add_argument("--storage", type=_storage, default=None,
                      help="where the trials are kept, to resume or share between workers: a database URL of "
                           f"{', '.join(STORAGE_DIALECTS)} (dialect+driver:// allowed), e.g. sqlite:///t.db, "
                           "sqlite:////abs/t.db, postgresql://user@host/db; or an Optuna journal file whose name ends "
                           f"in {' or '.join(JOURNAL_SUFFIXES)}; anything else is refused")  # fmt: skip
    tune.add_argument("--config-dir", default=None,
                      help="where to write <gpu>.yaml (default: the user cache dir); checked writable before any "
                           "timing")  # fmt: skip
    tune.set_defaults(func=_cmd_tune)

    show = sub.add_parser("show", help="which configs the attention_kernel uses, and from which file")
    show.add_argument("--device", type=_device_name, default="cuda:0")
    show.add_argument("--gpu", default=None, help="list the stored entries for a known GPU without the card")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_cmd_show)

    gen = sub.add_parser("codegen", help="print the generated Triton (or Gluon) source of one template variant")
    gen.add_argument("--template", default="fwd", choices=["fwd", "bwd", "fwd_ws", "bwd_ws", "bwd_dq_ws"],
                     help="fwd_ws / bwd_ws / bwd_dq_ws: the warp-specialized forward / dK/dV / dQ kernel (Gluon, "
                     "Hopper), KernelConfig.warp_specialized")  # fmt: skip
    gen.add_argument("--causal", action="store_true")
    gen.add_argument("--ragged", action="store_true", help="lengths that are not multiples of the blocks")
    gen.add_argument("--interpret", action="store_true", help="the variant used under TRITON_INTERPRET=1")
    gen.add_argument("--pingpong", action="store_true", help="fwd_ws: two consumers take turns (KernelConfig.pingpong)")
    gen.add_argument("--fused-dq", action="store_true",
                     help="bwd_ws: dQ added by the dK/dV kernel (KernelConfig.fused_dq)")  # fmt: skip
    gen.add_argument("--persistent", action="store_true",
                     help="the *_ws templates: programs walk the tiles (Schedule.persistent)")  # fmt: skip
    gen.set_defaults(func=_cmd_codegen)
    return parser


def _known_gpus() -> list[str]:
    from .config.device import KNOWN_GPUS

    return sorted(KNOWN_GPUS)


def _head_dim(text: str) -> int:
    from .config.types import MAX_HEAD_DIM

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..{MAX_HEAD_DIM}, got {text!r}") from None
    if not 1 <= value <= MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_HEAD_DIM}, got {value}")
    return value


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--window -1,0` as `--window=-1,0`: argparse takes a value starting with '-' for an option (it only knows
    plain negative numbers), and -1 (unbounded) is the window's most common first value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--window" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--window={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
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
        print("fa2tune: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
