"""The planner: the SRAM model against the compiler's recorded verdicts, reasons, defaults, other GPUs."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fa2tune.config import defaults, planner
from fa2tune.config.device import KNOWN_GPUS, known_gpu
from fa2tune.config.schedule import PERSISTENT
from fa2tune.config.types import KernelConfig

VERDICTS = Path(__file__).resolve().parent.parent / "docs" / "planner" / "nvidia-h200-compiler-bf16.csv"


def _recorded():
    with open(VERDICTS) as handle:
        for row in csv.DictReader(handle):
            cfg = KernelConfig(int(row["block_m"]), int(row["block_n"]), int(row["num_warps"]), int(row["num_stages"]))
            shared = int(row["shared_bytes"]) if row["shared_bytes"] else None
            yield row["kernel"], int(row["head_dim"]), cfg, shared, row["error"]


def test_model_against_recorded_compiler_verdicts():
    # Replays what Triton 3.6 allocated for every candidate compiled for sm_90 (scripts/check_planner.py):
    # no config the model accepts may exceed the H200's limit, and few it rejects may fit.
    h200 = known_gpu("h200")
    rows = list(_recorded())
    assert len(rows) >= 1000
    false_accepts, false_rejects, fits = [], [], 0
    for kernel, head_dim, cfg, shared, error in rows:
        assert not error, f"{kernel} {cfg} failed to compile: {error}"
        compiler_fits = shared <= h200.smem_per_block
        model_fits = planner.sram_bytes(cfg, head_dim, torch.bfloat16, kernel) <= h200.smem_per_block
        fits += compiler_fits
        if model_fits and not compiler_fits:
            false_accepts.append((kernel, head_dim, cfg, shared))
        if compiler_fits and not model_fits:
            false_rejects.append((kernel, head_dim, cfg, shared))
    assert not false_accepts, f"model accepts configs the compiler cannot fit: {false_accepts[:5]}"
    assert len(false_rejects) <= 0.10 * fits, f"{len(false_rejects)} false rejects of {fits} that fit"


def test_model_is_exact_for_the_forward_and_close_for_the_backward():
    # The forward's shared memory is predicted to the byte; the backward's within 0.85-2x above a quarter budget.
    for kernel, head_dim, cfg, shared, _ in _recorded():
        predicted = planner.sram_bytes(cfg, head_dim, torch.bfloat16, kernel)
        if kernel == "fwd":
            assert predicted == shared, f"fwd d={head_dim} {cfg}: {predicted} vs {shared}"
        elif shared > 232448 // 4:
            assert 0.85 * shared <= predicted <= 2 * shared, f"{kernel} d={head_dim} {cfg}: {predicted} vs {shared}"


def test_seed_rule_alone_would_accept_configs_that_fail():
    # The seed's B_r·d + B_c·d + B_r·B_c ignores pipeline stages and the V tile: it accepts what cannot launch.
    h200 = known_gpu("h200")
    cfg = KernelConfig(64, 128, 4, 4)  # OutOfResources on the H200: 278,528 B asked (docs/PLANNER.md)
    assert planner.seed_rule_bytes(cfg, 128, torch.bfloat16) <= h200.smem_per_block
    assert planner.sram_bytes(cfg, 128, torch.bfloat16) == 278528
    assert "shared memory: needs 278,528 B" in planner.check(cfg, h200, 128, torch.bfloat16)


def test_every_rejection_has_a_reason_and_plan_partitions_candidates():
    for kernel in planner.KERNELS:
        plan = planner.plan(known_gpu("l4"), 96, torch.float16, kernel)
        # 250 block/warp/stage configs; the forward's doubled by its pipeline_qk switch, plus 54 warpspec ones
        # (24, each persistent or not, and the 6 one-consumer ones two programs an SM; 51 for dK/dV — 24 persistent
        # or not, half with dQ fused in, the 6 one-consumer ones two an SM, and 6 with split roles, persistent or
        # not, then the 15 fused ones again drained before their dQ share — and 30 for dQ, 24 persistent or not and
        # the 6 one-consumer ones two an SM); at a head dim padded to fewer chunks (d=112, not 96) each warpspec one
        # twice, with the pad and without
        ws = {"fwd": 54, "bwd_dkdv": 51, "bwd_dq": 30}[kernel]
        expected = 250 * (kernel == "fwd") + 250 + ws
        assert len(plan.accepted) + len(plan.rejected) == len(planner.candidates(kernel, 96)) == expected
        assert len(planner.candidates(kernel, 112)) == len(planner.candidates(kernel)) == expected + ws
        assert plan.accepted and plan.rejected
        for cfg, need, reason in plan.rejected:
            if cfg.warp_specialized:  # an L4 (sm_89) has no wgmma: every warpspec config is out, for that reason
                assert reason.startswith("warpspec needs a Hopper GPU"), reason
                continue
            assert reason.startswith(("shared memory", "registers")), reason
            assert (need > plan.device.smem_per_block) == reason.startswith("shared memory")
        assert all(need <= plan.device.smem_per_block for _, need in plan.accepted)


def test_register_rule_rejects_what_spilled_on_the_h200():
    h200 = known_gpu("h200")
    # fwd d=128: (256, 32, 4 warps) ran at 114-165 TFLOP/s against 527 for the best in the H200's sweep: 320 values
    # a thread, over the 256 at which every sweep spilled (docs/PLANNER.md, "From the seed's rule to a byte model").
    assert planner.check(KernelConfig(256, 32, 4, 2), h200, 128, torch.bfloat16).startswith("registers")
    assert planner.check(KernelConfig(256, 64, 8, 4), h200, 128, torch.bfloat16) is None  # the measured best


@pytest.mark.parametrize("gpu", sorted(KNOWN_GPUS))
@pytest.mark.parametrize("kernel", planner.KERNELS)
def test_default_config_fits_every_known_gpu(gpu, kernel):
    info = known_gpu(gpu)
    for head_dim in (16, 64, 96, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            for causal in (False, True):
                for bucket in ("all", "short", "medium"):
                    cfg = defaults.default_config(head_dim, dtype, causal=causal, kernel=kernel, device=info,
                                                  seqlen_bucket=bucket)  # fmt: skip
                    assert planner.check(cfg, info, head_dim, dtype, kernel) is None


def test_default_config_prefers_the_h200_measurements():
    h200 = replace(known_gpu("h200"), triton_version="3.6.0")  # the Triton the measurements were made under
    # The warp-specialized forward first (docs/PERF.md, "The warp-specialized forward"), persistent ("Persistent
    # kernels and paired causal tiles"), ping-pong for causal past d=64, where three consumers fit
    persistent = KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT)
    assert defaults.default_config(128, torch.bfloat16, device=h200) == persistent
    assert defaults.default_config(96, torch.bfloat16, device=h200) == persistent
    pingpong = replace(persistent, pingpong=True)
    assert defaults.default_config(128, torch.bfloat16, causal=True, device=h200) == pingpong
    assert defaults.default_config(112, torch.bfloat16, causal=True, device=h200) == pingpong
    d64 = KernelConfig(192, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT)
    assert defaults.default_config(64, torch.bfloat16, device=h200) == d64
    assert defaults.default_config(48, torch.bfloat16, causal=True, device=h200) == replace(d64, num_stages=3)
    # where the measured config does not fit — Triton 3.9's three consumers spill at d=64 — the model's shapes follow
    # it, before the Triton template's
    under_39 = replace(h200, triton_version="3.9.0")
    assert defaults.default_config(64, torch.bfloat16, device=under_39) == replace(d64, block_m=128)
    assert defaults.default_config(64, torch.bfloat16, causal=True, device=under_39) == pingpong
    # dK/dV with dQ fused in up to d=128: persistent and three stages where they fit, split roles past it
    fused = KernelConfig(64, 128, 4, 2, warp_specialized=True, fused_dq=True)
    dkdv = lambda head_dim: defaults.default_config(head_dim, torch.bfloat16, kernel="bwd_dkdv", device=h200)
    assert dkdv(64) == replace(fused, num_stages=3, schedule=PERSISTENT)
    assert dkdv(96) == replace(fused, schedule=PERSISTENT)
    assert dkdv(128) == fused and dkdv(112) == replace(fused, pad_head_dim=True)  # pads_by_default
    assert dkdv(136).split_roles and dkdv(144).split_roles
    # the planner refuses fused dQ past d=128, where it compiles with 216-352 B of stack (a measured rule)
    assert planner.check(fused, h200, 128, torch.bfloat16, "bwd_dkdv") is None
    assert "fused in spills past head_dim 128" in planner.check(fused, h200, 136, torch.bfloat16, "bwd_dkdv")
    # below d=64 too, of one chunk or two (d = 33-48: 32 + 16), persistent with three stages, causal or not
    for head_dim in (16, 32, 40, 48, 56):
        assert dkdv(head_dim) == replace(fused, num_stages=3, schedule=PERSISTENT), head_dim
        causal = defaults.default_config(head_dim, torch.bfloat16, causal=True, kernel="bwd_dkdv", device=h200)
        assert causal == replace(fused, num_stages=3, schedule=PERSISTENT), head_dim
    # dQ: three stages, persistent
    dq = lambda head_dim: defaults.default_config(head_dim, torch.bfloat16, kernel="bwd_dq", device=h200)
    assert dq(128) == KernelConfig(128, 64, 4, 3, warp_specialized=True, schedule=PERSISTENT)
    assert dq(192) == KernelConfig(64, 64, 4, 3, warp_specialized=True, schedule=PERSISTENT)
    # then the Triton template's measured best: asked for, for fp32, off Hopper
    triton = dict(device=h200, warp_specialized=False)
    assert defaults.default_config(128, torch.bfloat16, **triton) == KernelConfig(256, 64, 8, 4)
    assert defaults.default_config(128, torch.bfloat16, causal=True, **triton) == KernelConfig(128, 128, 8, 3)
    assert not defaults.default_config(128, torch.float32, device=h200).warp_specialized
    assert not defaults.default_config(128, torch.bfloat16, device=known_gpu("a100-80gb")).warp_specialized
    # The L4 has 99 KiB per block: the H200's 192 KiB pick does not fit, a smaller one is chosen.
    l4 = known_gpu("l4")
    cfg = defaults.default_config(128, torch.bfloat16, device=l4)
    assert cfg != KernelConfig(256, 64, 8, 4) and planner.sram_bytes(cfg, 128, torch.bfloat16) <= l4.smem_per_block


def test_short_and_medium_calls_default_to_the_forms_measured_at_their_lengths():
    # A call of the "short" bucket at a head dim without an entry (docs/PERF.md, "Short and odd lengths"): the causal
    # forward leads with 128 x 64 persistent without ping-pong, the one without a mask with 128 x 128, the causal
    # dK/dV kernel leaves dQ to its own kernel, ahead of the padded fused form too (d=112); a "medium" causal forward
    # takes ping-pong at every head dim; the other kernels and masks keep their order.
    h200 = replace(known_gpu("h200"), triton_version="3.6.0")
    fwd = KernelConfig(128, 64, 4, 3, warp_specialized=True, schedule=PERSISTENT)
    dkdv = KernelConfig(64, 128, 4, 3, warp_specialized=True, schedule=PERSISTENT)
    default = lambda head_dim, bucket, **kw: defaults.default_config(head_dim, torch.bfloat16, device=h200,
                                                                     seqlen_bucket=bucket, **kw)  # fmt: skip
    for head_dim in (32, 40, 64, 72, 112, 128):
        assert default(head_dim, "short", causal=True) == fwd, head_dim
        assert default(head_dim, "short", causal=True, kernel="bwd_dkdv") == dkdv, head_dim
        for bucket in ("all", "medium"):  # dQ fused in
            assert default(head_dim, bucket, causal=True, kernel="bwd_dkdv").fused_dq, (head_dim, bucket)
        # medium lengths: ping-pong at every head dim, where long ones take three consumers at d <= 64
        assert default(head_dim, "medium", causal=True) == replace(fwd, block_n=128, num_stages=2, pingpong=True)
        assert default(head_dim, "all", causal=True) != fwd
        assert (default(head_dim, "all", causal=True).block_m == 192) == (head_dim <= 64), head_dim
        # no mask: short calls take 128 x 128 (two stages, persistent), the long order's choice past d=64, where
        # long ones take three consumers at d <= 64; medium ones keep the long order
        short_plain = replace(fwd, block_n=128, num_stages=2)
        assert default(head_dim, "short") == short_plain, head_dim
        assert (default(head_dim, "all") == short_plain) == (head_dim > 64), head_dim
        assert default(head_dim, "medium") == default(head_dim, "all"), head_dim
        for kernel, causal in (("bwd_dkdv", False), ("bwd_dq", False), ("bwd_dq", True)):
            assert default(head_dim, "short", causal=causal, kernel=kernel) == default(head_dim, "all", causal=causal,
                                                                                     kernel=kernel)  # fmt: skip
    # where a short form does not fit, the next one or the long order follows: two stages at d=192, split roles
    assert default(192, "short", causal=True) == replace(fwd, num_stages=2)
    assert default(192, "short") == default(192, "all") != replace(fwd, block_n=128, num_stages=2)
    assert default(192, "short", causal=True, kernel="bwd_dkdv").split_roles
    # fp32 and GPUs without wgmma take the Triton tiles of the long order
    triton = dict(causal=True, warp_specialized=False)
    assert default(128, "short", **triton) == default(128, "all", **triton)
    fp32 = defaults.default_config(128, torch.float32, causal=True, device=h200, seqlen_bucket="short")
    assert not fp32.warp_specialized
    with pytest.raises(ValueError, match=r"seqlen_bucket must be one of \('all', 'short', 'medium'\), got 'long'"):
        default(128, "long")


def test_bad_kernel_and_head_dim():
    with pytest.raises(ValueError, match=r"kernel must be one of \('fwd', 'bwd_dkdv', 'bwd_dq'\), got 'bwd'"):
        planner.sram_bytes(KernelConfig(64, 64), 64, torch.bfloat16, "bwd")
    assert planner.check(KernelConfig(64, 64), known_gpu("h200"), 512, torch.bfloat16).startswith("head_dim")


def test_unknown_gpu_lists_choices():
    with pytest.raises(ValueError, match=r"unknown GPU 'h300'; known GPUs: a100-40gb, .*h200"):
        known_gpu("h300")
    assert known_gpu("nvidia-h200") is known_gpu("h200")


@pytest.mark.slow
def test_recording_still_matches_the_installed_compiler():
    # Three rows of the recording compiled again now: if Triton changes its allocation, re-run check_planner.py.
    import json
    import os
    import subprocess
    import sys

    import triton

    if triton.__version__ != "3.6.0":
        pytest.skip(f"the recording was made with triton 3.6.0; this is {triton.__version__}")

    rows = [("fwd", 128, KernelConfig(64, 128, 4, 4)), ("bwd_dkdv", 64, KernelConfig(32, 128, 4, 3)),
            ("bwd_dq", 128, KernelConfig(128, 64, 8, 3)),
            ("fwd", 64, KernelConfig(128, 64, 8, 2, pipeline_qk=1))]  # fmt: skip
    recorded = {(k, d, cfg): shared for k, d, cfg, shared, _ in _recorded()}
    # pipeline_qk is not in the recording: its row must match the model itself, to the byte
    recorded[rows[3]] = planner.sram_bytes(rows[3][2], 64, torch.bfloat16)
    # The probe needs Triton's real compiler, not the interpreter this test process may run under.
    # The window/prefix (banded) and packed (varlen) variants keep the same tiles: the planner's model holds
    # for them only if the compiler gives them the same shared memory as the recorded causal variant.
    script = (
        "import json, sys, torch; from fa2tune.tune.probe import compile_config\n"
        "from fa2tune.config.types import KernelConfig\n"
        "rows = json.loads(sys.argv[1])\n"
        "print(json.dumps([compile_config(k, KernelConfig(*c), d, torch.bfloat16, causal=True, banded=i == 1,"
        " varlen=i == 2).shared_bytes for i, (k, d, c) in enumerate(rows)]))"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    args = json.dumps([(k, d, list(cfg.to_dict().values())) for k, d, cfg in rows])
    out = subprocess.run([sys.executable, "-c", script, args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [recorded[row] for row in rows]


def test_pipeline_qk_is_a_forward_switch_that_costs_one_score_tile_of_registers():
    h200 = known_gpu("h200")
    plain, pipelined = KernelConfig(128, 64, 8, 3), KernelConfig(128, 64, 8, 3, pipeline_qk=1)
    assert planner.check(pipelined, h200, 128, torch.bfloat16) is None
    assert planner.check(pipelined, h200, 128, torch.bfloat16, "bwd_dq").startswith("pipeline_qk")
    extra = planner.accumulators_per_thread(pipelined, 128) - planner.accumulators_per_thread(plain, 128)
    assert extra == 128 * 64 / 256  # one more 128×64 fp32 score tile over 8 warps
    # The QKᵀ issued ahead holds its K tile in one more shared-memory buffer (compiled for sm_90: docs/PLANNER.md)
    assert planner.sram_bytes(pipelined, 128, torch.bfloat16) - planner.sram_bytes(plain, 128, torch.bfloat16) == 16384
    assert planner.check(KernelConfig(128, 128, 8, 3, pipeline_qk=1), h200, 128, torch.bfloat16).startswith("shared")
    # (256, 64, 8w): 192 accumulators per thread plain, 256 pipelined: the second would spill
    assert planner.check(KernelConfig(256, 64, 8, 4, pipeline_qk=1), h200, 128, torch.bfloat16).startswith("registers")
