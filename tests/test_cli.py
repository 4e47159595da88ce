"""The `fa2tune` command line: thin, clear errors, non-zero exit codes when something is wrong."""

from __future__ import annotations

import pytest
import torch

from fa2tune import cli, selfcheck


def test_check_passes_and_prints_a_row_per_case(capsys, device):
    assert cli.main(["check", "--device", device, "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and ("Triton's interpreter" in out) == (device == "cpu")
    assert out.count(" ok") == 2 * len(selfcheck.default_shapes(on_gpu=device != "cpu"))


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
