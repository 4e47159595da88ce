"""How many dK/dV programs share a GQA group's query heads: the backward's group split.

A dK/dV program streams every query head of its K/V head's group against one load of its K/V rows, summing their
dK and dV as it goes. With a large group and the causal mask that stops paying: a program's length is the group
times its tile's (unequal) causal length, so the last programs run on while other SMs idle, and the programs in
flight read Q and dO of more heads than L2 keeps. Measured on an H100 (bf16, N=8k, 32 query heads, the
warp-specialized kernel; docs/PERF.md, "Grouped-query attention"), the d=128 causal backward with 16 query heads a
program (GQA 32/2) took 9.1 ms, split into programs of 4, 6.0 ms — what 4 (32/8) and 1 (MHA) take unsplit —; d=64
(persistent) gained 1.6 % at GQA 32/4, and d=256's split-roles kernel (64 K/V rows a program, twice the programs)
read the same split or not. Without the mask programs are equally long and the split gained nothing (d=128) or
lost 1.5 % (d=64): one load of K/V for the whole group is what GQA saves there.

Split, a group's query heads go to `split` programs of each K/V tile, each streaming group // split of them into
a partial dK and dV of its own (the kernels' KV_SPLIT: partial head hk reads K/V head hk // split); the partials,
in the gradients' dtype, are summed after (launch.backward). That costs the partials' memory (split times dK and
dV) and one read of them; each partial is rounded once to the dtype, as FlashAttention-2 rounds its per-head dK
and dV under GQA. The Triton template takes the split too, but splits only when told to: its timing under the split
is not measured.

FA2TUNE_DKDV_HEADS overrides the rule for debugging and A/B runs: the most query heads a program streams, under
either mask and in either kernel (a large value: never split). A launch plan's key holds it (launch.plans.plan_key), as
it changes what runs.
"""

from __future__ import annotations

import os

DKDV_HEADS_ENV = "FA2TUNE_DKDV_HEADS"
# The most query heads a causal warp-specialized dK/dV program streams: at d=128 N=8k, 4 ran as fast as 1 (MHA),
# 8 ran 17 % slower and 16 53 %.
MAX_CAUSAL_STREAMED_HEADS = 4


def dkdv_group_split(group: int, causal: bool, warp_specialized: bool = True) -> int:
    """The programs a K/V tile's group of `group` query heads is split over (1: one program streams them all): the
    fewest that leave each at most MAX_CAUSAL_STREAMED_HEADS heads, in a causal warp-specialized kernel (above), or
    FA2TUNE_DKDV_HEADS's in any; always a divisor of `group`."""
    most = _forced_heads()
    if most is None:
        if not (causal and warp_specialized):
            return 1
        most = MAX_CAUSAL_STREAMED_HEADS
    return next(split for split in range(1, group + 1) if group % split == 0 and group // split <= most)


def _forced_heads() -> int | None:
    value = os.environ.get(DKDV_HEADS_ENV)
    if value is None:
        return None
    try:
        heads = int(value)
    except ValueError:
        heads = 0
    if heads < 1:
        raise ValueError(
            f"{DKDV_HEADS_ENV} must be a positive integer (the query heads a dK/dV program streams); got {value!r}"
        )
    return heads

