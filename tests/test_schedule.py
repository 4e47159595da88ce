"""The schedule of the warp-specialized kernels' programs (fa2tune/config/schedule.py) and the named switches beside
it: the defaults run what the integer codes ran, the debugging variables override the tail policies, what a launch
runs is in its plan's key, and every spelling of a config (YAML, tuner parameters, the custom op's ints, the
scripts' command lines) reads back as the same config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fa2tune.config import planner
from fa2tune.config.schedule import (
    CAUSAL_TAIL_ENV,
    PER_TILE,
    PERSISTENT,
    SPLIT_TAIL_ENV,
    TWO_AN_SM,
    Schedule,
)
from fa2tune.config.store import EntryKey
from fa2tune.config.types import KernelConfig, Mask
from fa2tune.kernels import codegen
from fa2tune.launch import plans

NO_SPLIT = Schedule(persistent=True, split_tail=False)
CAUSAL_TAIL = Schedule(persistent=True, causal_tail=True)


@pytest.fixture
def unset(monkeypatch):
    for name in (SPLIT_TAIL_ENV, CAUSAL_TAIL_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_default_tails_are_what_the_integer_codes_ran(unset):
    # the split tail: a persistent forward without a mask, one program an SM; the causal tail: off by default
    assert PERSISTENT.splits_tail("fwd", causal=False)
    assert not PERSISTENT.splits_tail("fwd", causal=True) and not TWO_AN_SM.splits_tail("fwd", causal=False)
    assert not PER_TILE.splits_tail("fwd", causal=False) and not PERSISTENT.splits_tail("bwd_dq", causal=False)
    assert not any(s.deals_causal_tail(causal=True) for s in (PER_TILE, PERSISTENT, TWO_AN_SM))
    assert CAUSAL_TAIL.deals_causal_tail(causal=True) and not CAUSAL_TAIL.deals_causal_tail(causal=False)
    assert not NO_SPLIT.splits_tail("fwd", causal=False)


def test_the_variables_override_the_tails_where_a_launch_has_them(unset):
    unset.setenv(SPLIT_TAIL_ENV, "0")
    assert not PERSISTENT.splits_tail("fwd", causal=False)
    unset.setenv(SPLIT_TAIL_ENV, "")
    assert not PERSISTENT.splits_tail("fwd", causal=False)
    unset.setenv(SPLIT_TAIL_ENV, "1")
    assert NO_SPLIT.splits_tail("fwd", causal=False)
    assert not TWO_AN_SM.splits_tail("fwd", causal=False) and not PER_TILE.splits_tail("fwd", causal=False)
    unset.setenv(CAUSAL_TAIL_ENV, "1")
    assert PERSISTENT.deals_causal_tail(causal=True) and TWO_AN_SM.deals_causal_tail(causal=True)
    assert not PERSISTENT.deals_causal_tail(causal=False) and not PER_TILE.deals_causal_tail(causal=True)
    unset.setenv(CAUSAL_TAIL_ENV, "0")
    assert not CAUSAL_TAIL.deals_causal_tail(causal=True)


def test_a_launch_plan_key_holds_the_schedule_and_the_variables(unset):
    q = torch.zeros(1, 2, 8, 16)
    key = lambda config: plans.plan_key("fwd", (q, q, q), Mask(), 0.25, config)
    config = KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT)
    assert len({key(config), key(replace(config, schedule=NO_SPLIT)), key(replace(config, schedule=TWO_AN_SM))}) == 3
    before = key(config)
    unset.setenv(SPLIT_TAIL_ENV, "0")
    assert key(config) != before
    unset.setenv(CAUSAL_TAIL_ENV, "1")
    assert len({before, key(config), key(None)}) == 3  # a config resolved in the launch: the variables still count


def test_the_schedule_switches_make_configs_where_they_exist(unset):
    ws = KernelConfig(128, 128, 4, 2, warp_specialized=True)
    assert replace(ws, schedule=NO_SPLIT).combination_error("fwd") is None
    assert replace(ws, schedule=CAUSAL_TAIL).combination_error("bwd_dq") is None
    for schedule in (Schedule(programs_per_sm=2), Schedule(split_tail=False), Schedule(causal_tail=True)):
        problem = replace(ws, schedule=schedule).combination_error("fwd")
        assert problem.startswith("warpspec's programs_per_sm, split_tail and causal_tail are switches of persistent")
    for kernel, config in (("bwd_dq", replace(ws, schedule=NO_SPLIT)),
                           ("fwd", replace(ws, block_m=64, schedule=Schedule(True, 2, split_tail=False)))):  # fmt: skip
        assert config.combination_error(kernel).startswith("warpspec's split_tail is a switch of the forward's")
    with pytest.raises(ValueError, match=r"programs_per_sm must be one of \(1, 2\), got 3"):
        Schedule(persistent=True, programs_per_sm=3)


def test_an_entry_with_the_causal_tail_names_the_tail_s_code_too():
    # A causal persistent launch with the tail also runs the tail's variant: its entry's hash covers that code; the
    # unmasked entry, or a schedule without the tail, hashes what ran before the switch existed.
    config = KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT)
    for causal, differs in ((True, True), (False, False)):
        key = EntryKey(head_dim=128, dtype="bf16", causal=causal, kernel="fwd")
        with_tail = codegen.entry_code_hash(key, replace(config, schedule=CAUSAL_TAIL))
        assert (with_tail != codegen.entry_code_hash(key, config)) == differs


def test_every_spelling_of_a_config_reads_back_as_it():
    # YAML (to_dict), the tuner's parameters, the custom op's ints and the scripts' command-line words, for every
    # candidate and each tail policy off its default
    configs = [c for kernel in planner.KERNELS for c in planner.candidates(kernel)]
    configs += [replace(c, schedule=s) for c in configs if c.schedule == PERSISTENT for s in (NO_SPLIT, CAUSAL_TAIL)]
    for c in configs:
        assert KernelConfig.from_dict(c.to_dict()) == c
        assert KernelConfig.from_params(c.params()) == c
        assert KernelConfig.from_ints(c.to_ints()) == c and all(type(x) is int for x in c.to_ints())
        words = c.label().split()
        assert KernelConfig.parse(",".join([*words[0].split("x"), words[1][1:], words[2][1:], *words[3:]])) == c
    assert len({c.label() for c in configs}) == len(set(configs))  # one name each
    with pytest.raises(ValueError, match="a config is block_m,block_n,num_warps,num_stages"):
        KernelConfig.parse("128,128,4,2,warpspec")
