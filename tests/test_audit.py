"""The entry audit (fa2tune.tune.audit, scripts/audit_entries.py): each entry timed against what its calls would run
without it, at its tune's lengths, the ones behind marked — here with a measure whose times the test sets."""

from __future__ import annotations

import pytest
import torch

from fa2tune.api import attention_kernel
from fa2tune.config import defaults, store
from fa2tune.config.types import KernelConfig
from fa2tune.kernels import codegen
from fa2tune.tune import audit

from ._scripts import load_script

DEVICE = {"name": "Triton interpreter (CPU)", "slug": "cpu-interpreter"}
SLOW, FAST = KernelConfig(64, 32, 4, 2), KernelConfig(16, 16, 4, 1)
FALLBACK = defaults.INTERPRETER_CONFIG  # the planner's default on the interpreter, what a call without an entry runs


def _entry(kernel="fwd", causal=False, cfg=SLOW, bucket="all", window=False, head_dim=64):
    return store.Entry(
        key=store.EntryKey(head_dim=head_dim, dtype="fp32", causal=causal, kernel=kernel, seqlen_bucket=bucket,
                           window=window),
        config=cfg, ms=1.0, tflops=None, baseline={"name": "planner-default"}, trials=3, spread=0.01,
        triton_version="3.6.0", torch_version="2.13.0", template_hash=codegen.code_hash(kernel, causal=causal),
        date="2026-12-06",
    )  # fmt: skip


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FA2TUNE_CONFIG_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    attention_kernel.clear_cache()
    store._warned.clear()
    yield tmp_path / "audited.yaml"
    attention_kernel.clear_cache()


class _Clock:
    """A measure_factory whose objective returns set times per config (ms, summed over lengths as the tuner's is),
    recording what each measure was built for."""

    def __init__(self, times: dict):
        self.times, self.built, self.timed = times, [], []

    def __call__(self, kernel, head_dim, dtype, causal, *, seqlens, device, varlen, with_forward):
        self.built.append(dict(kernel=kernel, head_dim=head_dim, dtype=dtype, causal=causal.causal, seqlens=seqlens,
                               device=device, with_forward=with_forward))  # fmt: skip

        def measure(cfg):
            self.timed.append(cfg)
            value = self.times[cfg]
            if isinstance(value, Exception):
                raise value
            return value

        return measure


def test_an_entry_slower_than_its_fallback_is_marked_for_a_re_tune(config_file):
    # the plain forward's entry (SLOW) is 10 % behind the default; the causal one (FAST) ahead of it; a band-mask
    # entry is skipped (its window is not in the file), and a dK/dV entry of the short bucket is timed inside the
    # training call at the short lengths, as its tune times it
    store.write_entries(config_file, DEVICE, [
        _entry(), _entry(causal=True, cfg=FAST), _entry(window=True), _entry("bwd_dkdv", bucket="short", cfg=FAST),
    ])  # fmt: skip
    clock = _Clock({SLOW: 1.1, FAST: 0.9, FALLBACK: 1.0})
    shown = []
    rows = audit.audit(config_file, "cpu", measure_factory=clock, on_row=shown.append, rounds=3)
    assert shown == rows and len(rows) == 4
    by_key = {(row.key.kernel, row.key.causal, row.key.window): row for row in rows}  # the file's order is its own
    plain, causal, window = (by_key["fwd", c, w] for c, w in ((False, False), (True, False), (False, True)))
    assert plain.fallback == FALLBACK and plain.fallback_name == "planner-default"
    assert plain.ratio == pytest.approx(1.1) and plain.behind(0.03) and not plain.behind(0.2)
    assert causal.ratio == pytest.approx(0.9) and not causal.behind(0.0)
    assert window.ratio is None and "window" in window.note and not window.behind(0.0)
    assert clock.timed.count(SLOW) == 3 and len(clock.timed) == 3 * 2 * 3  # three rows timed, both configs, 3 rounds
    built = {b["kernel"]: b for b in clock.built}
    assert sorted(b["seqlens"] for b in clock.built) == [(512, 1024), (1024, 4096, 16384), (1024, 4096, 16384)]
    assert built["bwd_dkdv"]["seqlens"] == (512, 1024) and built["bwd_dkdv"]["with_forward"]
    assert not built["fwd"]["with_forward"] and all(b["dtype"] is torch.float32 for b in clock.built)
    table = dict(zip(rows, audit.report(rows, 0.03).splitlines()[1:], strict=True))
    assert table[plain].endswith("re-tune") and table[causal].endswith(" ok")
    assert "window" in table[window] and "+win" in table[window]


def test_filters_a_failing_config_and_an_entry_that_is_its_fallback(config_file):
    store.write_entries(config_file, DEVICE, [_entry(cfg=FALLBACK), _entry(causal=True), _entry(head_dim=128)])
    clock = _Clock({SLOW: RuntimeError("out of resource: shared memory"), FALLBACK: 1.0})
    rows = audit.audit(config_file, "cpu", head_dims={64}, measure_factory=clock)
    assert sorted(row.key.causal for row in rows) == [False, True]  # d=128 filtered out
    same, failed = sorted(rows, key=lambda row: row.key.causal)
    assert same.ratio is None and "the fallback is the entry's config" in same.note
    assert failed.ratio is None and failed.note.startswith("failed: RuntimeError: out of resource")
    assert audit.audit(config_file, "cpu", kernels={"bwd_dq"}, measure_factory=clock) == []
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        audit.audit(config_file, "cpu", rounds=0, measure_factory=clock)


def test_an_all_entry_beside_bucket_entries_is_timed_where_it_serves(config_file):
    # job.unserved_lengths: with short and medium entries for the key, the "all" entry serves the long lengths only
    store.write_entries(config_file, DEVICE, [_entry(), _entry(bucket="short"), _entry(bucket="medium")])
    clock = _Clock({SLOW: 1.0, FALLBACK: 1.0})
    rows = audit.audit(config_file, "cpu", buckets={"all"}, measure_factory=clock)
    assert len(rows) == 1 and clock.built[0]["seqlens"] == (8192, 16384)


def test_the_script_refuses_a_missing_file_and_the_cpu(tmp_path, capsys):
    script = load_script("audit_entries")
    with pytest.raises(SystemExit):
        script.main([str(tmp_path / "none.yaml")])
    assert "file: no such file" in capsys.readouterr().err
    path = tmp_path / "x.yaml"
    path.write_text("{}\n")
    with pytest.raises(SystemExit):
        script.main([str(path), "--device", "cpu"])
    assert "--device: a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main([str(path), "--rounds", "0"])
    assert "--rounds: at least 1, got 0" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert script.main([str(path)]) == 2
