"""Test setup: without a CUDA device the kernels run on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton builds any kernel; fa2tune renders and imports its kernel modules on
first use, but set it here, before anything imports triton, as the interpreter's documentation asks.
"""

from __future__ import annotations

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hermetic config lookup: a tuned YAML in the developer's ~/.cache (say, from `fa2tune tune --device cpu`) must
# not change which configs the tests launch. Each test run gets its own cache root.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fa2tune-tests-")
os.environ.pop("FA2TUNE_CONFIG_DIR", None)

import pytest

from fa2tune.config import planner
from fa2tune.launch import fastlaunch

# Tests of code written against given Tritons' internals: the Gluon kernels' API (planner.WS_TRITONS) and the compiled
# launchers' form (fastlaunch.TESTED_TRITON). On another Triton the product gates those paths off and these have
# nothing to test. CI runs the suite under each Triton of WS_TRITONS.
ON_WS_TRITON = pytest.mark.skipif(
    not planner.triton_version().startswith(planner.WS_TRITONS),
    reason=f"the Gluon kernels are written for Triton {planner.WS_TRITONS}; this is Triton {planner.triton_version()}",
)
ON_DIRECT_LAUNCH_TRITON = pytest.mark.skipif(
    not planner.triton_version().startswith(fastlaunch.TESTED_TRITON),
    reason=f"direct launches are checked on Triton {fastlaunch.TESTED_TRITON}; this is {planner.triton_version()}",
)

# Per-dtype tolerances against a float64 reference: |out - ref| <= atol + rtol·|ref|.
# bf16 has 8 bits of mantissa (eps 2^-8 ≈ 3.9e-3), fp16 11 bits (eps ≈ 4.9e-4); P is rounded to the input dtype
# before P·V, as in every FlashAttention kernel, so errors are a few eps of the output's magnitude.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2),
}


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """fa2tune keeps, per call signature, what the first call worked out (configs, grids: its plans). Tests patch
    what that is worked out from (selection.resolve, warpspec._sm_count): each starts with none kept."""
    from fa2tune.api import ops

    ops.clear_plans()


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """Per-dtype comparison with a report of how many elements are off and where the worst one is."""
    tol = TOLERANCES[dtype]
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: {int(torch.isnan(actual).sum())} NaN elements"
    both_inf = torch.isinf(expected) & (actual == expected)
    diff = torch.where(both_inf, 0.0, (actual - expected).abs())
    bad = diff > tol["atol"] + tol["rtol"] * expected.abs()
    if bad.any():
        worst = int(diff.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements differ beyond {tol} ({dtype}); worst at {index}: "
            f"got {actual[index].item():.6g}, expected {expected[index].item():.6g}"
        )
