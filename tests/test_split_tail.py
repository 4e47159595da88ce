"""The split tail of a persistent forward (fa2tune/launch/split_tail.py): which launches cut their last round's tiles,
and the merge of the pieces against float64 attention. The kernel's pieces are checked on a GPU in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from fa2tune.config import head_chunks
from fa2tune.config.schedule import PERSISTENT
from fa2tune.config.types import KernelConfig
from fa2tune.launch import split_tail, warpspec
from fa2tune.tune.reference import naive_attention

from .conftest import assert_close


@pytest.mark.parametrize(
    "tiles, programs, kv_steps, expected",
    [
        (2048, 132, 64, (1980, 3)),  # d=128 N=8k: 15 full rounds, 68 tiles in 204 pieces, 2 a program at most
        (2048, 132, 32, (1980, 3)),  # N=4k
        (2048, 132, 16, (2048, 1)),  # N=2k: too short for the pieces' stores and the merge to pay (measured)
        (2048, 128, 64, (2048, 1)),  # a full last round
        (2752, 132, 64, (2752, 1)),  # d=64 (192, 128) N=8k: 112 of 132 in the last round, no cut shortens it
        (2816, 132, 32, (2772, 3)),  # d=64 (192, 128) N=4k: 44 tiles, one piece each program
        (100, 132, 64, (100, 1)),  # fewer tiles than programs: one round
    ],
)
def test_plan_cuts_only_a_part_empty_last_round_that_it_shortens(tiles, programs, kv_steps, expected):
    assert split_tail.plan(tiles, programs, kv_steps) == expected


def test_plan_never_lengthens_a_launch_and_gives_each_piece_two_steps():
    for tiles in range(1, 600, 7):
        for programs in (3, 13, 132):
            for kv_steps in (16, 17, 40, 64, 128):
                main, split = split_tail.plan(tiles, programs, kv_steps)
                assert main % programs == 0 or split == 1
                assert 1 <= split <= split_tail.MAX_SPLIT and kv_steps // split >= split_tail.MIN_PIECE_STEPS
                whole = -(-tiles // programs) * (kv_steps + split_tail.PIECE_OVERHEAD_STEPS)
                cut = main // programs * (kv_steps + split_tail.PIECE_OVERHEAD_STEPS) + -(
                    -split_tail.pieces(tiles, main, split) // programs
                ) * (kv_steps / split + split_tail.PIECE_OVERHEAD_STEPS)
                assert cut <= whole


def _pieces_as_the_kernel_writes_them(q, k, v, *, tile_m, block_n, main, split):
    """PART_O, PART_LSE for q, k, v (batch, heads, N, d) as fwd_ws writes them: for each tile from `main` on (tiles
    numbered head by head), `split` pieces of its K/V tiles, each O over its keys (normalised) and their lse."""
    batch, heads, seqlen_q, head_dim = q.shape
    n_m, kv_steps = -(-seqlen_q // tile_m), -(-k.shape[2] // block_n)
    tiles = batch * heads * n_m
    part_o, part_lse = split_tail.workspace(tiles, main, split, tile_m, head_dim, q.device)
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    for tile in range(main, tiles):
        bh, r = divmod(tile, n_m)
        b, h = divmod(bh, heads)
        for part in range(split):
            lo, hi = part * kv_steps // split * block_n, (part + 1) * kv_steps // split * block_n
            rows = q[b, h, r * tile_m : (r + 1) * tile_m].double()
            o, lse = naive_attention(rows[None, None], k[b, h, lo:hi][None, None].double(),
                                     v[b, h, lo:hi][None, None].double())  # fmt: skip
            piece = (tile - main) * split + part
            part_o[piece, : rows.shape[0]] = o[0, 0].float()
            part_lse[piece, : rows.shape[0]] = lse[0, 0].float()
    return part_o, part_lse, tiles, n_m


@pytest.mark.parametrize("seqlen_q, seqlen_k, split, head_dim",
                         [(160, 256, 2, 32), (128, 200, 3, 32), (100, 130, 4, 40)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_gives_the_split_tiles_attention_over_all_their_keys(seqlen_q, seqlen_k, split, head_dim, dtype, device,
                                                                   monkeypatch):
    # d=40: the kernel's pieces are 48 columns wide (its head-dim chunks, 32 + 16), O 40; the merge reads the pieces'
    # columns and writes O's (here the 8 columns past O's are poison the merge must not carry into O)
    torch.manual_seed(seqlen_q + split)
    batch, heads, tile_m, block_n = 2, 3, 64, 16
    q = torch.randn(batch, heads, seqlen_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, heads, seqlen_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, heads, seqlen_k, head_dim, dtype=dtype, device=device)
    n_m = -(-seqlen_q // tile_m)
    tiles = batch * heads * n_m
    main = tiles - 4  # the last four tiles (of two heads, with a ragged last tile among them) are cut
    part_o, part_lse, _, _ = _pieces_as_the_kernel_writes_them(q, k, v, tile_m=tile_m, block_n=block_n, main=main,
                                                                split=split)  # fmt: skip
    width = head_chunks.padded(head_dim)
    part_o = torch.cat([part_o, part_o.new_full((*part_o.shape[:2], width - head_dim), float("nan"))], dim=2)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((batch, heads, seqlen_q), float("nan"), device=device)
    config = KernelConfig(64, 64, 4, 2, warp_specialized=True, schedule=PERSISTENT)
    merge_pieces = warpspec._module("fwd", config, False, head_dim)._merge_pieces
    merge = split_tail.Merge(merge_pieces, tiles=tiles, main=main, split=split, n_m=n_m, heads_q=heads,
                             seqlen_q=seqlen_q, tile_m=tile_m, width=width, head_dim=head_dim)  # fmt: skip
    merge(part_o, part_lse, o, lse)
    ref_o, ref_lse = naive_attention(q.double(), k.double(), v.double())
    written = torch.zeros(batch, heads, seqlen_q, dtype=torch.bool, device=device)
    for tile in range(main, tiles):
        bh, r = divmod(tile, n_m)
        written[bh // heads, bh % heads, r * tile_m : (r + 1) * tile_m] = True
    assert_close(o[written], ref_o[written], dtype)
    assert_close(lse[written], ref_lse[written], torch.float32, what="lse")
    assert o[~written].isnan().all() and lse[~written].isnan().all()  # the whole tiles are the kernel's to write
    # a plan's next call: the same launch, kept (built once per o and lse strides), writes the same rows again
    built, launcher = [], split_tail.fastlaunch.Launcher
    monkeypatch.setattr(split_tail.fastlaunch, "Launcher", lambda *args: (built.append(args), launcher(*args))[1])
    first, first_lse = o.clone(), lse.clone()
    o.fill_(float("nan"))
    lse.fill_(float("nan"))
    merge(part_o, part_lse, o, lse)
    assert not built
    assert torch.equal(o.nan_to_num(7.0), first.nan_to_num(7.0)) and torch.equal(lse.nan_to_num(7.0),
                                                                                first_lse.nan_to_num(7.0))  # fmt: skip
    # an O of other strides (sequence-major, as an out= tensor may be) gets a launch of its own, which writes it right
    seq_major = torch.full((batch, seqlen_q, heads, head_dim), float("nan"), dtype=dtype, device=device).transpose(1, 2)
    merge(part_o, part_lse, seq_major, lse)
    assert len(built) == 1 and torch.equal(seq_major.nan_to_num(7.0), first.nan_to_num(7.0))
