"""A Python model of the shipped dK/dV step order (templates/bwd_ws.py.jinja since v26): head by head, counters.

The producer loads (query head, Q tile) pairs head by head; with one query head per K/V head a consumer after the
first skips the leading tiles that see none of its keys; then it walks the rest with a tile counter that wraps to the
first tile at a head's end (`i_end`) and a head counter that steps on the wrap. Checked: each consumer takes the
producer's sequence in order, the next step's (head, tile) it loads statistics for is the one it computes next,
every pair in which one of its keys is visible is computed, and only pairs in which none is are skipped.
`python docs/bench/logs/bwd-dkdv-head-major-counters-model-session26.py` prints "ok 144".
"""

import importlib.util
from pathlib import Path

# v25's model of the tile-by-tile order: the programs' geometry and the final checks, shared
_spec = importlib.util.spec_from_file_location(
    "tile_major_model", Path(__file__).with_name("bwd-dkdv-tile-major-order-model-session25.py")
)
_tile_major = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tile_major)
ROWS = _tile_major.ROWS


def check(n_q: int, n_k: int, block_m: int, consumers: int, group: int) -> None:
    off = n_k - n_q
    for n0, i_start, n_tiles in _tile_major.programs(n_q, n_k, block_m, consumers):
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
            _tile_major.verify(produced, skip, computed, range(row0, min(row0 + ROWS, n_k)), block_m, n_q, off)


if __name__ == "__main__":
    for case in _tile_major.CASES:
        check(*case)
    print("ok", len(_tile_major.CASES))
