#!/usr/bin/env python3
"""What one consumer warp issues per step of a warp-specialized kernel's softmax loop (sm_90 SASS, compiled offline).

Finds the step loop — the innermost loop that issues both HGMMAs and a softmax's MUFU.EX2 (a consumer's QKᵀ,
softmax and P·V) — and counts its instructions by opcode, and the blocks inside it that a forward branch skips (the
mask, run only on tiles that cross the diagonal or the end of K): the instructions of an unmasked step are the
loop's less those (of an if/else's two blocks — a masked and an unmasked copy of the softmax — less the larger).
Against the step's tensor and MUFU cycles this says which unit a config could be bound by (at d=64 (192, 128) and
d=128 (128, 128) neither issue nor MUFU is saturated: the tensor pipe is the bound).
It also says where the step waits for its wgmmas (WARPGROUP.DEPBAR.LE gsb0, N: until at most N groups are in
flight) against its exponentials: a softmax meant to run under the previous P·V must come before the wait for none
in flight, and ptxas moves that wait ahead of it unless the softmax ends its basic block before the wait.
No GPU needed (Triton ships ptxas and cuobjdump); tests/test_warpspec.py runs it on the shipped forward and dQ.

    python scripts/sass_step_mix.py --kernel fwd --head-dim 64 --config 192,128,4,2,ws,persistent
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass

from sass_wgmma_operands import add_compile_arguments, compile_sass, parse

# a branch and its target; sm_90 writes some conditional branches with a second predicate ("@!P2 BRA P1, 0x5a70")
_TARGET = re.compile(r"^BRA(?:\.\S+)?\s+(?:!?U?P\d+,\s*)?(0x[0-9a-f]+)")


@dataclass(frozen=True)
class StepLoop:
    start: int
    end: int
    opcodes: Counter  # every instruction of the loop body by opcode (HGMMA, MUFU, FSEL, ...)
    skipped: tuple[tuple[int, int, Counter], ...]  # (branch, target, its opcodes) of each block a branch jumps over

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())

    @property
    def unmasked_opcodes(self) -> Counter:
        """What a step issues on its shortest path: every skippable block skipped, except that of two alternatives —
        an if/else, whose first block ends with a branch over the second, so their spans overlap — a step skips only
        one, the larger (the forward computes its softmax in a masked and an unmasked copy)."""
        ops = Counter(self.opcodes)
        for group in _alternatives(self.skipped):
            ops.subtract(max((block for _, _, block in group), key=lambda block: sum(block.values())))
        return +ops

    @property
    def unmasked(self) -> int:
        """Instructions a step issues on its shortest path (unmasked_opcodes)."""
        return sum(self.unmasked_opcodes.values())


def _alternatives(skipped: tuple[tuple[int, int, Counter], ...]) -> list[list[tuple[int, int, Counter]]]:
    """The skippable blocks grouped by overlapping spans: a group of one is a block a step may skip; a group of two
    is an if/else, of which a step runs one."""
    groups: list[list[tuple[int, int, Counter]]] = []
    for block in sorted(skipped, key=lambda block: block[0]):
        if groups and block[0] < max(target for _, target, _ in groups[-1]):
            groups[-1].append(block)
        else:
            groups.append([block])
    return groups


def _opcode(instruction: str) -> str:
    return instruction.split()[0].split(".")[0]


def step_loop(instructions: list[tuple[int, str]], min_block: int = 16, min_exp2: int = 16) -> StepLoop | None:
    """The innermost loop (backward branch) whose body issues HGMMAs and at least min_exp2 MUFU.EX2 — a softmax's
    worth: a step exponentiates 64·B_c/128 >= 32 scores a thread; a loop with one or two (a rescale factor, an
    epilogue) is not the step —, or None. Forward branches within it over at least min_block instructions are its
    skippable blocks (shorter ones are the loop's own control)."""
    branches = [(a, int(m.group(1), 16)) for a, x in instructions if (m := _TARGET.match(x))]
    loops = sorted(((t, a) for a, t in branches if t < a), key=lambda loop: loop[1] - loop[0])
    for start, end in loops:
        body = [(a, x) for a, x in instructions if start <= a <= end]
        opcodes = Counter(_opcode(x) for _, x in body)
        if opcodes["HGMMA"] and sum(x.startswith("MUFU.EX2") for _, x in body) >= min_exp2:
            spans = [(b, t) for b, t in branches if start <= b < t <= end]
            outermost = [(b, t) for b, t in spans if not any(o <= b and t <= p and (o, p) != (b, t) for o, p in spans)]
            skipped = []
            for branch, target in outermost:  # a block inside a skippable one is skipped with it: counted once
                inside = [x for a, x in body if branch < a < target]
                if len(inside) >= min_block:
                    skipped.append((branch, target, Counter(map(_opcode, inside))))
            return StepLoop(start, end, opcodes, tuple(skipped))
    return None


_WAIT = re.compile(r"^WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)")


def wait_placement(instructions: list[tuple[int, str]], loop: StepLoop) -> tuple[list[tuple[int, int]], int, int]:
    """([(address, groups left in flight) of each wgmma wait in the loop], first and last MUFU.EX2 address)."""
    body = [(a, x) for a, x in instructions if loop.start <= a <= loop.end]
    waits = [(a, int(m.group(1), 16)) for a, x in body if (m := _WAIT.match(x))]
    exp2 = [a for a, x in body if x.startswith("MUFU.EX2")]
    return waits, exp2[0], exp2[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_compile_arguments(parser, "fwd", "192,128,4,2,ws,persistent")
    args = parser.parse_args()
    instructions = parse(compile_sass(args.kernel, args.config, args.head_dim, args.causal, args.seqlen, args.group))
    loop = step_loop(instructions)
    if loop is None:
        sys.exit("no loop issues both HGMMAs and a softmax's MUFU.EX2")
    common = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(12))
    print(f"step loop {loop.start:#06x}-{loop.end:#06x}: {loop.instructions} instructions ({common})")
    for branch, target, ops in loop.skipped:
        print(f"  skipped by the branch at {branch:#06x} to {target:#06x}: {sum(ops.values())} "
              f"({', '.join(f'{op} {n}' for op, n in ops.most_common(5))})")  # fmt: skip
    ops = loop.unmasked_opcodes
    print(f"an unmasked step: {loop.unmasked} instructions, {ops['MUFU']} MUFU, {ops['HGMMA']} HGMMA")
    waits, first_exp2, last_exp2 = wait_placement(instructions, loop)
    print(
        f"wgmma waits (address: groups left in flight) {', '.join(f'{a:#06x}: {n}' for a, n in waits)}; "
        f"MUFU.EX2 {first_exp2:#06x}-{last_exp2:#06x}"
    )
    if any(n == 0 and a < first_exp2 for a, n in waits):
        print("  a wait for no wgmma in flight precedes every exponential: none runs under this consumer's wgmmas")


if __name__ == "__main__":
    main()
