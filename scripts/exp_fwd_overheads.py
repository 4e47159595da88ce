#!/usr/bin/env python3
"""Experiment (issue 6): what fa2tune's forward pays beside a minimal FlashAttention-2 loop, and FA4's lazy rescale.

A minimal non-causal forward (even shapes, (batch, heads, N, d) contiguous, bf16) with switches that add
fa2tune's structure one piece at a time — a 1-D grid instead of (Q tiles, batch·heads), run-time strides instead
of constexpr ones, the logsumexp store — and LAZY: skip the rescale of Õ and ℓ unless some row's running max grows
by more than 8 (log2 units; FlashAttention-4's trick: exp2(s - m) stays ≤ 2^8 with a stale max, and the result is
exact because Õ and ℓ share the max); and UNROLL: two iterations per trip of the loop (tl.range's
loop_unroll_factor), fewer instructions a score at d=64 (docs/PERF.md v8). Each case is checked against SDPA and
timed with do_bench beside fa2tune's own kernel at the same config (docs/PERF.md v5).

    python scripts/exp_fwd_overheads.py            # on a GPU: the table
    python scripts/exp_fwd_overheads.py --ptx      # no GPU needed: the inner loop's instruction mix, sm_90, and
                                                   # instructions a score with and without unrolling
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _minimal_fwd(
    Q, K, V, Out, LSE, qk_scale, N, H, stride_b, stride_h, stride_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    GRID1D: tl.constexpr, STRIDES: tl.constexpr, STORE_LSE: tl.constexpr, LAZY: tl.constexpr,
    UNROLL: tl.constexpr = 1,
):  # fmt: skip
    if GRID1D:  # fa2tune's grid: one axis, Q tile fastest
        num_m = tl.cdiv(N, BLOCK_M)
        pid_m = tl.program_id(0) % num_m
        bh = tl.program_id(0) // num_m
    else:
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    if STRIDES:
        base = b * stride_b + h * stride_h
        row = stride_m
    else:
        base = (b * H + h) * N * D
        row = D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * row + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_ptrs = K + base + offs_n[:, None] * row + offs_d[None, :]
    v_ptrs = V + base + offs_n[:, None] * row + offs_d[None, :]
    for _ in tl.range(0, N, BLOCK_N, loop_unroll_factor=UNROLL):
        qk = tl.dot(q, tl.trans(tl.load(k_ptrs)))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if LAZY:
            if tl.max(m_new - m_i, 0) > 8.0:  # one test per tile, for the whole tile
                alpha = tl.math.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.math.exp2(qk * qk_scale - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        k_ptrs += BLOCK_N * row
        v_ptrs += BLOCK_N * row
    tl.store(Out + base + offs_m[:, None] * row + offs_d[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty))
    if STORE_LSE:
        tl.store(LSE + (b * H + h) * N + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


CASES = {  # name: (GRID1D, STRIDES, STORE_LSE, LAZY, UNROLL)
    "minimal, 2-D grid": (0, 0, 0, 0, 1),
    "+ 1-D grid": (1, 0, 0, 0, 1),
    "+ 1-D grid, strides": (1, 1, 0, 0, 1),
    "+ 1-D grid, strides, LSE": (1, 1, 1, 0, 1),
    "minimal + lazy rescale": (0, 0, 0, 1, 1),
    # Two iterations per trip of the loop: fewer loop-control and address instructions a score at d=64 in the
    # sm_90 PTX (8.31 against 8.78), more at d=128 (register moves) — docs/PERF.md v8. The pipeliner gives each
    # unrolled copy its own K/V buffers (d=64, 3 stages: 112 KiB of shared memory instead of 64; d=128 does not
    # fit), hence also a case with one stage fewer. Measured in v9: both slower (436 → 356, 318 at d=64).
    "minimal, loop unrolled x2": (0, 0, 0, 0, 2),
    "minimal, unrolled x2, 1 stage fewer": (0, 0, 0, 0, 2),
}
FEWER_STAGES = {"minimal, unrolled x2, 1 stage fewer"}


def _run_minimal(q, k, v, o, lse, config, switches) -> None:
    batch, heads, n, d = q.shape
    block_m, block_n, warps, stages = config
    grid = (triton.cdiv(n, block_m) * batch * heads,) if switches[0] else (triton.cdiv(n, block_m), batch * heads)
    _minimal_fwd[grid](q, k, v, o, lse, d**-0.5 * LOG2E, n, heads, q.stride(0), q.stride(1), q.stride(2),
                       block_m, block_n, d, *switches, num_warps=warps, num_stages=stages)  # fmt: skip


def _cases(q, k, v, o, lse, config) -> dict:
    """Each case as a callable that writes its output into o."""
    import fa2tune
    from fa2tune.config.types import KernelConfig, Mask
    from fa2tune.launch import launcher

    fewer = (*config[:3], config[3] - 1)
    cases = {
        name: (lambda s=s, c=fewer if name in FEWER_STAGES else config: _run_minimal(q, k, v, o, lse, c, s))
        for name, s in CASES.items()
    }
    scale = q.shape[-1] ** -0.5
    cases["fa2tune launcher.forward"] = lambda: launcher.forward(
        q, k, v, causal=Mask(), scale=scale, config=KernelConfig(*config), out=o
    )
    cases["fa2tune.attention (tuned)"] = lambda: o.copy_(fa2tune.attention(q, k, v))
    return cases


def time_table() -> None:
    from triton.testing import do_bench

    rows = []
    for d, n, config in ((128, 8192, (256, 64, 8, 4)), (128, 2048, (256, 64, 8, 4)), (64, 8192, (128, 64, 8, 3))):
        batch, heads = 16384 // n, 2048 // d
        q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        o = torch.full_like(q, float("nan"))
        lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
        cases = _cases(q, k, v, o, lse, config)
        for name, fn in cases.items():
            o.fill_(float("nan"))
            try:
                fn()
            except triton.runtime.errors.OutOfResources as exc:  # unrolled copies' buffers past the limit
                print(d, n, config, name, exc)
                continue
            err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
            ms = do_bench(fn, warmup=50, rep=300)
            rows.append((d, n, config, name, 4 * batch * heads * n * n * d / ms / 1e9, err))
            print(*rows[-1], flush=True)
    print(f"\n{'d':>4} {'N':>6} {'config':<17} {'case':<28} {'TFLOP/s':>8} {'rel err':>8}")
    for d, n, config, name, tflops, err in rows:
        print(f"{d:>4} {n:>6} {config!s:<17} {name:<28} {tflops:>8.0f} {err:>8.1e}")


def loop_ops(kernel) -> list[str]:
    """The opcodes of a compiled kernel's inner loop (its longest self-looping block) in its PTX; also used by
    scripts/exp_exp2_poly.py --ptx."""
    ptx = kernel.asm["ptx"]
    loops = []
    for label in re.findall(r"^(\$L__BB0_\d+):", ptx, re.M):
        match = re.search(rf"^{re.escape(label)}:.*?bra(?:\.uni)?\s+{re.escape(label)};", ptx, re.S | re.M)
        if match:
            loops.append(match.group(0))
    return re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", max(loops, key=len), re.M)


def _compile_minimal(config, d: int, unroll: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_m, block_n, warps, stages = config
    names = _minimal_fwd.arg_names
    signature = {a: "*bf16" for a in ("Q", "K", "V", "Out")} | {"LSE": "*fp32", "qk_scale": "fp32"}
    signature |= {a: "i32" for a in ("N", "H", "stride_b", "stride_h", "stride_m")}
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "D": d, "GRID1D": 0, "STRIDES": 0, "STORE_LSE": 0,
                  "LAZY": 0, "UNROLL": unroll}  # fmt: skip
    signature |= dict.fromkeys(constexprs, "constexpr")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("Q", "K", "V", "Out", "LSE", "N")}
    source = ASTSource(_minimal_fwd, {a: signature[a] for a in names}, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def loop_mix() -> None:
    """The sm_90 PTX of the inner loop, by opcode: fa2tune's kernel at (256, 64, 8, 4), d=128, against the minimal;
    then the minimal kernel's instructions per score with the loop unrolled x2, at d=128 and d=64."""
    from fa2tune.config.types import KernelConfig
    from fa2tune.kernels import probe

    compiled = {}
    compile_ = triton.compile

    def keep(*args, **kwargs):
        compiled["fa2tune"] = compile_(*args, **kwargs)
        return compiled["fa2tune"]

    triton.compile = keep
    try:
        probe.compile_config("fwd", KernelConfig(256, 64, 8, 4), 128, torch.bfloat16)
    finally:
        triton.compile = compile_
    compiled["minimal"] = _compile_minimal((256, 64, 8, 4), 128, 1)
    for name, kernel in compiled.items():
        ops = loop_ops(kernel)
        top = {op: ops.count(op) for op in sorted(set(ops), key=ops.count, reverse=True)[:12]}
        print(f"{name:>8}: {len(ops)} instructions in the loop, shared {kernel.metadata.shared} B; {top}")
    for d, config in ((128, (256, 64, 8, 4)), (64, (128, 64, 8, 3))):
        for unroll in (1, 2):
            ops = loop_ops(_compile_minimal(config, d, unroll))
            scores = config[0] * config[1] * unroll / (32 * config[2])  # scores a thread computes per trip
            per_score = len(ops) / scores
            print(f"minimal d={d} {config} unroll {unroll}: {len(ops)} instructions a trip, {per_score:.2f} a score")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ptx", action="store_true", help="compare the inner loops' PTX (no GPU needed)")
    args = parser.parse_args()
    loop_mix() if args.ptx else time_table()


if __name__ == "__main__":
    main()
