#!/usr/bin/env python3
"""Experiment (issue 6): take part of the softmax's exp2 off the MUFU, as FlashAttention-4 does.

PERF-NOTES' cycle count: per score, the MUFU's ex2 costs 1/16 clk per SM (16 per clock) while the FP32 units have
128 lanes, so at d=64 the exp2s alone (0.0625 clk) take longer than the two matmuls (0.083 clk at the measured
rate) leave room for. 2^x = 2^round(x) · 2^f with |f| <= 1/2: a degree-3 polynomial for 2^f (3 FMAs, max
relative error 7.5e-5, well under bf16's 3.9e-3 rounding of P) and an integer add into the exponent field give
2^x on the FP32 units in 9 instructions, no conversion. Per score the loop issues ~6 instructions with the MUFU's
ex2 (6/128 clk of issue against 1/16 clk of MUFU); moving a fraction r of the exp2s to the polynomial balances
the two at r = 1/8 (0.0547 clk, 12 % less than 0.0625); at r = 1/4 issue becomes the limit again (0.0625), at
r = 1/2 it is worse (0.078). So pack=8 should win, pack=4 break even, the others lose.

Modes of the minimal kernel's unmasked loop (non-causal, even shapes, bf16):
  mufu   : tl.math.exp2 for every score (what fa2tune does)
  split2 : the tile split in column pairs with tl.reshape/tl.split: one of each pair by the polynomial
  asm2   : the same pairs through one inline-PTX block (pack=2): ex2.approx for one, the polynomial for the other
  asm4   : pack=4: three by ex2.approx, one by the polynomial
  asm8   : pack=8: seven by ex2.approx, one by the polynomial
  fma    : the polynomial for every score

    python scripts/exp_exp2_poly.py            # on a GPU: errors against float32 SDPA and TFLOP/s per mode
    python scripts/exp_exp2_poly.py --ptx      # no GPU needed: each mode's inner loop by opcode, sm_90
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MODES = ("mufu", "split2", "asm2", "asm4", "asm8", "fma")
# 2^f ≈ C0 + C1·f + C2·f² + C3·f³ on [-0.5, 0.5]: relative-error fit, max 7.5e-5 in fp32 arithmetic.
C0 = tl.constexpr(0.9999280927794703)
C1 = tl.constexpr(0.693260991384874)
C2 = tl.constexpr(0.2426108095468545)
C3 = tl.constexpr(0.055171435569761486)
ROUND = tl.constexpr(12582912.0)  # 1.5·2^23: x + ROUND rounds x to an integer held in the sum's low mantissa bits
# The same in PTX (hex float literals of the fp32 values) for the inline-assembly modes. No cvt: float-to-int and
# rounding conversions run at 16 per clock per SM on the H200, the MUFU's own rate, so they would gain nothing.
_POLY_PTX = """
    max.NaN.f32 x, {src}, 0fC2FC0000;
    add.f32 t, x, 0f4B400000;
    sub.f32 n, t, 0f4B400000;
    sub.f32 x, x, n;
    fma.rn.f32 p, x, 0f3D61FB71, 0f3E786EF8;
    fma.rn.f32 p, p, x, 0f3F31798D;
    fma.rn.f32 p, p, x, 0f3F7FFB4A;
    shl.b32 t, t, 23;
    add.s32 {dst}, p, t;"""


def _asm(pack: int) -> str:
    """PTX for `pack` scores: all but the last by ex2.approx (MUFU), the last by the polynomial (FP32 pipe)."""
    lines = [f"ex2.approx.ftz.f32 ${i}, ${pack + i};" for i in range(pack - 1)]
    poly = _POLY_PTX.format(src=f"${2 * pack - 1}", dst=f"${pack - 1}")
    return "{ .reg .b32 x, t, n, p;\n" + "\n".join(lines) + poly + "\n}"


@triton.jit
def _exp2_fma(x):
    """2^x on the FP32 units: 2^round(x) by an integer add into the exponent bits, 2^f (|f| <= 1/2) by the
    polynomial. x is clamped at -126 so that 2^round(x)·p stays a normal float (2^-126 for -inf: ~1e-38, not 0)."""
    x = tl.maximum(x, -126.0, propagate_nan=tl.PropagateNan.ALL)
    t = x + ROUND
    f = x - (t - ROUND)
    p = tl.fma(tl.fma(tl.fma(f, C3, C2), f, C1), f, C0)
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, ASM2: tl.constexpr,
          ASM4: tl.constexpr, ASM8: tl.constexpr):  # fmt: skip
    if MODE == 0:
        return tl.math.exp2(x)
    elif MODE == 1:
        a, b = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))
        return tl.reshape(tl.join(tl.math.exp2(a), _exp2_fma(b)), (BLOCK_M, BLOCK_N))
    elif MODE == 2:
        return tl.inline_asm_elementwise(ASM2, "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    elif MODE == 3:
        return tl.inline_asm_elementwise(ASM4, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.float32, is_pure=True, pack=4)
    elif MODE == 4:
        return tl.inline_asm_elementwise(
            ASM8, "=r," * 8 + "r,r,r,r,r,r,r,r", [x], dtype=tl.float32, is_pure=True, pack=8
        )
    else:
        return _exp2_fma(x)


@triton.jit
def _minimal_fwd(
    Q, K, V, Out, qk_scale, N, H,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr,
    ASM2: tl.constexpr, ASM4: tl.constexpr, ASM8: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * N * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_ptrs = K + base + offs_n[:, None] * D + offs_d[None, :]
    v_ptrs = V + base + offs_n[:, None] * D + offs_d[None, :]
    for _ in tl.range(0, N, BLOCK_N):
        qk = tl.dot(q, tl.trans(tl.load(k_ptrs)))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = _exp2(qk * qk_scale - m_new[:, None], BLOCK_M, BLOCK_N, MODE, ASM2, ASM4, ASM8)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        k_ptrs += BLOCK_N * D
        v_ptrs += BLOCK_N * D
    tl.store(Out + base + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty))


def _run(q, k, v, o, config, mode: str) -> None:
    batch, heads, n, d = q.shape
    block_m, block_n, warps, stages = config
    grid = (triton.cdiv(n, block_m), batch * heads)
    _minimal_fwd[grid](q, k, v, o, d**-0.5 * LOG2E, n, heads, block_m, block_n, d, MODES.index(mode), _asm(2),
                       _asm(4), _asm(8), num_warps=warps, num_stages=stages)  # fmt: skip


@triton.jit
def _exp2_tile(X, Y, MODE: tl.constexpr, ASM2: tl.constexpr, ASM4: tl.constexpr, ASM8: tl.constexpr):
    offs = tl.arange(0, 64)[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(Y + offs, _exp2(tl.load(X + offs), 64, 64, MODE, ASM2, ASM4, ASM8))


def exp2_errors(mode: str, device: str = "cuda") -> tuple[float, list[float]]:
    """One mode's exp2 against float64: the largest relative error on [-30, 0], and its values at 0, -1, -126,
    -127, -200 and -inf. The inline-assembly modes need a GPU; the others run under Triton's interpreter too."""
    x = torch.cat([torch.linspace(-30, 0, 4000), torch.tensor([0.0, -1.0, -126.0, -127.0, -200.0, float("-inf")])])
    x = torch.nn.functional.pad(x, (0, 4096 - x.numel()), value=-0.5).to(device)
    y = torch.full_like(x, float("nan"))
    _exp2_tile[(1,)](x, y, MODES.index(mode), _asm(2), _asm(4), _asm(8))
    want = torch.exp2(x.double())
    return ((y.double() - want).abs() / want)[:4000].max().item(), y[4000:4006].tolist()


def check_exp2() -> None:
    for mode in MODES:
        rel, tail = exp2_errors(mode)
        print(f"exp2 {mode:>6}: max rel err on [-30, 0] {rel:.1e}; at 0, -1, -126, -127, -200, -inf: {tail}")


def time_table() -> None:
    from triton.testing import do_bench

    rows = []
    cases = ((64, 8192, (128, 64, 8, 3)), (64, 8192, (128, 128, 8, 3)), (64, 2048, (128, 64, 8, 3)),
             (128, 8192, (256, 64, 8, 4)), (128, 8192, (128, 128, 8, 3)))  # fmt: skip
    for d, n, config in cases:
        batch, heads = 16384 // n, 2048 // d
        q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        o = torch.empty_like(q)
        for mode in MODES:
            o.fill_(float("nan"))
            _run(q, k, v, o, config, mode)
            err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
            ms = do_bench(functools.partial(_run, q, k, v, o, config, mode), warmup=50, rep=300)
            rows.append((d, n, config, mode, 4 * batch * heads * n * n * d / ms / 1e9, err))
            print(*rows[-1], flush=True)
    print(f"\n{'d':>4} {'N':>6} {'config':<17} {'mode':<7} {'TFLOP/s':>8} {'rel err':>8}")
    for d, n, config, mode, tflops, err in rows:
        print(f"{d:>4} {n:>6} {config!s:<17} {mode:<7} {tflops:>8.0f} {err:>8.1e}")


def loop_mix() -> None:
    """Each mode's inner loop in sm_90 PTX, by opcode, at d=64 (128, 64, 8 warps, 3 stages)."""
    from exp_fwd_overheads import loop_ops  # scripts/ is on the path when a script of it runs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = _minimal_fwd.arg_names
    signature = {a: "*bf16" for a in ("Q", "K", "V", "Out")} | {"qk_scale": "fp32", "N": "i32", "H": "i32"}
    for mode in MODES:
        constexprs = {"BLOCK_M": 128, "BLOCK_N": 64, "D": 64, "MODE": MODES.index(mode), "ASM2": _asm(2),
                      "ASM4": _asm(4), "ASM8": _asm(8)}  # fmt: skip
        sig = signature | dict.fromkeys(constexprs, "constexpr")
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("Q", "K", "V", "Out", "N")}
        source = ASTSource(_minimal_fwd, {a: sig[a] for a in names}, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        ops = loop_ops(kernel)
        top = {op: ops.count(op) for op in sorted(set(ops), key=ops.count, reverse=True)[:14]}
        layouts = kernel.asm["ttgir"].count("convert_layout")
        print(f"{mode:>6}: {len(ops)} in the loop, shared {kernel.metadata.shared} B, {layouts} convert_layout; {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ptx", action="store_true", help="compare the inner loops' PTX (no GPU needed)")
    args = parser.parse_args()
    if args.ptx:
        loop_mix()
    else:
        check_exp2()
        time_table()


if __name__ == "__main__":
    main()
