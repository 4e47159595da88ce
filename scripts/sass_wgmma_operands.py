#!/usr/bin/env python3
"""Does a warp-specialized kernel keep its register wgmma operands intact through its step loops? (sm_90 SASS)

An asynchronous wgmma whose A operand sits in registers (an "RS" HGMMA) reads them after it is issued; a value
meant to stay in registers across a loop's steps (K and V of the d <= 64 dK/dV kernel) must not be
written inside the loop. This compiles one config offline for sm_90 (no GPU: Triton ships ptxas and cuobjdump),
finds the innermost loops that issue HGMMAs, and reports for each its HGMMAs, their register A operands, its
local-memory spills, and the writes that give an operand carried into the loop to another matmul (read by one
HGMMA before anything in the loop writes it, written, then read by an HGMMA accumulating elsewhere: what the
miscompile below looked like; exit status 1 if there are any).

    python scripts/sass_wgmma_operands.py --kernel bwd_dkdv --head-dim 64 --causal --config 64,128,4,3,ws
    python scripts/sass_wgmma_operands.py --kernel bwd_dkdv --head-dim 96 --causal \
        --config 64,128,4,2,ws,fused-dq,persistent --group 4   # a GQA call's code: 4 query heads a K/V head

Why: with K and V as register operands and the causal mask under a branch, an sm_90 compile rewrites K's and V's
registers on every step (wrong dK on the H200); with the mask applied without a branch, nothing in the loop writes
them. tests/test_warpspec.py runs this check on the shipped kinds of warp-specialized kernel.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_RS_HGMMA = re.compile(r"^HGMMA\S*\s+R(\d+),\s+R(\d+),")  # HGMMA D(accumulator), A(registers), B(descriptor)
_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")
_DEST = re.compile(r"^(\S+)\s+R(\d+)\b")
# instructions whose first register operand is not a destination
_NO_DEST = ("HGMMA", "ST", "RED", "ATOM", "BRA", "WARPGROUP", "BAR", "SYNCS", "UTMA", "EXIT", "ISETP", "FSETP")
A_OPERAND_REGISTERS = 4  # an m64nNk16 HGMMA's 16-bit A fragment: four registers from the one it names


@dataclass(frozen=True)
class LoopReport:
    start: int
    end: int
    hgmmas: int
    operand_registers: tuple[int, ...]  # first registers of the RS HGMMAs' A fragments
    clobbers: tuple[str, ...]  # writes that give an operand carried into the loop to another matmul (_reused_operands)
    spills: int  # LDL / STL in the loop


def parse(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate) of every instruction in cuobjdump -sass output."""
    found = []
    for line in sass.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            text = m.group(2)
            found.append((int(m.group(1), 16), text.split(None, 1)[1] if text.startswith("@") else text))
    return found


def innermost_hgmma_loops(instructions: list[tuple[int, str]]) -> list[LoopReport]:
    """One report per backward branch whose body issues HGMMAs and holds no other such loop."""
    loops = {(int(t, 16), a) for a, x in instructions for t in _BRANCH.findall(x) if int(t, 16) < a}
    with_hgmma = [(s, e) for s, e in loops if any(s <= a <= e and x.startswith("HGMMA") for a, x in instructions)]
    innermost = [(s, e) for s, e in with_hgmma
                 if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in with_hgmma)]  # fmt: skip
    reports = []
    for start, end in sorted(innermost):
        body = [x for a, x in instructions if start <= a <= end]
        operands = sorted({int(m.group(2)) for x in body if (m := _RS_HGMMA.match(x))})
        spills = sum(x.startswith(("LDL", "STL")) for x in body)
        reports.append(LoopReport(start, end, sum(x.startswith("HGMMA") for x in body), tuple(operands),
                                  _reused_operands(body), spills))  # fmt: skip
    return reports


def _destination(instruction: str) -> int | None:
    """The register an instruction writes (its first operand), or None for stores, branches, HGMMAs, compares."""
    m = _DEST.match(instruction)
    return None if m is None or m.group(1).startswith(_NO_DEST) else int(m.group(2))


def _reused_operands(body: list[str]) -> tuple[str, ...]:
    """Writes that turn a register operand carried into the loop into another matmul's operand: the register is
    read, before anything in the loop writes it, as the A operand of HGMMAs accumulating into some register blocks,
    then written, then read as the A operand of HGMMAs accumulating into none of those. That is the signature of a
    value meant to last the loop (an operand loaded once) whose registers the compile gave to a value of one step; a
    value of the step before replaced by this step's (P of a pipelined forward) is read by the same matmuls before
    and after — by each head-dim chunk's, where V comes in several (d=192: P feeds two accumulators, and the loop as
    compiled may begin between their reads)."""
    before: dict[int, set[int]] = {}  # register -> accumulators of the HGMMAs that read it before any write
    after: dict[int, set[int]] = {}  # register -> accumulators of those that read it after the first write
    written: dict[int, str] = {}  # register -> the first instruction in the loop that wrote it
    for x in body:
        m = _RS_HGMMA.match(x)
        if m:
            accumulator, first = int(m.group(1)), int(m.group(2))
            for reg in range(first, first + A_OPERAND_REGISTERS):
                (after if reg in written else before).setdefault(reg, set()).add(accumulator)
        r = _destination(x)
        if r is not None:
            written.setdefault(r, x)
    found = []
    for reg, readers in after.items():
        if before.get(reg) and not readers & before[reg] and written[reg] not in found:
            found.append(written[reg])
    return tuple(found)


def compile_sass(kernel: str, config: str, head_dim: int, causal: bool, seqlen: int | None = None,
                 group: int = 1) -> str:  # fmt: skip
    """sm_90 SASS of one config of `kernel`, compiled without a GPU, as a call of `seqlen` tokens specializes it (None:
    probe.EXAMPLE_SEQLEN, a multiple of 16), of `group` query heads a K/V head (probe.compile_config's)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    from fa2tune.config.types import KernelConfig
    from fa2tune.tune import probe

    cfg = KernelConfig.parse(config)
    report = probe.compile_config(kernel, cfg, head_dim, torch.bfloat16, causal=causal,
                                  seqlen=probe.EXAMPLE_SEQLEN if seqlen is None else seqlen, group=group)  # fmt: skip
    if report.error:
        sys.exit(f"{cfg.label()}: {report.error}")
    return probe.cuobjdump(report.cubin, "-sass")


def add_compile_arguments(parser: argparse.ArgumentParser, kernel: str, config: str) -> None:
    """The options that name one config to compile (compile_sass's arguments), with these defaults."""
    parser.add_argument("--kernel", default=kernel, choices=("fwd", "bwd_dkdv", "bwd_dq"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument(
        "--config",
        default=config,
        help="block_m,block_n,warps,stages[,switch words of KernelConfig.label] (KernelConfig.parse)",
    )
    parser.add_argument(
        "--seqlen",
        type=int,
        default=None,
        help="the call's length the compile specializes for (default 8192; one that is not a multiple of 16 compiles "
        "the code such a call runs)",
    )
    parser.add_argument(
        "--group",
        type=int,
        default=1,
        help="query heads a K/V head, dividing the example call's 16 (default 1: an MHA call's code, the group a "
        "constant; more: a GQA call's, the group a run-time value)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_compile_arguments(parser, "bwd_dkdv", "64,128,4,3,ws")
    parser.add_argument("--sass", default=None, help="read this cuobjdump -sass output instead of compiling")
    args = parser.parse_args()
    if args.sass:
        with open(args.sass) as f:
            sass = f.read()
    else:
        sass = compile_sass(args.kernel, args.config, args.head_dim, args.causal, args.seqlen, args.group)
    reports = innermost_hgmma_loops(parse(sass))
    for r in reports:
        print(f"loop {r.start:#06x}-{r.end:#06x}: {r.hgmmas} HGMMA, register A operands from "
              f"{', '.join(f'R{o}' for o in r.operand_registers) or 'none'}; {r.spills} LDL/STL; "
              f"{len(r.clobbers)} writes giving an operand carried into the loop to another matmul")  # fmt: skip
        for x in r.clobbers[:5]:
            print(f"    {x}")
    sys.exit(1 if any(r.clobbers for r in reports) else 0)


if __name__ == "__main__":
    main()
