"""The `fa2tune` command: parse, call the library, print."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

from .types import DTYPE_CHOICES  # torch-free: `fa2tune tune` starts its helper processes before importing torch


def _resolve_device(name: str) -> str:
    """Returns a usable device string or exits with code 2 and a one-line reason."""
    import torch

    if name == "cpu":
        # Triton reads TRITON_INTERPRET when it builds each @jit function, its own library's included, so the
        # choice must come before triton is imported; fa2tune itself imports triton only when a kernel runs.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
            sys.exit("fa2tune: --device cpu needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        print(
            "note: --device cpu runs the kernels through Triton's interpreter: right answers, no speed.",
            file=sys.stderr,
        )
        return "cpu"
    if not name.startswith("cuda"):
        sys.exit(f"fa2tune: --device must be cpu or cuda[:N], got {name!r}")
    if not torch.cuda.is_available():
        print(
            f"fa2tune: no CUDA device is visible (asked for {name}); use --device cpu to run through Triton's "
            "interpreter",
            file=sys.stderr,
        )
        sys.exit(2)
    return name


def _cmd_check(args: argparse.Namespace) -> int:
    device = _resolve_device(args.device)

    from . import selfcheck
    from .inputs import DTYPES_BY_NAME
    from .types import Mask

    dtypes = [DTYPES_BY_NAME[d] for d in args.dtype.split(",")]
    print(f"{'batch,hq,hkv,nq,nk,d':>24} {'dtype':>9} {'mask':>14} {'rel err O':>10} {'rel err lse':>11}  result")
    failed = 0
    for shape in selfcheck.default_shapes(on_gpu=device != "cpu"):
        left = max(8, shape[4] // 4)  # a window that leaves whole K tiles out at the larger lengths
        masks = [("full", Mask(), False), ("causal", Mask(causal=True), False),
                 (f"window {left},0", Mask(causal=True, window=(left, -1)), False),
                 ("causal varlen", Mask(causal=True), True)]  # fmt: skip
        for dtype in dtypes:
            for name, mask, varlen in masks:
                r = selfcheck.check_forward(shape, dtype=dtype, causal=mask, device=device, varlen=varlen)
                failed += not r.passed
                print(
                    f"{','.join(map(str, r.shape)):>24} {str(dtype).replace('torch.', ''):>9} {name:>14} "
                    f"{r.rel_err:>10.1e} {r.lse_rel_err:>11.1e}  {'ok' if r.passed else 'FAIL'}"
                )
    print("all checks passed" if not failed else f"{failed} checks FAILED")
    return 1 if failed else 0


def _device_info(args: argparse.Namespace):
    """The DeviceInfo for --gpu NAME (the known-GPU table) or --device cuda:N (the card); exits 2 without one."""
    from . import device

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

    from . import planner
    from .inputs import DTYPES_BY_NAME

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
                # asdict, not to_dict: every row of a table has every column, switches at 0 included
                "accepted": [{**asdict(cfg), "sram_bytes": need} for cfg, need in p.accepted],
                "rejected": [{**asdict(cfg), "sram_bytes": need, "reason": why} for cfg, need, why in p.rejected],
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
    """The config's template switches in words ("" for the plain Triton template)."""
    names = {"pipeline_qk": {1: "pipeline_qk"}, "warpspec": {1: "warpspec", 2: "warpspec ping-pong"},
             "persistent": {1: "persistent", 2: "persistent, two programs an SM"}}  # fmt: skip
    return " ".join(names[field][value] for field, value in asdict(cfg).items() if field in names and value)


def _cmd_codegen(args: argparse.Namespace) -> int:
    from . import codegen
    from .types import Variant

    variant = Variant.for_template(
        args.template, causal=args.causal, banded=False, varlen=False, even_m=not args.ragged,
        even_n=not args.ragged, dot_fp32=args.interpret, pingpong=args.pingpong, persistent=args.persistent,
    )  # fmt: skip
    print(codegen.render(args.template, variant), end="")
    return 0


def _window(text: str) -> tuple[int, int]:
    from .inputs import check_window

    try:
        return check_window(tuple(int(x) for x in text.split(",")))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT with ints >= -1, got {text!r} ({exc})") from None


def _tuning_lengths(text: str | None, bucket: str) -> tuple[int, ...]:
    """--seqlens, or the bucket's default; a bucket tuned at a length it never serves would be wrong."""
    from .store import BUCKET_RANGES

    text = text or {"short": "512,1024", "medium": "2048,4096"}.get(bucket, "1024,4096,16384")
    try:
        seqlens = tuple(int(n) for n in text.split(","))
    except ValueError:
        seqlens = ()
    problem = None
    if not seqlens or min(seqlens) < 1:
        problem = f"--seqlens must be comma-separated ints >= 1, got {text!r}"
    elif bucket in BUCKET_RANGES and not all(BUCKET_RANGES[bucket][0] < n <= BUCKET_RANGES[bucket][1] for n in seqlens):
        low, high = BUCKET_RANGES[bucket]
        problem = f"--seqlen-bucket {bucket} serves lengths in ({low}, {high}]; --seqlens {text} goes outside it"
    if problem:
        print(f"fa2tune: {problem}", file=sys.stderr)
        sys.exit(2)
    return seqlens


def _at_served_lengths(spec, target):
    """spec, tuned at the lengths that the file's bucket entries leave to it (tunejob.unserved_lengths), and says so."""
    from . import tunejob

    lengths = tunejob.unserved_lengths(spec, target)
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


def _cmd_tune(args: argparse.Namespace) -> int:
    if all(d.strip().startswith("cuda") for d in args.device.split(",")) or args.device == "all":
        # Before this process imports torch: the fork server that starts the workers and compile processes imports
        # torch, triton and fa2tune meanwhile (fa2tune.processes), not after.
        from . import processes

        processes.start_early()
    devices = [d.strip() for d in args.device.split(",")] if args.device != "all" else _all_cuda_devices()
    devices = [_resolve_device(d) for d in devices]
    from . import bench, planner, runtime, store, tunejob

    if devices[0] == "cpu":
        print("note: CPU timings (Triton's interpreter) say nothing about GPU speed; this run only exercises the "
              "pipeline on tiny shapes.")  # fmt: skip
    kernels = {"bwd": ["bwd_dkdv", "bwd_dq"], "all": list(planner.KERNELS)}.get(args.kernel, [args.kernel])
    seqlens = _tuning_lengths(args.seqlens, args.seqlen_bucket)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    config_dir = Path(args.config_dir) if args.config_dir else store.user_config_dir()
    storage = args.storage
    if storage is None and len(devices) > 1:  # workers share one study through a journal file
        storage = str(config_dir / ".studies" / "tune.journal")
    rows, path = [], None
    # One pool of compile processes for every study of a single-GPU tune (multi-GPU workers start their own).
    jobs = args.jobs or os.cpu_count() or 1
    pool = bench.CompilePool(jobs) if devices[0] != "cpu" and len(devices) == 1 else None
    try:
        specs = [
            tunejob.StudySpec(kernel=kernel, head_dim=args.head_dim, dtype=args.dtype, causal=causal,
                              seqlens=seqlens, tokens=args.tokens, trials=args.trials, timeout_s=args.timeout,
                              storage=storage, window=args.window, varlen=args.varlen,
                              seqlen_bucket=args.seqlen_bucket)
            for kernel in kernels for causal in causals
        ]  # fmt: skip
        target = tunejob.config_path(devices[0], config_dir)  # what the file holds now is timed beside the rest
        specs = [replace(spec, incumbent=tunejob.incumbent(spec, target)) for spec in specs]
        if args.seqlens is None:  # an "all" entry beside bucket entries is tuned at the lengths it serves
            specs = [_at_served_lengths(spec, target) for spec in specs]
        if len(devices) > 1:
            print(f"{len(specs)} studies shared by {len(devices)} workers ({storage})", flush=True)
            done = tunejob.run_parallel_many(specs, devices, progress=_worker_progress(specs, devices))
            print()
            for spec, (result, entry, _) in zip(specs, done, strict=True):
                path = tunejob.write(entry, devices[0], config_dir)
                rows.append((spec.kernel, spec.causal, result))
        for number, spec in enumerate(specs if len(devices) == 1 else []):

            def progress(done, total, best_ms, elapsed, spec=spec):
                print(f"\r  {spec.kernel} causal={spec.causal}: trial {done}/{total}  best {best_ms:.3f} ms  "
                      f"{elapsed:.0f} s", end="", flush=True)  # fmt: skip

            then = specs[number + 1] if number + 1 < len(specs) else None  # its first configs compile meanwhile
            result, entry = tunejob.run_study(
                spec, devices[0], on_trial=progress, compile_pool=pool, then=then, release_pool=then is None
            )
            print()
            path = tunejob.write(entry, devices[0], config_dir)
            rows.append((spec.kernel, spec.causal, result))
    finally:
        if pool is not None:
            pool.close()
    runtime.clear_cache()
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
    return 0


def _all_cuda_devices() -> list[str]:
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        print("fa2tune: --device all found no CUDA device", file=sys.stderr)
        sys.exit(2)
    return [f"cuda:{i}" for i in range(count)]


def _cmd_show(args: argparse.Namespace) -> int:
    import torch

    from . import runtime, selection, store

    if args.gpu:
        info = _device_info(args)
        slug = info.slug
    else:
        device_name = _resolve_device(args.device)
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
    if not args.gpu:  # what the runtime resolves now, including planner defaults
        for head_dim in sorted({r["head_dim"] for r in rows if "head_dim" in r} | {64, 128}):
            for causal in (False, True):
                k = runtime.get_kernel(head_dim, device=device_name, dtype=torch.bfloat16, causal=causal)
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
    parser = argparse.ArgumentParser(prog="fa2tune", description="Exact FlashAttention-2 in Triton, tuned per GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run the kernels against a float64 reference on random odd shapes")
    check.add_argument("--device", default="cuda:0", help="cuda[:N], or cpu for Triton's interpreter")
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
    plan.add_argument("--kernel", default="fwd", choices=["fwd", "bwd", "bwd_dkdv", "bwd_dq"])
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_cmd_plan)

    tune = sub.add_parser("tune", help="time candidate configs with Optuna and store the fastest as YAML")
    tune.add_argument(
        "--device",
        default="cuda:0",
        help="cuda[:N]; several (cuda:0,cuda:1) or 'all' run one worker per GPU on one study; "
        "cpu exercises the pipeline (no speed)",
    )
    tune.add_argument("--head-dim", type=_head_dim, required=True)
    tune.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_CHOICES))
    tune.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    tune.add_argument(
        "--kernel",
        default="fwd",
        choices=["fwd", "bwd", "bwd_dkdv", "bwd_dq", "all"],
        help="bwd: both backward kernels; bwd_dkdv / bwd_dq one of them (after a change to its template)",
    )
    tune.add_argument(
        "--window",
        type=_window,
        default=None,
        help="LEFT,RIGHT: tune the band-mask variant at this window, e.g. 1024,0 or -1,0 (-1: unbounded)",
    )
    tune.add_argument("--varlen", action="store_true", help="tune the packed-sequence (attention_varlen) variant")
    tune.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU core)")
    tune.add_argument("--seqlens", default=None,
                      help="tuning lengths, at batch·N = --tokens (default 1024,4096,16384 — less those the "
                           "file's short and medium entries for the key serve, 8192 added where fewer than two "
                           "remain —; 512,1024 for --seqlen-bucket short; 2048,4096 for medium)")  # fmt: skip
    tune.add_argument("--seqlen-bucket", default="all", choices=["all", "short", "medium"],
                      help="short: an entry used only by calls with max(seqlen_q, seqlen_k) <= 1024, tuned at such "
                           "lengths (a backward kernel timed inside the whole training call, where the host can be "
                           "the bound); medium: the same for 1024 < max(seqlen_q, seqlen_k) <= 4096; all: the entry "
                           "for every other length")  # fmt: skip
    tune.add_argument("--tokens", type=int, default=16384)
    tune.add_argument("--trials", type=int, default=40, help="configs measured per study")
    tune.add_argument("--timeout", type=float, default=None, help="seconds per study")
    tune.add_argument("--storage", default=None, help="Optuna storage URL shared by workers (sqlite:///t.db, ...)")
    tune.add_argument("--config-dir", default=None, help="where to write <gpu>.yaml (default: the user cache dir)")
    tune.set_defaults(func=_cmd_tune)

    show = sub.add_parser("show", help="which configs the runtime uses, and from which file")
    show.add_argument("--device", default="cuda:0")
    show.add_argument("--gpu", default=None, help="list the stored entries for a known GPU without the card")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_cmd_show)

    gen = sub.add_parser("codegen", help="print the generated Triton (or Gluon) source of one template variant")
    gen.add_argument("--template", default="fwd", choices=["fwd", "bwd", "fwd_ws", "bwd_ws", "bwd_dq_ws"],
                     help="fwd_ws / bwd_ws / bwd_dq_ws: the warp-specialized forward / dK/dV / dQ kernel (Gluon, "
                     "Hopper), KernelConfig.warpspec")  # fmt: skip
    gen.add_argument("--causal", action="store_true")
    gen.add_argument("--ragged", action="store_true", help="lengths that are not multiples of the blocks")
    gen.add_argument("--interpret", action="store_true", help="the variant used under TRITON_INTERPRET=1")
    gen.add_argument("--pingpong", action="store_true", help="fwd_ws: the ping-pong variant (warpspec=2)")
    gen.add_argument("--persistent", action="store_true", help="fwd_ws: one program per SM walks the tiles")
    gen.set_defaults(func=_cmd_codegen)
    return parser


def _known_gpus() -> list[str]:
    from .device import KNOWN_GPUS

    return sorted(KNOWN_GPUS)


def _head_dim(text: str) -> int:
    from .types import MAX_HEAD_DIM

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
            return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # `fa2tune plan ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
