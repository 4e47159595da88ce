"""`fa2tune bench` and fa2tune.bench on the CPU: tiny shapes through Triton's interpreter, every provider checked
against SDPA before it is timed, the standard FLOP count, the outputs (table, JSON, CSV, plots), the presets and
the errors that name their flag."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fa2tune import cli
from fa2tune.bench import measure, providers, report
from fa2tune.bench.shapes import GRID_TOKENS, PRESETS, Shape, Sweep
from fa2tune.cli import bench_command

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; on a GPU bench measures for real")

_TINY = ["bench", "--device", "cpu", "--batch", "1", "--heads", "2", "--kv-heads", "1", "--seqlen", "33",
         "--head-dim", "16"]  # fmt: skip


def test_bench_on_cpu_prints_json_writes_the_csv_and_counts_causal_flops_as_half(tmp_path, capsys):
    csv_path, plots = tmp_path / "rows.csv", tmp_path / "plots"
    argv = [*_TINY, "--causal", "yes", "--mode", "fwd", "--providers", "fa2tune,sdpa_math,sdpa_cudnn", "--json",
            "--csv", str(csv_path), "--plots", str(plots)]  # fmt: skip
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["skipped"] == {"sdpa_cudnn": "needs a CUDA device"} and "[1/1] fwd bf16 B=1 H=2/1 N=33" in err
    assert data["environment"]["device"].startswith("CPU") and data["environment"]["triton"]
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {"fa2tune", "sdpa_math"}
    for row in rows.values():
        assert row["note"] == "" and 0 <= row["rel_err"] < measure.MAX_REL_ERR and row["ms"] > 0
        # 4·B·H·d over the visible pairs, causal: 33·34/2 of 33² (milliseconds and TFLOP/s rounded to 3 digits)
        assert row["tflops"] * 1e12 * row["ms"] * 1e-3 == pytest.approx(4 * 1 * 2 * 16 * 33 * 34 / 2, rel=1e-2)
    back = report.read_rows(csv_path)
    assert [(r["provider"], r["heads_kv"], r["tflops"]) for r in back] == [
        (r["provider"], r["heads_kv"], r["tflops"]) for r in data["rows"]
    ]
    assert [p.name for p in plots.iterdir()] == ["d16-fwd.png"]


def test_bench_table_and_training_mode_on_cpu(capsys):
    assert cli.main([*_TINY, "--causal", "no", "--mode", "fwd+bwd", "--providers", "fa2tune,sdpa_flash"]) == 0
    out = capsys.readouterr().out
    header, row = out.splitlines()[1:3]
    assert header.split()[-2:] == ["fa2tune", "sdpa_flash"] and row.split()[:7] == [
        "fwd+bwd", "bf16", "1", "2/1", "33", "16", "False"
    ]  # fmt: skip
    assert all(float(cell) > 0 for cell in row.split()[7:])  # both checked (output and three gradients), then timed
    assert "fwd+bwd vs sdpa_flash      geomean" in out


def _fake(name: str, build, seq_major: bool = False) -> providers.Provider:
    return providers.Provider(name, name, build, lambda device: None, seq_major=seq_major)


def _sdpa_seq_major(shape):
    """SDPA called on flash_attn's (batch, seqlen, heads, d) layout, as the flash_attn providers are."""
    def run(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=shape.causal, enable_gqa=True)  # fmt: skip
        return out.transpose(1, 2)

    return run


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_a_wrong_provider_gets_no_number_and_a_failing_one_costs_only_its_row(mode):
    # A provider whose output (or gradient) is off is not timed; one that raises gets its error as the note; one in
    # flash_attn's layout is given its inputs transposed and compared after transposing back.
    def off(shape):
        return lambda q, k, v: F.scaled_dot_product_attention(q, k * 1.5, v, is_causal=shape.causal, enable_gqa=True)

    def raises(shape):
        def run(q, k, v):
            raise RuntimeError("no kernel for this shape\nsecond line")

        return run

    chosen = [_fake("off", off), _fake("raises", raises), _fake("seq_major", _sdpa_seq_major, seq_major=True)]
    shape = Shape(batch=2, heads=4, heads_kv=2, seqlen=20, head_dim=8, causal=True, dtype="fp32", mode=mode)
    wrong, failing, transposed = measure.measure_shape(shape, chosen, "cpu")
    assert math.isnan(wrong["tflops"]) and wrong["rel_err"] > measure.MAX_REL_ERR and "not timed" in wrong["note"]
    assert math.isnan(failing["tflops"]) and failing["note"] == "RuntimeError: no kernel for this shape"
    assert transposed["note"] == "" and transposed["rel_err"] < 1e-5 and transposed["tflops"] > 0


def test_rounds_time_the_providers_in_alternating_order_and_report_the_mean(monkeypatch):
    # Each provider is checked right before its first timing, then timed round by round, first to last and last to
    # first; a provider that fails while timed gets no number and its reason, and is not timed again; a provider
    # named twice has two rows.
    calls, readings = [], iter(range(1, 100))

    def recording(name, fails_when_timed=False):
        def build(shape):
            def run(q, k, v):
                calls.append(name)
                if fails_when_timed and calls.count(name) > 1:
                    raise RuntimeError("launch failed")
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=True)

            return run

        return _fake(name, build)

    def one_run_each(call):  # a reading a call: the next number
        call()
        return measure.Timing(median_ms=float(next(readings)), p20_ms=0.0, p80_ms=0.0)

    monkeypatch.setattr(measure, "_time_host", one_run_each)
    chosen = [recording("a"), recording("b"), recording("flaky", fails_when_timed=True), recording("c")]
    shape = Shape(batch=1, heads=2, heads_kv=1, seqlen=20, head_dim=8, causal=False, dtype="fp32", mode="fwd")
    rows = {r["provider"]: r for r in measure.measure_shape(shape, chosen, "cpu", rounds=3)}
    assert calls == ["a", "a", "b", "b", "flaky", "flaky", "c", "c", "c", "b", "a", "a", "b", "c"]
    means = [(1 + 6 + 7) / 3, (2 + 5 + 8) / 3, (3 + 4 + 9) / 3]  # readings 1-3, then 4-6 backwards, then 7-9
    assert [rows[name]["ms"] for name in "abc"] == pytest.approx(means, rel=1e-2)
    assert math.isnan(rows["flaky"]["tflops"]) and rows["flaky"]["note"] == "RuntimeError: launch failed"
    twice = measure.measure_shape(shape, [chosen[0], chosen[1], chosen[0]], "cpu")
    assert [r["provider"] for r in twice] == ["a", "b", "a"] and all(r["ms"] > 0 for r in twice)


def test_the_math_backend_is_skipped_where_its_scores_would_not_fit():
    big = Shape(batch=16, heads=16, heads_kv=16, seqlen=16384, head_dim=128, causal=False, dtype="bf16", mode="fwd")
    assert "GiB of scores" in providers.PROVIDERS["sdpa_math"].skip(big)
    assert providers.PROVIDERS["sdpa_math"].skip(Shape(1, 2, 2, 64, 16, False, "bf16", "fwd")) is None


def test_flash_attn_not_installed_is_skipped_with_how_to_install_it():
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash_attn is installed here")
    except ImportError:
        pass
    chosen, skipped = providers.select(["fa2tune", "flash_attn", "flash_attn_cute"], "cuda")
    assert [p.name for p in chosen] == ["fa2tune"]
    assert "pip install flash-attn)" in skipped["flash_attn"]
    assert "pip install flash-attn-4" in skipped["flash_attn_cute"]


def test_presets_expand_to_their_shapes_and_flags_override_them():
    grid = PRESETS["grid"].shapes()
    assert len(grid) == 2 * 2 * 6 * 2  # modes x head dims x lengths x masks
    assert all(s.batch * s.seqlen == GRID_TOKENS and s.heads * s.head_dim == 2048 for s in grid)
    llama = PRESETS["llama"].override(seqlens=(2048,), modes=("fwd",), heads=None).shapes()
    assert {(s.heads, s.heads_kv, s.head_dim, s.seqlen, s.batch) for s in llama} == {(32, 8, 128, 2048, 8)}
    assert {s.head_dim for s in PRESETS["headdims"].shapes()} == {64, 80, 96, 128, 192, 256}
    with pytest.raises(ValueError, match="--kv-heads must divide the query heads, 32 at d=64; got 3"):
        Sweep(seqlens=(64,), head_dims=(64,), heads_kv=3).shapes()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "--device", "cpu"], "past --seqlen 256 (got 16384); give small shapes, e.g. --batch 1"),
        ([*_TINY[:-4], "--seqlen", "64", "--head-dim", "16", "--kv-heads", "3"], "--kv-heads must divide"),
        (["bench", "--providers", "fa2tune,nope"], "expected names from fa2tune, sdpa_flash"),
        (["bench", "--mode", "bwd"], "expected fwd or fwd+bwd"),
        (["bench", "--seqlen", "0"], "expected comma-separated integers >= 1"),
        (["bench", "--head-dim", "64,300"], "must be in 1..256, got 300"),
    ],
)
def test_a_bad_bench_argument_is_one_line_and_exit_code_2(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_without_matplotlib_the_plots_are_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "can_plot", lambda: False)
    folder = tmp_path / "plots"
    argv = [*_TINY, "--causal", "no", "--mode", "fwd", "--providers", "sdpa_math", "--plots", str(folder)]
    assert cli.main(argv) == 0
    assert "matplotlib is not installed (pip install 'fa2tune[bench]')" in capsys.readouterr().err
    assert not folder.exists()


def test_from_csv_reports_an_earlier_run_without_measuring(tmp_path, capsys):
    rows = [dict(provider=p, head_dim=64, seqlen=512, causal=False, mode="fwd", tflops=t)
            for p, t in (("fa2tune", 400.0), ("sdpa_cudnn", 320.0))]  # fmt: skip
    report.write_rows(rows, tmp_path / "nvidia-h200.csv")
    assert cli.main(["bench", "--from-csv", str(tmp_path / "nvidia-h200.csv"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["tflops"] for r in data["rows"]] == [400.0, 320.0] and data["rows"][0]["batch"] == 32
    assert "geomean 1.25x over 1 shapes" in data["summary"][0]


_HEADER = "provider,mode,dtype,batch,heads,heads_kv,seqlen,head_dim,causal,ms,tflops,rel_err,note\n"


@pytest.mark.parametrize(
    "body, says",
    [
        ("fa2tune,fwd,bf16,x,2,2,64,32,yes,1.0,2.0,,\n", "column batch: expected a whole number, got 'x'"),
        ("fa2tune,fwd,bf16,1,2,2,64,32,yes,abc,,,\n", "column ms: expected a number, got 'abc'"),
        ("fa2tune,fwd,bf16,1,2,2,0,32,yes,1.0,2.0,,\n", "column seqlen: expected at least 1, got 0"),
        ("fa2tune,fwd,bf16,1,2\n", "column head_dim: missing (a short row)"),
        ("fa2tune,fwd,bf16,1,2,2,64,32,maybe,1.0,2.0,,\n", "column causal: expected True or False, got 'maybe'"),
    ],
)
@pytest.mark.parametrize("flag", ["--from-csv", "--merge-into"])
def test_a_csv_with_a_bad_row_is_refused_by_line_and_column_before_measuring(tmp_path, capsys, body, says, flag):
    path = tmp_path / "rows.csv"
    path.write_text(_HEADER + "fa2tune,fwd,bf16,1,2,2,64,32,no,1.0,2.0,,\n" + body)
    before = path.read_text()
    with pytest.raises(SystemExit) as exc:
        cli.main([*_TINY, "--mode", "fwd", "--providers", "sdpa_math", flag, str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{flag} {path}: line 3: {says}" in err, err
    assert "[1/" not in err and path.read_text() == before  # refused before any shape was measured


def test_a_csv_row_reads_its_mask_in_any_case_and_a_quoted_note_does_not_shift_the_line_named(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text(_HEADER + 'fa2tune,fwd,bf16,1,2,2,64,32,TRUE,1.0,2.0,,"a note\nover two lines"\n'
                    + "fa2tune,fwd,bf16,1,2,2,64,32,FALSE,1.0,x,,\n")  # fmt: skip
    assert report.csv_problem(path) == "line 4: column tflops: expected a number, got 'x'"
    path.write_text(_HEADER + 'fa2tune,fwd,bf16,1,2,2,64,32,TRUE,1.0,2.0,,"a note\nover two lines"\n')
    assert report.csv_problem(path) is None and [row["causal"] for row in report.read_rows(path)] == [True]


def test_a_reading_that_is_not_finite_reads_as_no_number():
    row = report.complete(dict(provider="fa2tune", mode="fwd", seqlen="64", head_dim="32", causal="no", ms="nan",
                               tflops="inf"))  # fmt: skip
    assert math.isnan(row["ms"]) and math.isnan(row["tflops"])


def test_processes_measure_in_fresh_processes_and_merge_each_rows_median(tmp_path, capsys, monkeypatch):
    # --processes 3 --merge-into CSV: three `fa2tune bench` child processes given this one's shape flags, device and
    # providers (and a CSV each); each row's median replaces the merged file's row, the other rows are kept.
    readings = iter([150.0, 210.0, 180.0])
    commands = []

    def child(command, check, stdout):
        commands.append(command)
        row = dict(provider="fa2tune", head_dim=16, seqlen=33, causal=False, mode="fwd", tflops=next(readings),
                   batch=1, heads=2, heads_kv=1)  # fmt: skip
        report.write_rows([row], command[command.index("--csv") + 1])

    monkeypatch.setattr(bench_command.subprocess, "run", child)
    grid = tmp_path / "grid.csv"
    kept = dict(provider="fa2tune", head_dim=128, seqlen=8192, causal=False, mode="fwd", tflops=644.0)
    report.write_rows([kept], grid)
    argv = [*_TINY, "--causal", "no", "--mode", "fwd", "--providers", "fa2tune", "--processes", "3",
            "--rounds", "2", "--merge-into", str(grid)]  # fmt: skip
    assert cli.main(argv) == 0
    assert len(commands) == 3 and commands[0][3:] == [
        "bench", "--device", "cpu", "--providers", "fa2tune", "--rounds", "2", "--batch", "1", "--heads", "2",
        "--kv-heads", "1", "--seqlen", "33", "--head-dim", "16", "--causal", "no", "--mode", "fwd", "--csv",
        commands[0][-1]
    ]  # fmt: skip
    merged = report.read_rows(grid)
    assert [(r["seqlen"], r["tflops"]) for r in merged] == [(8192, 644.0), (33, 180.0)]
    assert "the median of 3 processes" in capsys.readouterr().err


def test_without_a_reference_no_provider_is_timed(monkeypatch):
    # A shape whose reference cannot run (out of memory, say) leaves nothing to check a provider against: every
    # row says so, none gets a number, and the benchmark goes on.
    def no_reference(shape):
        def run(q, k, v):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

        return run

    monkeypatch.setattr(measure, "_reference", no_reference)
    shape = Shape(1, 2, 2, 16, 8, False, "fp32", "fwd")
    (row,) = measure.measure_shape(shape, [providers.PROVIDERS["sdpa_math"]], "cpu")
    assert math.isnan(row["tflops"]) and row["note"].startswith("the reference failed: OutOfMemoryError: CUDA out")


def test_the_bench_and_attention_import_no_optuna():
    # The tuner's search needs optuna; measuring and running attention do not, and a GPU host set up to run a model
    # may lack it (this project's GPU machine does): `fa2tune bench` and fa2tune.attention must import without it.
    import subprocess
    import sys

    script = ("import sys, fa2tune, fa2tune.bench.measure, fa2tune.cli.bench_command; "
              "assert 'optuna' not in sys.modules, 'optuna imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", script], check=True)
