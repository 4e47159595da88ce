"""The oracle itself: standard attention vs PyTorch, the seed's tiled algorithm vs standard, the worked example."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fa2tune.tune.reference import InnerStep, causal_visible, naive_attention, tiled_attention, tiled_attention_batched

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("causal", [False, True])
def test_naive_matches_pytorch_sdpa(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 19, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 19, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 19, 8, dtype=torch.float64)
    o, lse = naive_attention(q, k, v, causal=causal)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
    s = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(8)
    if causal:
        s = s.masked_fill(~causal_visible(19, 19), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-12, atol=1e-12)


def test_causal_is_bottom_right_aligned():
    visible = causal_visible(2, 5)
    assert visible.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert not causal_visible(5, 2)[:3].any()  # the first N_q - N_k queries see no key


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(1, 1), (2, 3), (7, 5), (16, 8), (64, 64)])
@pytest.mark.parametrize("lengths", [(13, 13), (6, 17), (17, 6), (1, 1)])
def test_tiled_equals_standard(lengths, blocks, causal):
    torch.manual_seed(hash((lengths, blocks, causal)) % 2**31)
    n_q, n_k = lengths
    q, k, v = torch.randn(n_q, 5, dtype=torch.float64), *torch.randn(2, n_k, 5, dtype=torch.float64)
    o, lse = tiled_attention(q, k, v, block_r=blocks[0], block_c=blocks[1], causal=causal)
    ref_o, ref_lse = naive_attention(q, k, v, causal=causal)
    torch.testing.assert_close(o, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_causal_loop_skips_future_tiles():
    # Option B: every visited tile holds at least one visible score, and the count is what the bound allows.
    torch.manual_seed(1)
    n, block_r, block_c = 20, 4, 3
    q, k, v = torch.randn(3, n, 8, dtype=torch.float64)
    trace: list[InnerStep] = []
    tiled_attention(q, k, v, block_r=block_r, block_c=block_c, causal=True, trace=trace)
    assert all(torch.isfinite(step.s).any() for step in trace)
    expected_steps = sum(math.ceil(min(n, r0 + block_r) / block_c) for r0 in range(0, n, block_r))
    assert len(trace) == expected_steps < math.ceil(n / block_r) * math.ceil(n / block_c)


def test_batched_tiled_with_gqa():
    torch.manual_seed(2)
    q = torch.randn(2, 4, 11, 6, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 9, 6, dtype=torch.float64)
    o, lse = tiled_attention_batched(q, k, v, block_r=4, block_c=4, causal=True)
    ref_o, ref_lse = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(o, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_worked_example_statistics_follow_the_seeds_closed_forms():
    q = torch.tensor([[2, -1], [-2, 5], [4, 1], [0, 2], [3, 0], [1, -3]], dtype=torch.float64)
    k = torch.tensor([[1, 0, 4, -1, 5, 2], [-2, 3, 1, 2, 0, -4]], dtype=torch.float64).T
    v = torch.tensor([[3, 0], [1, 2], [-2, 1], [5, -3], [4, 0], [-1, 2]], dtype=torch.float64)
    trace: list[InnerStep] = []
    tiled_attention(q, k, v, block_r=2, block_c=2, scale=1.0, trace=trace)
    steps = [s for s in trace if s.i == 0]
    assert len(steps) == 3 and len(trace) == 9
    e = math.e
    # ℓ_1 after each step, as the seed writes it in closed form.
    closed_l = [
        [1 + e**-7, 1 + e**-27],
        [1 + e**-3 + e**-10 + e**-11, 1 + e**-3 + e**-18 + e**-27],
        [1 + e**-2 + e**-3 + e**-6 + e**-13 + e**-14, 1 + e**-3 + e**-18 + e**-25 + e**-27 + e**-39],
    ]
    for step, want in zip(steps, closed_l, strict=True):
        torch.testing.assert_close(step.l, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)
    # Õ_1 after step 2 in the seed's closed form (the first time the correction fires).
    want_o2 = [
        [3 * e**-3 + e**-10 - 2 + 5 * e**-11, 2 * e**-10 + 1 - 3 * e**-11],
        [1 + 3 * e**-27 + 5 * e**-3 - 2 * e**-18, 2 - 3 * e**-3 + e**-18],
    ]
    torch.testing.assert_close(steps[1].o, torch.tensor(want_o2, dtype=torch.float64), rtol=1e-14, atol=1e-15)
    assert steps[2].m.tolist() == [10.0, 15.0]


def test_verify_fa_example_script_passes():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "verify_fa_example.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "O_1 = O~_1 / l_1 = [[3.177, 0.27], [1.19, 1.763]]" in result.stdout
    assert "final l_1  = [1.1876, 1.0498]" in result.stdout
    assert "Triton kernel" in result.stdout
