"""The `fa2tune` command line: thin, clear errors, non-zero exit codes when something is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from fa2tune import cli, selfcheck


def test_check_passes_and_prints_a_row_per_case(capsys, device):
    assert cli.main(["check", "--device", device, "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert out.count(" ok") == 4 * len(selfcheck.default_shapes(on_gpu=device != "cpu"))  # full, causal, window, varlen
    assert "window" in out and "varlen" in out


def test_check_fails_loudly_when_the_kernel_is_wrong(capsys, monkeypatch, device):
    real = selfcheck.forward

    def off_by_a_little(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o * 1.01, lse

    monkeypatch.setattr(selfcheck, "forward", off_by_a_little)
    assert cli.main(["check", "--device", device, "--dtype", "fp32"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_no_gpu_is_a_plain_error_with_exit_code_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU message cannot show here")
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--device", "cuda:0"])
    assert exc.value.code == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_bad_dtype_lists_the_choices(capsys, device):
    assert cli.main(["check", "--device", device, "--dtype", "fp8"]) == 2
    assert "--dtype must be from ['bf16', 'fp16', 'fp32'], got ['fp8']" in capsys.readouterr().err


def test_plan_json_for_a_known_gpu(capsys):
    import json

    assert cli.main(["plan", "--gpu", "h200", "--head-dim", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"]["smem_per_block"] == 232448 and out["head_dim"] == 128 and out["dtype"] == "bf16"
    # 250 block/warp/stage configs × pipeline_qk, and 54 warp-specialized ones (24, persistent or not; 6
    # one-consumer ones two programs an SM)
    assert len(out["accepted"]) + len(out["rejected"]) == 554
    fields = {"block_m", "block_n", "num_warps", "num_stages", "pipeline_qk", "warpspec", "persistent", "sram_bytes"}
    assert set(out["accepted"][0]) == fields
    # 5 need more shared memory than the H200 has at d=128 (three or four stages of 128-row K and V tiles), and
    # one more register than its consumers have (192 rows, 128-row K/V tiles); persistent, another 3 more shared
    # memory (three stages of 128-row tiles beside the O buffer); two an SM, only (64, 64) with 2 stages fits twice
    assert sum(r["warpspec"] > 0 for r in out["accepted"]) == 18 + 16 + 1
    assert all(r["sram_bytes"] <= 232448 for r in out["accepted"]) and all(r["reason"] for r in out["rejected"])


def test_plan_table_and_bwd_lists_both_kernels(capsys):
    assert cli.main(["plan", "--gpu", "l4", "--head-dim", "64", "--kernel", "bwd"]) == 0
    out = capsys.readouterr().out
    assert "bwd_dkdv on NVIDIA L4 (101,376 B" in out and "bwd_dq on NVIDIA L4" in out and "rejected:" in out
    assert "warpspec needs a Hopper GPU" in out  # the L4 has no wgmma
    assert cli.main(["plan", "--gpu", "h200", "--head-dim", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:4] == ["128", "128", "4", "2"] and line.endswith("warpspec ping-pong") for line in lines)


def test_plan_errors_name_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--gpu", "h300", "--head-dim", "64"])
    assert exc.value.code == 2 and "known GPUs: a100-40gb" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--gpu", "h200", "--head-dim", "300"])
    assert exc.value.code == 2 and "--head-dim: must be in 1..256, got 300" in capsys.readouterr().err


def test_inspect_known_gpu_json(capsys):
    import json

    assert cli.main(["inspect", "--gpu", "a100-80gb", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["capability"] == [8, 0] and info["smem_per_block"] == 163 * 1024 and info["sm_count"] == 108


def test_inspect_without_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU message cannot show here")
    with pytest.raises(SystemExit) as exc:
        cli.main(["inspect"])
    assert exc.value.code == 2 and "no CUDA device is visible" in capsys.readouterr().err


def test_codegen_prints_a_variant(capsys):
    assert cli.main(["codegen", "--template", "bwd", "--causal", "--ragged"]) == 0
    out = capsys.readouterr().out
    assert "def _attn_bwd_dkdv(" in out and "causal=True, even_m=False, even_n=False" in out
    assert cli.main(["codegen", "--template", "fwd_ws", "--causal", "--pingpong"]) == 0
    out = capsys.readouterr().out
    assert "def _attn_fwd_ws(" in out and "PINGPONG = gl.constexpr(True)" in out and "pingpong=True" in out
    assert "PERSISTENT = gl.constexpr(False)" in out
    assert cli.main(["codegen", "--template", "fwd_ws", "--persistent"]) == 0
    out = capsys.readouterr().out
    assert "PERSISTENT = gl.constexpr(True)" in out and "persistent=True" in out and "pingpong=False" in out


def test_tune_on_cpu_writes_yaml_that_the_runtime_then_uses(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    import fa2tune
    from fa2tune import runtime, store

    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "no", "--kernel", "fwd"]
    assert cli.main([*args, "--config-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "say nothing about GPU speed" in out and "wrote" in out and "winner" in out
    _, entries = store.read_file(tmp_path / "cpu-interpreter.yaml")
    (entry,) = entries
    # each study's timed configs, fastest first: the winner leads its list
    (timed,) = [line for line in out.splitlines() if line.startswith("  fwd causal=False timed: ")]
    assert timed.removeprefix("  fwd causal=False timed: ").startswith(entry.config.label() + " ")
    assert entry.key == store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="fwd")
    assert entry.baseline["name"] == "planner-default" and entry.trials >= 1
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path))
    runtime.clear_cache()
    kernel = fa2tune.get_kernel(16, device="cpu")
    assert kernel.config == entry.config and kernel.source == str(tmp_path / "cpu-interpreter.yaml")
    assert cli.main(["show", "--device", "cpu", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert any(r.get("file") == str(tmp_path / "cpu-interpreter.yaml") and r.get("used") for r in shown["rows"])
    runtime.clear_cache()


def test_show_lists_the_length_bucket_configs_a_call_resolves(tmp_path, capsys, monkeypatch):
    # `fa2tune show` prints, beside the config of every length, the forward configs of the short and medium buckets
    # where the store has entries for them.
    if torch.cuda.is_available():
        pytest.skip("resolves for the CPU interpreter; on a GPU show reads the card")
    from fa2tune import codegen, runtime, store
    from fa2tune.types import KernelConfig

    configs = {
        "all": KernelConfig(32, 16, 4, 1),
        "short": KernelConfig(16, 16, 4, 1),
        "medium": KernelConfig(16, 32, 4, 2),
    }
    entries = []
    for bucket, cfg in configs.items():
        key = store.EntryKey(head_dim=64, dtype="bf16", causal=False, kernel="fwd", seqlen_bucket=bucket)
        entries.append(store.Entry(key=key, config=cfg, ms=1.0, tflops=None, baseline={}, trials=1, spread=None,
                                   triton_version="0", torch_version="0", date="2026-11-30",
                                   template_hash=codegen.entry_code_hash(key, cfg)))  # fmt: skip
    store.write_entries(tmp_path / "cpu-interpreter.yaml", {"name": "cpu", "slug": "cpu-interpreter"}, entries)
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path))
    runtime.clear_cache()
    try:
        assert cli.main(["show", "--device", "cpu", "--json"]) == 0
    finally:
        runtime.clear_cache()
    shown = json.loads(capsys.readouterr().out)
    (row,) = [r for r in shown["rows"] if r.get("resolved") and r["head_dim"] == 64 and not r["causal"]]
    assert row["fwd"] == configs["all"].to_dict()
    assert row["fwd_short"] == configs["short"].to_dict() and row["fwd_medium"] == configs["medium"].to_dict()
    assert row["medium_source"] == str(tmp_path / "cpu-interpreter.yaml")


def test_a_re_tune_times_the_config_the_file_holds_for_its_key(tmp_path, capsys, monkeypatch):
    # What the written file holds for the key (stale entries too: their config won under older templates) is each
    # study's incumbent: timed beside the candidates and shown as "before ms"; other keys' entries are not.
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    from dataclasses import replace

    from fa2tune import store, tunejob
    from fa2tune.types import KernelConfig

    path = tmp_path / "cpu-interpreter.yaml"
    held = KernelConfig(16, 64, 4, 1)
    entry = store.Entry(key=store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="fwd"), config=held,
                        ms=1.0, tflops=None, baseline={}, trials=1, spread=None, triton_version="0",
                        torch_version="0", template_hash="stale", date="2026-01-01")  # fmt: skip
    other = replace(entry, key=replace(entry.key, causal=True), config=KernelConfig(64, 16, 4, 1))
    store.write_entries(path, {"name": "cpu"}, [entry, other])
    seen = []
    real = tunejob.run_study
    monkeypatch.setattr(tunejob, "run_study", lambda spec, *a, **kw: seen.append(spec) or real(spec, *a, **kw))
    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "no", "--kernel", "fwd"]
    assert cli.main([*args, "--config-dir", str(tmp_path)]) == 0
    assert [s.incumbent for s in seen] == [held]
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("kernel causal"))
    header, row = lines[at : at + 2]  # the summary table's header and its one row; each study's timed list after
    winner = next(e for e in store.read_file(path)[1] if e.key == entry.key).config
    before_ms = row.split(winner.label())[1].split()[2]  # after the winner: ms, default ms, before ms
    assert "default ms before ms" in header and float(before_ms) > 0
    assert tunejob.incumbent(seen[0], tmp_path / "missing.yaml") is None
    (tmp_path / "bad.yaml").write_text("entries: [")
    assert tunejob.incumbent(seen[0], tmp_path / "bad.yaml") is None


def test_tune_one_backward_kernel_on_cpu(tmp_path):
    # after a change to one backward template only its entries are stale: `--kernel bwd_dq` tunes that one alone
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    from fa2tune import store

    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "1", "--causal", "no", "--kernel", "bwd_dq"]
    assert cli.main([*args, "--config-dir", str(tmp_path)]) == 0
    _, entries = store.read_file(tmp_path / "cpu-interpreter.yaml")
    assert [e.key.kernel for e in entries] == ["bwd_dq"]


def test_tune_window_and_varlen_variants_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    from fa2tune import store

    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "yes", "--kernel", "fwd"]
    assert cli.main([*args, "--window", "8,0", "--varlen", "--config-dir", str(tmp_path)]) == 0
    _, entries = store.read_file(tmp_path / "cpu-interpreter.yaml")
    assert [(e.key.window, e.key.varlen, e.key.causal) for e in entries] == [(True, True, True)]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--window", "-2,0"])  # a leading minus is a value here, not an unknown option
    assert exit_info.value.code == 2
    assert "expected LEFT,RIGHT with ints >= -1" in capsys.readouterr().err


@pytest.fixture
def studies_run(monkeypatch):
    """The StudySpec of every study a CPU `fa2tune tune` runs, in order (the studies still run)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    from fa2tune import tunejob

    seen = []
    real = tunejob.run_study
    monkeypatch.setattr(tunejob, "run_study", lambda spec, *a, **kw: seen.append(spec) or real(spec, *a, **kw))
    return seen


def test_tune_a_short_length_bucket_on_cpu(tmp_path, capsys, studies_run):
    from fa2tune import store

    seen = studies_run
    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "no", "--kernel", "fwd"]
    assert cli.main([*args, "--seqlen-bucket", "short", "--config-dir", str(tmp_path)]) == 0
    (spec,) = seen
    assert spec.seqlens == (512, 1024) and spec.variant == "short"  # its own lengths and its own Optuna study
    _, entries = store.read_file(tmp_path / "cpu-interpreter.yaml")
    assert [e.key.seqlen_bucket for e in entries] == ["short"]
    for bad in ("512,2048", "0", "a,b"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*args, "--seqlen-bucket", "short", "--seqlens", bad])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "serves lengths in (0, 1024]; --seqlens 512,2048 goes outside it" in err
    assert "comma-separated ints >= 1" in err
    # The medium bucket: its own default lengths, and none it does not serve.
    assert cli._tuning_lengths(None, "medium") == (2048, 4096)
    with pytest.raises(SystemExit):
        cli._tuning_lengths("1024,2048", "medium")
    assert "serves lengths in (1024, 4096]; --seqlens 1024,2048 goes outside it" in capsys.readouterr().err


def test_tune_all_beside_a_bucket_entry_is_timed_where_the_entry_serves(tmp_path, capsys, studies_run):
    seen = studies_run
    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "no", "--kernel", "fwd",
            "--config-dir", str(tmp_path)]  # fmt: skip
    assert cli.main([*args, "--seqlen-bucket", "short"]) == 0
    assert cli.main(args) == 0
    assert seen[-1].seqlens == (4096, 16384) and seen[-1].seqlen_bucket == "all"
    assert 'its "all" entry serves longer calls and is tuned at 4096,16384' in capsys.readouterr().out
    assert cli.main([*args, "--seqlens", "1024,2048"]) == 0  # lengths given: taken as they are, no note
    assert seen[-1].seqlens == (1024, 2048) and "serves longer calls" not in capsys.readouterr().out


def test_a_window_may_start_with_minus_one_without_the_equals_form():
    parse = lambda *argv: cli.build_parser().parse_args(cli._join_negative_values(list(argv)))
    assert parse("tune", "--head-dim", "64", "--window", "-1,0").window == (-1, 0)
    assert parse("tune", "--head-dim", "64", "--window=-1,0").window == (-1, 0)
    assert parse("tune", "--head-dim", "64", "--window", "128,0").window == (128, 0)
    with pytest.raises(SystemExit):  # an option after --window is still an option, not a window
        parse("tune", "--head-dim", "64", "--window", "--varlen")
