"""Benchmark reporting (fa2tune.bench.report, plots): geomean ratios against a baseline, the CSV round trip and the
grid's older CSV form, merging and medians of runs, the plots."""

from __future__ import annotations

import math

import pytest

from fa2tune.bench import plots, report


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
    r = report.ratios(rows, "fa2tune", "sdpa_cudnn", "fwd")
    # keyed by shape: (dtype, batch, heads, heads_kv, N, d, causal); the grid's batch·N = 16k and heads·d = 2048
    assert r == {("bf16", 32, 32, 32, 512, 64, False): 2.0, ("bf16", 32, 32, 32, 512, 64, True): 0.5,
                 ("bf16", 16, 32, 32, 1024, 64, False): 2.0, ("bf16", 16, 32, 32, 1024, 64, True): 2.0}  # fmt: skip
    assert math.isclose(report.geomean(r.values()), (2.0 * 0.5 * 2.0 * 2.0) ** 0.25)
    assert report.ratios(rows, "fa2tune", "flex", "fwd") == {}  # NaN baselines are skipped, not divided


def test_summary_names_the_worst_shape():
    lines = report.summary(_rows())
    cudnn = next(line for line in lines if "sdpa_cudnn" in line)
    assert "geomean 1.41x over 4 shapes" in cudnn and "worst 0.50x at d=64 N=512 causal=True" in cudnn
    assert "below 1x: 1" in cudnn and not any("flex" in line for line in lines)


def test_csv_round_trip_and_plots(tmp_path):
    rows = _rows()
    report.write_rows(rows, tmp_path / "bench.csv")
    back = report.read_rows(tmp_path / "bench.csv")
    assert [(r["provider"], r["seqlen"], r["causal"], r["tflops"]) for r in back[:-1]] == [
        (r["provider"], r["seqlen"], r["causal"], r["tflops"]) for r in rows[:-1]
    ]
    assert math.isnan(back[-1]["tflops"])
    (png,) = plots.write_plots(back, tmp_path / "plots", "test")
    assert png.name == "d64-fwd.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(provider, seqlen, causal, tflops, mode="fwd+bwd"):
    return dict(provider=provider, head_dim=64, seqlen=seqlen, causal=causal, mode=mode, tflops=tflops)


def test_median_of_runs_takes_each_rows_median_across_processes():
    # A host-bound row reads far apart between processes (148–209 TFLOP/s for one row; docs/PERF.md, "Host time per
    # call"): the row is their median; a reading a provider could not give (NaN) is left out, and a row no process
    # could measure stays NaN.
    runs = [[_row("fa2tune", 512, True, a), _row("sdpa_cudnn", 512, True, b), _row("flex", 512, True, c)]
            for a, b, c in ((160.1, 189.7, math.nan), (208.9, 189.3, math.nan), (185.2, 190.0, math.nan))]  # fmt: skip
    fa2tune, cudnn, flex = report.median_of_runs(runs)
    assert (fa2tune["provider"], fa2tune["tflops"]) == ("fa2tune", 185.2) and cudnn["tflops"] == 189.7
    assert math.isnan(flex["tflops"])
    runs[1][0]["tflops"] = math.nan  # an even count of readings: the mean of the middle two
    assert report.median_of_runs(runs)[0]["tflops"] == round((160.1 + 185.2) / 2, 1)


def test_merge_rows_replaces_what_was_measured_and_keeps_the_rest():
    base = [_row(p, n, c, 100.0) for n in (512, 1024) for c in (False, True) for p in ("fa2tune", "sdpa_cudnn")]
    new = [_row("fa2tune", 512, True, 150.0), _row("sdpa_cudnn", 512, True, 190.0), _row("fa2tune", 2048, True, 1.0)]
    merged = report.merge_rows(base, new)
    assert [r["tflops"] for r in merged[: len(base)]] == [100.0, 100.0, 150.0, 190.0, 100.0, 100.0, 100.0, 100.0]
    assert merged[len(base) :] == [new[2]]  # a shape base lacked goes after its rows
    assert report.merge_rows(base, [_row("fa2tune", 512, True, 1.0, mode="fwd")])[-1]["mode"] == "fwd"


def test_the_grids_older_csv_reads_as_the_grids_shapes(tmp_path):
    # docs/bench/<gpu>.csv predates the batch, heads and dtype columns: its rows are the grid's (batch·N = 16k,
    # heads·d = 2048, bf16; a gqa column gives the K/V heads), so they merge with rows `fa2tune bench` measures.
    old = tmp_path / "grid.csv"
    old.write_text("provider,head_dim,seqlen,causal,mode,tflops,gqa\n"
                   "fa2tune,64,512,False,fwd,397.6,\nfa2tune,128,2048,True,fwd+bwd,nan,4\n")  # fmt: skip
    mha, gqa = report.read_rows(old)
    assert (mha["batch"], mha["heads"], mha["heads_kv"], mha["dtype"], mha["tflops"]) == (32, 32, 32, "bf16", 397.6)
    assert (gqa["batch"], gqa["heads"], gqa["heads_kv"], gqa["causal"]) == (8, 16, 4, True) and math.isnan(gqa["ms"])
    new = dict(mha, tflops=401.0, ms=1.5)
    merged = report.merge_rows([mha, gqa], [new, dict(new, heads_kv=8)])
    assert len(merged) == 3 and merged[0]["tflops"] == 401.0 and merged[0]["ms"] == 1.5
    assert merged[1] is gqa and merged[2]["heads_kv"] == 8  # another K/V head count is another shape, added
    report.write_rows(merged, old)
    assert [r["heads_kv"] for r in report.read_rows(old)] == [32, 4, 8]


def test_a_summary_names_a_shape_off_the_grid_with_its_batch_and_heads():
    rows = [dict(_row(p, 256, False, t, mode="fwd"), batch=3, heads=8, heads_kv=2, dtype="fp16")
            for p, t in (("fa2tune", 90.0), ("sdpa_flash", 60.0))]  # fmt: skip
    (line,) = report.summary(rows)
    assert "geomean 1.50x over 1 shapes" in line and "at d=64 N=256 causal=False fp16 B=3 H=8/2" in line


@pytest.mark.parametrize("value, written", [(644.3149, 644.3), (12.04, 12.0), (0.0123456, 0.0123), (2.2e-05, 2.2e-05)])
def test_numbers_keep_a_decimal_on_a_gpu_and_three_digits_below_ten(value, written):
    assert report.rounded(value) == written and math.isnan(report.rounded(math.nan))


def test_plots_are_named_by_head_dim_and_mode_and_by_heads_only_where_two_share_those(tmp_path):
    rows = [dict(_row("fa2tune", n, False, 100.0 + n, mode="fwd"), heads=h, heads_kv=kv)
            for n in (256, 512) for h, kv in ((8, 8), (8, 2))]  # fmt: skip
    rows.append(dict(_row("fa2tune", 256, True, 50.0, mode="fwd+bwd"), head_dim=128))
    written = sorted(p.name for p in plots.write_plots(rows, tmp_path, ""))
    assert written == ["d128-fwd_bwd.png", "d64-fwd-h8.png", "d64-fwd-h8kv2.png"]
