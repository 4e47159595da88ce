"""Benchmark reporting: geomean ratios against a baseline, the CSV round trip, the plots."""

from __future__ import annotations

import math

from fa2tune import benchreport


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
