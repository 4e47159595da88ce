"""The command line: one subparser per command, each option's value checked as it is parsed (arguments.py)."""

from __future__ import annotations

import argparse

from ..bench import PROVIDER_NAMES
from ..bench.shapes import GRID_TOKENS, GRID_WIDTH, MODES, PRESET_HELP
from ..config.decode_config import DECODE_KERNEL
from ..config.lengths import BUCKET_RANGES, SEQLEN_BUCKETS, TUNING_LENGTHS, TUNING_TOKENS
from ..config.types import DTYPE_CHOICES, KERNELS  # torch-free, as everything this package imports at its top
from . import arguments, bench_command, commands, tune_command
from .arguments import JOURNAL_SUFFIXES, MIN_TIMEOUT_S, RUN_BUDGET_S, STORAGE_DIALECTS
from .common import USAGE_ERROR
from .decode_tune_command import DEFAULT_HEADS


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit code 2: argparse's default prints the whole usage above the error, seven
    lines for `tune`, and the one that matters comes last."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


_QUIET = "no notes or progress on stderr, only warnings and errors (results still print)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fa2tune", description="Exact FlashAttention-2 in Triton, tuned per GPU.")
    parser.add_argument("--version", action="version", version=_version(),
                        help="print fa2tune's version and those of Triton and PyTorch installed, and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help=_QUIET)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_check(sub)
    _add_inspect(sub)
    _add_plan(sub)
    _add_tune(sub)
    _add_show(sub)
    _add_codegen(sub)
    _add_bench(sub)
    for command in sub.choices.values():  # `fa2tune tune ... -q` as well as `fa2tune -q tune ...`
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=_QUIET)
    return parser


def _version() -> str:
    """fa2tune 0.1.0 (triton 3.6.0, torch 2.13.0): the versions a bug report needs, read without importing them."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"fa2tune {__version__} (triton {installed('triton')}, torch {installed('torch')})"


def _add_check(sub) -> None:
    check = sub.add_parser("check", help="run the kernels against a float64 reference on random odd shapes")
    check.add_argument("--device", type=arguments.device_name, default="cuda:0",
                       help="cuda[:N], or cpu (Triton's interpreter)")  # fmt: skip
    check.add_argument("--dtype", default="bf16,fp16", help=f"comma-separated, from {sorted(DTYPE_CHOICES)}")
    check.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    check.set_defaults(func=commands.check)


def _add_inspect(sub) -> None:
    inspect = sub.add_parser("inspect", help="what the GPU offers: SMs, shared memory, registers, L2")
    inspect.add_argument("--device", default="cuda:0", help="the CUDA device to read (cuda[:N])")
    inspect.add_argument("--gpu", default=None, help="a known GPU instead of the card (see `fa2tune plan --help`)")
    inspect.add_argument("--json", action="store_true", help="print the properties as JSON")
    inspect.set_defaults(func=commands.inspect)


def _add_plan(sub) -> None:
    plan = sub.add_parser("plan", help="which block configs fit the GPU's shared memory and registers, and why not")
    plan.add_argument("--head-dim", type=arguments.head_dim, required=True, help="the head dimension d to plan for")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--device", default="cuda:0", help="plan for this CUDA device's card (cuda[:N])")
    where.add_argument("--gpu", default=None, help="plan without the card: one of " + ", ".join(arguments.known_gpus()))
    plan.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_CHOICES), help="the q, k, v dtype")
    plan.add_argument("--kernel", default="fwd", choices=[*KERNELS, "bwd"],
                      help="the kernel whose configs to plan; bwd: both backward kernels")  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print the plan as JSON, every config's switches included")
    plan.set_defaults(func=commands.plan)


def _add_tune(sub) -> None:
    tune = sub.add_parser("tune", help="time candidate configs with Optuna and store the fastest as YAML")
    tune.add_argument(
        "--device",
        type=arguments.device_names,
        default="cuda:0",
        help="cuda[:N]; several (cuda:0,cuda:1; each GPU once, all of one kind) or 'all' run one worker per GPU "
        "on one study; cpu exercises the pipeline (no speed)",
    )
    tune.add_argument("--head-dim", type=arguments.head_dim, required=True, help="the head dimension d to tune for")
    tune.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_CHOICES), help="the q, k, v dtype to tune for")
    tune.add_argument("--causal", default="both", choices=["both", "yes", "no"],
                      help="which masks get a study: causal, no mask, or both (one study each)")  # fmt: skip
    tune.add_argument(
        "--kernel",
        default="all",
        choices=[*KERNELS, "bwd", "all", DECODE_KERNEL],
        help="all (default): the forward and both backward kernels, what training runs; fwd: the forward alone "
        "(inference); bwd: both backward kernels; bwd_dkdv / bwd_dq one of them (after a change to its template); "
        "decode: flash_attn_with_kvcache's decode kernel and its split rule, timed on decode steps of --heads over "
        "--kv-heads heads (one entry per head dim and dtype; --causal, --window, --varlen, --seqlens, "
        "--seqlen-bucket, --tokens and --storage do not apply)",
    )
    tune.add_argument("--heads", type=arguments.positive_int, default=None,
                      help=f"query heads of the timed calls: your model's (default: {GRID_WIDTH} // d; --kernel "
                           f"decode: {DEFAULT_HEADS[0]})")  # fmt: skip
    tune.add_argument("--kv-heads", type=arguments.positive_int, default=None,
                      help="K/V heads of the timed calls, dividing --heads (default: as many as --heads; --kernel "
                           f"decode: {DEFAULT_HEADS[1]}); fewer than --heads tunes grouped-query entries, which GQA "
                           "calls read before the plain entry of the same length bucket")  # fmt: skip
    tune.add_argument(
        "--window",
        type=arguments.window,
        default=None,
        help="LEFT,RIGHT: tune the band-mask variant at this window, e.g. 1024,0 or -1,0 (-1: unbounded)",
    )
    tune.add_argument("--varlen", action="store_true", help="tune the packed-sequence (attention_varlen) variant")
    tune.add_argument("--jobs", type=arguments.positive_int, default=None,
                      help="compile processes (default: one per CPU core)")  # fmt: skip
    _add_tune_lengths(tune)
    _add_tune_budget(tune)
    tune.add_argument("--config-dir", default=None,
                      help="where to write <gpu>.yaml (default: $FA2TUNE_CONFIG_DIR where it is set, the first "
                           "directory calls search, else the user cache dir); checked writable before any "
                           "timing")  # fmt: skip
    tune.add_argument("--json", action="store_true",
                      help="print what each study found as JSON instead of the table (progress stays on stderr)")
    tune.set_defaults(func=tune_command.tune)


def _add_tune_lengths(tune) -> None:
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
    tune.add_argument("--tokens", type=arguments.positive_int, default=TUNING_TOKENS,
                      help="batch·N of each tuning length")  # fmt: skip


def _add_tune_budget(tune) -> None:
    tune.add_argument("--trials", type=arguments.positive_int, default=40,
                      help="configs timed per study at most, within its --timeout (>= 1; the config the file holds "
                           "for the key is timed beside them, whatever the budget)")  # fmt: skip
    tune.add_argument("--timeout", type=arguments.timeout, default=None,
                      help=f"seconds per study (>= {MIN_TIMEOUT_S:g}), counted from its first reading: no config is "
                           f"timed after it (default: {RUN_BUDGET_S:g} s of wall time shared by the run's studies, "
                           "builds included)")  # fmt: skip
    tune.add_argument("--storage", type=arguments.storage, default=None,
                      help="where the trials are kept, to resume or share between workers: a database URL of "
                           f"{', '.join(STORAGE_DIALECTS)} (dialect+driver:// allowed), e.g. sqlite:///t.db, "
                           "sqlite:////abs/t.db, postgresql://user@host/db; or an Optuna journal file whose name ends "
                           f"in {' or '.join(JOURNAL_SUFFIXES)}; anything else is refused")  # fmt: skip


def _add_show(sub) -> None:
    show = sub.add_parser("show", help="which configs the attention_kernel uses, and from which file")
    where = show.add_mutually_exclusive_group()  # as plan's: a --device beside --gpu would be ignored
    where.add_argument("--device", type=arguments.device_name, default="cuda:0",
                       help="cuda[:N], or cpu (Triton's interpreter): whose configs to show")  # fmt: skip
    where.add_argument("--gpu", default=None, help="list the stored entries for a known GPU without the card")
    show.add_argument("--json", action="store_true", help="print the entries as JSON")
    show.set_defaults(func=commands.show)


def _add_codegen(sub) -> None:
    gen = sub.add_parser("codegen", help="print the generated Triton (or Gluon) source of one template variant")
    gen.add_argument("--template", default="fwd", choices=["fwd", "bwd", "fwd_ws", "bwd_ws", "bwd_dq_ws"],
                     help="fwd_ws / bwd_ws / bwd_dq_ws: the warp-specialized forward / dK/dV / dQ kernel (Gluon, "
                     "Hopper), KernelConfig.warp_specialized")  # fmt: skip
    gen.add_argument("--causal", action="store_true", help="the causal-mask variant")
    gen.add_argument("--ragged", action="store_true", help="lengths that are not multiples of the blocks")
    gen.add_argument("--interpret", action="store_true", help="the variant used under TRITON_INTERPRET=1")
    gen.add_argument("--pingpong", action="store_true", help="fwd_ws: two consumers take turns (KernelConfig.pingpong)")
    gen.add_argument("--fused-dq", action="store_true",
                     help="bwd_ws: dQ added by the dK/dV kernel (KernelConfig.fused_dq)")  # fmt: skip
    gen.add_argument("--split-roles", action="store_true",
                     help="bwd_ws: two consumers share 64 K/V rows, dV side and dK side (KernelConfig.split_roles)")
    gen.add_argument("--drain-before-dq", action="store_true",
                     help="bwd_ws with --fused-dq: the step's dV and dK retire before its dQ share "
                     "(KernelConfig.drain_before_dq)")  # fmt: skip
    gen.add_argument("--persistent", action="store_true",
                     help="the *_ws templates: programs walk the tiles (Schedule.persistent)")  # fmt: skip
    gen.add_argument("--pad-head-dim", action="store_true",
                     help="the *_ws templates: the head dim computed in fewer, wider chunks where that costs at most "
                     "a quarter more columns (KernelConfig.pad_head_dim; d=112: one chunk of 128)")  # fmt: skip
    gen.add_argument("--two-an-sm", action="store_true",
                     help="bwd_ws: the form two programs an SM run (Schedule.programs_per_sm = 2): the consumers load "
                     "each step's logsumexp and δ, not staged in shared memory (KernelConfig.stages_statistics)")
    gen.add_argument("--head-dim", type=arguments.head_dim, default=128,
                     help="fwd_ws: the head dim it is written out for, a chunk at a time (default 128)")  # fmt: skip
    gen.set_defaults(func=commands.codegen)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="TFLOP/s of fa2tune beside PyTorch's SDPA backends, FlexAttention and "
                           "flash_attn, on the same inputs, each checked against a reference")  # fmt: skip
    bench.add_argument("--device", type=arguments.device_name, default="cuda:0",
                       help="cuda[:N], or cpu: tiny shapes through Triton's interpreter (checks the pipeline; the "
                            "timings say nothing about speed)")  # fmt: skip
    bench.add_argument("--preset", choices=sorted(PRESET_HELP), default=None,
                       help="the shapes of a named set, which the shape flags below then change: "
                            + "; ".join(f"{name}: {text}" for name, text in PRESET_HELP.items())
                            + " (default: grid)")  # fmt: skip
    bench.add_argument("--batch", type=arguments.positive_int, default=None,
                       help=f"batch size (default: {GRID_TOKENS} // N, the grid's batch·N)")
    bench.add_argument("--heads", type=arguments.positive_int, default=None,
                       help=f"query heads (default: {GRID_WIDTH} // d, the grid's heads·d)")
    bench.add_argument("--kv-heads", type=arguments.positive_int, default=None,
                       help="K/V heads, dividing the query heads: fewer is grouped-query attention (default: as many "
                            "as query heads)")  # fmt: skip
    bench.add_argument("--seqlen", type=arguments.positive_ints, default=None,
                       help="sequence lengths N, comma-separated (query and key lengths are equal)")
    bench.add_argument("--head-dim", type=arguments.head_dims, default=None, help="head dims, comma-separated")
    bench.add_argument("--causal", choices=["no", "yes", "both"], default=None,
                       help="which masks: no mask, causal, or both (default: both)")
    bench.add_argument("--dtype", choices=sorted(DTYPE_CHOICES), default=None, help="q, k, v dtype (default: bf16)")
    bench.add_argument("--mode", type=arguments.modes, default=None,
                       help=f"{' or '.join(MODES)}, comma-separated for both (default: both); fwd+bwd times the "
                            "forward and all three gradients (FLOPs x 3.5)")  # fmt: skip
    bench.add_argument("--providers", type=arguments.provider_names, default=None,
                       help=f"comma-separated, from {', '.join(PROVIDER_NAMES)} (default: all; one that is not "
                            "installed or cannot run on the device is skipped with a note)")  # fmt: skip
    _add_bench_outputs(bench)
    bench.set_defaults(func=bench_command.bench)


def _add_bench_outputs(bench) -> None:
    bench.add_argument("--json", action="store_true",
                       help="print the rows, the environment and the summary as JSON instead of the table")
    bench.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    bench.add_argument("--plots", default=None,
                       help="write TFLOP/s plots (one PNG per head dim and mode) to this folder; needs matplotlib "
                            "(pip install 'fa2tune[bench]'), skipped with a note without it")  # fmt: skip
    bench.add_argument("--from-csv", default=None,
                       help="report (and plot) an earlier run's CSV instead of measuring; the shape flags are not "
                            "used")  # fmt: skip
    bench.add_argument("--merge-into", default=None,
                       help="a CSV whose rows for the shapes and providers measured are replaced (the rest kept, "
                            "new ones added): how part of a grid is measured again")  # fmt: skip
    bench.add_argument("--processes", type=arguments.positive_int, default=1,
                       help="measure in this many fresh processes, one after another, and report each row's median "
                            "(training calls at N <= 512 wait for the host and read up to 35 %% apart between "
                            "processes)")  # fmt: skip
    bench.add_argument("--rounds", type=arguments.positive_int, default=1,
                       help="time each shape's providers this many times, each round in the other order (first to "
                            "last, then last to first), and report the mean: a GPU's readings drift within a run, "
                            "which one pass in a fixed order charges to the providers timed last")  # fmt: skip


def join_negative_values(argv: list[str]) -> list[str]:
    """`--window -1,0` as `--window=-1,0`: argparse takes a value starting with '-' for an option (it only knows
    plain negative numbers), and -1 (unbounded) is the window's most common first value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--window" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--window={arg}"
        else:
            out.append(arg)
    return out
