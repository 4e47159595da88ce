"""fa2tune.tune.timing's timer discards a process's first timing (no GPU needed: do_bench is stood in for)."""

import math

import pytest
import triton.testing

from fa2tune.tune import timing


def test_a_process_s_first_timing_is_discarded_and_later_ones_are_not(monkeypatch):
    # On the H200 the first timing a process takes reads 3-8 % high (docs/PERF.md, "How it is measured"): the first
    # call returns its second reading; later calls time once.
    readings = iter([[0.9, 0.95, 1.0], [1.9, 2.0, 2.1], [2.9, 3.0, 3.1]])
    calls = []

    def do_bench(fn, warmup, rep, quantiles):
        calls.append(fn)
        return next(readings)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(timing, "_timed_before", False)
    first = timing.time_cuda(lambda: None)
    assert len(calls) == 2 and (first.p20_ms, first.median_ms, first.p80_ms) == (1.9, 2.0, 2.1)
    second = timing.time_cuda(lambda: None)
    assert len(calls) == 3 and second.median_ms == pytest.approx(3.0)


def test_a_reading_of_fewer_runs_than_min_runs_is_taken_again_in_a_window_that_holds_them(monkeypatch):
    # do_bench fits as many runs into its window as the call allows: a 60 ms call in a 100 ms window is timed once.
    # time_cuda takes such a reading again in a window of MIN_RUNS + 1 calls; a short call's reading stands, and a
    # process's first timing is discarded either way (a long call's in the longer window).
    windows = []

    def do_bench(fn, warmup, rep, quantiles):
        windows.append(rep)
        return {"long": [59.0, 60.0, 61.0], "short": [0.9, 1.0, 1.1], "nan": [math.nan] * 3}[fn]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(timing, "_timed_before", False)
    assert timing.time_cuda("long", rep_ms=100).median_ms == 60.0
    assert windows == [100, 60 * (timing.MIN_RUNS + 1)]
    windows.clear()
    assert timing.time_cuda("short", rep_ms=100).median_ms == 1.0 and windows == [100]
    windows.clear()
    assert timing.time_cuda("long", rep_ms=100).median_ms == 60.0
    assert windows == [100, 60 * (timing.MIN_RUNS + 1)]
    windows.clear()
    assert math.isnan(timing.time_cuda("nan", rep_ms=100).median_ms) and windows == [100]  # no window from a NaN
