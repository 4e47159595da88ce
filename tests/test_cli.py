"""The `fa2tune` command line: thin, clear errors, non-zero exit codes when something is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fa2tune import cli
from fa2tune.cli.outputs import storage_file
from fa2tune.config import defaults
from fa2tune.config.types import KernelConfig
from fa2tune.tune import verification


def test_check_passes_and_prints_a_row_per_case(capsys, device):
    assert cli.main(["check", "--device", device, "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    # full, causal, window, varlen
    assert out.count(" ok") == 4 * len(verification.default_shapes(on_gpu=device != "cpu"))
    assert "window" in out and "varlen" in out


def test_check_fails_loudly_when_the_kernel_is_wrong(capsys, monkeypatch, device):
    real = verification.forward

    def off_by_a_little(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o * 1.01, lse

    monkeypatch.setattr(verification, "forward", off_by_a_little)
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
    fields = {"block_m", "block_n", "num_warps", "num_stages", "pipeline_qk", "warp_specialized", "pingpong",
              "fused_dq", "split_roles", "drain_before_dq", "pad_head_dim", "persistent", "programs_per_sm",
              "split_tail", "sram_bytes"}  # fmt: skip
    assert set(out["accepted"][0]) == fields
    # 5 need more shared memory than the H200 has at d=128 (three or four stages of 128-row K and V tiles), and
    # one more register than its consumers have (192 rows, 128-row K/V tiles); persistent, another 3 more shared
    # memory (three stages of 128-row tiles beside the O buffer); two an SM, only (64, 64) with 2 stages fits twice.
    # The same under Triton 3.9, whose extra registers (planner._TRITON_REGISTERS_BESIDE_EXTRA) take only what
    # spills: at B_c = 128 three consumers, which do not fit here anyway
    assert sum(r["warp_specialized"] for r in out["accepted"]) == 18 + 16 + 1
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
    assert cli.main(["codegen", "--template", "bwd_ws", "--fused-dq", "--drain-before-dq"]) == 0
    assert "drain_before_dq=True" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:  # the switch exists only with dQ fused in: said, not ignored
        cli.main(["codegen", "--template", "bwd_ws", "--drain-before-dq"])
    assert exited.value.code == 2 and "--drain-before-dq is a switch of --template bwd_ws with --fused-dq" in (
        capsys.readouterr().err
    )
    # a switch of other templates (or at a head dim it does not change, or beside one it excludes) would render the
    # same code as without it: said, not ignored
    assert cli.main(["codegen", "--template", "bwd_ws", "--pad-head-dim", "--head-dim", "112"]) == 0
    assert "qk_chunks=(128,)" in capsys.readouterr().out
    refused = [
        (["--template", "fwd", "--pad-head-dim"], "--pad-head-dim is a switch of --template fwd_ws or bwd_ws or "
         "bwd_dq_ws, got --template fwd"),
        (["--template", "bwd_dq_ws", "--pingpong"], "--pingpong is a switch of --template fwd_ws"),
        (["--template", "fwd_ws", "--ragged"], "--ragged is a switch of --template fwd or bwd"),
        (["--template", "fwd_ws", "--fused-dq"], "--fused-dq is a switch of --template bwd_ws"),
        (["--template", "fwd_ws", "--pad-head-dim"], "--pad-head-dim changes no chunk at --head-dim 128"),
        (["--template", "bwd_ws", "--split-roles", "--fused-dq"], "--split-roles takes neither"),
    ]  # fmt: skip
    for argv, said in refused:
        with pytest.raises(SystemExit) as exited:
            cli.main(["codegen", *argv])
        assert exited.value.code == 2 and said in capsys.readouterr().err


def test_tune_on_cpu_writes_yaml_that_the_runtime_then_uses(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    import fa2tune
    from fa2tune.api import attention_kernel
    from fa2tune.config import store

    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "no", "--kernel", "fwd"]
    assert cli.main([*args, "--config-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "say nothing about GPU speed" in err and "wrote" in out and "winner" in out  # notes on stderr
    assert "trial 1/2" in err and "trial" not in out  # progress too: stdout holds the report alone
    _, entries = store.read_file(tmp_path / "cpu-interpreter.yaml")
    (entry,) = entries
    # each study's timed configs, fastest first by their search readings, the winner among them (the finish times
    # the fastest again and picks by those readings, so under noise the winner need not lead)
    (timed,) = [line for line in out.splitlines() if line.startswith("  fwd causal=False timed: ")]
    listed = [item.rsplit(" ", 1) for item in timed.removeprefix("  fwd causal=False timed: ").split(", ")]
    readings = [float(ms) for _, ms in listed]
    assert readings == sorted(readings) and entry.config.label() in [label for label, _ in listed]
    assert entry.key == store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="fwd")
    assert entry.baseline["name"] == "planner-default" and entry.trials >= 1
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path))
    attention_kernel.clear_cache()
    kernel = fa2tune.get_kernel(16, device="cpu")
    assert kernel.config == entry.config and kernel.source == str(tmp_path / "cpu-interpreter.yaml")
    assert cli.main(["show", "--device", "cpu", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert any(r.get("file") == str(tmp_path / "cpu-interpreter.yaml") and r.get("used") for r in shown["rows"])
    attention_kernel.clear_cache()


def test_show_lists_the_length_bucket_configs_a_call_resolves(tmp_path, capsys, monkeypatch):
    # `fa2tune show` prints, beside the config of every length, the forward configs of the short and medium buckets
    # where the store has entries for them.
    if torch.cuda.is_available():
        pytest.skip("resolves for the CPU interpreter; on a GPU show reads the card")
    from fa2tune.api import attention_kernel
    from fa2tune.config import store
    from fa2tune.config.types import KernelConfig
    from fa2tune.kernels import codegen

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
    attention_kernel.clear_cache()
    try:
        assert cli.main(["show", "--device", "cpu", "--json"]) == 0
    finally:
        attention_kernel.clear_cache()
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

    from fa2tune.config import store
    from fa2tune.config.types import KernelConfig
    from fa2tune.tune import job

    path = tmp_path / "cpu-interpreter.yaml"
    held = KernelConfig(16, 64, 4, 1)
    entry = store.Entry(key=store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="fwd"), config=held,
                        ms=1.0, tflops=None, baseline={}, trials=1, spread=None, triton_version="0",
                        torch_version="0", template_hash="stale", date="2026-01-01")  # fmt: skip
    other = replace(entry, key=replace(entry.key, causal=True), config=KernelConfig(64, 16, 4, 1))
    store.write_entries(path, {"name": "cpu"}, [entry, other])
    seen = []
    real = job.run_study
    monkeypatch.setattr(job, "run_study", lambda spec, *a, **kw: seen.append(spec) or real(spec, *a, **kw))
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
    assert job.incumbent(seen[0], tmp_path / "missing.yaml") is None
    # A key with no entry of its own starts from the same-cost dtype's entry (what its calls run until it has one),
    # and the file's own entry wins over it.
    assert job.incumbent(replace(seen[0], dtype="fp16"), path) == (winner, "the stored bf16 config", None)
    fp16_held = KernelConfig(32, 32, 4, 1)
    store.write_entries(path, {"name": "cpu"}, [replace(entry, key=replace(entry.key, dtype="fp16"), config=fp16_held)])
    assert job.incumbent(replace(seen[0], dtype="fp16"), path) == (fp16_held, "the stored config", None)
    assert job.incumbent(replace(seen[0], dtype="fp32"), path) is None  # fp32 has no same-cost dtype
    (tmp_path / "bad.yaml").write_text("entries: [")
    assert job.incumbent(seen[0], tmp_path / "bad.yaml") is None


def test_tune_decode_on_cpu_writes_an_entry_that_decode_calls_then_run(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune --kernel decode` is a real tune")
    import fa2tune
    from fa2tune.api import selection
    from fa2tune.config import store
    from fa2tune.kernels import codegen
    from fa2tune.launch import decode as decode_launch

    path = tmp_path / "cpu-interpreter.yaml"
    args = ["tune", "--device", "cpu", "--head-dim", "16", "--kernel", "decode", "--trials", "1"]
    assert cli.main([*args, "--config-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert f"wrote {path}" in out and "cpu-interpreter/decode/d16/bf16: " in out and "timed: " in out
    assert "say nothing about GPU speed" in err and "config 1/1" in err  # notes and progress on stderr
    (entry,) = store.read_file(path)[1]
    assert entry.key == store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="decode")
    assert entry.template_hash == codegen.decode_code_hash() and entry.trials == 1 and entry.ms > 0
    assert entry.baseline["name"] == "planner-default" and entry.gbps is None and entry.tflops is None
    # A decode call of the key runs the stored config: looked up for a new call signature, from the file's path
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path))
    assert selection.resolve_decode("cpu", 16, torch.bfloat16) == (entry.config, str(path))
    seen, real = [], decode_launch._plan
    monkeypatch.setattr(decode_launch, "_plan", lambda *a: seen.append(a[-1]) or real(*a))
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 16, dtype=torch.bfloat16) for _ in "kv")
    fa2tune.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([7, 40], dtype=torch.int32))
    assert seen == [entry.config]
    # A flag of the attention kernels' studies, and heads that do not group, end the command before any timing
    for extra, said in ((["--causal", "yes"], "--causal: not for --kernel decode"),
                        (["--heads", "6"], "--kv-heads must divide --heads")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            cli.main([*args, *extra])
        assert exc.value.code == 2 and said in capsys.readouterr().err


def test_tune_one_backward_kernel_on_cpu(tmp_path):
    # after a change to one backward template only its entries are stale: `--kernel bwd_dq` tunes that one alone
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    from fa2tune.config import store

    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "1", "--causal", "no", "--kernel", "bwd_dq"]
    assert cli.main([*args, "--config-dir", str(tmp_path)]) == 0
    _, entries = store.read_file(tmp_path / "cpu-interpreter.yaml")
    assert [e.key.kernel for e in entries] == ["bwd_dq"]


def test_tune_window_and_varlen_variants_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    from fa2tune.config import store

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
    from fa2tune.tune import job

    seen = []
    real = job.run_study
    monkeypatch.setattr(job, "run_study", lambda spec, *a, **kw: seen.append(spec) or real(spec, *a, **kw))
    return seen


def test_tune_at_a_models_heads_writes_grouped_entries_that_gqa_calls_read_first(tmp_path, capsys, studies_run,
                                                                                 monkeypatch):  # fmt: skip
    from fa2tune.api import attention_kernel, selection
    from fa2tune.config import store
    from fa2tune.config.types import Mask

    seen = studies_run
    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "1", "--causal", "no", "--kernel", "fwd",
            "--config-dir", str(tmp_path)]  # fmt: skip
    assert cli.main([*args, "--heads", "4", "--kv-heads", "2"]) == 0
    assert "grouped-query entries, timed at 4 query heads over 2 K/V heads" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "grouped-query" not in capsys.readouterr().out
    grouped, plain = seen
    assert (grouped.heads, grouped.kv_heads, grouped.group, grouped.variant) == (4, 2, 2, "gqa4x2")
    assert grouped.study_name(selection.device_info("cpu")).endswith("/gqa4x2")
    assert plain.variant == "" and plain.group == 1
    path = tmp_path / "cpu-interpreter.yaml"
    entries = {e.key.gqa: e for e in store.read_file(path)[1]}
    assert sorted(entries) == [False, True] and entries[False].heads is None
    assert entries[True].heads == [2, 1]  # what the interpreter timed: a group of 2, its shapes small
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path))
    attention_kernel.clear_cache()
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    assert selection.config_for(None, "fwd", q, k, k, Mask(), None) == entries[True].config
    assert selection.config_for(None, "fwd", q, q, q, Mask(), None) == entries[False].config
    # `show` marks both used, and says what GQA calls resolve beside what MHA calls do
    capsys.readouterr()
    assert cli.main(["show", "--device", "cpu", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    stored = [r for r in rows if not r.get("resolved") and r["head_dim"] == 16 and r["kernel"] == "fwd"]
    assert sorted((r["gqa"], r["used"]) for r in stored) == [(False, True), (True, True)]
    resolved = {r.get("gqa", False): r for r in rows if r.get("resolved") and r["head_dim"] == 16 and not r["causal"]}
    assert resolved[True]["fwd"] == entries[True].config.to_dict() and resolved[True]["source"] == str(path)
    assert resolved[False]["fwd"] == entries[False].config.to_dict()
    # --heads alone times MHA calls at those heads: a plain entry; K/V heads that do not divide end the command
    assert cli.main([*args, "--heads", "2"]) == 0 and seen[-1].key.gqa is False and seen[-1].heads == 2
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--kv-heads", "3"])
    assert exit_info.value.code == 2
    assert "--kv-heads must divide --heads (query heads share K/V heads in groups), got --heads 128 and --kv-heads 3 " \
           "(--heads defaults to 2048 // d)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--heads", "70000", "--kv-heads", "1"])
    assert exit_info.value.code == 2 and "take at most 65535 heads" in capsys.readouterr().err


def test_tune_a_short_length_bucket_on_cpu(tmp_path, capsys, studies_run):
    from fa2tune.config import store

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
    assert cli.tune_command._tuning_lengths(None, "medium") == (2048, 4096)
    with pytest.raises(SystemExit):
        cli.tune_command._tuning_lengths("1024,2048", "medium")
    assert "serves lengths in (1024, 4096]; --seqlens 1024,2048 goes outside it" in capsys.readouterr().err


def test_tune_all_beside_a_bucket_entry_is_timed_where_the_entry_serves(tmp_path, capsys, studies_run):
    seen = studies_run
    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "no", "--kernel", "fwd",
            "--config-dir", str(tmp_path)]  # fmt: skip
    assert cli.main([*args, "--seqlen-bucket", "short"]) == 0
    assert cli.main(args) == 0
    assert seen[-1].seqlens == (4096, 16384) and seen[-1].seqlen_bucket == "all"
    assert 'its "all" entry serves longer calls and is tuned at 4096,16384' in capsys.readouterr().err
    assert cli.main([*args, "--seqlens", "1024,2048"]) == 0  # lengths given: taken as they are, no note
    assert seen[-1].seqlens == (1024, 2048) and "serves longer calls" not in capsys.readouterr().err


def test_a_tune_without_timeout_shares_one_run_budget_among_its_studies(tmp_path, studies_run):
    # one fwd study takes the whole budget, a share of the run's wall time (its builds count); --timeout, where
    # given, is each study's own, counted from its first reading
    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "1", "--causal", "no", "--kernel", "fwd",
            "--config-dir", str(tmp_path)]  # fmt: skip
    assert cli.main(args) == 0
    assert studies_run[-1].timeout_s == cli.arguments.RUN_BUDGET_S and studies_run[-1].timeout_counts_builds
    assert cli.main([*args, "--timeout", "15"]) == 0
    assert studies_run[-1].timeout_s == 15 and not studies_run[-1].timeout_counts_builds
    # `--kernel all` with both masks: six studies, a sixth each; never below the shortest timeout a study can use
    assert cli.arguments.study_timeout(None, 6) == cli.arguments.RUN_BUDGET_S / 6
    assert cli.arguments.study_timeout(None, 10**6) == cli.arguments.MIN_TIMEOUT_S
    assert cli.arguments.study_timeout(30.0, 6) == 30.0


def test_a_window_may_start_with_minus_one_without_the_equals_form():
    parse = lambda *argv: cli.build_parser().parse_args(cli.parser.join_negative_values(list(argv)))
    assert parse("tune", "--head-dim", "64", "--window", "-1,0").window == (-1, 0)
    assert parse("tune", "--head-dim", "64", "--window=-1,0").window == (-1, 0)
    assert parse("tune", "--head-dim", "64", "--window", "128,0").window == (128, 0)
    with pytest.raises(SystemExit):  # an option after --window is still an option, not a window
        parse("tune", "--head-dim", "64", "--window", "--varlen")


@pytest.fixture
def fake_timing(monkeypatch):
    """CPU tunes timed by a cost table instead of the interpreter's clock, so winners are deterministic:
    costs[cfg] ms for a config in it, costs[None] for any other; timed: every config timed, in order. With
    interrupt_at = (study, timing), that timing of that study (both counted from 1) raises KeyboardInterrupt."""
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    from types import SimpleNamespace

    from fa2tune.tune import workload

    fake = SimpleNamespace(costs={None: 1.0}, timed=[], interrupt_at=None, studies=0)

    def make_measure(*args, **kwargs):
        fake.studies += 1  # one objective per study
        study, timings = fake.studies, []

        def measure(cfg):
            fake.timed.append(cfg)
            timings.append(cfg)
            if fake.interrupt_at == (study, len(timings)):
                raise KeyboardInterrupt
            return fake.costs.get(cfg, fake.costs[None])

        measure.spread = lambda cfg: None
        return measure

    monkeypatch.setattr(workload, "make_measure", make_measure)
    return fake


_CPU_TUNE = ["tune", "--device", "cpu", "--head-dim", "16", "--causal", "no", "--kernel", "fwd"]


def test_a_small_re_tune_keeps_the_stored_winner_unless_it_times_a_faster_one(tmp_path, capsys, fake_timing):
    # A `--trials 1` re-tune after a `--trials 3` one timed only the default and replaced the stored winner, 4x
    # faster, by it. The stored config is timed in every re-tune, whatever its budget, and the faster one is kept.
    from fa2tune.config import store

    default = defaults.INTERPRETER_CONFIG  # the CPU's default config
    fake_timing.costs.update({None: 1.0, default: 4.0})
    args = [*_CPU_TUNE, "--config-dir", str(tmp_path)]
    stored = lambda: store.read_file(tmp_path / "cpu-interpreter.yaml")[1][0].config
    assert cli.main([*args, "--trials", "3"]) == 0
    winner = stored()
    assert winner != default
    capsys.readouterr()
    fake_timing.timed.clear()
    assert cli.main([*args, "--trials", "1"]) == 0
    assert winner in fake_timing.timed and stored() == winner
    assert f"fwd causal=False: kept the stored config {winner.label()} (1.000 ms" in capsys.readouterr().out
    fake_timing.costs[default] = 0.5  # now the default is faster: it replaces the stored winner
    assert cli.main([*args, "--trials", "1"]) == 0
    assert stored() == default
    note = f"replaced the stored config {winner.label()} (1.000 ms) by {default.label()} (0.500 ms)"
    assert note in capsys.readouterr().out


def _exit_code(argv: list[str]) -> int:
    """cli.main's exit code, whether it returns it or exits with it."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.fixture
def no_study(monkeypatch):
    """Fails a test whose command starts a study: argument checks must come before any timing."""
    from fa2tune.tune import job, workers

    def run_study(*args, **kwargs):
        raise AssertionError("a study started")

    monkeypatch.setattr(job, "run_study", run_study)
    monkeypatch.setattr(workers, "run_parallel_many", run_study)


@pytest.mark.parametrize(
    "where, says",
    [
        ("a-file", "a-file is a file, not a directory"),
        ("a-file/configs", "a-file is a file, not a directory"),
        ("yaml-is-a-dir", "cpu-interpreter.yaml is a directory, not a file"),
        ("/proc/fa2tune-configs", "cannot create or write in /proc/fa2tune-configs"),
    ],
)
def test_a_config_dir_that_cannot_be_written_stops_the_tune_before_any_timing(tmp_path, capsys, no_study, where,
                                                                               says):  # fmt: skip
    # It failed only after the whole tune, with a 18-34 line traceback.
    if where.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "yaml-is-a-dir" / "cpu-interpreter.yaml").mkdir(parents=True)
    config_dir = where if where.startswith("/") else str(tmp_path / where)
    assert _exit_code([*_CPU_TUNE, "--trials", "1", "--config-dir", config_dir]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"fa2tune: --config-dir {config_dir}: ") and says in line and captured.out == ""


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--trials", "0", "argument --trials: expected an integer >= 1, got '0'"),
        ("--trials", "-3", "expected an integer >= 1, got '-3'"),
        ("--timeout", "0", "argument --timeout: expected seconds >= 10"),
        ("--timeout", "-1", "expected seconds >= 10"),
        ("--timeout", "nan", "got 'nan'"),
        ("--timeout", "5", "got '5'"),
        ("--storage", "foo", "argument --storage: expected a database URL (sqlite:///PATH, postgresql://..."),
        ("--storage", "sqlite:/t.db", "a URL needs '://'"),
        ("--storage", "mysqlx://host/db", "unknown scheme 'mysqlx'"),
        ("--storage", "sqlite://", "in-memory database"),
        ("--storage", "", "or a journal file path ending in .journal or .log, got ''"),
        ("--storage", "a-file/t.journal", "--storage a-file/t.journal: a-file is a file, not a directory"),
        ("--tokens", "0", "argument --tokens: expected an integer >= 1"),
        ("--jobs", "-1", "argument --jobs: expected an integer >= 1"),
        ("--device", "gpu", "argument --device: expected cpu, cuda or cuda:N, got 'gpu'"),
        ("--device", "cpu,", "expected cpu, cuda or cuda:N, got ''"),
        ("--device", "cpu,cuda:0", "cpu and CUDA devices cannot share a tune"),
        ("--device", "cuda:1,cuda:1", "each GPU at most once"),
        ("--head-dim", "-8", "argument --head-dim: must be in 1..256, got -8"),
        ("--head-dim", "300", "must be in 1..256, got 300"),
        ("--head-dim", "sixteen", "must be an integer in 1..256, got 'sixteen'"),
        ("--dtype", "float16", "argument --dtype: invalid choice: 'float16'"),
        ("--kernel", "attn", "argument --kernel: invalid choice: 'attn'"),
        ("--seqlens", "1,,2", "--seqlens must be comma-separated ints >= 1, got '1,,2'"),
        ("--window", "5", "argument --window: expected LEFT,RIGHT"),
    ],
)
def test_a_bad_tune_argument_is_one_line_and_exit_code_2_before_any_work(tmp_path, capsys, monkeypatch, no_study,
                                                                         flag, value, says):  # fmt: skip
    # Unchecked before the work, `--trials 0` and a tiny `--timeout` fail after the study ("no config could be
    # measured", 19 lines), `--storage foo` makes a journal file ./foo, `--device gpu` exits 1, and argparse's
    # errors take 8 lines.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    args = [*_CPU_TUNE, "--trials", "1", "--config-dir", str(tmp_path / "out"), flag, value]
    assert _exit_code(args) == 2
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1 and says in captured.err and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing created: no ./foo, no out/


def test_the_storage_rule_takes_database_urls_and_journal_files():
    parse = lambda value: cli.build_parser().parse_args(["tune", "--head-dim", "64", "--storage", value]).storage
    for value in ("sqlite:///t.db", "sqlite:////abs/t.db", "postgresql+psycopg2://u:p@host:5432/db",
                  "mysql://u@host/db", "t.journal", "runs/t.log", "/abs/t.journal"):  # fmt: skip
        assert parse(value) == value
    assert storage_file("sqlite:////abs/t.db") == Path("/abs/t.db")
    assert storage_file("sqlite:///t.db?timeout=9") == Path("t.db")
    assert storage_file("postgresql://host/db") is None and storage_file("t.log") == Path("t.log")


def test_check_and_show_take_the_same_device_names(capsys):
    for command in ("check", "show"):
        assert _exit_code([command, "--device", "gpu"]) == 2  # a usage error, not a failed check (1)
        err = capsys.readouterr().err
        said = f"fa2tune {command}: argument --device: expected cpu, cuda or cuda:N, got 'gpu'"
        assert err == f"{said} (see fa2tune {command} --help)\n"


def _running_and_failed(storage: str) -> tuple[int, list]:
    import optuna

    from fa2tune.tune import study_storage

    opened = study_storage.open_storage(storage)
    (summary,) = optuna.get_all_study_summaries(opened)
    trials = optuna.load_study(study_name=summary.study_name, storage=opened).get_trials()
    running = sum(t.state == optuna.trial.TrialState.RUNNING for t in trials)
    return running, [t.user_attrs.get("reason") for t in trials if t.state == optuna.trial.TrialState.FAIL]


def _last_line_after_notes(err: str) -> str:
    """The last line of a command's stderr, after checking that every line before it is a note or progress."""
    *before, last = err.splitlines()
    assert all(line.startswith(("note: ", "  ")) for line in before), before
    return last


def test_ctrl_c_in_a_tune_is_one_line_exit_130_and_says_what_was_kept(tmp_path, capsys, fake_timing):
    # Ctrl-C printed a 69-line traceback (170 with workers) and left the trial it interrupted RUNNING.
    from fa2tune.config import store

    journal = tmp_path / "studies" / "t.journal"
    args = [*_CPU_TUNE, "--trials", "3", "--config-dir", str(tmp_path)]
    fake_timing.interrupt_at = (1, 2)  # in the second config's timing
    assert cli.main(args) == 130
    assert _last_line_after_notes(capsys.readouterr().err) == "fa2tune: interrupted; nothing written"
    fake_timing.studies = 0
    assert cli.main([*args, "--storage", str(journal)]) == 130
    said = f"fa2tune: interrupted; nothing written; 1 timed trial kept in {journal} (the same command reuses them)"
    assert _last_line_after_notes(capsys.readouterr().err) == said
    assert _running_and_failed(str(journal)) == (0, ["interrupted"])  # the interrupted trial told, not left RUNNING
    # The second study interrupted: the first one's entry is written, and said so.
    fake_timing.studies = 0
    fake_timing.interrupt_at = (2, 1)  # the first timing of the second study
    assert cli.main([*args, "--causal", "both"]) == 130
    yaml = tmp_path / "cpu-interpreter.yaml"
    assert _last_line_after_notes(capsys.readouterr().err) == f"fa2tune: interrupted; 1 entry written to {yaml}"
    assert len(store.read_file(yaml)[1]) == 1


@pytest.mark.slow
def test_ctrl_c_while_workers_time_ends_every_process_of_the_tune_with_one_line(tmp_path):
    # Ctrl-C at a terminal (SIGINT to the whole process group) during a two-worker tune ends it with one line, exit
    # code 130 and no process left, not with tracebacks from the main process and from each worker (170 lines).
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    if not Path("/proc/self/environ").exists():
        pytest.skip("finds the tune's processes through /proc")
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    mark = f"FA2TUNE_TEST_RUN={uuid.uuid4().hex}"  # in the environment of every process the tune starts
    env = {**os.environ, mark.split("=")[0]: mark.split("=")[1]}
    args = ["tune", "--device", "cpu,cpu", "--head-dim", "16", "--trials", "5", "--kernel", "all",
            "--config-dir", str(tmp_path)]  # fmt: skip
    tune = subprocess.Popen([sys.executable, "-m", "fa2tune", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True)  # fmt: skip
    said, deadline = b"", time.time() + 240
    while b" best " not in said and time.time() < deadline:  # a worker has timed a trial: the workers are at work
        said += os.read(tune.stderr.fileno(), 4096) or b""  # progress goes to stderr
        assert tune.poll() is None, said
    os.killpg(tune.pid, signal.SIGINT)
    out, err = tune.communicate(timeout=120)
    lines = (said + err).decode().splitlines()
    assert tune.returncode == 130, lines
    assert lines[-1].startswith("fa2tune: interrupted; nothing written; ") and "timed trial" in lines[-1], lines
    # no traceback from any process: before the last line, only the notes and the progress lines
    assert out == b"" and lines[0].startswith("note: --device cpu"), lines
    assert all(line.startswith(("note: ", "  cpu")) or "studies shared by" in line for line in lines[:-1]), lines

    def left() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return pids

    deadline = time.time() + 20  # the fork server sees its client gone and exits
    while left() and time.time() < deadline:
        time.sleep(0.2)
    assert left() == []


def test_a_tune_over_several_devices_lists_what_every_worker_timed(tmp_path, capsys, monkeypatch):
    # each worker process times trials of one shared study; the process that finishes it has none of its own, and
    # the report listed nothing as timed (and --json no trials) where the table counted them
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune (scripts/gpu-tests.sh skips it)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    args = ["tune", "--device", "cpu,cpu", "--head-dim", "16", "--trials", "2", "--kernel", "fwd", "--causal", "no",
            "--config-dir", str(tmp_path / "cfg"), "--json"]  # fmt: skip
    assert cli.main(args) == 0
    (study,) = json.loads(capsys.readouterr().out)["studies"]
    assert study["timed"] == 2 and len(study["trials"]) == 2, study
    assert sorted(t["ms"] for t in study["trials"]) == [t["ms"] for t in study["trials"]]  # fastest first


_POOL_INTERRUPTED = """
import sys, time
from fa2tune.tune import compile_pool
from fa2tune.config import planner
from fa2tune.config.types import KernelConfig, Mask
import torch

if __name__ == "__main__":
    pool = compile_pool.CompilePool(2)
    configs = [KernelConfig(m, n, 4, 1) for m in (64, 128) for n in (64, 128)]
    pool.start("fwd", 16, torch.bfloat16, Mask(), configs, seqlens=(64,), device="cpu")
    print("compiling", flush=True)
    try:
        time.sleep(600)
    except KeyboardInterrupt:  # what `fa2tune tune` does with its pool on Ctrl-C
        pool.release()
        pool.close()
        sys.exit(130)
"""


@pytest.mark.slow
def test_ctrl_c_while_the_compile_pool_compiles_lets_it_go_without_a_traceback(tmp_path):
    # A single-GPU tune's compile processes take Ctrl-C too: unhandled, each dies in its compile with a traceback,
    # and the pool, left waiting for those compiles' results, never closes (the tune hangs until killed).
    if not Path("/proc/self/environ").exists():
        pytest.skip("a POSIX process group")
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(_POOL_INTERRUPTED)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             start_new_session=True)  # fmt: skip
    assert child.stdout.readline() == b"compiling\n"
    import time

    time.sleep(3)  # the pool's processes are in their first compiles
    os.killpg(child.pid, signal.SIGINT)
    try:
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    assert child.returncode == 130 and err == b""


def test_version_names_fa2tune_triton_and_torch(capsys):
    import importlib.metadata

    import fa2tune

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    out = capsys.readouterr().out.strip()
    assert exc.value.code == 0 and out.startswith(f"fa2tune {fa2tune.__version__} (triton ")
    assert f"torch {importlib.metadata.version('torch')}" in out


def test_every_option_of_every_command_has_help():
    import argparse

    def options(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, f"{path} {name}")
            else:
                yield path, action

    found = list(options(cli.build_parser(), "fa2tune"))
    assert {path for path, _ in found} >= {f"fa2tune {c}" for c in ("check", "tune", "bench", "plan", "show")}
    missing = [f"{path} {'/'.join(action.option_strings)}" for path, action in found if not action.help]
    assert missing == []


def test_check_json_holds_a_result_per_case(capsys, device):
    assert cli.main(["check", "--device", device, "--dtype", "fp16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True and data["failed"] == 0
    assert len(data["results"]) == 4 * len(verification.default_shapes(on_gpu=device != "cpu"))
    first = data["results"][0]
    assert first["dtype"] == "fp16" and first["mask"] == "full" and 0 <= first["rel_err"] < 2e-3 and first["passed"]


def test_tune_json_holds_each_studys_winner_as_written(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU pipeline test; on a GPU `fa2tune tune` is a real tune")
    from fa2tune.config import store

    args = ["tune", "--device", "cpu", "--head-dim", "16", "--trials", "2", "--causal", "no", "--kernel", "fwd"]
    assert cli.main([*args, "--config-dir", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)  # progress and notes stay on stderr
    (entry,) = store.read_file(tmp_path / "cpu-interpreter.yaml")[1]
    (study,) = data["studies"]
    assert data["config_file"] == str(tmp_path / "cpu-interpreter.yaml") and "trial 1/2" in err
    assert (study["kernel"], study["causal"], study["winner"]) == ("fwd", False, entry.config.to_dict())
    # the winner is one of the study's trials (which one depends on the re-timing of the best, on a CPU a toss-up)
    assert study["winner"] in [trial["config"] for trial in study["trials"]] and study["ms"] > 0


def test_messages_go_to_the_fa2tune_logger_and_can_be_silenced(capsys, caplog):
    # The command's notes and progress are records of the "fa2tune" logger: --quiet leaves only results on the
    # command line, and a program that calls the library sets the logger's level as for any library.
    import logging

    from fa2tune.bench import measure, providers
    from fa2tune.bench.shapes import Shape

    argv = ["bench", "--device", "cpu", "--batch", "1", "--heads", "1", "--seqlen", "8", "--head-dim", "8",
            "--mode", "fwd", "--causal", "no", "--providers", "sdpa_math"]  # fmt: skip
    for quiet in (["--quiet", *argv], [*argv, "-q"]):  # before the command or among its options
        assert cli.main(quiet) == 0
        out, err = capsys.readouterr()
        assert err == "" and "sdpa_math" in out
    assert cli.main(argv) == 0
    assert "[1/1] fwd bf16 B=1 H=1 N=8 d=8" in capsys.readouterr().err
    chosen = [providers.PROVIDERS["sdpa_math"]]
    shape = Shape(1, 1, 1, 8, 8, False, "fp32", "fwd")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fa2tune"):
        measure.measure([shape], chosen, "cpu")
    assert [r.name for r in caplog.records] == ["fa2tune.bench"]
    caplog.clear()
    capsys.readouterr()
    logger = logging.getLogger("fa2tune")
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)  # what a library user writes to silence it
        measure.measure([shape], chosen, "cpu")
    finally:
        logger.setLevel(level)
    assert caplog.records == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize("triton, numpy, refused", [("3.6.0", "2.4.0", True), ("3.6.0", "2.3.5", False),
                                                    ("3.9.0", "2.4.0", False)])  # fmt: skip
def test_device_cpu_refuses_a_numpy_that_tritons_interpreter_fails_on(triton, numpy, refused, capsys, monkeypatch):
    # `pip install .` pulls the newest numpy, on which Triton 3.6's interpreter fails deep inside a kernel launch
    # ("only 0-dimensional arrays can be converted to Python scalars"): --device cpu says what to install instead.
    import importlib.metadata

    real = importlib.metadata.version
    installed = {"triton": triton, "numpy": numpy}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed.get(name) or real(name))
    if not refused:
        assert cli.main(["show", "--device", "cpu", "--json"]) == 0
        return
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"in Triton {triton} fails on numpy {numpy}" in err
    assert "pip install 'numpy<2.4'" in err and "fa2tune[cpu]" in err


def test_without_config_dir_a_tune_writes_where_calls_look_first(tmp_path, capsys, monkeypatch, fake_timing):
    # With $FA2TUNE_CONFIG_DIR set, a tune without --config-dir wrote to the user cache, behind the file calls read
    # first: an entry there for the key kept running and the new winner never did. It writes there now, timing that
    # file's entry as the incumbent, and a blocked place is named as the variable.
    import warnings

    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "deployed"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the directory it creates is not one "that does not exist"
        assert cli.main([*_CPU_TUNE, "--trials", "1"]) == 0
    assert (tmp_path / "deployed" / "cpu-interpreter.yaml").is_file()
    assert not (tmp_path / "cache" / "fa2tune" / "configs").exists()
    capsys.readouterr()
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    assert _exit_code([*_CPU_TUNE, "--trials", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"fa2tune: $FA2TUNE_CONFIG_DIR {tmp_path / 'a-file'}: ")


def test_a_tune_writes_through_a_linked_config_file_and_checks_its_lock_first(tmp_path, capsys, no_study,
                                                                              fake_timing):  # fmt: skip
    # A <gpu>.yaml linked from a shared place was replaced by a copy beside the link (the shared file kept its old
    # entries); a directory in the lock file's place failed the tune after all its timing, with a traceback.
    from fa2tune.config import store

    shared, deployed = tmp_path / "shared", tmp_path / "deployed"
    shared.mkdir(), deployed.mkdir()
    (deployed / "cpu-interpreter.yaml").symlink_to(shared / "cpu-interpreter.yaml")
    (shared / "cpu-interpreter.yaml.lock").mkdir()
    assert _exit_code([*_CPU_TUNE, "--trials", "1", "--config-dir", str(deployed)]) == 2
    assert "cpu-interpreter.yaml.lock is a directory, not the file the writer locks" in capsys.readouterr().err
    (shared / "cpu-interpreter.yaml.lock").rmdir()
    entry = store.Entry(key=store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="fwd"),
                        config=KernelConfig(16, 16, 4, 1), ms=1.0, tflops=None, baseline={}, trials=1, spread=None,
                        triton_version="0", torch_version="0", date="2026-12-05", template_hash="0")  # fmt: skip
    store.write_entries(deployed / "cpu-interpreter.yaml", {"name": "cpu", "slug": "cpu-interpreter"}, [entry])
    assert (deployed / "cpu-interpreter.yaml").is_symlink()
    assert len(store.read_file(shared / "cpu-interpreter.yaml")[1]) == 1


@pytest.mark.parametrize(
    "argv, says",
    [
        ([*_CPU_TUNE, "--config-dir", ""], "--config-dir: an empty path (an unset variable?)"),
        (["codegen", "--template", "fwd_ws", "--head-dim", "0"], "argument --head-dim: must be in 1..256, got 0"),
        (["show", "--gpu", "h200", "--device", "cuda:1"], "argument --device: not allowed with argument --gpu"),
        (["bench", "--device", "cpu", "--csv", "."], "--csv .: . is a directory, not a file"),
        (["bench", "--device", "cpu", "--merge-into", "notes.txt"], "--merge-into notes.txt: not a benchmark CSV"),
        (["bench", "--from-csv", "missing.csv"], "--from-csv missing.csv: no such file"),
        ([*_CPU_TUNE, "--trials", "1", "--config-dir", "out", "--storage", "notes.log"],
         "--storage notes.log: notes.log exists and is not an Optuna journal"),
    ],
)
def test_flags_that_would_fail_after_the_work_are_refused_before_it(argv, says, tmp_path, capsys, monkeypatch,
                                                                    no_study):  # fmt: skip
    # each failed after the work with a traceback, or lost it: an empty --config-dir wrote to the cache without a
    # word, a --merge-into that was not a bench CSV was overwritten
    from fa2tune.bench import measure

    monkeypatch.chdir(tmp_path)
    for name in ("notes.txt", "notes.log"):
        (tmp_path / name).write_text("my notes\n")
    monkeypatch.setattr(measure, "measure", lambda *args: pytest.fail("measured"))
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    assert says in captured.err and len(captured.err.splitlines()) <= 3 and captured.out == ""
    assert all((tmp_path / name).read_text() == "my notes\n" for name in ("notes.txt", "notes.log"))


def test_show_json_writes_a_nan_as_null(tmp_path, capsys, monkeypatch):
    # JSON has no NaN: an entry's tflops of .nan came out as NaN, which strict parsers refuse. The store now skips
    # such an entry (a measure no tune gives), and the JSON writer itself writes NaN and infinities as null.
    from fa2tune.cli.common import to_json
    from fa2tune.config import store

    strict = lambda text: json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert strict(to_json({"a": [float("nan"), float("inf"), 1.5]})) == {"a": [None, None, 1.5]}

    entry = store.Entry(key=store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="fwd"),
                        config=KernelConfig(16, 16, 4, 1), ms=1.0, tflops=float("nan"), baseline={}, trials=1,
                        spread=None, triton_version="0", torch_version="0", date="2026-12-05",
                        template_hash="0")  # fmt: skip
    store.write_entries(tmp_path / "nvidia-h200.yaml", {"name": "NVIDIA H200", "slug": "nvidia-h200"}, [entry])
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="tflops must be a finite number >= 0"):
        assert cli.main(["show", "--gpu", "h200", "--json"]) == 0
    shown = strict(capsys.readouterr().out)
    assert [r for r in shown["rows"] if r.get("file") == str(tmp_path / "nvidia-h200.yaml") and "tflops" in r] == []


def test_show_marks_used_what_lookup_uses(tmp_path, capsys, monkeypatch):
    # "used" was only "no earlier file has the key": a stale entry in $FA2TUNE_CONFIG_DIR showed as used while calls
    # ran the cache's entry (lookup skips stale ones and moves down the path), and a config the planner rejects for
    # the device showed as used too; a <gpu>.yaml that is a directory got no row at all.
    from fa2tune.config import store
    from fa2tune.kernels import codegen

    key = store.EntryKey(head_dim=16, dtype="bf16", causal=False, kernel="fwd")
    big = store.EntryKey(head_dim=16, dtype="bf16", causal=True, kernel="fwd")

    def entry(key, cfg, stale=False):
        return store.Entry(key=key, config=cfg, ms=1.0, tflops=None, baseline={}, trials=1, spread=None,
                           triton_version="0", torch_version="0", date="2026-12-05",
                           template_hash="0" if stale else codegen.entry_code_hash(key, cfg))  # fmt: skip

    device = {"name": "cpu", "slug": "cpu-interpreter"}
    store.write_entries(tmp_path / "env" / "cpu-interpreter.yaml", device,
                        [entry(key, KernelConfig(16, 16, 4, 1), stale=True),
                         entry(big, KernelConfig(256, 256, 8, 4))])  # fmt: skip
    store.write_entries(tmp_path / "cache" / "fa2tune" / "configs" / "cpu-interpreter.yaml", device,
                        [entry(key, KernelConfig(32, 32, 4, 1)), entry(big, KernelConfig(16, 16, 4, 1))])  # fmt: skip
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.main(["show", "--device", "cpu", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if "used" in r]
    used = {(r["file"].startswith(str(tmp_path / "env")), r["causal"]): (r["used"], r.get("why_not", "")) for r in rows}
    assert used[(True, False)] == (False, "stale: tuned against other kernel code")
    assert used[(False, False)] == (True, "")  # the cache's entry, which calls run
    assert not used[(True, True)][0] and used[(True, True)][1].startswith("the planner rejects it here: ")
    # resolve takes the planner's default after a rejected entry, not a later file's entry for the key
    assert used[(False, True)] == (False, "lookup stops at an earlier file's entry for the key "
                                          f"({tmp_path / 'env' / 'cpu-interpreter.yaml'})")  # fmt: skip
    (tmp_path / "env" / "cpu-interpreter.yaml").unlink()
    (tmp_path / "env" / "cpu-interpreter.yaml").mkdir()
    assert cli.main(["show", "--device", "cpu", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["rows"]
    assert {"file": str(tmp_path / "env" / "cpu-interpreter.yaml"), "error": "not a readable file"} in shown
