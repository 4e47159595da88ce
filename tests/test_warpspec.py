"""The warp-specialized forward (KernelConfig.warp_specialized, templates/fwd_ws.py.jinja) without a GPU: its configs'
rules, the planner's model against the compiler, code hashes, and the launcher's routing of calls it cannot take.
Its results on a GPU are checked in tests/test_gpu.py."""

from __future__ import annotations

import inspect
import itertools
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import fa2tune
from fa2tune.api import ops, selection
from fa2tune.config import defaults, head_chunks, planner, schema_v1
from fa2tune.config.device import known_gpu
from fa2tune.config.schedule import PER_TILE, PERSISTENT, TWO_AN_SM
from fa2tune.config.store import EntryKey
from fa2tune.config.types import PARAM_NAMES, KernelConfig, Variant
from fa2tune.kernels import codegen
from fa2tune.launch import fallback, warpspec
from fa2tune.tune import tuner
from fa2tune.tune.reference import naive_attention

from .conftest import ON_WS_TRITON, assert_close

WS = KernelConfig(128, 128, 4, 2, warp_specialized=True)


def test_configs_combine_fields_by_warpspec_rules():
    assert WS.consumers() == 2 and KernelConfig(192, 64, 4, 3, warp_specialized=True).consumers() == 3
    assert KernelConfig(128, 64, 8, 3).consumers() == 0
    assert (
        KernelConfig(64, 128, 4, 2, warp_specialized=True).consumers("bwd_dkdv") == 2
    )  # dK/dV: 64 K/V rows per consumer
    assert KernelConfig(128, 64, 4, 2, warp_specialized=True).consumers("bwd_dq") == 2  # dQ: 64 query rows per consumer
    assert KernelConfig.from_dict(WS.to_dict()) == WS and WS.to_dict()["warp_specialized"] == 1
    assert "warp_specialized" not in KernelConfig(128, 64).to_dict()  # entries written before the switch read the same
    bad = {
        KernelConfig(192, 64): "block_m=192 needs warpspec",
        KernelConfig(32, 64, 4, 2, warp_specialized=True): "warpspec takes block_m in (64, 128, 192)",
        KernelConfig(128, 64, 8, 2, warp_specialized=True): "warpspec configs have num_warps=4",
        KernelConfig(64, 64, 4, 2, warp_specialized=True, pingpong=True): (
            "warpspec's pingpong (ping-pong of two consumers) needs block_m=128"
        ),
    }
    for cfg, message in bad.items():
        assert cfg.combination_error().startswith(message)
        assert planner.check(cfg, known_gpu("h200"), 128, torch.bfloat16).startswith(message)
    assert KernelConfig(64, 128, 4, 2, warp_specialized=True).combination_error("bwd_dkdv") is None
    assert (
        KernelConfig(64, 128, 4, 2, warp_specialized=True, fused_dq=True).combination_error("bwd_dkdv") is None
    )  # dQ fused in
    assert (
        KernelConfig(128, 128, 4, 2, warp_specialized=True)
        .combination_error("bwd_dkdv")
        .startswith(
            "bwd_dkdv's warpspec takes block_n in (64, 128) (64 K/V rows per consumer warpgroup) and block_m in (64,)"
        )
    )
    assert WS.combination_error("bwd_dq") is None
    assert (
        KernelConfig(192, 64, 4, 2, warp_specialized=True)
        .combination_error("bwd_dq")
        .startswith("bwd_dq's warpspec takes block_m in")
    )
    assert (
        KernelConfig(128, 64, 4, 2, warp_specialized=True, pingpong=True)
        .combination_error("bwd_dq")
        .startswith("warpspec's pingpong (ping-pong of two consumers) is a switch of warp-specialized forward configs")
    )
    with pytest.raises(ValueError, match="warpspec must be 0, 1 or 2, got 3"):  # a schema-1 file's code
        schema_v1.config(dict(block_m=128, block_n=64, num_warps=4, num_stages=2, warpspec=3), "fwd")
    # persistent: a switch of the warpspec kernels only; written to YAML only when on
    persistent = KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT)
    assert persistent.combination_error() is None and KernelConfig.from_dict(persistent.to_dict()) == persistent
    assert "schedule" not in WS.to_dict() and persistent.to_dict()["schedule"]["persistent"] == 1
    for cfg, kernel in ((KernelConfig(128, 64, 8, 2, schedule=PERSISTENT), "fwd"),
                        (KernelConfig(64, 64, schedule=PERSISTENT), "bwd_dq")):  # fmt: skip
        assert cfg.combination_error(kernel).startswith("persistent is a switch of the warpspec kernels fwd, bwd_dkdv")
    assert KernelConfig(64, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT).combination_error("bwd_dkdv") is None
    assert persistent.combination_error("bwd_dq") is None
    with pytest.raises(ValueError, match="persistent must be 0, 1 or 2, got 3"):  # a schema-1 file's code
        schema_v1.config(dict(block_m=128, block_n=64, num_warps=4, num_stages=2, warpspec=1, persistent=3), "fwd")
    # two programs an SM: one-consumer warpspec configs only (of each kernel: 64 owned rows)
    two = KernelConfig(64, 64, 4, 3, warp_specialized=True, schedule=TWO_AN_SM)
    assert two.combination_error() is None and KernelConfig.from_dict(two.to_dict()) == two
    assert (
        two.combination_error("bwd_dkdv") is None and replace(two, fused_dq=True).combination_error("bwd_dkdv") is None
    )
    assert two.combination_error("bwd_dq") is None and replace(two, block_n=128).combination_error("bwd_dq") is None
    assert two.label() == "64x64 w4 s3 ws persistent x2"
    for cfg, kernel in ((replace(two, block_m=128), "fwd"), (replace(two, block_m=128), "bwd_dq"),
                        (replace(two, block_n=128), "bwd_dkdv")):  # fmt: skip
        assert cfg.combination_error(kernel).startswith("warpspec's programs_per_sm=2 (two programs an SM)"), (
            cfg,
            kernel,
        )
    with pytest.raises(ValueError, match=r"block_m must be one of \(16, 32, 64, 128, 256, 192\), got 96"):
        KernelConfig(96, 64, 4, 2, warp_specialized=True)


def test_split_roles_is_a_dkdv_form_of_one_k_v_block_that_takes_every_head_dim():
    split = KernelConfig(64, 64, 4, 2, warp_specialized=True, split_roles=True)
    assert split.combination_error("bwd_dkdv") is None and split.consumers("bwd_dkdv") == 2
    assert not split.two_an_sm_shape("bwd_dkdv")  # two consumers hold most of an SM
    assert KernelConfig.parse("64,64,4,2,ws,split-roles") == split and "split-roles" in split.label()
    assert KernelConfig.from_dict(split.to_dict()) == split and KernelConfig.from_ints(split.to_ints()) == split
    assert "split_roles" not in KernelConfig(64, 128, 4, 2, warp_specialized=True).to_dict()  # old entries read alike
    for other, words in ((replace(split, block_n=128), "block_n=64"),
                         (replace(split, warp_specialized=False), "warp-specialized"),
                         (replace(split, schedule=TWO_AN_SM), "one-consumer")):  # fmt: skip
        assert words in other.combination_error("bwd_dkdv"), other
    assert "bwd_dkdv" in split.combination_error("fwd")
    h200 = known_gpu("h200")
    # One warpgroup holds dK and dV of its 64 rows up to d=128; past it the default splits the roles, and the
    # model admits it up to d=256 (whose persistent form, with dK and dV staged apart, needs more than an SM has)
    for head_dim in (144, 192, 200, 256):
        assert planner.check(replace(split, split_roles=False), h200, head_dim, torch.bfloat16, "bwd_dkdv")
        assert planner.check(split, h200, head_dim, torch.bfloat16, "bwd_dkdv") is None
        # (unpadded: defaults.pads_by_default pads the fused form only)
        assert defaults.default_config(head_dim, torch.bfloat16, kernel="bwd_dkdv", device=h200) == split
    assert "shared memory" in planner.check(replace(split, schedule=PERSISTENT), h200, 256, torch.bfloat16, "bwd_dkdv")
    assert not defaults.default_config(128, torch.bfloat16, kernel="bwd_dkdv", device=h200).split_roles
    # not with dQ fused in: a program's 64 K/V rows would reduce each dQ tile twice as often as two 64-row blocks
    fused = replace(split, fused_dq=True)
    assert "split_roles does not take fused_dq" in fused.combination_error("bwd_dkdv")
    assert "split_roles does not take fused_dq" in planner.check(fused, h200, 192, torch.bfloat16, "bwd_dkdv")
    with pytest.raises(ValueError, match=r"dkdv_config .*split_roles does not take fused_dq"):
        fallback.check_combination(fused, "bwd_dkdv")
    assert planner.check(split, known_gpu("l4"), 192, torch.bfloat16, "bwd_dkdv").startswith("warpspec needs a Hopper")


def test_planner_offers_warpspec_on_hopper_only_and_for_what_it_takes(monkeypatch):
    h200 = known_gpu("h200")
    assert planner.check(WS, h200, 128, torch.bfloat16) is None
    assert planner.check(WS, h200, 128, torch.float16) is None
    assert planner.check(WS, known_gpu("a100-80gb"), 128, torch.bfloat16).startswith(
        "warpspec needs a Hopper GPU (compute capability 9.x: wgmma), this one is 8.0"
    )
    assert planner.check(WS, h200, 128, torch.float32).startswith("warpspec takes float16/bfloat16")
    # the kernels are written out a head-dim chunk at a time: every multiple of 8 up to 256, dQ fused into the dK/dV
    # kernel too
    fits_all = KernelConfig(128, 64, 4, 2, warp_specialized=True)
    assert all(planner.check(fits_all, h200, d, torch.bfloat16) is None for d in (16, 40, 96, 136, 192, 248))
    assert planner.check(WS, h200, 100, torch.bfloat16).startswith("warpspec takes head_dim a multiple of 8")
    dkdv_ws = KernelConfig(64, 128, 4, 2, warp_specialized=True)
    assert planner.check(dkdv_ws, h200, 96, torch.bfloat16, "bwd_dkdv") is None
    assert planner.check(replace(dkdv_ws, fused_dq=True), h200, 96, torch.bfloat16, "bwd_dkdv") is None
    assert planner.check(replace(dkdv_ws, fused_dq=True), h200, 64, torch.bfloat16, "bwd_dkdv") is None
    # V's head dim of its own: both head dims taken by warpspec, the model at the larger
    assert planner.check(replace(dkdv_ws, fused_dq=True), h200, 64, torch.bfloat16, "bwd_dkdv", head_dim_v=32) is None
    assert planner.check(fits_all, h200, 128, torch.bfloat16, head_dim_v=100).startswith(
        "warpspec takes head_dim a multiple of 8 in 16..256, got 100"
    )
    for d, dv in ((192, 128), (128, 192), (64, 96)):
        for kernel, cfg in (("fwd", fits_all), ("bwd_dkdv", dkdv_ws), ("bwd_dq", fits_all)):
            assert planner.check(cfg, h200, d, torch.bfloat16, kernel, head_dim_v=dv) == planner.check(
                cfg, h200, max(d, dv), torch.bfloat16, kernel
            )
    # The Gluon kernels compile on the Tritons they were written for (3.6, and 3.9, which renamed their TMA copies): a
    # card read under another Triton rules them out, so a shipped warpspec entry is passed over with a warning, not
    # compiled.
    read_under = lambda version: replace(h200, source="card", triton_version=version)
    assert planner.check(WS, read_under("3.6.0"), 128, torch.bfloat16) is None
    assert planner.check(WS, read_under("3.9.0"), 128, torch.bfloat16) is None
    assert planner.check(WS, read_under("3.10.0"), 128, torch.bfloat16) == (
        "warpspec's Gluon kernels are written for Triton 3.6.x and 3.9.x; this is Triton 3.10.0"
    )
    assert planner.check(KernelConfig(128, 64, 8, 3), read_under("3.10.0"), 128, torch.bfloat16) is None
    # dQ at d=128 with 128-row K/V tiles and two consumers: 64·(128 + 2.5·128)/128 = 224 > 240 − 24
    assert planner.check(WS, h200, 128, torch.bfloat16, "bwd_dq").startswith("registers: 224 fp32 accumulator")
    dkdv = [
        c for c in planner.candidates("bwd_dkdv", 128)
        if c.warp_specialized and not c.fused_dq and not c.split_roles and c.schedule != TWO_AN_SM
    ]
    assert len(dkdv) == 12 and all(planner.check(c, h200, 128, torch.bfloat16, "bwd_dkdv") is None for c in dkdv[:8])
    # two one-consumer dK/dV programs an SM: 232 registers less 16 hold d=64's 64·(2·64 + 3·64)/128 + 32 = 192, not
    # d=128's 224; at d=64 with dQ fused in, 2 and 3 stages fit twice in shared memory, 4 do not (two an SM, the
    # consumers load each step's logsumexp and δ: staged beside Q_i and dO_i, 3 stages would not fit twice)
    two = [c for c in planner.candidates("bwd_dkdv")
           if c.schedule == TWO_AN_SM and not c.drain_before_dq and not c.pad_head_dim]  # fmt: skip
    assert {(c.block_n, c.fused_dq) for c in two} == {(64, False), (64, True)} and len(two) == 6
    assert not any(c.stages_statistics("bwd_dkdv") for c in two)
    fits = {c.label(): planner.check(c, h200, 64, torch.bfloat16, "bwd_dkdv") for c in two}
    assert [name for name, reason in fits.items() if reason] == ["64x64 w4 s4 ws fused-dq persistent x2"]
    assert all(planner.check(c, h200, 128, torch.bfloat16, "bwd_dkdv") for c in two)
    # dQ fused in (fused_dq) adds dSᵀ twice (2·2·128·64 B), a consumer's fp32 staging buffer of its 64 dQ columns
    # (2·64·64·4 B at d=128, the consumers splitting the columns; all 64 columns each at d=64) and 256 B for its
    # barriers, with each stage's logsumexp and δ (2·4·64 B): two stages at d=128 need 198,400 B (the sm_90 compile
    # allocates 198,152), three 231,680, and a persistent grid (dK, dV staged apart) 263,936 > the H200's 232,448
    fused = KernelConfig(64, 128, 4, 2, warp_specialized=True, fused_dq=True)
    assert planner.sram_bytes(fused, 128, torch.bfloat16, "bwd_dkdv") == 198400
    assert (
        planner.sram_bytes(
            KernelConfig(64, 128, 4, 3, warp_specialized=True, fused_dq=True), 128, torch.bfloat16, "bwd_dkdv"
        )
        == 231680
    )
    assert planner.check(fused, h200, 128, torch.bfloat16, "bwd_dkdv") is None
    # three stages fit at d=128 but spill (232 B of stack): ruled out, so the tuner's first fused pick is 2 stages
    three = planner.check(
        KernelConfig(64, 128, 4, 3, warp_specialized=True, fused_dq=True), h200, 128, torch.bfloat16, "bwd_dkdv"
    )
    assert three.startswith("registers: dK/dV with dQ fused in at head_dim > 64 spills past 2 stages")
    space = [c for c in planner.candidates("bwd_dkdv") if not planner.check(c, h200, 128, torch.bfloat16, "bwd_dkdv")]
    first = tuner.first_configs(device=h200, kernel="bwd_dkdv", head_dim=128, dtype=torch.bfloat16, causal=False,
                                trials=8, space=space)  # fmt: skip
    assert fused in first
    persistent_fused = KernelConfig(64, 128, 4, 2, warp_specialized=True, fused_dq=True, schedule=PERSISTENT)
    assert planner.check(persistent_fused, h200, 128, torch.bfloat16, "bwd_dkdv").startswith("shared memory")
    assert planner.check(persistent_fused, h200, 64, torch.bfloat16, "bwd_dkdv") is None
    fused_space = [c for c in planner.candidates("bwd_dkdv") if c.fused_dq and c.schedule != TWO_AN_SM
                   and not c.drain_before_dq and not c.pad_head_dim]  # fmt: skip
    assert len(fused_space) == 12 and not any(c.split_roles for c in fused_space)
    # the fp32 dQ's TMA blocks, one a head-dim chunk: its query-side block, at most 64 columns (a 64 × 64 fp32 partial
    # is 32 registers a thread); d = 128's two 64-column blocks are one descriptor
    assert warpspec.dq_partial_blocks(((1, 1, 64, 128),)) == ((1, 1, 64, 64),)
    assert warpspec.dq_partial_blocks(((1, 1, 64, 64), (1, 1, 64, 32))) == ((1, 1, 64, 64), (1, 1, 64, 32))
    # at d <= 64 without a mask K and V are register operands too (a consumer's 64 × d of each, 16-bit): 32 values
    # a thread more than d=64's accumulators, in both forms (the model has no mask: it counts them for causal too);
    # none at d=128, where they would not fit
    assert planner.kv_in_registers(64) and planner.kv_in_registers(32) and not planner.kv_in_registers(128)
    assert not planner.kv_in_registers(64, causal=True)
    # V alone up to d = 96, and causal too past d = 64 where dQ is fused in, one program an SM (the step loop in two
    # phases): not unfused, not two programs an SM (the statistics not staged), not at d=128 nor d <= 64
    fused = KernelConfig.parse("64,128,4,2,ws,fused-dq,persistent")
    assert planner.v_in_registers(96) and planner.v_in_registers(80, causal=True, cfg=fused)
    assert not planner.v_in_registers(96, causal=True, cfg=fused.without_fused_dq())
    assert not planner.v_in_registers(96, causal=True, cfg=KernelConfig.parse("64,64,4,3,ws,fused-dq,persistent,x2"))
    assert not planner.v_in_registers(128, causal=True, cfg=fused) and not planner.v_in_registers(64, True, fused)
    for cfg in (
        KernelConfig(64, 128, 4, 3, warp_specialized=True),
        KernelConfig(64, 128, 4, 3, warp_specialized=True, fused_dq=True),
    ):
        at64 = planner.accumulators_per_thread(cfg, 64, "bwd_dkdv")
        planner_without = 64 * (2 * 64 + (3 * 64 if not cfg.fused_dq else 2.5 * 64)) / 128
        assert at64 == planner_without + 32 and planner.check(cfg, h200, 64, torch.bfloat16, "bwd_dkdv") is None
    # persistent dK/dV stages dK, dV apart from K, V: 2·128·(4·128 + 8·64) + 512 B > 227 KiB at 4 stages
    assert planner.check(dkdv[-1], h200, 128, torch.bfloat16, "bwd_dkdv").startswith("shared memory")
    # 4 stages of 128-row K and V tiles at d=128: 2·128·(128 + 8·128) + 512 B > the H200's 227 KiB; 3 fit
    assert planner.check(KernelConfig(128, 128, 4, 4, warp_specialized=True), h200, 128, torch.bfloat16).startswith(
        "shared"
    )
    assert planner.check(KernelConfig(128, 128, 4, 3, warp_specialized=True), h200, 128, torch.bfloat16) is None
    ws = [c for c in planner.candidates("fwd") if c.warp_specialized and not c.pad_head_dim]
    assert len(ws) == 54 and all(c.combination_error() is None for c in ws)
    assert [sum(c.schedule == p for c in ws) for p in (PERSISTENT, TWO_AN_SM)] == [24, 6]  # two an SM: block_m = 64
    # two programs an SM: each in half the SM's shared memory less its 1 KiB reserve, and compiled at maxnreg 128
    two_an_sm = KernelConfig(64, 64, 4, 3, warp_specialized=True, schedule=TWO_AN_SM)
    assert planner.check(replace(two_an_sm, schedule=PERSISTENT), h200, 128, torch.bfloat16) is None  # 131,584 B
    assert "2 programs an SM (programs_per_sm=2) leave each 115,712 B" in planner.check(two_an_sm, h200, 128,
                                                                                       torch.bfloat16)  # fmt: skip
    assert planner.check(replace(two_an_sm, num_stages=2), h200, 128, torch.bfloat16) is None  # 98,816 B
    assert (
        planner.ws_registers(two_an_sm)
        == planner.WS_TWO_AN_SM_REGISTERS
        != planner.ws_registers(replace(two_an_sm, schedule=PERSISTENT))
    )
    assert warpspec.compiled_form("fwd", two_an_sm, 64, True)[2]["maxnreg"] == 128
    # persistent stages O apart from Q: 2·128·(128 + 128 + 4·128) + 512 B fits, with 3 stages 256.5 KiB does not
    assert planner.sram_bytes(
        KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT), 128, torch.bfloat16
    ) == (planner.sram_bytes(WS, 128, torch.bfloat16) + 2 * 128 * 128)
    assert planner.check(
        KernelConfig(128, 128, 4, 3, warp_specialized=True, schedule=PERSISTENT), h200, 128, torch.bfloat16
    ).startswith("shared memory")
    # 192-row programs at d=128 with 128-row K/V tiles: three consumers of 160 registers would spill
    assert planner.check(KernelConfig(192, 128, 4, 2, warp_specialized=True), h200, 128, torch.bfloat16).startswith(
        "registers"
    )
    dq = [c for c in planner.candidates("bwd_dq") if c.warp_specialized and not c.pad_head_dim]
    assert len(dq) == 30 and all(c.combination_error("bwd_dq") is None for c in dq)
    assert (
        planner.check(KernelConfig(128, 64, 4, 3, warp_specialized=True), h200, 128, torch.bfloat16, "bwd_dq") is None
    )
    # one-consumer dQ programs two an SM: at d=128 only (64, 64) with 2 stages fits half an SM, 2·128·(3·64 + 4·64)
    # + 512 = 115,200 B of 115,712 (the sm_90 compile allocates 114,988), and 64·(128 + 2.5·128)/128 = 224
    # accumulators do not fit 232 − 24 registers; d=64 fits all but 3 and 4 stages of 128-row K/V tiles
    fits = {(d, c.label()): planner.check(c, h200, d, torch.bfloat16, "bwd_dq") for c in dq if c.schedule == TWO_AN_SM
            for d in (64, 128)}  # fmt: skip
    assert [key for key, reason in fits.items() if reason is None] == [
        (64, "64x64 w4 s2 ws persistent x2"), (128, "64x64 w4 s2 ws persistent x2"),
        (64, "64x64 w4 s3 ws persistent x2"), (64, "64x64 w4 s4 ws persistent x2"),
        (64, "64x128 w4 s2 ws persistent x2")]  # fmt: skip
    assert fits[128, "64x64 w4 s3 ws persistent x2"].startswith("shared memory: needs 147,968 B")
    assert fits[128, "64x128 w4 s2 ws persistent x2"].startswith("registers: 224 fp32 accumulator values")
    # dK/dV at d=256: 64·(2·256 + 3·64)/128 = 352 accumulators a consumer thread
    assert planner.check(dkdv[0], h200, 256, torch.bfloat16, "bwd_dkdv").startswith("registers")


def test_persistent_grids_hold_a_program_an_sm_or_two(monkeypatch):
    monkeypatch.setattr(warpspec, "_sm_count", lambda index: 132)
    one, two = (KernelConfig(64, 64, 4, 3, warp_specialized=True, schedule=s) for s in (PERSISTENT, TWO_AN_SM))
    assert warpspec._grid(one, 8, 1024, 0) == ((132,), 8192)
    assert warpspec._grid(two, 8, 1024, 0) == ((264,), 8192)
    assert warpspec._grid(two, 2, 3, 0) == ((6,), 6)  # never more programs than tiles
    assert warpspec._grid(replace(two, schedule=PER_TILE), 8, 1024, 0) == ((8, 1024), 8192)


def test_the_unchecked_descriptor_is_the_checked_one():
    # warpspec._descriptor's fast path (fastlaunch on) builds the dataclass without its __init__: same fields, and
    # compiled_form is cached, so a launch's host time holds neither (docs/PERF.md, "Launch plans and direct launches")
    t = torch.empty(2, 3, 80, 64, dtype=torch.bfloat16)[:, :, 8:]
    for block in [(1, 1, 64, 64), (1, 1, 128, 64)]:
        fast, checked = warpspec._descriptor(t, block, checked=False), warpspec._descriptor(t, block)
        assert fast == checked and type(fast) is type(checked) and fast.strides == [15360, 5120, 64, 1]
    config = KernelConfig(128, 64, 4, 3, warp_specialized=True)
    assert warpspec.compiled_form("bwd_dq", config, 128, True) is warpspec.compiled_form("bwd_dq", config, 128, True)


def test_head_chunks_cover_every_head_dim_in_powers_of_two():
    # every head dim 1…256 is covered by distinct powers of two >= 16, largest first, summing to the head dim rounded
    # up to 16 (TMA zero-fills the columns past the tensor's end); the warp-specialized forward takes the multiples
    # of 8 from 16 on (a row of 16-bit values is then whole 16-byte TMA units)
    for d in range(1, 257):
        widths = head_chunks.chunks(d)
        assert head_chunks.padded(d) == sum(widths) == -(-d // 16) * 16
        assert all(w >= 16 and w & (w - 1) == 0 for w in widths) and list(widths) == sorted(set(widths), reverse=True)
        assert head_chunks.supported(d) == (d % 8 == 0 and d >= 16)
    assert head_chunks.chunks(96) == (64, 32) and head_chunks.chunks(240) == (128, 64, 32, 16)
    assert head_chunks.offsets((128, 64, 32, 16)) == (0, 128, 192, 224)
    with pytest.raises(ValueError, match=r"head_dim must be in 1\.\.256, got 264"):
        head_chunks.chunks(264)
    # the rendered forward: a descriptor, a buffer ring, a wgmma and (for V) an accumulator a chunk, each chunk's TMA
    # copy at its first column
    source = codegen.render("fwd_ws", Variant.for_template(
        "fwd_ws", causal=False, banded=False, varlen=False, even_m=False, even_n=False, head_dim=224))  # fmt: skip
    assert "def _attn_fwd_ws(q_desc0, q_desc1, q_desc2, k_desc0, k_desc1, k_desc2, v_desc0, v_desc1, v_desc2," in source
    assert "[b, hk, row, 192]" in source and "acc2 = gl.zeros([M, 32]" in source and "acc3" not in source
    with pytest.raises(ValueError, match="fwd_ws is rendered for a head dim"):
        Variant.for_template("fwd_ws", causal=False, banded=False, varlen=False, even_m=False, even_n=False)


def test_a_head_dim_pads_to_fewer_chunks_where_a_quarter_more_columns_allow():
    # pad_head_dim computes a head dim on the narrowest width of fewer chunks at most MAX_PAD wider (TMA zero-fills
    # the columns past the tensor's end and writes none of them); elsewhere it would be the same kernel
    for d in range(16, 257, 8):
        exact, wide = head_chunks.padded(d), head_chunks.fewer_chunks(d)
        assert wide == head_chunks.padded(d, pad=True) == sum(head_chunks.chunks(d, pad=True)) >= exact
        assert head_chunks.pads(d) == (wide != exact)
        if head_chunks.pads(d):
            assert wide <= exact * (1 + head_chunks.MAX_PAD) and wide % 16 == 0
            assert len(head_chunks.chunks(d, pad=True)) < len(head_chunks.chunks(d))
        # none narrower has fewer chunks
        assert all(len(head_chunks.chunks(w)) >= len(head_chunks.chunks(d)) for w in range(exact, wide, 16))
    assert [d for d in range(16, 257, 8) if head_chunks.pads(d)] == [104, 112, 168, 176, 200, 208, 216, 224, 232, 240]
    assert head_chunks.chunks(112, pad=True) == (128,) and head_chunks.chunks(176, pad=True) == (128, 64)
    assert head_chunks.chunks(80, pad=True) == (64, 16)  # 128 would be 60 % more columns
    # the switch: a warpspec config's, stored and parsed by name, carried through the custom op's ints
    padded = KernelConfig.parse("64,128,4,2,ws,fused-dq,pad-head-dim")
    assert padded.pad_head_dim and padded.label() == "64x128 w4 s2 ws fused-dq pad-head-dim"
    assert KernelConfig.from_dict(padded.to_dict()) == padded and padded.to_dict()["pad_head_dim"] is True
    assert "pad_head_dim" not in replace(padded, pad_head_dim=False).to_dict()  # entries before it read the same
    assert KernelConfig.from_ints(padded.to_ints()) == padded
    # an int list of the layout before the switch (a cached or exported graph's) reads with it off
    before = [v for name, v in zip(PARAM_NAMES, padded.to_ints(), strict=True) if name != "pad_head_dim"]
    assert KernelConfig.from_ints(before) == replace(padded, pad_head_dim=False)
    assert KernelConfig(64, 64, 4, 2, pad_head_dim=True).combination_error().startswith("pad_head_dim (the head dim")
    # the planner: the twin where it changes the chunks, modelled as the wider head dim's config
    h200, bf = known_gpu("h200"), torch.bfloat16
    dq = KernelConfig(128, 64, 4, 3, warp_specialized=True)
    for kernel, cfg in (("fwd", WS), ("bwd_dkdv", padded), ("bwd_dq", dq)):
        cfg = replace(cfg, pad_head_dim=True)
        unpadded = replace(cfg, pad_head_dim=False)
        assert planner.check(cfg, h200, 112, bf, kernel) is None
        assert planner.sram_bytes(cfg, 112, bf, kernel) == planner.sram_bytes(unpadded, 128, bf, kernel)
        assert planner.accumulators_per_thread(cfg, 112, kernel) == planner.accumulators_per_thread(unpadded, 128,
                                                                                                   kernel)
        assert planner.check(cfg, h200, 128, bf, kernel).startswith("pad_head_dim changes no chunk at head_dim 128")
        assert cfg in planner.candidates(kernel, 112) and cfg not in planner.candidates(kernel, 128)
    # the code: d=112 padded renders d=128's one chunk, the launch describes 128-column blocks, the hash is its own
    fwd = dict(causal=False, banded=False, varlen=False, even_m=False, even_n=False, head_dim=112)
    assert Variant.for_template("fwd_ws", pad_head_dim=True, **fwd).qk_chunks == (128,)
    assert Variant.for_template("fwd_ws", **fwd).qk_chunks == (64, 32, 16)
    blocks = warpspec.compiled_form("fwd", replace(WS, pad_head_dim=True), 112, False)[1]
    assert blocks["q"] == ((1, 1, 64, 128),) and blocks["v"] == ((1, 1, 128, 128),)
    hashes = {codegen.code_hash("fwd", causal=False, warp_specialized=True, head_dim=112, pad_head_dim=pad)
              for pad in (False, True)}  # fmt: skip
    assert len(hashes) == 2
    # the tuner times the default's padded twin among its first configs, where there is one
    first = lambda d: tuner.first_configs(device=h200, kernel="fwd", head_dim=d, dtype=bf, causal=False, trials=8,
                                          space=planner.candidates("fwd", d))  # fmt: skip
    default = defaults.default_config(112, bf, kernel="fwd", device=h200)
    assert replace(default, pad_head_dim=not default.pad_head_dim) in first(112)[:4]
    assert not any(c.pad_head_dim for c in first(128))
    # at d=176 the default's shape padded does not fit (246,400 B of shared memory): a padded config that does. (As
    # Triton 3.6 compiles it: under 3.9 the default there is 128 × 64, whose padded twin fits.)
    h36 = replace(h200, triton_version="3.6.0")
    first36 = tuner.first_configs(device=h36, kernel="fwd", head_dim=176, dtype=bf, causal=False, trials=8,
                                  space=planner.candidates("fwd", 176))  # fmt: skip
    assert planner.check(replace(defaults.default_config(176, bf, kernel="fwd", device=h36), pad_head_dim=True),
                         h36, 176, bf, "fwd") is not None  # fmt: skip
    assert [c for c in first36 if c.pad_head_dim and planner.check(c, h36, 176, bf, "fwd") is None]


def test_fused_dq_blocks_cover_k_s_chunks_and_are_dealt_evenly():
    # dQ fused into the dK/dV kernel forms and reduces dQ in blocks of at most 64 columns within one chunk (a wgmma's
    # B operand is a slice of one chunk's K buffer; a TMA reduction a block): every column once, in column order;
    # dealt to two consumers whose column counts differ by at most one block, the first no fewer
    for d in range(16, 257, 8):
        blocks = head_chunks.dq_blocks(d)
        widths = head_chunks.chunks(d)
        columns = [head_chunks.offsets(widths)[c] + start + k for c, start, w in blocks for k in range(w)]
        assert columns == list(range(head_chunks.padded(d)))
        assert all(w == head_chunks.dq_width(widths[c]) <= head_chunks.DQ_BLOCK_MAX for c, _, w in blocks)
        shares = head_chunks.dq_shares(d, 2)
        assert sorted(b for share in shares for b in share) == sorted(blocks)
        counts = [sum(w for *_, w in share) for share in shares]
        assert 0 <= counts[0] - counts[1] <= max(w for *_, w in blocks)
        assert head_chunks.dq_widths(d)[0][0] == blocks[0][2]  # the widest first: the staging buffer's shape
    assert head_chunks.dq_blocks(192) == ((0, 0, 64), (0, 64, 64), (1, 0, 64))
    assert head_chunks.dq_shares(192, 2) == (((0, 0, 64), (1, 0, 64)), ((0, 64, 64),))
    assert head_chunks.dq_shares(128, 2) == (((0, 0, 64),), ((0, 64, 64),))  # consumer c: columns 64c … 64c + 63
    assert head_chunks.dq_widths(112) == ((64, 0), (32, 1), (16, 2))


def test_code_hash_names_the_template_and_its_switches():
    key = EntryKey(head_dim=128, dtype="bf16", causal=True, kernel="fwd")
    configs = {"triton": KernelConfig(128, 128, 4, 2), "ws": WS, "pingpong": replace(WS, pingpong=True)}
    hashes = {name: codegen.entry_code_hash(key, cfg) for name, cfg in configs.items()}
    persistent = codegen.entry_code_hash(key, KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT))
    assert len({*hashes.values(), persistent}) == 4
    assert persistent == codegen.code_hash("fwd", causal=True, warp_specialized=True, persistent=True, head_dim=128)
    dkdv = EntryKey(head_dim=128, dtype="bf16", causal=True, kernel="bwd_dkdv")
    assert codegen.entry_code_hash(dkdv, KernelConfig(64, 128, 4, 2, warp_specialized=True)) != codegen.entry_code_hash(
        dkdv, KernelConfig(64, 128, 4, 2)
    )
    assert codegen.template_for("bwd_dkdv", True) == "bwd_ws"
    assert hashes["ws"] == codegen.code_hash("fwd", causal=True, warp_specialized=True, head_dim=128)
    assert codegen.code_hash("fwd", causal=False, warp_specialized=True, head_dim=128) != hashes["ws"]
    # the warp-specialized forward is written out for its head dim's chunks: another head dim, other code; the
    # Triton templates' code is the same at every head dim
    assert codegen.entry_code_hash(replace(key, head_dim=96), WS) != hashes["ws"]
    assert codegen.entry_code_hash(replace(key, head_dim=96), configs["triton"]) == hashes["triton"]
    assert codegen.template_for("fwd", True) == "fwd_ws" and codegen.template_for("bwd_dq", False) == "bwd"
    assert codegen.template_for("bwd_dq", True) == "bwd_dq_ws"
    dq = EntryKey(head_dim=128, dtype="bf16", causal=True, kernel="bwd_dq")
    assert (
        codegen.entry_code_hash(dq, KernelConfig(128, 64, 4, 3, warp_specialized=True))
        == codegen.code_hash("bwd_dq", causal=True, warp_specialized=True, head_dim=128)
        != codegen.entry_code_hash(dq, KernelConfig(128, 64, 4, 3))
    )
    assert "def _attn_bwd_dq_ws(" in codegen.render("bwd_dq_ws", Variant.for_template(
        "bwd_dq_ws", causal=False, banded=False, varlen=False, even_m=True, even_n=True, head_dim=128))  # fmt: skip
    assert "def _attn_bwd_dkdv_ws(" in codegen.render("bwd_ws", Variant.for_template(
        "bwd_ws", causal=True, banded=False, varlen=False, even_m=True, even_n=True, head_dim=128))  # fmt: skip
    # bwd_dkdv's fused_dq (dQ fused in) is code of its own; fused_dq is a switch of bwd_ws only
    fused = Variant.for_template("bwd_ws", causal=True, banded=False, varlen=False, even_m=True, even_n=True,
                                 fused_dq=True, head_dim=128)  # fmt: skip
    assert fused.fused_dq and "tma_reduce_add(dqacc_desc" in codegen.render("bwd_ws", fused)
    assert not Variant.for_template("bwd_dq_ws", causal=True, banded=False, varlen=False, even_m=True, even_n=True,
                                    fused_dq=True, head_dim=128).fused_dq  # fmt: skip
    assert codegen.code_hash("bwd_dkdv", causal=True, warp_specialized=True, fused_dq=True, head_dim=128) != (
        codegen.code_hash("bwd_dkdv", causal=True, warp_specialized=True, head_dim=128)
    )
    variant = Variant.for_template(
        "fwd_ws", causal=True, banded=False, varlen=False, even_m=True, even_n=True, pingpong=True, head_dim=128
    )
    source = codegen.render("fwd_ws", variant)
    assert "CAUSAL = gl.constexpr(True)" in source and "PINGPONG = gl.constexpr(True)" in source
    assert "warp_specialize" in source and f"template_hash: {codegen.template_hash('fwd_ws')}" in source


def test_only_the_triton_causal_dkdv_grid_launches_its_heads_interleaved():
    # _macros.jinja's interleaved_slot: the Triton template's causal dK/dV grid takes its heads' tiles interleaved (the
    # longest tiles of every head first); without the mask every tile is as long, and a band's tiles are not longest
    # first. The warp-specialized dK/dV kernel keeps head-by-head order (interleaved, it measured slower), and the
    # forward and dQ kernels keep one query head's tiles together.
    def source(template, causal, persistent=False, banded=False):
        return codegen.render(template, Variant.for_template(
            template, causal=causal, banded=banded, varlen=False, even_m=True, even_n=True, persistent=persistent,
            head_dim=128))  # fmt: skip

    interleaved = "in_set % width"
    assert interleaved in source("bwd", True)
    assert interleaved not in source("bwd", False) and interleaved not in source("bwd", True, banded=True)
    assert interleaved not in source("bwd_ws", True) and interleaved not in source("bwd_ws", True, persistent=True)
    assert interleaved not in source("fwd_ws", True) and interleaved not in source("bwd_dq_ws", True)


def test_the_dkdv_producer_stages_the_statistics_where_one_program_holds_the_sm():
    # Each step's logsumexp and δ go to shared memory beside Q_i and dO_i (the producer loads them) where one dK/dV
    # program holds an SM; two an SM have no room (d=64's three fused stages fill half of it to 256 B): there the
    # consumers load them a step ahead. The rule is KernelConfig's: the launcher's variant, the entry's code hash
    # and the planner's bytes all follow it.
    one = KernelConfig(64, 64, 4, 3, warp_specialized=True, fused_dq=True, schedule=PERSISTENT)
    two = replace(one, schedule=TWO_AN_SM)
    assert one.stages_statistics("bwd_dkdv") and not two.stages_statistics("bwd_dkdv")
    assert not one.stages_statistics("bwd_dq") and not KernelConfig(64, 64, 4, 3).stages_statistics("bwd_dkdv")
    key = EntryKey(head_dim=64, dtype="bf16", causal=True, kernel="bwd_dkdv")
    assert codegen.entry_code_hash(key, one) != codegen.entry_code_hash(key, two)
    staged, loaded = (warpspec._module("bwd_dkdv", cfg, True, 64) for cfg in (one, two))
    assert "lse_smem.index(stage).store(" in inspect.getsource(staged)
    assert "lse_smem" not in inspect.getsource(loaded) and "_row_stats(LSE, DELTA" in inspect.getsource(loaded)
    # 2 · 4 B a row of each of the 3 stages' 64 query rows
    assert planner.sram_bytes(one, 64, torch.bfloat16, "bwd_dkdv") - planner.sram_bytes(
        two, 64, torch.bfloat16, "bwd_dkdv"
    ) == 2 * 4 * 3 * 64
    assert planner.check(two, known_gpu("nvidia-h200"), 64, torch.bfloat16, "bwd_dkdv") is None
    # split roles keep the consumers' loads (staged they read 1.8 % slower): the variant drops the switch with them
    split = KernelConfig(64, 64, 4, 2, warp_specialized=True, split_roles=True)
    assert not split.stages_statistics("bwd_dkdv")
    assert not Variant.for_template("bwd_ws", causal=False, banded=False, varlen=False, even_m=False, even_n=False,
                                    split_roles=True, stage_stats=True, head_dim=192).stage_stats  # fmt: skip

def test_drain_before_dq_is_a_switch_of_fused_dq_with_code_of_its_own_under_either_mask():
    # The step's dV and dK wgmmas retire before its dQ share (KernelConfig.drain_before_dq): which order is faster
    # depends on the head dim and the mask, so it is a switch the tuner times, only where dQ is fused in.
    fused = KernelConfig.parse("64,128,4,2,ws,fused-dq")
    drained = KernelConfig.parse("64,128,4,2,ws,fused-dq,drain-before-dq")
    assert drained == replace(fused, drain_before_dq=True) and drained.label().endswith("fused-dq drain-before-dq")
    assert drained.combination_error("bwd_dkdv") is None
    lone = replace(drained, fused_dq=False)
    assert "drain_before_dq" in lone.combination_error("bwd_dkdv") and "fused_dq=False" in lone.combination_error(
        "bwd_dkdv"
    )
    assert planner.check(lone, known_gpu("h200"), 128, torch.bfloat16, "bwd_dkdv").startswith("warpspec's drain")
    with pytest.raises(ValueError, match=r"dkdv_config .*drain_before_dq"):
        fallback.check_combination(lone, "bwd_dkdv")
    # the twin a deterministic or V-own-head-dim backward runs leaves the switch with dQ
    assert drained.without_fused_dq() == replace(fused, fused_dq=False)
    assert drained.without_fused_dq().combination_error("bwd_dkdv") is None
    assert KernelConfig.from_ints(drained.to_ints()) == drained
    assert KernelConfig.from_dict(drained.to_dict()) == drained and "drain_before_dq" not in fused.to_dict()
    # the planner offers every fused candidate drained and not, and nothing else drained
    space = planner.candidates("bwd_dkdv")
    drained_space = {replace(c, drain_before_dq=False) for c in space if c.drain_before_dq}
    assert drained_space == {c for c in space if c.fused_dq and not c.drain_before_dq}
    # a study times a fused default's (and incumbent's) twin with the switch flipped among its first configs
    h200 = known_gpu("h200")
    fits = [c for c in space if planner.check(c, h200, 128, torch.bfloat16, "bwd_dkdv") is None]
    for default in (fused, drained):  # no incumbent: the default's twin right after it
        first = tuner.first_configs(device=h200, kernel="bwd_dkdv", head_dim=128, dtype=torch.bfloat16, causal=True,
                                    trials=8, space=fits, default=default)  # fmt: skip
        assert first[:2] == [default, replace(default, drain_before_dq=not default.drain_before_dq)]
        assert len(first) == len(set(first))
    # and a promising fused pick's, where the default does not fuse dQ
    first = tuner.first_configs(device=known_gpu("h100-sxm"), kernel="bwd_dkdv", head_dim=128, dtype=torch.bfloat16,
                                causal=True, trials=40, space=space, default=fused.without_fused_dq())  # fmt: skip
    assert not first[0].fused_dq
    picked = [c for c in first if c.fused_dq and not c.drain_before_dq]
    assert picked and all(first[first.index(c) + 1] == replace(c, drain_before_dq=True) for c in picked)
    for causal in (False, True):
        key = EntryKey(head_dim=128, dtype="bf16", causal=causal, kernel="bwd_dkdv")
        assert codegen.entry_code_hash(key, drained) != codegen.entry_code_hash(key, fused)
        source = inspect.getsource(warpspec._module("bwd_dkdv", drained, causal, 128))
        # dK reads dSᵀ from shared memory, and the step's wgmmas retire before the Q_i, dO_i buffer goes back
        assert "warpgroup_mma(ds_own, q0, dk0" in source
        wait = source.index("dv0, dk0, pt_op, q0, do0 = warpgroup_mma_wait(0, deps=(dv0, dk0, pt_op, q0, do0))")
        assert source.index("mbarrier.arrive(qdo_empty", wait) < source.index("dq = warpgroup_mma(ds_smem", wait)
        # one release of the Q_i, dO_i buffer a step: the drain's, none in the dQ share after it (another would free a
        # stage the producer may refill while a consumer still reads it)
        for head_dim in (64, 96, 128):
            source = inspect.getsource(warpspec._module("bwd_dkdv", drained, causal, head_dim))
            drains = [at for at in range(len(source)) if source.startswith("# dV's and dK's wgmmas retired", at)]
            assert drains, (head_dim, causal)
            for at in drains:
                # the step's end: its counters advanced (by the step, or by the causal two-phase loop after it)
                step_end = min(e for e in (source.find("i = i_next", at), source.find("i_next = i + 1", at)) if e >= 0)
                assert source.count("mbarrier.arrive(qdo_empty", at, step_end) == 1, (head_dim, causal)
    # without the mask and the switch, dSᵀ is dK's register operand (FlashAttention-3's order)
    assert "warpgroup_mma(ds_own, q0, dk0" not in inspect.getsource(warpspec._module("bwd_dkdv", fused, False, 128))


def test_the_causal_two_phases_are_rendered_where_the_planner_counts_v_in_registers():
    # bwd_ws.py.jinja's CAUSAL_SPLIT (the causal step loop in two phases, V a register operand under the mask) and
    # planner.v_in_registers(causal=True) state one rule twice: the template renders the phases for exactly the head
    # dims and configs the planner says hold V in registers with the mask
    from fa2tune.config.types import Variant
    from fa2tune.kernels import codegen

    spellings = ["64,128,4,2,ws,fused-dq,persistent", "64,128,4,2,ws,fused-dq",
                 "64,128,4,3,ws,fused-dq,drain-before-dq", "64,64,4,3,ws,fused-dq,persistent,x2",
                 "64,128,4,2,ws,persistent", "64,64,4,2,ws,split-roles"]
    split = set()
    for head_dim in (32, 48, 64, 72, 80, 88, 96, 104, 112, 128, 160):
        for spelling in spellings:
            config = KernelConfig.parse(spelling)
            if config.split_roles and head_dim <= 128:
                continue  # split roles past d = 128 only
            variant = Variant.for_template("bwd_ws", causal=True, banded=False, varlen=False, even_m=False,
                                           even_n=False, head_dim=head_dim, **config.template_switches("bwd_dkdv"))
            rendered = "def _diagonal_tiles(" in codegen.render("bwd_ws", variant)
            assert rendered == planner.v_in_registers(head_dim, causal=True, cfg=config), (head_dim, spelling)
            split |= {head_dim} if rendered else set()
    assert split == {72, 80, 88, 96}, split


_PROBE = """
import json, sys, torch
from fa2tune.tune import probe
from fa2tune.config.types import KernelConfig
rows = []
for kernel, head_dim, fields, causal in json.loads(sys.argv[1]):
    report = probe.compile_config(kernel, KernelConfig.parse(fields), head_dim, torch.bfloat16, causal=causal)
    usage = probe.cuobjdump(report.cubin, "-res-usage")
    stack = [int(w.split(":")[1]) for w in usage.split() if w.startswith("STACK:")]
    rows.append([report.shared_bytes, report.error, stack])
print(json.dumps(rows))
"""


_ATTRS_PROBE = """
import json, torch
from fa2tune.tune import probe
from fa2tune.config.types import KernelConfig
out = []
for kernel, config, seqlen, group in (("bwd_dkdv", "64,128,4,3,ws,fused-dq,persistent", 8192, 1),
                                      ("bwd_dkdv", "64,128,4,3,ws,fused-dq,persistent", 3000, 1),
                                      ("fwd", "128,128,4,2,ws,persistent", 8192, 1),
                                      ("fwd", "128,128,4,2,ws,persistent", 3000, 1),
                                      ("bwd_dkdv", "64,128,4,3,ws,fused-dq,persistent", 8192, 4)):
    seen = []
    probe._compile = lambda source, target, options: seen.append(source)
    probe.compile_config(kernel, KernelConfig.parse(config), 64, torch.bfloat16, seqlen=seqlen, group=group)
    names = seen[0].fn.arg_names
    kinds = {name: seen[0].signature[name] for name in names}
    attrs = {name: seen[0].attrs.get((index,)) for index, name in enumerate(names)}
    constants = {name: seen[0].constants.get((index,)) for index, name in enumerate(names)}
    out.append({"kinds": kinds, "attrs": attrs, "constants": constants})
print(json.dumps(out))
"""


def _probe(script: str, *args: str, timeout: int = 600):
    """Runs a compile probe (one of the scripts below) in a fresh Python without the interpreter — an offline sm_90
    compile needs real Triton, and these tests run under TRITON_INTERPRET=1 — from the repository root (the scripts
    import scripts/); returns the JSON it prints last."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=str(codegen.templates_dir().parent))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@ON_WS_TRITON
def test_offline_compiles_specialize_arguments_as_a_launch_does():
    # Triton's JIT marks a 16-byte-aligned tensor argument, and an int divisible by 16, tt.divisibility=16, which lets
    # the compiler vectorize the loads they address and bound, and passes an int equal to 1 as a constant; an offline
    # compile (probe, hence the register and SASS checks here) must too, or it reads other code than runs (an in-kernel
    # dQ cast compiled without the pointers' showed scalar loads and more stack: docs/HISTORY.md, "Backward"; without
    # the lengths', the d=128 dK/dV step issued 613 instructions where a call of 8192 tokens runs 545).
    divisible = [["tt.divisibility", 16]]
    aligned, ragged, forward, ragged_forward, grouped = _probe(_ATTRS_PROBE, timeout=300)
    pointers = [name for name, kind in aligned["kinds"].items() if kind.startswith("*")]
    assert pointers == ["LSE", "DELTA"] and all(aligned["attrs"][name] == divisible for name in pointers)
    lengths = ("N_Q", "N_K")
    stats = ("stride_lb", "stride_lh")
    assert all(aligned["kinds"][name] == "i32" and aligned["attrs"][name] == divisible for name in lengths + stats)
    assert all(ragged["kinds"][name] == "i32" and ragged["attrs"][name] is None for name in lengths)
    # the backward's statistics buffers have rows padded to a multiple of 16 (launch.backward's _Stats): 3008 a head
    assert all(ragged["kinds"][name] == "i32" and ragged["attrs"][name] == divisible for name in stats)
    # the forward writes the logsumexp (batch, heads, N): its head stride is the length
    assert ragged_forward["attrs"]["stride_lh"] is None and ragged_forward["attrs"]["stride_lb"] == divisible
    assert aligned["kinds"]["GROUP"] == "constexpr" and aligned["constants"]["GROUP"] == 1  # one query head a K/V head
    # group=4 compiles a GQA call's code: the group a run-time int, as the JIT passes any value but 1
    assert grouped["kinds"]["GROUP"] == "i32" and grouped["constants"]["GROUP"] is None
    # the split tail's counts are do_not_specialize: one binary whether a launch splits its tail or not
    assert forward["kinds"]["MAIN"] == forward["kinds"]["SPLIT"] == "i32"
    assert forward["attrs"]["MAIN"] is None and forward["attrs"]["SPLIT"] is None


# A spill of two registers around a loop (8 B of stack) is not the register model's business: Triton 3.9 keeps one
# where 3.6 kept none (a fused-dQ dK/dV consumer at d=64 with 63 registers to spare).
SPILL_NOISE = 8


@ON_WS_TRITON
def test_planner_model_and_registers_match_the_compiler():
    # Compiled for sm_90 without a card (Triton ships ptxas and cuobjdump): the shared memory the model predicts is
    # what the compiler allocates, to within the mbarrier allowance, and a consumer spills (STACK > 0) exactly when
    # the planner's register rule says it would, with the split of planner.WS_REGISTERS: one, two (ping-pong,
    # causal; persistent, with its separate O buffer) and three consumers that fit, one consumer two an SM (maxnreg
    # 128: planner.WS_TWO_AN_SM_REGISTERS) at d=64 and d=128, a fused-dQ dK/dV one at d=64 (two consumers at d=48,
    # causal) and a dQ one at d=128 (its 2 stages within 512 B of half an SM), a dK/dV kernel, dK/dV kernels with split
    # roles at d=256 and d=192, dQ kernels of one and two consumers that fit and one that does not, two forward
    # consumers at B_c=128 at the edge of their budget under Triton 3.9 (d=144 fits, d=160 spills there and not under
    # 3.6: planner._TRITON_REGISTERS_BESIDE_EXTRA), three at B_c=64 that fit, and three forward consumers at d=128
    # B_c=128 that do not.
    # (Persistent and causal, the loop over tiles keeps 8-24 B of stack beside fitting accumulators, 128 B with
    # three consumers at d=64, 16-32 B with dQ fused in and the consumers taking turns at d <= 64 (Triton 3.9 also
    # without the mask, one program a tile more): the rule does not count it, the tuner's timing does: docs/PERF.md,
    # "Persistent kernels and paired causal tiles". Fused dQ's two consumers are checked at d=48 causal, which takes
    # no turns.)
    rows = [("fwd", 128, "128,128,4,2,ws", False), ("fwd", 128, "128,128,4,2,ws,pingpong", True),
            ("fwd", 64, "192,128,4,2,ws", True), ("fwd", 128, "64,64,4,4,ws", False),
            ("fwd", 128, "128,128,4,2,ws,persistent", False), ("fwd", 64, "64,128,4,2,ws,persistent,x2", True),
            ("fwd", 128, "64,64,4,2,ws,persistent,x2", True),
            ("bwd_dkdv", 64, "64,64,4,3,ws,fused-dq,persistent,x2", True),
            ("bwd_dq", 128, "64,64,4,2,ws,persistent,x2", True), ("bwd_dkdv", 64, "64,128,4,3,ws", True),
            ("bwd_dkdv", 48, "64,128,4,3,ws,fused-dq,persistent", True),
            ("bwd_dkdv", 64, "64,64,4,3,ws,fused-dq", False), ("bwd_dq", 128, "128,64,4,3,ws", True),
            ("bwd_dq", 128, "64,128,4,2,ws", False), ("bwd_dq", 128, "128,128,4,2,ws", True),
            ("bwd_dkdv", 256, "64,64,4,2,ws,split-roles", True),
            ("bwd_dkdv", 192, "64,64,4,2,ws,split-roles,persistent", False),
            ("fwd", 160, "128,128,4,2,ws,pingpong", False), ("fwd", 144, "128,128,4,2,ws,pingpong", False),
            ("fwd", 128, "192,64,4,2,ws", True), ("fwd", 128, "192,128,4,2,ws", False)]  # fmt: skip
    reports = _probe(_PROBE, json.dumps(rows))
    for (kernel, head_dim, fields, _), (shared, error, stack) in zip(rows, reports, strict=True):
        cfg = KernelConfig.parse(fields)
        assert error is None
        predicted = planner.sram_bytes(cfg, head_dim, torch.bfloat16, kernel)
        assert predicted - 512 <= shared <= predicted, (fields, shared, predicted)
        reason = planner.check(cfg, known_gpu("h200"), head_dim, torch.bfloat16, kernel) or ""
        assert stack and (max(stack) > SPILL_NOISE) == reason.startswith("registers"), (fields, stack, reason)
    assert reason.startswith("registers: 128 fp32 accumulator values per consumer thread")  # the last row spills


_HEAD_DIM_V_PROBE = """
import json, sys, torch
from fa2tune.tune import probe
from fa2tune.config.types import KernelConfig
rows = []
for kernel, head_dim, head_dim_v, fields, causal in json.loads(sys.argv[1]):
    report = probe.compile_config(kernel, KernelConfig.from_dict(fields), head_dim, torch.bfloat16, causal=causal,
                                  head_dim_v=head_dim_v)
    usage = probe.cuobjdump(report.cubin, "-res-usage") if report.cubin else ""
    rows.append([report.shared_bytes, report.error, max(int(w.split(":")[1]) for w in usage.split()
                                                        if w.startswith("STACK:"))])
print(json.dumps(rows))
"""


@ON_WS_TRITON
def test_a_v_head_dim_of_its_own_compiles_within_the_larger_head_dims_resources():
    # A call whose V has a head dim of its own runs the configs of the larger head dim (planner.config_head_dim):
    # compiled for sm_90, each warpspec kernel at (d, dv) holds no more shared memory and no more stack (spills) than
    # the same config at (max, max), which the planner's model and the tuner judge. The configs: each kernel's default
    # at the larger head dim as such a call runs it (a dK/dV default with dQ fused in gives way to its unfused twin:
    # fallback.unfused_for_v), a one-consumer dK/dV one where that default is the Triton template's.
    from fa2tune.launch import fallback

    h200 = known_gpu("h200")
    rows = []
    for (d, dv), kernel in itertools.product(((192, 128), (128, 64), (96, 128)), ("fwd", "bwd_dkdv", "bwd_dq")):
        config = defaults.default_config(max(d, dv), torch.bfloat16, kernel=kernel, device=h200)
        config = config if config.warp_specialized else KernelConfig(64, 64, 4, 2, warp_specialized=True)
        config = fallback.unfused_for_v(config, False, d, dv)
        causal = kernel != "fwd"  # the backward's kernels causal: their masks are where the branches are
        rows += [(kernel, d, dv, config.to_dict(), causal), (kernel, max(d, dv), None, config.to_dict(), causal)]
    reports = _probe(_HEAD_DIM_V_PROBE, json.dumps(rows))
    for row, (shared, error, stack), (shared_max, error_max, stack_max) in zip(rows[::2], reports[::2], reports[1::2],
                                                                              strict=True):  # fmt: skip
        assert error is None and error_max is None, (row, error, error_max)
        assert shared <= shared_max and stack <= stack_max, (row, shared, shared_max, stack, stack_max)


@ON_WS_TRITON
def test_fused_dq_compiles_at_a_head_dim_of_two_dq_widths():
    # d=96's dQ blocks are 64 and 32 columns wide, the 32 one a view of the 64 one's shared memory
    # (shared_memory_descriptor._reinterpret, which Triton 3.9 renamed: fa2tune.kernels.gluon_ext aliases it); with V's
    # own head dim too. CI compiles it under both Tritons.
    fused = KernelConfig.parse("64,128,4,2,ws,fused-dq,persistent").to_dict()
    rows = [("bwd_dkdv", 96, None, fused, False), ("bwd_dkdv", 96, 128, fused, True)]
    for shared, error, _ in _probe(_HEAD_DIM_V_PROBE, json.dumps(rows)):
        assert error is None and shared > 0


@ON_WS_TRITON
def test_a_padded_head_dim_compiles_as_the_wider_head_dims_kernel():
    # pad_head_dim at d=112 (one chunk of 128) and d=240 (one of 256) compiles for sm_90, each kernel's form the
    # defaults take: the kernel is the wider head dim's (the same rendered module, TMA blocks and example ints), so its
    # shared memory and stack are what the planner models for the padded config
    configs = [("fwd", "128,128,4,2,ws,persistent", False), ("bwd_dkdv", "64,128,4,2,ws,fused-dq", True),
               ("bwd_dq", "128,64,4,3,ws,persistent", False)]  # fmt: skip
    rows = []
    for (kernel, fields, causal), (d, wide) in itertools.product(configs, ((112, 128), (240, 256))):
        cfg = KernelConfig.parse(fields)
        if kernel == "bwd_dkdv" and d == 240:
            cfg = KernelConfig.parse("64,64,4,2,ws,split-roles")  # past fused dQ's head dims
        rows += [(kernel, d, None, replace(cfg, pad_head_dim=True).to_dict(), causal),
                 (kernel, wide, None, cfg.to_dict(), causal)]  # fmt: skip
    reports = _probe(_HEAD_DIM_V_PROBE, json.dumps(rows))
    for row, padded, wide in zip(rows[::2], reports[::2], reports[1::2], strict=True):
        assert padded[1] is None and padded[0] == wide[0] > 0 and padded[2] == wide[2], (row, padded, wide)


_SASS_PROBE = """
import json, sys
sys.path.insert(0, "scripts")
import sass_wgmma_operands as sass
out = []
for kernel, head_dim, causal, config in json.loads(sys.argv[1]):
    loops = sass.innermost_hgmma_loops(sass.parse(sass.compile_sass(kernel, config, head_dim, causal)))
    out.append([[loop.hgmmas, len(loop.operand_registers), len(loop.clobbers)] for loop in loops])
print(json.dumps(out))
"""


@ON_WS_TRITON
def test_step_loops_leave_register_operands_carried_into_them_alone():
    # An asynchronous wgmma reads a register A operand after it is issued; a value carried into a step loop for it must
    # not be rewritten in the loop. An sm_90 compile did (K and V as operands, the causal mask under a branch: wrong dK;
    # docs/PERF.md, "The backward's dK/dV kernel and fused dQ"). scripts/sass_wgmma_operands.py reads the compiled
    # loops; the shipped kinds of warpspec kernel (causal, where the branches are, the fused dQ, d=64's K and V in
    # registers, and d=192's two head-dim chunks, where one P or Pᵀ feeds two matmuls) issue register-operand HGMMAs
    # in their step loops and leave every operand carried into a loop alone.
    rows = [("bwd_dkdv", 64, True, "64,128,4,3,ws,fused-dq,persistent"),
            ("bwd_dkdv", 64, False, "64,128,4,3,ws,fused-dq,persistent"),
            ("bwd_dkdv", 128, True, "64,128,4,2,ws,persistent"), ("bwd_dkdv", 128, False, "64,128,4,2,ws,fused-dq"),
            ("fwd", 128, True, "128,128,4,2,ws,pingpong,persistent"),
            ("bwd_dq", 128, True, "128,64,4,3,ws,persistent"),
            ("fwd", 192, False, "128,64,4,2,ws,persistent"), ("bwd_dkdv", 192, True, "64,64,4,2,ws,split-roles"),
            ("bwd_dkdv", 96, True, "64,128,4,2,ws,fused-dq,persistent"),
            ("bwd_dkdv", 80, True, "64,128,4,2,ws,fused-dq"),
            ("bwd_dkdv", 96, False, "64,128,4,2,ws,fused-dq,persistent"),
            ("bwd_dkdv", 64, False, "64,128,4,3,ws,fused-dq,persistent,drain-before-dq")]  # fmt: skip
    found = _probe(_SASS_PROBE, json.dumps(rows))
    for row, loops in zip(rows, found, strict=True):
        assert any(operands > 0 for _, operands, _ in loops), (row, loops)  # the check has something to check
        assert all(clobbers == 0 for _, _, clobbers in loops), (row, loops)
    # K and V are register operands where planner.kv_in_registers says, d=64 without a mask: eight A fragments (K's
    # and V's 64 × 64 rows, four k-steps of 16 each) beside each step's Pᵀ (four) and, with dQ fused in, its dSᵀ (dK's
    # register operand without the mask: four more). The consumers' turns at forming dQ_i write the step loop two
    # steps an iteration, so the widest loop holds two steps' operands: causal, two Pᵀ; without the mask, two Pᵀ, two
    # dSᵀ, and K and V once
    assert planner.kv_in_registers(64) and not planner.kv_in_registers(64, causal=True)
    causal, unmasked, drained = (max(operands for _, operands, _ in loops) for loops in (found[0], found[1], found[-1]))
    assert causal == 2 * 4 and unmasked == causal + 2 * 4 + 8, (found[0], found[1])
    # drained before its dQ share (drain_before_dq), dK reads dSᵀ from shared memory: K and V and Pᵀ, no dSᵀ (the
    # drain retires a step's wgmmas before the next, so the compiler may give both steps' Pᵀ one set of registers)
    assert causal + 4 >= drained - 8 > 0 and drained < unmasked - 4, found[-1]
    # causal at d = 80 and 96 with dQ fused in, the step loop in two phases (bwd_ws.py.jinja's CAUSAL_SPLIT): V is the
    # dPᵀ wgmma's register operand under the mask too, and the phase without it holds what the unmasked kernel's loop
    # holds (V, Pᵀ, dSᵀ)
    causal96, unmasked96 = (max(operands for _, operands, _ in loops) for loops in (found[-4], found[-2]))
    assert causal96 == unmasked96, (found[-4], found[-2])
    for loops, head_dim in ((found[-4], 96), (found[-3], 80)):
        # both phases of both consumers: four step loops, each holding V's A fragments (a k-step of 16 columns each)
        # beside Pᵀ's (64 query rows: four), where the causal kernel without the phases held Pᵀ's alone
        widest = [operands for hgmmas, operands, _ in loops if hgmmas == max(h for h, _, _ in loops)]
        assert len(widest) >= 4 and min(widest) >= head_dim // 16 + 64 // 16, (head_dim, loops)


# each config's step loop (scripts/sass_step_mix.py): the blocks a branch skips, and where it waits for its wgmmas
_STEP_PROBE = """
import json, sys
sys.path.insert(0, "scripts")
import sass_step_mix as mix
from sass_wgmma_operands import compile_sass, parse
out = []
for kernel, head_dim, causal, config in json.loads(sys.argv[1]):
    instructions = parse(compile_sass(kernel, config, head_dim, causal))
    loop = mix.step_loop(instructions)
    out.append({"skipped": [dict(ops) for _, _, ops in loop.skipped], "waits": mix.wait_placement(instructions, loop)})
print(json.dumps(out))
"""


@ON_WS_TRITON
def test_the_causal_forward_masks_a_score_with_one_compare_and_one_select():
    # A query row i < N_Q sees keys j <= i + N_K − N_Q <= N_K − 1: the diagonal bound implies the end of K, so the
    # forward's mask block (the block of a step loop that an unmasked step branches over) needs one ISETP and one
    # FSEL a score (docs/PERF.md, "The warp-specialized forward"; a mask that also tests the end of K issues 96 ISETP
    # and 128 FSEL for 64 scores a thread at d=64 (64, 128)).
    # Scores a thread: block_m·block_n / 128 threads of a consumer warpgroup.
    rows = [("fwd", 64, True, "64,128,4,3,ws,persistent,x2"), ("fwd", 128, True, "128,128,4,2,ws,pingpong,persistent")]
    for row, found in zip(rows, _probe(_STEP_PROBE, json.dumps(rows)), strict=True):
        blocks = found["skipped"]
        assert blocks, (row, "no mask block under a branch")
        mask = max(blocks, key=lambda ops: sum(ops.values()))
        scores = 64 * int(row[3].split(",")[1]) // 128  # one consumer's 64 rows × block_n over its 128 threads
        assert scores <= mask.get("FSEL", 0) <= scores + 4, (row, mask)
        assert mask.get("ISETP", 0) <= scores + 4, (row, mask)


@ON_WS_TRITON
def test_the_exponentials_run_before_the_waits_for_the_wgmmas_issued_under_them():
    # The forward issues QKᵀ_j and P_j-1·V_j-1, waits for QKᵀ_j, computes the softmax, then waits for P·V; dQ issues
    # S_j, dP_j and dQ, waits for S_j, computes P_j, then waits for dP_j. ptxas hoists the later wait above the
    # exponentials when they share its basic block, and then nothing runs under the wgmmas (docs/PERF.md, "The
    # warp-specialized forward"). In the compiled step loop only the wait for the scores may precede the first MUFU.EX2;
    # every later one follows the last.
    rows = [("fwd", 128, False, "128,128,4,2,ws,persistent"), ("fwd", 64, False, "128,128,4,4,ws,persistent"),
            ("bwd_dq", 128, True, "128,64,4,3,ws,persistent")]  # fmt: skip
    for row, found in zip(rows, _probe(_STEP_PROBE, json.dumps(rows)), strict=True):
        waits, first_exp2, last_exp2 = found["waits"]
        before = [address for address, _ in waits if address < first_exp2]
        after = [address for address, _ in waits if address > last_exp2]
        assert len(before) == 1 and len(after) == len(waits) - 1 >= 1, (row, waits, first_exp2, last_exp2)


def test_a_fused_dq_config_gives_way_to_its_twin_under_deterministic_algorithms(monkeypatch, device):
    # dQ fused into the dK/dV kernel (fused_dq) sums dQ by TMA reductions in arrival order: not bit-reproducible.
    # torch's default allows that; under torch.use_deterministic_algorithms(True) a resolved fused config runs its
    # warpspec=1 twin (a dQ kernel of its own) and an explicit one is an error naming the argument.
    fused = KernelConfig(64, 128, 4, 3, warp_specialized=True, fused_dq=True, schedule=PERSISTENT)
    ws1 = KernelConfig(64, 128, 4, 3, warp_specialized=True, schedule=PERSISTENT)
    assert fallback.deterministic(fused, explicit=True) is fused
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert fallback.deterministic(fused, explicit=False) == ws1
    assert fallback.deterministic(replace(fused, drain_before_dq=True), explicit=False) == ws1
    assert fallback.deterministic(ws1, explicit=True) is ws1
    q, k, v, do = (torch.randn(1, 2, 40, 64, device=device) for _ in range(4))
    o, lse = ops.forward(q, k, v, causal=False, scale=0.125)
    with pytest.raises(RuntimeError, match=r"dkdv_config .* fuses dQ in .*use_deterministic_algorithms"):
        ops.backward(do, q, k, v, o, lse, causal=False, scale=0.125, dkdv_config=fused)


def test_a_tuned_warpspec_config_falls_back_to_triton_where_it_cannot_run(monkeypatch, device):
    # Under the interpreter (or for inputs TMA cannot take) a resolved warpspec config gives way to the Triton
    # template's default; an explicit one is an error that says why.
    monkeypatch.setattr(selection, "resolve", lambda *args, **kwargs: (WS, "test"))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 70, 64, device=device) for _ in range(3))
    o = fa2tune.attention(q, k, v, causal=True)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    assert_close(o, ref, torch.float32)
    if device == "cpu":
        with pytest.raises(ValueError, match="cannot run this call: warpspec runs on a CUDA GPU only"):
            fa2tune.attention(q, k, v, config=WS)
    bad_dq = KernelConfig(192, 64, 4, 2, warp_specialized=True)
    with pytest.raises(ValueError, match=r"dq_config .*bwd_dq's warpspec takes block_m in \(64, 1"):
        ops.backward(q, q, k, v, q, q[..., 0], causal=False, scale=0.125, dq_config=bad_dq)
    with pytest.raises(ValueError, match="block_m=192 needs warpspec"):
        fa2tune.attention(q, k, v, config=KernelConfig(192, 64))
    if device == "cpu":
        dkdv = KernelConfig(64, 128, 4, 2, warp_specialized=True)
        with pytest.raises(ValueError, match=r"dkdv_config .* cannot run this call: warpspec runs on a CUDA GPU only"):
            ops.backward(q, q, k, v, q, q[..., 0], causal=False, scale=0.125, dkdv_config=dkdv)
        dq = KernelConfig(128, 64, 4, 3, warp_specialized=True)
        with pytest.raises(ValueError, match=r"dq_config .* cannot run this call: warpspec runs on a CUDA GPU only"):
            ops.backward(q, q, k, v, q, q[..., 0], causal=False, scale=0.125, dq_config=dq)
