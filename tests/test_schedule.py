"""The schedule of the warp-specialized kernels' programs (fa2tune/config/schedule.py) and the named switches beside
it: the defaults run what the integer codes ran, the debugging variable overrides the split tail, what a launch runs
is in its plan's key, and every spelling of a config (YAML, tuner parameters, the custom op's ints, the scripts'
command lines) reads back as the same config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fa2tune.config import planner
from fa2tune.config.schedule import PER_TILE, PERSISTENT, SPLIT_TAIL_ENV, TWO_AN_SM, Schedule
from fa2tune.config.types import KernelConfig, Mask
from fa2tune.launch import plans

NO_SPLIT = Schedule(persistent=True, split_tail=False)


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv(SPLIT_TAIL_ENV, raising=False)
    return monkeypatch


def test_the_default_tail_is_what_the_integer_codes_ran(unset):
    # the split tail: a persistent forward without a mask, one program an SM
    assert PERSISTENT.splits_tail("fwd", causal=False)
    assert not PERSISTENT.splits_tail("fwd", causal=True) and not TWO_AN_SM.splits_tail("fwd", causal=False)
    assert not PER_TILE.splits_tail("fwd", causal=False) and not PERSISTENT.splits_tail("bwd_dq", causal=False)
    assert not NO_SPLIT.splits_tail("fwd", causal=False)


def test_the_variable_overrides_the_split_tail_where_a_launch_has_it(unset):
    unset.setenv(SPLIT_TAIL_ENV, "0")
    assert not PERSISTENT.splits_tail("fwd", causal=False)
    unset.setenv(SPLIT_TAIL_ENV, "")
    assert not PERSISTENT.splits_tail("fwd", causal=False)
    unset.setenv(SPLIT_TAIL_ENV, "1")
    assert NO_SPLIT.splits_tail("fwd", causal=False)
    assert not TWO_AN_SM.splits_tail("fwd", causal=False) and not PER_TILE.splits_tail("fwd", causal=False)


def test_a_launch_plan_key_holds_the_schedule_and_the_variable(unset):
    q = torch.zeros(1, 2, 8, 16)
    key = lambda config: plans.plan_key("fwd", (q, q, q), Mask(), 0.25, config)
    config = KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT)
    assert len({key(config), key(replace(config, schedule=NO_SPLIT)), key(replace(config, schedule=TWO_AN_SM))}) == 3
    before, before_resolved = key(config), key(None)
    unset.setenv(SPLIT_TAIL_ENV, "0")
    assert key(config) != before
    assert key(None) != before_resolved  # a config resolved in the launch: the variable still counts


def test_the_schedule_switches_make_configs_where_they_exist(unset):
    ws = KernelConfig(128, 128, 4, 2, warp_specialized=True)
    assert replace(ws, schedule=NO_SPLIT).combination_error("fwd") is None
    for schedule in (Schedule(programs_per_sm=2), Schedule(split_tail=False)):
        problem = replace(ws, schedule=schedule).combination_error("fwd")
        assert problem.startswith("warpspec's programs_per_sm and split_tail are switches of persistent")
    for kernel, config in (("bwd_dq", replace(ws, schedule=NO_SPLIT)),
                           ("fwd", replace(ws, block_m=64, schedule=Schedule(True, 2, split_tail=False)))):  # fmt: skip
        assert config.combination_error(kernel).startswith("warpspec's split_tail is a switch of the forward's")
    with pytest.raises(ValueError, match=r"programs_per_sm must be one of \(1, 2\), got 3"):
        Schedule(persistent=True, programs_per_sm=3)


def test_every_spelling_of_a_config_reads_back_as_it():
    # YAML (to_dict), the tuner's parameters, the custom op's ints and the scripts' command-line words, for every
    # candidate and the split tail off its default
    configs = [c for kernel in planner.KERNELS for c in planner.candidates(kernel)]
    configs += [replace(c, schedule=NO_SPLIT) for c in configs if c.schedule == PERSISTENT]
    for c in configs:
        assert KernelConfig.from_dict(c.to_dict()) == c
        assert KernelConfig.from_params(c.params()) == c
        assert KernelConfig.from_ints(c.to_ints()) == c and all(type(x) is int for x in c.to_ints())
        words = c.label().split()
        assert KernelConfig.parse(",".join([*words[0].split("x"), words[1][1:], words[2][1:], *words[3:]])) == c
    assert len({c.label() for c in configs}) == len(set(configs))  # one name each
    with pytest.raises(ValueError, match="a config is block_m,block_n,num_warps,num_stages"):
        KernelConfig.parse("128,128,4,2,warpspec")


def test_a_study_s_trials_with_a_retired_schedule_field_read_as_the_config_without_it():
    # A tuner study begun before causal_tail left the schedule holds it in every trial's parameters (off: no planner
    # candidate had it on), and a resumed study reads them back (study_trials); the scripts' word for it is gone
    for c in (KernelConfig(64, 64), KernelConfig(128, 128, 4, 2, warp_specialized=True, schedule=PERSISTENT)):
        assert KernelConfig.from_params({**c.params(), "causal_tail": False}) == c
    with pytest.raises(ValueError, match="a config is block_m,block_n,num_warps,num_stages"):
        KernelConfig.parse("128,128,4,2,ws,persistent,causal-tail")
