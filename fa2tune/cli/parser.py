"""The command line: one subparser per command, each option's value checked as it is parsed (arguments.py)."""

from __future__ import annotations

import argparse

from ..config.lengths import BUCKET_RANGES, SEQLEN_BUCKETS, TUNING_LENGTHS
from ..config.types import DTYPE_CHOICES, KERNELS  # torch-free, as everything this package imports at its top
from . import arguments, commands, tune_command
from .arguments import JOURNAL_SUFFIXES, MIN_TIMEOUT_S, STORAGE_DIALECTS
from .common import USAGE_ERROR


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, exit code 2: argparse's default prints the whole usage above the error, seven
    lines for `tune`, and the one that matters comes last."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fa2tune", description="Exact FlashAttention-2 in Triton, tuned per GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_check(sub)
    _add_inspect(sub)
    _add_plan(sub)
    _add_tune(sub)
    _add_show(sub)
    _add_codegen(sub)
    return parser


def _add_check(sub) -> None:
    check = sub.add_parser("check", help="run the kernels against a float64 reference on random odd shapes")
    check.add_argument("--device", type=arguments.device_name, default="cuda:0",
                       help="cuda[:N], or cpu (Triton's interpreter)")  # fmt: skip
    check.add_argument("--dtype", default="bf16,fp16", help=f"comma-separated, from {sorted(DTYPE_CHOICES)}")
    check.set_defaults(func=commands.check)


def _add_inspect(sub) -> None:
    inspect = sub.add_parser("inspect", help="what the GPU offers: SMs, shared memory, registers, L2")
    inspect.add_argument("--device", default="cuda:0")
    inspect.add_argument("--gpu", default=None, help="a known GPU instead of the card (see `fa2tune plan --help`)")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=commands.inspect)


def _add_plan(sub) -> None:
    plan = sub.add_parser("plan", help="which block configs fit the GPU's shared memory and registers, and why not")
    plan.add_argument("--head-dim", type=arguments.head_dim, required=True)
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--device", default="cuda:0")
    where.add_argument("--gpu", default=None, help="plan without the card: one of " + ", ".join(arguments.known_gpus()))
    plan.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_CHOICES))
    plan.add_argument("--kernel", default="fwd", choices=[*KERNELS, "bwd"])
    plan.add_argument("--json", action="store_true")
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
    tune.add_argument("--head-dim", type=arguments.head_dim, required=True)
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
                      help="where to write <gpu>.yaml (default: the user cache dir); checked writable before any "
                           "timing")  # fmt: skip
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
    tune.add_argument("--tokens", type=arguments.positive_int, default=16384, help="batch·N of each tuning length")


def _add_tune_budget(tune) -> None:
    tune.add_argument("--trials", type=arguments.positive_int, default=40,
                      help="configs timed per study (>= 1; the config the file holds for the key is timed beside "
                           "them, whatever the budget)")  # fmt: skip
    tune.add_argument("--timeout", type=arguments.timeout, default=None,
                      help=f"seconds per study (>= {MIN_TIMEOUT_S:g}): no new trial starts after it")  # fmt: skip
    tune.add_argument("--storage", type=arguments.storage, default=None,
                      help="where the trials are kept, to resume or share between workers: a database URL of "
                           f"{', '.join(STORAGE_DIALECTS)} (dialect+driver:// allowed), e.g. sqlite:///t.db, "
                           "sqlite:////abs/t.db, postgresql://user@host/db; or an Optuna journal file whose name ends "
                           f"in {' or '.join(JOURNAL_SUFFIXES)}; anything else is refused")  # fmt: skip


def _add_show(sub) -> None:
    show = sub.add_parser("show", help="which configs the attention_kernel uses, and from which file")
    show.add_argument("--device", type=arguments.device_name, default="cuda:0")
    show.add_argument("--gpu", default=None, help="list the stored entries for a known GPU without the card")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=commands.show)


def _add_codegen(sub) -> None:
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
    gen.add_argument("--head-dim", type=int, default=128,
                     help="fwd_ws: the head dim it is written out for, a chunk at a time (default 128)")  # fmt: skip
    gen.set_defaults(func=commands.codegen)


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
