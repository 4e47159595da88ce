#!/usr/bin/env python3
"""Experiment (issue 6, item 3): in which order should a causal forward run its Q tiles?

In a causal forward the Q tile t of a head sees (t + 1)·B_r keys: the last tile of a head costs N/B_r times the
first. fa2tune's grid (docs/PERF.md v6) runs each head's tiles longest first, head after head: the GPU starts
programs in grid order, axis 0 fastest, so the launch interleaves long and short tiles of consecutive heads and
its last wave mixes them. Orders measured here, on a minimal causal kernel (unmasked loop to the diagonal, one
masked diagonal block; bf16, even shapes, batch·N = 16k tokens, heads·d = 2048):

  tile-fast  : grid (Q tiles, batch·heads), tile reversed on axis 0 — fa2tune's order today
  head-fast  : grid (batch·heads, Q tiles), tile reversed on axis 1 — every head's longest tile before any head's
               next: longest first over the whole launch (what LPT scheduling would do), but the programs running
               together read different heads' K/V, so they share less of L2
  persistent : one program per resident slot (SMs × programs per SM, from the compiled kernel's shared memory,
               registers and warps); program p takes work items p, p + P, p + 2P, ... of the head-fast order

Prediction: the tail of a launch is at most one wave of programs; with ~8 waves at N=512 (d=128, 4 tiles a head
and 512 heads), ending on the shortest tiles instead of a mix can save up to a few per cent there, nothing at
N ≥ 4k where a head's tiles alone make several waves; head-fast may lose at 8k–16k, where K/V of the heads in
flight no longer fit in L2. Persistent saves the per-program set-up and block scheduling of ~2k programs.

    python scripts/exp_causal_order.py              # on a GPU: TFLOP/s per order, beside fa2tune.attention

Measured on the H200 (docs/PERF.md v8): tile-fast wins at every length tried, by 4-10 % over head-fast and 5-15 %
over persistent. (The fa2tune.attention column includes copying the result into `out`, ~35 µs at 16k tokens.)
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
ORDERS = ("tile-fast", "head-fast", "persistent")


@triton.jit
def _step(acc, l_i, m_i, q, K, V, base, start_n, offs_m, qk_scale, BLOCK_N: tl.constexpr, D: tl.constexpr,
          MASKED: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One K/V block of the online softmax; MASKED: the diagonal block, keys after the query become -inf."""
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(K + base + cols[None, :] * D + offs_d[:, None])
    v = tl.load(V + base + cols[:, None] * D + offs_d[None, :])
    if UPCAST:  # Triton's interpreter computes bf16 dots wrongly; fp32 operands are exact there
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, k) * qk_scale
    if MASKED:
        qk = tl.where(cols[None, :] <= offs_m[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _tile(Q, K, V, Out, bh, start_m, qk_scale, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
          UPCAST: tl.constexpr):  # fmt: skip
    """One causal Q tile, as fa2tune splits it: keys [0, start_m) unmasked, then the diagonal [start_m, start_m +
    BLOCK_M) masked."""
    base = bh.to(tl.int64) * N * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in tl.range(0, start_m, BLOCK_N):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, K, V, base, start_n, offs_m, qk_scale, BLOCK_N, D, False, UPCAST)
    for start_n in tl.range(start_m, start_m + BLOCK_M, BLOCK_N):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, K, V, base, start_n, offs_m, qk_scale, BLOCK_N, D, True, UPCAST)
    tl.store(Out + base + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty))


@triton.jit
def _causal_fwd(Q, K, V, Out, qk_scale, N, BH, ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    tiles = N // BLOCK_M
    if ORDER == 0:  # tile-fast
        _tile(Q, K, V, Out, tl.program_id(1), (tiles - 1 - tl.program_id(0)) * BLOCK_M, qk_scale, N, BLOCK_M,
              BLOCK_N, D, UPCAST)  # fmt: skip
    elif ORDER == 1:  # head-fast
        _tile(Q, K, V, Out, tl.program_id(0), (tiles - 1 - tl.program_id(1)) * BLOCK_M, qk_scale, N, BLOCK_M,
              BLOCK_N, D, UPCAST)  # fmt: skip
    else:  # persistent, over the head-fast order
        for item in tl.range(tl.program_id(0), tiles * BH, tl.num_programs(0)):
            _tile(Q, K, V, Out, item % BH, (tiles - 1 - item // BH) * BLOCK_M, qk_scale, N, BLOCK_M, BLOCK_N, D,
                  UPCAST)  # fmt: skip


def slots(kernel, num_warps: int, device: torch.device) -> int:
    """Programs of a compiled kernel that fit on the GPU at once: SMs × min(shared memory, registers, warps)."""
    props = torch.cuda.get_device_properties(device)
    smem = props.shared_memory_per_multiprocessor // max(1, kernel.metadata.shared + 1024)  # 1 KiB reserved a block
    regs = props.regs_per_multiprocessor // max(1, kernel.n_regs * 32 * num_warps)
    warps = props.max_threads_per_multi_processor // (32 * num_warps)
    return props.multi_processor_count * max(1, min(smem, regs, warps))


def run(q, k, v, out, order: str, config, persistent_programs: int | None = None):
    """Runs the minimal causal forward in `order`; returns the compiled kernel (its first launch compiles it)."""
    batch, heads, n, d = q.shape
    block_m, block_n, warps, stages = config
    if n % block_m or block_m % block_n:
        raise ValueError(f"N={n} must be a multiple of block_m={block_m}, and block_m of block_n={block_n}")
    tiles, bh = n // block_m, batch * heads
    grids = {
        "tile-fast": (tiles, bh),
        "head-fast": (bh, tiles),
        "persistent": (min(persistent_programs or 1, tiles * bh),),
    }
    grid = grids[order]
    upcast = q.device.type == "cpu"
    return _causal_fwd[grid](q, k, v, out, d**-0.5 * LOG2E, n, bh, ORDERS.index(order), block_m, block_n, d, upcast,
                             num_warps=warps, num_stages=stages)  # fmt: skip


def _fa2tune_causal(q, k, v, out) -> None:
    import fa2tune

    out.copy_(fa2tune.attention(q, k, v, causal=True))


def time_table(seqlens: list[int]) -> None:
    from triton.testing import do_bench

    configs = {64: (128, 64, 8, 3), 128: (128, 128, 8, 3)}  # the shipped causal forward configs (bf16, N > 1k)
    rows = []
    for d, config in configs.items():
        for n in seqlens:
            batch, heads = 16384 // n, 2048 // d
            q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            out = torch.empty_like(q)
            flops = 2 * batch * heads * n * n * d  # 4·B·H·N²·d × 1/2 for causal
            compiled = run(q, k, v, out, "tile-fast", config)
            programs = slots(compiled, config[2], q.device)
            cases = {order: functools.partial(run, q, k, v, out, order, config, programs) for order in ORDERS}
            cases["fa2tune.attention"] = functools.partial(_fa2tune_causal, q, k, v, out)
            for name, fn in cases.items():
                out.fill_(float("nan"))
                fn()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                ms = do_bench(fn, warmup=50, rep=300)
                rows.append((d, n, config, programs, name, flops / ms / 1e9, err))
                print(*rows[-1], flush=True)
    print(f"\n{'d':>4} {'N':>6} {'config':<17} {'slots':>5} {'order':<18} {'TFLOP/s':>8} {'rel err':>8}")
    for d, n, config, programs, name, tflops, err in rows:
        print(f"{d:>4} {n:>6} {config!s:<17} {programs:>5} {name:<18} {tflops:>8.0f} {err:>8.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    args = parser.parse_args()
    time_table([int(n) for n in args.seqlens.split(",")])


if __name__ == "__main__":
    main()
