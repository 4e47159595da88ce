"""The `fa2tune` command: parse, call the library, print."""

from __future__ import annotations

import argparse
import os
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _resolve_device(name: str) -> str:
    """Returns a usable device string or exits with code 2 and a one-line reason."""
    import torch

    if name == "cpu":
        # Triton reads TRITON_INTERPRET when it builds each @jit function, its own library's included, so the
        # choice must come before triton is imported; fa2tune itself imports triton only when a kernel runs.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
            sys.exit("fa2tune: --device cpu needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        print("note: --device cpu runs the kernels through Triton's interpreter: right answers, no speed.")
        return "cpu"
    if not name.startswith("cuda"):
        sys.exit(f"fa2tune: --device must be cpu or cuda[:N], got {name!r}")
    if not torch.cuda.is_available():
        print(f"fa2tune: no CUDA device is visible (asked for {name}); use --device cpu to run through Triton's "
              "interpreter", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    return name


def _cmd_check(args: argparse.Namespace) -> int:
    device = _resolve_device(args.device)
    import torch

    from . import selfcheck

    dtypes = [getattr(torch, DTYPES[d]) for d in args.dtype.split(",")]
    print(f"{'batch,hq,hkv,nq,nk,d':>24} {'dtype':>9} {'causal':>6} {'rel err O':>10} {'rel err lse':>11}  result")
    failed = 0
    for shape in selfcheck.default_shapes(on_gpu=device != "cpu"):
        for dtype in dtypes:
            for causal in (False, True):
                r = selfcheck.check_forward(shape, dtype=dtype, causal=causal, device=device)
                failed += not r.passed
                print(f"{','.join(map(str, r.shape)):>24} {str(dtype).replace('torch.', ''):>9} {causal!s:>6} "
                      f"{r.rel_err:>10.1e} {r.lse_rel_err:>11.1e}  {'ok' if r.passed else 'FAIL'}")  # fmt: skip
    print("all checks passed" if not failed else f"{failed} checks FAILED")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fa2tune", description="Exact FlashAttention-2 in Triton, tuned per GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run the kernels against a float64 reference on random odd shapes")
    check.add_argument("--device", default="cuda:0", help="cuda[:N], or cpu for Triton's interpreter")
    check.add_argument("--dtype", default="bf16,fp16", help=f"comma-separated, from {sorted(DTYPES)}")
    check.set_defaults(func=_cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "dtype", None):
        bad = [d for d in args.dtype.split(",") if d not in DTYPES]
        if bad:
            print(f"fa2tune: --dtype must be from {sorted(DTYPES)}, got {bad}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
