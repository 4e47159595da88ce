"""A Python model of the dK/dV kernel's step order in bwd-dkdv-tile-major-counters-draft-session25.patch.

The producer loads (query head, Q tile) pairs tile by tile; each consumer skips the leading tiles that see none of
its keys (for every head of the GQA group), then walks the rest with (tile, head) counters. Checked: each consumer
takes the producer's sequence in order, computes every pair in which one of its keys is visible, and skips only
pairs in which none is. `python docs/bench/logs/bwd-dkdv-tile-major-order-model-session25.py` prints "ok 144".
"""

ROWS = 64  # K/V rows a consumer


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def visible(q_tile: int, block_m: int, n_q: int, keys: range, off: int) -> bool:
    """Does a query row of the tile see one of the keys (bottom-right causal alignment)?"""
    return any(k <= q + off for q in range(q_tile * block_m, min((q_tile + 1) * block_m, n_q)) for k in keys)


def programs(n_q: int, n_k: int, block_m: int, consumers: int):
    """(first K/V row, first Q tile, Q tiles to visit) of each dK/dV program, as the kernel's _tile gives them."""
    for r in range(cdiv(n_k, ROWS * consumers)):
        n0 = r * ROWS * consumers
        i_start = max(n0 - (n_k - n_q), 0) // block_m
        yield n0, i_start, max(cdiv(n_q, block_m) - i_start, 0)


def verify(produced: list, skip: int, computed: list, keys: range, block_m: int, n_q: int, off: int) -> None:
    """The consumer took the producer's sequence in order, computed every pair in which one of its keys is visible
    and skipped only pairs in which none is."""
    assert produced[:skip] + computed == produced
    assert all(pair in computed for pair in produced if visible(pair[1], block_m, n_q, keys, off))
    assert not any(visible(i, block_m, n_q, keys, off) for _, i in produced[:skip])


def check(n_q: int, n_k: int, block_m: int, consumers: int, group: int) -> None:
    off = n_k - n_q
    for n0, i_start, n_tiles in programs(n_q, n_k, block_m, consumers):
        produced = [(g, i_start + t) for t in range(n_tiles) for g in range(group)]
        for wg in range(consumers):
            row0 = n0 + wg * ROWS
            c, first, n_iters, skip = 0, i_start, group * n_tiles, 0
            if wg > 0:
                skip = min(max(row0 - off, 0) // block_m - first, n_tiles) * group
                assert skip >= 0
                c, first, n_iters = c + skip, first + skip // group, n_iters - skip
            i, g, computed = first, 0, []
            for it in range(n_iters):
                assert produced[c + it] == (g, i)
                computed.append((g, i))
                g_next = g + 1
                i, g = i + (g_next == group), 0 if g_next == group else g_next
            verify(produced, skip, computed, range(row0, min(row0 + ROWS, n_k)), block_m, n_q, off)


# (N_Q, N_K) of the GPU tests, B_r, consumers, GQA group
LENGTHS = [(512, 512), (1000, 1537), (1, 5), (257, 257), (300, 1000), (1000, 300), (129, 64), (64, 200)]
CASES = [(nq, nk, bm, c, g) for nq, nk in LENGTHS for bm in (64, 128) for c in (1, 2, 3) for g in (1, 2, 4)]

if __name__ == "__main__":
    for case in CASES:
        check(*case)
    print("ok", len(CASES))
