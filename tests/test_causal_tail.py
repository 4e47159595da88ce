"""The causal tail of a persistent forward (fa2tune/launch/causal_tail.py): the order the kernel's slots visit tiles in,
which the plan models, and the plans it makes. The kernel itself is checked on a GPU in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from fa2tune.config.schedule import PERSISTENT
from fa2tune.launch import causal_tail


def kernel_order(batch_heads: int, n_m: int, programs: int, main: int, tail_heads: int) -> list[list[tuple]]:
    """Each program's tiles (bh, rank; rank 0 a head's longest) in the order the warpspec kernels' causal persistent
    loops visit them with CAUSAL_TAIL — units p, p + P, … < cdiv(main + tail_heads·n_m, P)·P (_causal_last); a unit
    below main is a pair (_unit_size, _unit_tile), one from main on a tail slot (_work_size, _tail_item) —, written
    out in Python from templates/_ws_common.py.jinja."""
    half = (n_m + 1) // 2
    last = -(-(main + tail_heads * n_m) // programs) * programs
    order = []
    for p in range(programs):
        tiles = []
        for unit in range(p, last, programs):
            if unit < main:
                j = unit % half
                tiles += [(unit // half, j)] + ([(unit // half, n_m - 1 - j)] if j != n_m - 1 - j else [])
                continue
            k = unit // programs
            q = p if (k - main // programs) % 2 == 0 else programs - 1 - p
            item = k * programs + q - main
            if item < tail_heads * n_m:
                tiles.append((main // half + item % tail_heads, item // tail_heads))
        order.append(tiles)
    return order


SHAPES = [  # (batch_heads, n_m, programs)
    (32, 64, 132), (1024, 8, 264), (64, 43, 132), (16, 86, 132), (8, 8, 3), (8, 16, 7), (8, 9, 6), (3, 1, 3),
    (5, 5, 40), (2, 16, 132), (7, 2, 4),
]


@pytest.mark.parametrize("batch_heads, n_m, programs", SHAPES)
def test_the_kernel_order_runs_every_tile_once_whatever_the_tail(batch_heads, n_m, programs):
    everything = sorted((bh, r) for bh in range(batch_heads) for r in range(n_m))
    half = (n_m + 1) // 2
    for tail_heads in sorted({0, 1, 2, batch_heads // 2, batch_heads - 1, batch_heads}):
        order = kernel_order(batch_heads, n_m, programs, (batch_heads - tail_heads) * half, tail_heads)
        assert sorted(t for tiles in order for t in tiles) == everything, f"tail of {tail_heads} heads"


@pytest.mark.parametrize("batch_heads, n_m, programs", SHAPES)
def test_program_loads_are_the_kernel_orders_costs(batch_heads, n_m, programs):
    costs = torch.tensor(causal_tail.forward_costs(n_m, 128, 64, 1000, 1537), dtype=torch.float64)  # uneven pairs
    half = (n_m + 1) // 2
    for tail_heads in sorted({0, 1, batch_heads // 3, batch_heads}):
        order = kernel_order(batch_heads, n_m, programs, (batch_heads - tail_heads) * half, tail_heads)
        want = torch.tensor([sum(costs[rank].item() for _, rank in tiles) for tiles in order], dtype=torch.float64)
        got = causal_tail.program_loads(batch_heads, programs, tail_heads, costs)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("batch_heads, n_m, programs", SHAPES)
def test_the_plans_vectorised_lengths_are_program_loads(batch_heads, n_m, programs):
    # candidate_lengths models every tail size at once; each must be program_loads' longest program for that size
    costs = torch.tensor(causal_tail.forward_costs(n_m, 64, 128, n_m * 64 - 7, n_m * 64 + 100), dtype=torch.float64)
    candidates = causal_tail.candidate_lengths(batch_heads, programs, costs)
    assert candidates and all(1 <= heads <= batch_heads for heads, _ in candidates)
    for tail_heads, length in candidates:
        want = causal_tail.program_loads(batch_heads, programs, tail_heads, costs).max().item()
        assert length == pytest.approx(want), f"tail of {tail_heads} heads"


def test_tile_costs_follow_the_bottom_right_causal_mask():
    overhead = causal_tail.TILE_OVERHEAD_STEPS
    # forward: 300 queries over 1000 keys: row tile r of 64 rows sees keys up to 700 + 64·(r + 1), in 128-key tiles;
    # by rank, the last row tile first
    assert causal_tail.forward_costs(5, 64, 128, 300, 1000) == tuple(k + overhead for k in (8, 8, 7, 7, 6))
    # 1000 queries over 300 keys: the first rows see no key, yet visit one tile (the kernel's loops run a step)
    assert causal_tail.forward_costs(4, 256, 128, 1000, 300)[-1] == 1 + overhead
    # dK/dV: 1000 keys over 300 queries, K/V tiles of 128 rows, Q tiles of 64, two query heads a K/V head: key
    # tile r is first seen by query 128·r − 700, so tiles 0 … 5 see all 5 Q tiles, tile 6 (keys 768 …) 4 and 7 2
    assert causal_tail.dkdv_costs(8, 128, 64, 300, 1000, 2) == tuple(2 * q + overhead for q in (5,) * 6 + (4, 2))


@pytest.mark.parametrize(
    "head_dim, seqlen, block_m, block_n, per_sm",
    [(64, 512, 64, 128, 2), (64, 2048, 128, 128, 1), (64, 8192, 192, 128, 1), (64, 16384, 192, 128, 1),
     (128, 512, 128, 64, 1), (128, 4096, 128, 128, 1), (128, 8192, 128, 128, 1)],
)  # fmt: skip
def test_the_plan_evens_out_the_grids_causal_rows(head_dim, seqlen, block_m, block_n, per_sm):
    # the shipped causal configs at issue 6's shapes (16k tokens, heads·d = 2048) on the H200's 132 SMs: pairs alone
    # leave the longest program ≥ 3 % over an even share; the tail brings it within 2.5 % (the module's claim)
    batch_heads, n_m, programs = 16384 // seqlen * (2048 // head_dim), -(-seqlen // block_m), 132 * per_sm
    costs = causal_tail.forward_costs(n_m, block_m, block_n, seqlen, seqlen)
    main, tail_heads = causal_tail.plan(batch_heads, programs, costs)
    costs = torch.tensor(costs, dtype=torch.float64)
    even = costs.sum().item() * batch_heads / programs
    assert main == (batch_heads - tail_heads) * ((n_m + 1) // 2) and 0 < tail_heads < batch_heads
    assert causal_tail.program_loads(batch_heads, programs, 0, costs).max().item() > 1.03 * even
    assert causal_tail.program_loads(batch_heads, programs, tail_heads, costs).max().item() < 1.025 * even


def test_the_plan_never_lengthens_a_launch():
    for batch_heads, n_m, programs in [*SHAPES, (1, 1, 1), (40, 3, 132), (128, 17, 100)]:
        for seqlen_q, seqlen_k in ((n_m * 64, n_m * 64), (n_m * 64 - 5, n_m * 64 + 300), (n_m * 64, 70)):
            for costs in (causal_tail.forward_costs(n_m, 64, 128, seqlen_q, seqlen_k),
                          causal_tail.dkdv_costs(n_m, 64, 128, seqlen_q, seqlen_k, 2)):  # fmt: skip
                _assert_no_longer(batch_heads, programs, costs)


def _assert_no_longer(batch_heads: int, programs: int, tile_costs: tuple[float, ...]) -> None:
    main, tail_heads = causal_tail.plan(batch_heads, programs, tile_costs)
    costs = torch.tensor(tile_costs, dtype=torch.float64)
    pairs = causal_tail.program_loads(batch_heads, programs, 0, costs).max().item()
    assert 0 <= tail_heads <= batch_heads and main == (batch_heads - tail_heads) * ((costs.numel() + 1) // 2)
    if tail_heads:
        tail = causal_tail.program_loads(batch_heads, programs, tail_heads, costs).max().item()
        assert tail <= pairs - causal_tail.MIN_GAIN_STEPS


def test_pair_loads_sum_whole_periods_as_the_units_would():
    # a million units are summed a period of lcm(programs, pairs a head) at a time: the same loads as unit by unit
    pair_costs = torch.tensor([5.0, 3.5, 2.25])
    got = causal_tail._pair_loads(7, 1_000_003, 132, pair_costs)
    u = torch.arange(7, 1_000_003)
    want = torch.bincount(u % 132, weights=pair_costs[u % 3], minlength=132).double()
    torch.testing.assert_close(got, want)


def test_the_tail_is_turned_on_by_its_variable_only(monkeypatch):
    enabled = lambda: PERSISTENT.deals_causal_tail(causal=True)  # a shipped schedule: the tail at its default
    monkeypatch.delenv("FA2TUNE_CAUSAL_TAIL", raising=False)
    assert not enabled()  # off until it has run on a GPU (Schedule.causal_tail's default)
    monkeypatch.setenv("FA2TUNE_CAUSAL_TAIL", "1")
    assert enabled()
    monkeypatch.setenv("FA2TUNE_CAUSAL_TAIL", "0")
    assert not enabled()
