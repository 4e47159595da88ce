"""A Python model of the shipped dK/dV step order (templates/bwd_ws.py.jinja since v26): head by head, counters.

The producer loads (query head, Q tile) pairs head by head; with one query head per K/V head a consumer after the
first skips the leading tiles that see none of its keys; then it walks the rest with a tile counter that wraps to the
first tile at a head's end (`i_end`) and a head counter that steps on the wrap. Checked: each consumer takes the
producer's sequence in order, the next step's (head, tile) it loads statistics for is the one it computes next,
every pair in which one of its keys is visible is computed, and only pairs in which none is are skipped.
`python docs/bench/logs/bwd-dkdv-head-major-counters-model-session26.py` prints "ok 144".
"""

ROWS = 64  # K/V rows a consumer


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def visible(q_tile: int, block_m: int, n_q: int, keys: range, off: int) -> bool:
    """Does a query row of the tile see one of the keys (bottom-right causal alignment)?"""
    return any(k <= q + off for q in range(q_tile * block_m, min((q_tile + 1) * block_m, n_q)) for k in keys)


def check(n_q: int, n_k: int, block_m: int, consumers: int, group: int) -> None:
    off = n_k - n_q
    for r in range(cdiv(n_k, ROWS * consumers)):
        n0 = r * ROWS * consumers
        i_start = max(n0 - off, 0) // block_m
        n_tiles = max(cdiv(n_q, block_m) - i_start, 0)
        produced = [(g, i_start + t) for g in range(group) for t in range(n_tiles)]
        for wg in range(consumers):
            row0 = n0 + wg * ROWS
            c, first, n_iters, skip = 0, i_start, group * n_tiles, 0
            i_end = first + n_tiles
            if wg > 0:
                skip = min(max(row0 - off, 0) // block_m - first, n_tiles) if group == 1 else 0
                assert skip >= 0
                c, first, n_iters = c + skip, first + skip, n_iters - skip
            i, g, computed = first, 0, []
            for it in range(n_iters):
                assert produced[c + it] == (g, i)
                computed.append((g, i))
                i_next = i + 1
                wrap = i_next == i_end
                i_next = first if wrap else i_next
                g_next = g + wrap
                if it + 1 < n_iters:  # the statistics loaded for the next step are that step's
                    assert produced[c + it + 1] == (g_next, i_next)
                i, g = i_next, g_next
            assert produced[:skip] + computed == produced
            keys = range(row0, min(row0 + ROWS, n_k))
            assert all(pair in computed for pair in produced if visible(pair[1], block_m, n_q, keys, off))
            assert not any(visible(i, block_m, n_q, keys, off) for _, i in produced[:skip])


if __name__ == "__main__":
    lengths = [(512, 512), (1000, 1537), (1, 5), (257, 257), (300, 1000), (1000, 300), (129, 64), (64, 200)]
    cases = [(nq, nk, bm, c, g) for nq, nk in lengths for bm in (64, 128) for c in (1, 2, 3) for g in (1, 2, 4)]
    for case in cases:
        check(*case)
    print("ok", len(cases))
