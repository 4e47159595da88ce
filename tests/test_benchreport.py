"""Benchmark reporting: geomean ratios against a baseline, the CSV round trip, the plots."""

from __future__ import annotations

import math

from fa2tune.tune import benchreport


def _rows():
    rows = []
    for seqlen in (512, 1024):
        for causal in (False, True):
            for provider, tflops in (("fa2tune", 400.0), ("sdpa_cudnn", 200.0), ("sdpa_flash", 800.0)):
                if provider == "fa2tune" and seqlen == 512 and causal:
                    tflops = 100.0  # one shape where fa2tune loses to cuDNN
                rows.append(dict(provider=provider, head_dim=64, seqlen=seqlen, causal=causal, mode="fwd",
                                 tflops=tflops))  # fmt: skip
    rows.append(dict(provider="flex", head_dim=64, seqlen=512, causal=False, mode="fwd", tflops=math.nan))
    return rows


def test_ratios_and_geomean():
    rows = _rows()
    r = benchreport.ratios(rows, "fa2tune", "sdpa_cudnn", "fwd")
    assert r == {(64, 512, False): 2.0, (64, 512, True): 0.5, (64, 1024, False): 2.0, (64, 1024, True): 2.0}
    assert math.isclose(benchreport.geomean(r.values()), (2.0 * 0.5 * 2.0 * 2.0) ** 0.25)
    assert benchreport.ratios(rows, "fa2tune", "flex", "fwd") == {}  # NaN baselines are skipped, not divided


def test_summary_names_the_worst_shape():
    lines = benchreport.summary(_rows())
    cudnn = next(line for line in lines if "sdpa_cudnn" in line)
    assert "geomean 1.41x over 4 shapes" in cudnn and "worst 0.50x at d=64 N=512 causal=True" in cudnn
    assert "below 1x: 1" in cudnn and not any("flex" in line for line in lines)


def test_csv_round_trip_and_plots(tmp_path):
    rows = _rows()
    benchreport.write_rows(rows, tmp_path / "bench.csv")
    back = benchreport.read_rows(tmp_path / "bench.csv")
    assert [(r["provider"], r["seqlen"], r["causal"], r["tflops"]) for r in back[:-1]] == [
        (r["provider"], r["seqlen"], r["causal"], r["tflops"]) for r in rows[:-1]
    ]
    assert math.isnan(back[-1]["tflops"])
    (png,) = benchreport.write_plots(back, tmp_path / "plots", "test")
    assert png.name == "d64-fwd.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(provider, seqlen, causal, tflops, mode="fwd+bwd"):
    return dict(provider=provider, head_dim=64, seqlen=seqlen, causal=causal, mode=mode, tflops=tflops)


def test_median_of_runs_takes_each_rows_median_across_processes():
    # A host-bound row reads far apart between processes (148–209 TFLOP/s for one row; docs/PERF.md, "Host time per
    # call"): the row is their median; a reading a provider could not give (NaN) is left out, and a row no process
    # could measure stays NaN.
    runs = [[_row("fa2tune", 512, True, a), _row("sdpa_cudnn", 512, True, b), _row("flex", 512, True, c)]
            for a, b, c in ((160.1, 189.7, math.nan), (208.9, 189.3, math.nan), (185.2, 190.0, math.nan))]  # fmt: skip
    fa2tune, cudnn, flex = benchreport.median_of_runs(runs)
    assert (fa2tune["provider"], fa2tune["tflops"]) == ("fa2tune", 185.2) and cudnn["tflops"] == 189.7
    assert math.isnan(flex["tflops"])
    runs[1][0]["tflops"] = math.nan  # an even count of readings: the mean of the middle two
    assert benchreport.median_of_runs(runs)[0]["tflops"] == round((160.1 + 185.2) / 2, 1)


def test_merge_rows_replaces_what_was_measured_and_keeps_the_rest():
    base = [_row(p, n, c, 100.0) for n in (512, 1024) for c in (False, True) for p in ("fa2tune", "sdpa_cudnn")]
    new = [_row("fa2tune", 512, True, 150.0), _row("sdpa_cudnn", 512, True, 190.0), _row("fa2tune", 2048, True, 1.0)]
    merged = benchreport.merge_rows(base, new)
    assert [r["tflops"] for r in merged[: len(base)]] == [100.0, 100.0, 150.0, 190.0, 100.0, 100.0, 100.0, 100.0]
    assert merged[len(base) :] == [new[2]]  # a shape base lacked goes after its rows
    assert benchreport.merge_rows(base, [_row("fa2tune", 512, True, 1.0, mode="fwd")])[-1]["mode"] == "fwd"
