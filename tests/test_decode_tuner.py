"""The decode tune (fa2tune.tune.decode_tuner, decode_space): its space of configs grouped by what they launch, the
search over recorded readings (no GPU), the finish, and the builds handed to the compile pool."""

from __future__ import annotations

import math

import pytest
import torch

from fa2tune.config import decode_plan
from fa2tune.config.decode_config import DecodeConfig
from fa2tune.config.device import known_gpu
from fa2tune.tune import decode_space, decode_tuner, decode_workload
from fa2tune.tune.finish import INCUMBENT_MARGIN
from fa2tune.tune.timing import Timing

H200 = known_gpu("h200")
STEPS = decode_workload.workloads(cpu=False)


def _space(head_dim=128, incumbent=None) -> decode_space.DecodeSpace:
    default = decode_plan.default_config(H200, head_dim, torch.bfloat16)
    return decode_space.build(decode_space.SEARCH, H200, head_dim, torch.bfloat16, STEPS, heads=32, kv_heads=8,
                              default=default, incumbent=incumbent)  # fmt: skip


def test_configs_that_launch_the_same_kernels_on_every_step_are_timed_once():
    space = _space()
    assert len(space.representative) + len(space.unfit) == 3 * 2 * 3 * 3 * 4 * 3  # the table's combinations
    # 4 and 16 packed rows fit one tile of 16 (max_block_m never cuts one), and the split steps' 32k and 128k keys
    # never reach min_split_keys' cap: a class is a compiled shape and a programs_per_sm
    assert len(space.classes) == 3 * 2 * 3 * 4
    for config, chosen in space.representative.items():
        assert (config.block_n, config.num_warps, config.num_stages, config.programs_per_sm) == (
            chosen.block_n, chosen.num_warps, chosen.num_stages, chosen.programs_per_sm)  # fmt: skip
        assert space.launches[chosen] == decode_space.launches(config, STEPS, heads=32, kv_heads=8, sm_count=132)
    # Representatives keep the default's undecided fields where they fit: 128 keys a step and 4 stages fit an H200
    # at d=128 only with fewer packed rows
    assert space.classes[0] == space.default == decode_plan.DEFAULT_CONFIG
    assert {(c.max_block_m, c.min_split_keys) for c in space.classes} == {(64, 512), (16, 512)}
    assert {(c.block_n, c.num_stages) for c in space.classes if c.max_block_m == 16} == {(128, 4)}
    assert all("shared memory" in reason for reason in space.unfit.values())
    # The split rule's parameter splits the two short steps differently: 5 and 33 splits at 2 programs an SM
    assert [launch[-1] for launch in space.launches[space.default]] == [1, 1, 5, 5, 33, 33, 1, 1]


def test_the_file_s_config_represents_its_class_and_one_that_no_longer_fits_is_dropped():
    kept = DecodeConfig(block_n=32, num_warps=8, num_stages=2, max_block_m=32, min_split_keys=1024)
    space = _space(incumbent=kept)
    assert space.incumbent == kept and space.representative[kept] == kept and space.classes[1] == kept
    too_large = DecodeConfig(block_n=256, num_stages=8, max_block_m=128)
    space = _space(incumbent=too_large)
    assert space.incumbent is None and "is no longer a candidate (needs" in space.incumbent_unfit


class _Recorded:
    """Readings from a table instead of a GPU: ms_of(config) per step (raising for a config that fails)."""

    on_gpu = True

    def __init__(self, ms_of):
        self.ms_of, self.timed = ms_of, []
        self.gigabytes = [1.0, 4.0]

    def readings(self, config, *, quick=False):
        self.timed.append((config, quick))
        ms = self.ms_of(config)
        return [Timing(ms, 0.99 * ms, 1.01 * ms), Timing(4 * ms, 3.96 * ms, 4.04 * ms)]


def _ms(config):
    """Faster with more programs an SM and longer steps; 8 warps at 128 keys a step fail to run."""
    if config.num_warps == 8 and config.block_n == 128:
        raise RuntimeError("out of resources: shared memory")
    return 1.0 + 1.0 / config.programs_per_sm + 32 / config.block_n + 0.01 * config.num_stages


def _tune(space, bench, trials=12, verify=lambda config: 0.0, **spec):
    spec = decode_tuner.DecodeSpec(head_dim=128, dtype="bf16", heads=32, kv_heads=8, trials=trials, **spec)
    return decode_tuner.tune(spec, space, bench, name="h200/decode", verify=verify, tolerance=1e-2)


def test_the_search_times_each_class_once_and_a_failing_config_scores_inf():
    space = _space()
    bench = _Recorded(_ms)
    result = _tune(space, bench, trials=30)
    searched = [config for config, quick in bench.timed if quick]
    assert len(searched) == len(set(searched)) == 30 == result.measured + result.failed  # the budget: classes timed
    assert set(searched) <= set(space.classes) and searched[0] == space.default  # the baseline first
    assert result.failed == sum(c.num_warps == 8 and c.block_n == 128 for c in searched)
    assert all("out of resources" in r.reason for r in result.history if r.ms is None)
    # the winner is the fastest class timed, read again; ms and GB/s are the steps' geometric means
    fastest = min((c for c in searched if c.num_warps != 8 or c.block_n != 128), key=_ms)
    assert result.best == fastest and result.best_ms == pytest.approx(2 * _ms(fastest))
    assert result.gbps == pytest.approx(2.0 / (result.best_ms * 1e-3))  # sqrt(1 · 4) GB over 2·ms
    assert result.default_ms == pytest.approx(2 * _ms(space.default))
    assert {config for config, quick in bench.timed if not quick} >= {fastest, space.default}


def test_the_compile_processes_are_let_go_between_the_search_and_the_finish():
    # on_timed (the CLI's pool.release) runs after the search's quick readings and before the finish's: no build
    # left queued runs beside the timings that pick the winner
    bench = _Recorded(_ms)
    spec = decode_tuner.DecodeSpec(head_dim=128, dtype="bf16", heads=32, kv_heads=8, trials=6)
    decode_tuner.tune(spec, _space(), bench, name="h200/decode", verify=lambda config: 0.0, tolerance=1e-2,
                      on_timed=lambda: bench.timed.append("released"))  # fmt: skip
    released = bench.timed.index("released")
    assert all(quick for _, quick in bench.timed[:released]) and released == 6
    assert bench.timed[released + 1 :] and not any(quick for _, quick in bench.timed[released + 1 :])


def test_the_search_ends_once_every_class_is_timed():
    space = _space()
    result = _tune(space, _Recorded(_ms), trials=1000)
    assert result.measured + result.failed == len(space.classes)
    assert result.best == DecodeConfig(block_n=128, num_warps=4, num_stages=2, programs_per_sm=8)


def test_no_new_class_is_timed_after_the_timeout():
    result = _tune(_space(), _Recorded(_ms), trials=1000, timeout_s=0.0)
    assert result.measured == 1 and result.best == result.default  # the first class is always timed


def test_the_timeout_counts_from_the_first_class_timed_not_from_the_builds(monkeypatch):
    # Every class's kernels start building when the tune starts; the first reading waits for its build (30 s here,
    # on a clock the test moves), and the timeout counts from that reading: 10 s of 4 s timings is three classes.
    from fa2tune.tune import records

    clock = [1000.0]
    monkeypatch.setattr(records.time, "time", lambda: clock[0])

    def slow_first(config):
        clock[0] += 34.0 if not bench.timed[:-1] else 4.0  # the first class's build, then each timing
        return _ms(config)

    bench = _Recorded(slow_first)
    result = _tune(_space(), bench, trials=1000, timeout_s=10.0)
    assert result.measured + result.failed == 4  # read at 34 s, then classes starting at 34, 38 and 42 s
    # a share of a run's wall time counts the builds: past it at the first reading
    bench = _Recorded(slow_first)
    result = _tune(_space(), bench, trials=1000, timeout_s=10.0, timeout_counts_builds=True)
    assert result.measured + result.failed == 1


def test_a_winner_that_fails_verification_gives_way_to_the_next():
    space = _space()
    wrong = DecodeConfig(block_n=128, num_warps=4, num_stages=2, programs_per_sm=8)
    result = _tune(space, _Recorded(_ms), trials=1000, verify=lambda config: 0.5 if config == wrong else 1e-3)
    assert result.best != wrong and result.best_ms > 2 * _ms(wrong)
    with pytest.raises(RuntimeError, match="no measured config passed verification"):
        _tune(space, _Recorded(_ms), trials=3, verify=lambda config: math.nan)


@pytest.mark.parametrize("faster_by, kept", [(INCUMBENT_MARGIN / 2, True), (INCUMBENT_MARGIN * 3, False)])
def test_the_file_s_config_stays_unless_beaten_by_more_than_the_margin(faster_by, kept):
    incumbent = DecodeConfig(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)
    rival = DecodeConfig(block_n=128, num_warps=4, num_stages=2, programs_per_sm=4)
    space = _space(incumbent=incumbent)
    ms_of = lambda config: 1.0 - faster_by if config == rival else 1.0 if config == incumbent else 2.0
    result = _tune(space, _Recorded(ms_of), trials=1000)
    assert result.best == (incumbent if kept else rival)
    assert result.incumbent_note.startswith("kept the stored config" if kept else "replaced the stored config")


def test_the_builds_run_in_the_compile_pool_and_a_failed_build_is_the_config_s_failure():
    from fa2tune.tune import compile_pool, processes

    # one class, the interpreter's config: its builds run the interpreter's tiny steps in the pool's processes
    only = {name: (value,) for name, value in decode_plan.INTERPRETER_CONFIG.to_dict().items()}
    space = decode_space.build(only, known_gpu("h200"), 16, torch.float32, decode_workload.workloads(cpu=True),
                               heads=4, kv_heads=2, default=decode_plan.INTERPRETER_CONFIG, incumbent=None)  # fmt: skip
    with compile_pool.CompilePool(2, context=processes.fork_context()) as pool:
        sizes = dict(heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)
        built = decode_tuner._start_builds(space, pool, **sizes, device="cpu")
        broken = decode_tuner._start_builds(space, pool, **sizes, device="no-such-device")
        assert built(space.default) is None
        assert "no-such-device" in broken(space.default)
        spec = decode_tuner.DecodeSpec(head_dim=16, dtype="fp32", heads=4, kv_heads=2, trials=10)
        with pytest.raises(RuntimeError, match=r"no config could be measured; reasons: .*no-such-device"):
            decode_tuner.tune(spec, space, _Recorded(_ms), name="cpu/decode", verify=lambda config: 0.0,
                              tolerance=1e-5, built=broken)  # fmt: skip


def test_the_reference_check_catches_a_wrong_decode_output(monkeypatch):
    # (the CLI test's tune passes it with right kernels); 2 % off in every output is 2 % of relative error
    from fa2tune.tune import verification

    real = decode_workload.run_step
    monkeypatch.setattr(decode_workload, "run_step", lambda *args: (real(*args)[0] * 1.02, None))
    error = verification.check_decode(decode_plan.INTERPRETER_CONFIG, heads=4, kv_heads=2, head_dim=16,
                                      dtype=torch.float16, device="cpu")  # fmt: skip
    assert error == pytest.approx(0.02, rel=0.05) and error > verification.REL_TOLERANCE[torch.float16]


def test_the_finish_times_its_configs_in_alternating_rounds_and_scores_their_means():
    # Each finish reading here is 5 % slower than the one before (a GPU's drift). The finish times each config
    # FINAL_ROUNDS times, in alternating order, once each though the default is also the file's config; the
    # winner's ms and its steps' readings are the means over the rounds.
    from fa2tune.tune.timing import FINAL_ROUNDS

    incumbent = _space().default
    finish = []

    class Drifting(_Recorded):
        def readings(self, config, *, quick=False):
            if not quick:
                finish.append(config)
            got = super().readings(config, quick=quick)
            drift = 1 + 0.05 * len(finish)
            return [Timing(t.median_ms * drift, t.p20_ms * drift, t.p80_ms * drift) for t in got]

    result = _tune(_space(incumbent=incumbent), Drifting(_ms), trials=8)
    finalists = list(dict.fromkeys(finish))
    rounds = [finish[i * len(finalists) : (i + 1) * len(finalists)] for i in range(FINAL_ROUNDS)]
    assert len(finish) == FINAL_ROUNDS * len(finalists) and rounds[1] == rounds[0][::-1]
    drifts = [1 + 0.05 * (i + 1) for i, config in enumerate(finish) if config == result.best]
    mean_drift = sum(drifts) / len(drifts)
    assert result.best_ms == pytest.approx(2 * _ms(result.best) * mean_drift)  # sqrt(1 · 4) · ms, over its rounds
    assert [t.median_ms for t in result.readings] == pytest.approx([_ms(result.best) * mean_drift,
                                                                    4 * _ms(result.best) * mean_drift])  # fmt: skip
